"""Paged-attention kernel sets (the reference one, and the emulated backend's "cpu" one with
its C++ kernels, AVX2 and AVX-512) against a naive dense attention, over a shape sweep."""

import pytest
import torch
from attention_cases import (
    CPU_KERNELS,
    NEEDS_AVX2,
    TILED_CASES,
    cpu_isa,
    make_case,
    naive_attention,
    ragged_paged_attention,
    tiled_case,
)

from neuron_serve.attention import kernels
from neuron_serve.attention.kernels import write_kv
from neuron_serve.device.emulated import attention as cpu_kernels

__all__ = ["ragged_paged_attention"]  # a fixture

CASES = [  # seq_lens, query_lens: decodes, prefill chunks with and without prefix context
    ([5], [5]),
    ([17, 9, 33], [1, 1, 1]),
    ([40, 12, 7], [8, 1, 7]),
    ([64, 3, 29, 50], [64, 1, 5, 1]),
    ([100, 65, 33], [1, 1, 1]),  # decodes over 2-4 of the cpu kernel's 32-position chunks
]


@pytest.mark.parametrize("seq_lens,query_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)])  # GQA 1, 2, 3, 4, 8
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("head_size", [64, 128])
def test_matches_naive_attention(seq_lens, query_lens, heads, block_size, window, soft_cap,
                                 head_size, ragged_paged_attention):
    num_heads, num_kv_heads = heads
    query, kv_cache, table, req_of, pos_of, dense, n = make_case(
        0, seq_lens, query_lens, num_heads, num_kv_heads, head_size, block_size)
    scale = head_size ** -0.5
    out = ragged_paged_attention(query, kv_cache, table, req_of, pos_of, scale, window, soft_cap)
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), scale,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # padding rows too


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("seq_lens,query_lens", CASES[1:])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("head_size", [64, 128])
def test_an_fp8_cache_matches_naive_attention_over_its_dequantized_values(
        seq_lens, query_lens, heads, kv_dtype, head_size, ragged_paged_attention):
    """Written with vLLM's per-tensor scales, read as stored x scale: the kernels' output is
    the dense attention of what the cache holds (the oracle dequantizes it itself)."""
    scales = (torch.tensor(0.37), torch.tensor(1.9))
    query, kv_cache, table, req_of, pos_of, dense, n = make_case(
        1, seq_lens, query_lens, *heads, head_size, 16, kv_dtype=kv_dtype, kv_scales=scales)
    assert kv_cache.dtype == kv_dtype
    out = ragged_paged_attention(query, kv_cache, table, req_of, pos_of, 0.125, None, None,
                                 None, scales)
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.125)
                            for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)


def test_a_bucket_refilled_by_a_shorter_step_holds_padding_not_the_last_step():
    """The buffers are written in place every step: whatever the last step left beyond this
    one's real part is reset to the padding (0, and -1 for unused single-token slots)."""
    import numpy as np

    from neuron_serve.buckets import build_grid
    from neuron_serve.model_runner.inputs import BucketBuffers, plan_step

    grid = build_grid([32], [4], [4], max_num_seqs=4, query_tile=8)
    block_table = np.array([[3, 5, 0, 0], [7, 1, 0, 0], [2, 4, 6, 0]])
    token_ids = np.arange(3 * 64).reshape(3, 64) + 1

    def plan(num_computed, num_scheduled):
        n = len(num_scheduled)
        return plan_step(token_ids[:n], num_computed, num_computed + num_scheduled,
                         block_table[:n], num_scheduled, 16, grid)

    (long_plan, long_arrays), (short_plan, short_arrays) = (
        plan(np.array([20, 0, 33]), np.array([1, 9, 4])), plan(np.array([0]), np.array([5])))
    assert long_plan.bucket == short_plan.bucket
    buf = BucketBuffers(long_plan.bucket, torch.device("cpu"))
    buf.fill(long_arrays)
    buf.fill(short_arrays)
    fresh = BucketBuffers(short_plan.bucket, torch.device("cpu"))
    fresh.fill(short_arrays)
    for name in BucketBuffers.NAMES:
        assert torch.equal(getattr(buf, name), getattr(fresh, name)), name
    for name in BucketBuffers.TILE_NAMES:
        assert torch.equal(getattr(buf.tiles, name), getattr(fresh.tiles, name)), name
    assert buf.input_ids.tolist() == [1, 2, 3, 4, 5] + [0] * 27  # request 0's chunk, padding


@pytest.mark.parametrize("seq_lens,query_lens", TILED_CASES)
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kernel_set", ["reference", pytest.param("cpu", marks=CPU_KERNELS),
                                        pytest.param("cpu-avx2", marks=CPU_KERNELS)])
def test_query_tiles_over_an_fp8_cache_match_naive_attention(seq_lens, query_lens, kv_dtype,
                                                             kernel_set):
    scales = (torch.tensor(2.5), torch.tensor(0.02))
    args, tiles, used, dense, n = tiled_case(2, seq_lens, query_lens, (6, 2), 64, 16,
                                             query_tile=8, kv_dtype=kv_dtype, kv_scales=scales)
    name, _, isa = kernel_set.partition("-")
    with cpu_isa(isa or None):
        out = kernels.get(name).ragged_paged_attention(*args, 0.25, 8, None, tiles, scales)
    query, _, _, req_of, pos_of = args
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.25, 8)
                            for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_an_fp8_cache_saturates_and_is_refused_without_scales(kv_dtype):
    """Past the format's range a value is stored as its largest finite one (torch's e5m2
    cast alone gives inf); the C++ kernels refuse an 8-bit cache without its scales."""
    kv_cache = torch.zeros(2, 4, 1, 2 * 64, dtype=kv_dtype)
    big = torch.full((1, 1, 64), 1e6)
    write_kv(kv_cache, big, -big, torch.tensor([5]), (torch.tensor(1.0), torch.tensor(1.0)))
    row = kv_cache[1, 1, 0].float()
    limit = torch.finfo(kv_dtype).max
    assert (row[:64] == limit).all() and (row[64:] == -limit).all()
    if not cpu_kernels.extension.cpu_supported():
        return
    cpu_kernels.kernel_set()  # loads the ops
    with pytest.raises(RuntimeError, match="an 8-bit kv_cache needs k_scale and v_scale"):
        torch.ops.neuron_serve.paged_attention(torch.zeros(1, 1, 64), kv_cache,
                                               torch.tensor([[1]]), torch.tensor([0]),
                                               torch.tensor([1]), 0.125, 0, 0.0)


def test_write_kv_touches_only_the_given_slots():
    kv_cache = torch.zeros(4, 8, 2, 6)
    key, value = torch.ones(3, 2, 3), 2 * torch.ones(3, 2, 3)
    write_kv(kv_cache, key, value, torch.tensor([9, 10, 31]))
    flat = kv_cache.view(-1, 2, 6)
    written = torch.zeros(32, dtype=torch.bool)
    written[[9, 10, 31]] = True
    assert (flat[written][..., :3] == 1).all() and (flat[written][..., 3:] == 2).all()
    assert (flat[~written] == 0).all()


def test_padded_step_leaves_real_kv_untouched():
    """A planned, padded mixed step writes only its own tokens' slots and the null block."""
    import numpy as np

    from neuron_serve.buckets import build_grid
    from neuron_serve.model_runner.inputs import BucketBuffers, plan_step

    bs, heads, head = 16, 2, 8
    block_table = np.array([[3, 5, 0, 0], [7, 0, 0, 0], [2, 4, 6, 0]])
    num_computed, num_scheduled = np.array([20, 0, 33]), np.array([1, 9, 4])
    token_ids = np.arange(3 * 64).reshape(3, 64)
    grid = build_grid([32], [4], [4], max_num_seqs=4)
    plan, arrays = plan_step(token_ids, num_computed, num_computed + num_scheduled, block_table,
                             num_scheduled, bs, grid)
    buf = BucketBuffers(plan.bucket, torch.device("cpu"))
    buf.fill(arrays)
    assert plan.bucket.num_tokens == 32 and plan.num_tokens == 14  # 18 padding tokens
    kv_cache = torch.randn(8, bs, heads, 2 * head)
    before = kv_cache.clone()
    write_kv(kv_cache, torch.ones(32, heads, head), torch.ones(32, heads, head), buf.slot_mapping)
    changed = (kv_cache != before).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
    real = {int(b) * bs + p % bs for r, n in enumerate(num_scheduled)
            for p in range(num_computed[r], num_computed[r] + n)
            for b in [block_table[r, p // bs]]}
    assert set(changed) - set(range(bs)) == real  # beyond the null block: exactly the real slots


@pytest.mark.parametrize("seq_lens,query_lens", TILED_CASES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
# The reference set's kernels are traced, so head size does not change their code; the
# "cpu" set's C++ kernels have one per head size.
@pytest.mark.parametrize("kernel_set,head_size", [
    ("reference", 64), pytest.param("cpu", 64, marks=CPU_KERNELS),
    pytest.param("cpu", 128, marks=CPU_KERNELS), pytest.param("cpu-avx2", 64, marks=CPU_KERNELS)])
def test_query_tiled_attention_matches_naive_attention(seq_lens, query_lens, heads, window,
                                                       soft_cap, kernel_set, head_size):
    args, tiles, used, dense, n = tiled_case(2, seq_lens, query_lens, heads, head_size, 16,
                                             query_tile=8)
    assert used["tile_req"] > 0 and used["single_token"] > 0  # both paths carry real tokens
    name, _, isa = kernel_set.partition("-")
    fn = kernels.get(name).ragged_paged_attention
    with cpu_isa(isa or None):
        out = fn(*args, 0.25, window, soft_cap, tiles)
    query, _, _, req_of, pos_of = args
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.25,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.emulated
@NEEDS_AVX2
def test_cpu_kernels_reject_block_ids_and_tokens_outside_their_tensors():
    """The C++ kernels read the cache through the block table: an id outside the cache or a
    token outside the query is an error naming it, not a read out of bounds."""
    import re


    cpu_kernels.kernel_set()  # loads the ops
    args, tiles, _, _, _ = tiled_case(2, *TILED_CASES[0], (4, 4), 64, 16, query_tile=8)
    query, kv_cache, table, req_of, pos_of = args
    ops = torch.ops.neuron_serve
    bad_table = table.clone()
    bad_table[0, 0] = kv_cache.shape[0]
    message = re.escape(f"block id {kv_cache.shape[0]} of request 0 is outside the KV cache's "
                        f"{kv_cache.shape[0]}")
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(query, kv_cache, bad_table, req_of, pos_of, 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention_tiles(query, kv_cache, bad_table, tiles.tile_token, tiles.tile_req,
                                  pos_of, 0.25, 0, 0.0)
    bad_tokens = tiles.tile_token.clone()
    bad_tokens[0, 0] = len(query)
    with pytest.raises(RuntimeError, match=f"tile 0 row 0 is token {len(query)} of {len(query)}"):
        ops.paged_attention_tiles(query, kv_cache, table, bad_tokens, tiles.tile_req, pos_of,
                                  0.25, 0, 0.0)


@pytest.mark.emulated
@NEEDS_AVX2
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("seq_lens", [[200], [150, 70], [31]])  # 6, 4 / 2 and 0 chunks
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, None), (None, 5.0)])
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_decode_of_fewer_tokens_than_threads_splits_positions_and_matches_naive(
        threads, seq_lens, window, soft_cap, isa):
    """With fewer decode tokens than threads the C++ kernel splits each token's positions
    among the threads and merges the parts' softmaxes: the same attention as one pass."""
    query, kv_cache, table, req_of, pos_of, dense, n = make_case(
        3, seq_lens, [1] * len(seq_lens), 6, 2, 64, 32, pad_tokens=0)
    cpu_kernels.kernel_set()  # loads the ops
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cpu_isa(isa):
            out = torch.ops.neuron_serve.paged_attention(query, kv_cache, table, req_of, pos_of,
                                                         0.125, window or 0, soft_cap or 0.0)
    finally:
        torch.set_num_threads(before)
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.125,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.emulated
@NEEDS_AVX2
def test_decode_kernel_takes_a_step_without_tokens():
    query, kv_cache, table, req_of, pos_of, _, _ = make_case(3, [40], [1], 6, 2, 64, 32,
                                                             pad_tokens=0)
    cpu_kernels.kernel_set()  # loads the ops
    out = torch.ops.neuron_serve.paged_attention(query[:0], kv_cache, table, req_of[:0],
                                                 pos_of[:0], 0.125, 0, 0.0)
    assert out.shape == (0, 6, 64)

"""Paged-attention kernel sets (the reference one, and the emulated backend's "cpu" one with
its C++ kernels, AVX2 and AVX-512) against a naive dense attention, over a shape sweep."""

import contextlib
import math

import pytest
import torch

from neuron_serve.attention import cpu_kernels, kernels
from neuron_serve.attention.kernels import QueryTiles, write_kv
from neuron_serve.model_runner import cpu_extension


NEEDS_AVX2 = pytest.mark.skipif(not cpu_extension.cpu_supported(),
                                reason="the C++ kernels need AVX2")


@pytest.fixture(params=["reference", pytest.param("cpu", marks=NEEDS_AVX2),
                        pytest.param("cpu-avx2", marks=NEEDS_AVX2)])
def ragged_paged_attention(request):
    """Each kernel set; "cpu" runs whatever this CPU picks (AVX-512 where it has it),
    "cpu-avx2" the AVX2 code of the same kernels."""
    name, _, isa = request.param.partition("-")
    with cpu_isa("avx2" if isa else None):
        yield kernels.get(name).ragged_paged_attention


@contextlib.contextmanager
def cpu_isa(isa: str | None):
    """The "cpu" kernels restricted to AVX2 code (isa "avx2"), or left to pick (None)."""
    if isa is None:
        yield
        return
    cpu_kernels.kernel_set()  # loads the ops
    if torch.ops.neuron_serve.paged_attention_isa(False) == "avx2":
        pytest.skip("this CPU runs the AVX2 code anyway")
    torch.ops.neuron_serve.paged_attention_isa(True)
    try:
        yield
    finally:
        torch.ops.neuron_serve.paged_attention_isa(False)


def naive_attention(q, k, v, pos, scale, window=None, soft_cap=None):
    """q [H, D] at position pos over dense k, v [L, Hkv, D] of its request."""
    group = q.shape[0] // k.shape[1]
    k = k[: pos + 1].repeat_interleave(group, dim=1)  # [pos+1, H, D]
    v = v[: pos + 1].repeat_interleave(group, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    if window:
        s[:, : max(0, pos + 1 - window)] = -math.inf
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v.double()).float()


def make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_size, block_size,
              pad_tokens=3):
    """Requests with shuffled block tables; the last query_lens[r] tokens of each are queries."""
    gen = torch.Generator().manual_seed(seed)
    width = max(math.ceil(s / block_size) for s in seq_lens) + 1
    num_blocks = 1 + sum(math.ceil(s / block_size) for s in seq_lens) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never the null block
    kv_cache = torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    dense, q_tok, req_of, pos_of = [], [], [], []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        n = math.ceil(seq_len / block_size)
        block_table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        dense.append((k, v))
        positions = torch.arange(seq_len)
        slots = block_table[r, positions // block_size] * block_size + positions % block_size
        write_kv(kv_cache, k, v, slots)
        for p in range(seq_len - q_len, seq_len):
            req_of.append(r), pos_of.append(p)
    num_real = len(req_of)
    req_of += [0] * pad_tokens
    pos_of += [0] * pad_tokens
    query = torch.randn(num_real + pad_tokens, num_heads, head_size, generator=gen)
    return (query, kv_cache, block_table, torch.tensor(req_of), torch.tensor(pos_of),
            dense, num_real)


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

    from neuron_serve.model_runner.buckets import build_grid
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


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
def test_compiled_kernel_matches_naive_attention(heads, window, soft_cap, ragged_paged_attention,
                                                request):
    """Under torch.compile the kernel takes its fused form (kernels._fused_attention)."""
    if request.node.callspec.params["ragged_paged_attention"] == "cpu-avx2":
        pytest.skip("the same graph as \"cpu\"; its AVX2 code is checked eagerly")
    num_heads, num_kv_heads = heads
    query, kv_cache, table, req_of, pos_of, dense, n = make_case(
        1, [40, 12, 7], [8, 1, 7], num_heads, num_kv_heads, 64, 16)
    fn = torch.compile(ragged_paged_attention, fullgraph=True, dynamic=False, backend="inductor")
    out = fn(query, kv_cache, table, req_of, pos_of, 0.25, window, soft_cap)
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.25,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


TILED_CASES = [  # seq_lens, query_lens: whole tiles, leftovers in tiles and as single tokens
    ([40, 12, 7], [8, 1, 7]),
    ([64, 3, 29, 50], [64, 1, 5, 1]),
    ([20, 19, 18, 30], [19, 18, 17, 3]),
]


def tiled_case(seed, seq_lens, query_lens, heads, head_size, block_size, query_tile):
    """make_case's step packed into the smallest tiled bucket that its tiles can hold."""
    import numpy as np

    from neuron_serve.model_runner import query_tiles
    from neuron_serve.model_runner.buckets import Bucket
    from neuron_serve.model_runner.inputs import BucketBuffers

    num_heads, num_kv_heads = heads
    case = make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_size, block_size)
    num_scheduled = np.array(query_lens)
    n = case[-1]
    for num_tokens in range(n + 3, 4 * n):  # the case's 3 padding tokens, then more
        bucket = Bucket(num_tokens, len(seq_lens), case[2].shape[1], query_tile)
        if query_tiles.fits(num_scheduled, bucket):
            break
    arrays = query_tiles.pack(num_scheduled, bucket)
    used = {name: len(a) for name, a in arrays.items()}

    def padded(name, *shape):
        out = torch.full(shape, BucketBuffers.PADDING.get(name, 0), dtype=torch.long)
        out[: used[name]] = torch.from_numpy(arrays[name])
        return out

    tiles = QueryTiles(padded("tile_token", bucket.num_tiles, query_tile), padded("tile_req", bucket.num_tiles),
                       padded("single_token", bucket.single_token_slots), padded("token_slot", num_tokens))
    query, kv_cache, table, req_of, pos_of, dense, _ = case
    extra = num_tokens - len(req_of)  # more padding tokens: request 0, position 0
    query = torch.cat([query, torch.randn(extra, *query.shape[1:])])
    req_of, pos_of = (torch.cat([x, torch.zeros(extra, dtype=torch.long)]) for x in (req_of, pos_of))
    return (query, kv_cache, table, req_of, pos_of), tiles, used, dense, n


@pytest.mark.parametrize("seq_lens,query_lens", TILED_CASES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
# The reference set's kernels are traced, so head size does not change their code; the
# "cpu" set's C++ kernels have one per head size.
@pytest.mark.parametrize("kernel_set,compiled,head_size", [
    ("reference", False, 64), ("reference", True, 64),
    pytest.param("cpu", False, 64, marks=NEEDS_AVX2), pytest.param("cpu", True, 64, marks=NEEDS_AVX2),
    pytest.param("cpu", False, 128, marks=NEEDS_AVX2),
    pytest.param("cpu-avx2", False, 64, marks=NEEDS_AVX2)])
def test_query_tiled_attention_matches_naive_attention(seq_lens, query_lens, heads, window,
                                                       soft_cap, kernel_set, compiled, head_size):
    args, tiles, used, dense, n = tiled_case(2, seq_lens, query_lens, heads, head_size, 16,
                                             query_tile=8)
    assert used["tile_req"] > 0 and used["single_token"] > 0  # both paths carry real tokens
    name, _, isa = kernel_set.partition("-")
    if compiled and heads != {"reference": (8, 2), "cpu": (6, 2)}[name]:  # ~10 s a compile
        pytest.skip("compiled: the reference set at GQA 4, the cpu set's graph at 3")
    fn = kernels.get(name).ragged_paged_attention
    if compiled:
        torch._dynamo.reset()  # each case is a new shape: stay under dynamo's recompile limit
        fn = torch.compile(fn, fullgraph=True, dynamic=False, backend="inductor")
    with cpu_isa(isa or None):
        out = fn(*args, 0.25, window, soft_cap, tiles)
    query, _, _, req_of, pos_of = args
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.25,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


@NEEDS_AVX2
def test_cpu_kernels_reject_block_ids_and_tokens_outside_their_tensors():
    """The C++ kernels read the cache through the block table: an id outside the cache or a
    token outside the query is an error naming it, not a read out of bounds."""
    import re

    from neuron_serve.attention import cpu_kernels

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


@NEEDS_AVX2
def test_decode_kernel_takes_a_step_without_tokens():
    query, kv_cache, table, req_of, pos_of, _, _ = make_case(3, [40], [1], 6, 2, 64, 32,
                                                             pad_tokens=0)
    cpu_kernels.kernel_set()  # loads the ops
    out = torch.ops.neuron_serve.paged_attention(query[:0], kv_cache, table, req_of[:0],
                                                 pos_of[:0], 0.125, 0, 0.0)
    assert out.shape == (0, 6, 64)

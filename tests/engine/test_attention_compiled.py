"""The attention kernel sets compiled by inductor (the reference set takes its fused form,
kernels._fused_attention), against the same naive attention as the eager unit tests."""

import pytest
import torch
from attention_cases import (
    CPU_KERNELS,
    TILED_CASES,
    cpu_isa,
    make_case,
    naive_attention,
    ragged_paged_attention,
    tiled_case,
)
from torch._dynamo.testing import CompileCounterWithBackend

from neuron_serve.attention import kernels

__all__ = ["ragged_paged_attention"]  # a fixture


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



@pytest.mark.parametrize("seq_lens,query_lens", TILED_CASES)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("kernel_set,heads", [
    ("reference", (8, 2)), pytest.param("cpu", (6, 2), marks=CPU_KERNELS)])
def test_compiled_query_tiles_match_naive_attention(seq_lens, query_lens, window, soft_cap,
                                                    kernel_set, heads):
    args, tiles, used, dense, n = tiled_case(2, seq_lens, query_lens, heads, 64, 16, query_tile=8)
    torch._dynamo.reset()  # each case is a new shape: stay under dynamo's recompile limit
    fn = torch.compile(kernels.get(kernel_set).ragged_paged_attention, fullgraph=True,
                       dynamic=False, backend="inductor")
    with cpu_isa(None):
        out = fn(*args, 0.25, window, soft_cap, tiles)
    query, _, _, req_of, pos_of = args
    expected = torch.stack([naive_attention(query[t], *dense[req_of[t]], int(pos_of[t]), 0.25,
                                            window, soft_cap) for t in range(n)])
    torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kernel_set", ["reference", pytest.param("cpu", marks=CPU_KERNELS)])
def test_compiled_write_and_attention_over_an_fp8_cache(kv_dtype, kernel_set):
    """A step's write and attention in one graph over an 8-bit cache, its scales graph
    inputs: new scales take effect without a recompile."""
    query, kv_cache, table, req_of, pos_of, dense, n = make_case(
        1, [40, 12, 7], [8, 1, 7], 8, 2, 64, 16, kv_dtype=kv_dtype,
        kv_scales=(torch.tensor(0.5), torch.tensor(2.0)))
    kernel_set_ = kernels.get(kernel_set)

    def step(key, value, slots, scales):
        kernel_set_.write_kv(kv_cache, key, value, slots, scales)
        return kernel_set_.ragged_paged_attention(query, kv_cache, table, req_of, pos_of, 0.25,
                                                  None, None, None, scales)

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    fn = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
    slots = torch.tensor([0, 1])  # the null block: no request reads it
    for scales in [(torch.tensor(0.5), torch.tensor(2.0)), (torch.tensor(0.25), torch.tensor(4.0))]:
        # The cache as written with the first scales, read with these: values scale alike.
        ratio = (scales[0] / 0.5, scales[1] / 2.0)
        out = fn(torch.randn(2, 2, 64), torch.randn(2, 2, 64), slots, scales)
        expected = torch.stack([naive_attention(query[t], dense[req_of[t]][0] * ratio[0],
                                                dense[req_of[t]][1] * ratio[1], int(pos_of[t]),
                                                0.25) for t in range(n)])
        torch.testing.assert_close(out[:n], expected, rtol=1e-5, atol=1e-5)
    assert backend.frame_count == 1  # one graph for both scales

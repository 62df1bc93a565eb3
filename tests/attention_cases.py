"""Shared by the attention kernel tests of the unit tier (eager) and the engine tier
(compiled): a naive dense attention, random paged cases, and the C++ kernels' ISA switch."""

import contextlib
import math

import numpy as np
import pytest
import torch

from neuron_serve.attention import kernels
from neuron_serve.attention.kernels import QueryTiles, write_kv
from neuron_serve.buckets import Bucket
from neuron_serve.device.emulated import attention as cpu_kernels
from neuron_serve.device.emulated import extension as cpu_extension
from neuron_serve.model_runner import query_tiles
from neuron_serve.model_runner.inputs import BucketBuffers

NEEDS_AVX2 = pytest.mark.skipif(not cpu_extension.cpu_supported(),
                                reason="the C++ kernels need AVX2")
CPU_KERNELS = (pytest.mark.emulated, NEEDS_AVX2)  # marks of the emulated "cpu" kernel set


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
              pad_tokens=3, kv_dtype=torch.float32, kv_scales=None):
    """Requests with shuffled block tables; the last query_lens[r] tokens of each are queries.
    An 8-bit `kv_dtype` cache is written with `kv_scales`; the dense keys and values returned
    are then what it holds, dequantized by the oracle's own arithmetic."""
    gen = torch.Generator().manual_seed(seed)
    width = max(math.ceil(s / block_size) for s in seq_lens) + 1
    num_blocks = 1 + sum(math.ceil(s / block_size) for s in seq_lens) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never the null block
    kv_cache = torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=kv_dtype)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    dense, req_of, pos_of = [], [], []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        n = math.ceil(seq_len / block_size)
        block_table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        positions = torch.arange(seq_len)
        slots = block_table[r, positions // block_size] * block_size + positions % block_size
        write_kv(kv_cache, k, v, slots, kv_scales)
        if kv_scales is not None:
            k, v = (fp8_round_trip(x, kv_dtype, s) for x, s in zip((k, v), kv_scales))
        dense.append((k, v))
        for p in range(seq_len - q_len, seq_len):
            req_of.append(r), pos_of.append(p)
    num_real = len(req_of)
    req_of += [0] * pad_tokens
    pos_of += [0] * pad_tokens
    query = torch.randn(num_real + pad_tokens, num_heads, head_size, generator=gen)
    return (query, kv_cache, block_table, torch.tensor(req_of), torch.tensor(pos_of),
            dense, num_real)


def fp8_round_trip(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x as an 8-bit cache holds it, read back: x / scale saturated, rounded, times scale."""
    limit = torch.finfo(dtype).max
    return (x / scale).clamp(-limit, limit).to(dtype).float() * scale


TILED_CASES = [  # seq_lens, query_lens: whole tiles, leftovers in tiles and as single tokens
    ([40, 12, 7], [8, 1, 7]),
    ([64, 3, 29, 50], [64, 1, 5, 1]),
    ([20, 19, 18, 30], [19, 18, 17, 3]),
]


def tiled_case(seed, seq_lens, query_lens, heads, head_size, block_size, query_tile, **kv):
    """make_case's step packed into the smallest tiled bucket that its tiles can hold."""
    num_heads, num_kv_heads = heads
    case = make_case(seed, seq_lens, query_lens, num_heads, num_kv_heads, head_size, block_size,
                     **kv)
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

    tiles = QueryTiles(padded("tile_token", bucket.num_tiles, query_tile),
                       padded("tile_req", bucket.num_tiles),
                       padded("single_token", bucket.single_token_slots),
                       padded("token_slot", num_tokens))
    query, kv_cache, table, req_of, pos_of, dense, _ = case
    extra = num_tokens - len(req_of)  # more padding tokens: request 0, position 0
    query = torch.cat([query, torch.randn(extra, *query.shape[1:])])
    req_of, pos_of = (torch.cat([x, torch.zeros(extra, dtype=torch.long)]) for x in (req_of, pos_of))
    return (query, kv_cache, table, req_of, pos_of), tiles, used, dense, n


@pytest.fixture(params=["reference", pytest.param("cpu", marks=CPU_KERNELS),
                        pytest.param("cpu-avx2", marks=CPU_KERNELS)])
def ragged_paged_attention(request):
    """Each kernel set; "cpu" runs whatever this CPU picks (AVX-512 where it has it),
    "cpu-avx2" the AVX2 code of the same kernels."""
    name, _, isa = request.param.partition("-")
    with cpu_isa("avx2" if isa else None):
        yield kernels.get(name).ragged_paged_attention

"""Kernel microbenchmark: our ragged paged attention (the emulated backend's kernel set,
compiled, as in the step graph) and the reference kernels vs
vLLM's CPU attention op (`cpu_attention_with_kv_cache`) on the same shapes and the same
K/V, decode-heavy and prefill-heavy; outputs checked equal before timing.

A compiled function's call costs about 0.2 ms on its own here (dynamo's guards, the
wrapper), which the step graph pays once per step, not per layer; so the "cpu" set's C++
op is also timed alone, called directly like vLLM's.

    .venv/bin/python benchmarks/attention_bench.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BLOCK_SIZE = 32
# name: (context length per request, query tokens per request, requests)
CASES = {"decode: 8 seqs × 1 token, context 256": (256, 1, 8),
         "decode: 32 seqs × 1 token, context 640": (640, 1, 32),
         "prefill: 1 seq × 256 tokens, context 256": (256, 256, 1),
         "prefill chunk: 2 seqs × 256 tokens, context 512": (512, 256, 2)}


def _case(shape, context: int, q_len: int, reqs: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = 1 + reqs * blocks_per_req
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = perm.view(reqs, blocks_per_req)
    kv = torch.randn(num_blocks, BLOCK_SIZE, shape.kv_heads, 2 * shape.head_dim, generator=gen)
    query = torch.randn(reqs * q_len, shape.heads, shape.head_dim, generator=gen)
    token_req = torch.arange(reqs).repeat_interleave(q_len)
    token_pos = (torch.arange(context - q_len, context)).repeat(reqs)
    return query, kv, block_table, token_req, token_pos


def _query_tiles(q_len: int, reqs: int, num_blocks: int):
    """The query tiles the step graph gives a multi-token step (None for decodes)."""
    import numpy as np

    from neuron_serve.attention.kernels import QueryTiles
    from neuron_serve.buckets import QUERY_TILE, Bucket
    from neuron_serve.model_runner import query_tiles

    if q_len == 1:
        return None
    bucket = Bucket(q_len * reqs, reqs, num_blocks, QUERY_TILE)
    packed = query_tiles.pack(np.full(reqs, q_len), bucket)
    single = np.full(bucket.single_token_slots, -1)  # unused slots, as in the step
    single[: len(packed["single_token"])] = packed["single_token"]
    return QueryTiles(*(torch.from_numpy(a) for a in (packed["tile_token"], packed["tile_req"],
                                                      single, packed["token_slot"])))


def _kernel_set() -> str:
    from neuron_serve import device
    return device.current().attention_kernel


def _ours(shape, case, kernel_set: str):
    from neuron_serve.attention import kernels

    ragged_paged_attention = kernels.get(kernel_set).ragged_paged_attention
    query, kv, block_table, token_req, token_pos = case
    tiles = _query_tiles(len(token_req) // len(block_table), len(block_table), block_table.shape[1])
    fn = torch.compile(ragged_paged_attention, fullgraph=True, dynamic=False)
    scale = shape.head_dim ** -0.5
    return lambda: fn(query, kv, block_table, token_req, token_pos, scale, tiles=tiles)


def _op_alone(shape, case):
    """The "cpu" kernel set's C++ op called directly (decode: paged_attention; prefill:
    paged_attention_tiles, the tiles alone)."""
    from neuron_serve.device.emulated import attention as cpu_kernels

    cpu_kernels.kernel_set()  # loads the ops
    query, kv, block_table, token_req, token_pos = case
    q_len = len(token_req) // len(block_table)
    tiles = _query_tiles(q_len, len(block_table), block_table.shape[1])
    scale, ops = shape.head_dim ** -0.5, torch.ops.neuron_serve
    if tiles is None:
        return lambda: ops.paged_attention(query, kv, block_table, token_req, token_pos, scale, 0, 0.0)
    return lambda: ops.paged_attention_tiles(query, kv, block_table, tiles.tile_token,
                                             tiles.tile_req, token_pos, scale, 0, 0.0)


def _vllm(shape, case, context: int, q_len: int, reqs: int):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    query, kv, block_table, _, _ = case
    # vLLM's own cache layout, written by its own op from the same keys and values.
    num_blocks = kv.shape[0]
    alloc = torch.zeros(num_blocks, shape.kv_heads, 2 * BLOCK_SIZE, shape.head_dim)
    key_cache, value_cache = alloc.chunk(2, dim=2)
    flat = kv.view(num_blocks * BLOCK_SIZE, shape.kv_heads, 2 * shape.head_dim)
    slots = torch.arange(BLOCK_SIZE, num_blocks * BLOCK_SIZE)  # every slot outside the null block
    isa = _get_attn_isa(torch.float32, BLOCK_SIZE, shape.head_dim)
    ops.cpu_attn_reshape_and_cache(flat[slots, :, :shape.head_dim].contiguous(),
                                   flat[slots, :, shape.head_dim:].contiguous(),
                                   key_cache, value_cache, slots, isa)
    query_start_loc = torch.arange(0, reqs + 1, dtype=torch.int32) * q_len
    seq_lens = torch.full((reqs,), context, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=reqs, num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        seq_lens=seq_lens, dtype=torch.float32, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False)
    output = torch.empty_like(query)
    table = block_table.to(torch.int32)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=shape.head_dim ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
            scheduler_metadata=metadata, s_aux=None)
        return output
    return run


def _median_ms(fn, repeats: int) -> tuple[float, float, float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), min(times), max(times)


def run(shape, repeats: int = 5) -> list[dict]:
    rows = []
    for name, (context, q_len, reqs) in CASES.items():
        case = _case(shape, context, q_len, reqs)
        ours, reference = _ours(shape, case, _kernel_set()), _ours(shape, case, "reference")
        theirs = _vllm(shape, case, context, q_len, reqs)
        for fn in (ours, reference):
            torch.testing.assert_close(fn(), theirs(), rtol=1e-3, atol=1e-3)
        fns = {"ours": ours, "reference": reference, "vllm": theirs}
        if _kernel_set() == "cpu" and shape.head_dim in (64, 128):  # the op's head sizes
            fns["op"] = _op_alone(shape, case)
        # Taking turns, so a noisy neighbour slows all of them alike.
        times = {key: [] for key in fns}
        for _ in range(3):
            for key, fn in fns.items():
                times[key].append(_median_ms(fn, repeats))
        # Each kernel's middle round of three (median, min, max of that round).
        o, r, t = (sorted(times[k])[1] for k in ("ours", "reference", "vllm"))
        op = sorted(times["op"])[1][0] if "op" in times else None
        rows.append(dict(case=name, ours_ms=o[0], ours_min=o[1], ours_max=o[2],
                         reference_ms=r[0], op_ms=op, vllm_ms=t[0], vllm_min=t[1],
                         vllm_max=t[2], ours_over_vllm=o[0] / t[0]))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["## Attention kernel (ms per layer call, median [min–max])", "",
             f"| case | ours (\"{_kernel_set()}\" kernels, compiled) | reference kernels "
             "(compiled) | our C++ op alone | vLLM CPU op | ours ÷ vLLM | op alone ÷ vLLM |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        op = r.get("op_ms")
        op_cells = f"{op:.3f} | " if op else "– | "
        op_ratio = f"{op / r['vllm_ms']:.2f}×" if op else "–"
        lines.append(f"| {r['case']} | {r['ours_ms']:.3f} [{r['ours_min']:.3f}–{r['ours_max']:.3f}] | "
                     f"{r['reference_ms']:.3f} | {op_cells}"
                     f"{r['vllm_ms']:.3f} [{r['vllm_min']:.3f}–{r['vllm_max']:.3f}] | "
                     f"{r['ours_over_vllm']:.2f}× | {op_ratio} |")
    return "\n".join(lines) + (
        "\n\nOne compiled call includes torch.compile's call overhead, paid once per step in "
        "the engine; the op alone is the kernel the step graph calls in each layer.")


def main() -> None:
    import hardware
    from shapes import SHAPES, checkpoint
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    path = checkpoint(args.model) if args.model in SHAPES else Path(args.model)
    print(markdown(run(hardware.ModelShape.of(AutoConfig.from_pretrained(path)), args.repeats)))


if __name__ == "__main__":
    main()

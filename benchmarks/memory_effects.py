"""What streaming a decode step's weights does to the rest of the step, on this machine.

    .venv/bin/python benchmarks/memory_effects.py [--model smollm2-135m] [--repeats 9]

A decode step reads every weight once: for SmolLM2-135M in 8 bits, 134 MB, four times the
L3 of the machines we run on. Three measurements, each taking turns with its baseline:

* Host code after the stream: the runner's step planner (`plan_step`, one decode request)
  hot, and right after a plain read of the step's weight bytes. Everything the host runs
  between two steps (vLLM's scheduler, the sampler, our runner) starts from what that read
  left in the caches.
* A plain read of those bytes in 4 KB pages and in 2 MB transparent huge pages
  (`MADV_HUGEPAGE`): what page walks cost a stream.
* The step's INT8 matmuls in order (our kernel, one row, VNNI and float tiles) with the
  weights as `pack_weight` keeps them (huge pages, device/emulated/huge_pages.py) and
  copied into plain 4 KB pages. Called from Python: each call also pays the op's Python
  overhead (a few µs).

Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from linear_bench import _median_ms, weight_shapes  # noqa: E402
from shapes import checkpoint  # noqa: E402


def host_after_stream(stream: torch.Tensor, repeats: int) -> tuple[float, float]:
    """plan_step µs, hot and right after reading `stream` (medians)."""
    from neuron_serve.buckets import Bucket
    from neuron_serve.model_runner.inputs import plan_step

    grid = (Bucket(1, 1, 16), Bucket(1, 1, 64), Bucket(128, 1, 64))
    args = (np.zeros((1, 1024), np.int32), np.array([200]), np.array([201]),
            np.arange(64, dtype=np.int32)[None], np.array([1]), 16, grid)
    hot, cold = [], []
    for _ in range(repeats * 20):
        plan_step(*args)
        start = time.perf_counter()
        plan_step(*args)
        hot.append(time.perf_counter() - start)
        stream.sum()
        start = time.perf_counter()
        plan_step(*args)
        cold.append(time.perf_counter() - start)
    return statistics.median(hot) * 1e6, statistics.median(cold) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    from transformers import AutoConfig

    from neuron_serve.device.emulated import huge_pages, skinny_matmul
    from neuron_serve.device.emulated.quantized_linear import quantize_rows

    skinny_matmul.load()
    config = AutoConfig.from_pretrained(checkpoint(args.model))
    shapes = weight_shapes(config)
    order = [n for _ in range(config.num_hidden_layers) for n in shapes if n != "lm_head"]
    small_layers, huge_layers = [], []  # pack_weight's blocks are in huge pages
    for name in order + ["lm_head"]:
        n, k, _ = shapes[name]
        values, scale = quantize_rows(torch.randn(n, k) / k ** 0.5, torch.int8)
        blocks, scale = skinny_matmul.pack_weight(values), skinny_matmul.pack_scale(scale, torch.int8)
        huge_layers.append((blocks, n, scale))
        small_layers.append((blocks.clone(), n, scale))
    nbytes = sum(w.numel() for w, *_ in small_layers)
    small_pages = torch.ones(nbytes // 4)
    huge_read = torch.frombuffer(huge_pages.mapping(nbytes // 4 * 4), dtype=torch.float32).fill_(1.0)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w, *_ in small_layers}

    def step(weights):
        return lambda: [skinny_matmul.skinny_matmul(xs[w.shape[1]], w, None, n, s)
                        for w, n, s in weights]

    arms = {"plain read, 4 KB pages": lambda: small_pages.sum(),
            "plain read, 2 MB pages": lambda: huge_read.sum()}
    for isa in ("avx512-vnni", "avx512", "avx2"):
        arms[f"{isa} matmuls, 4 KB pages"] = (isa, step(small_layers))
        arms[f"{isa} matmuls, 2 MB pages"] = (isa, step(huge_layers))
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, arm in arms.items():
            if isinstance(arm, tuple):
                isa, arm = arm
                if torch.ops.neuron_serve.skinny_matmul_isa(isa) != isa:
                    continue  # this CPU has no such tiles
            times[name].append(_median_ms(arm))
    hot, cold = host_after_stream(small_pages, args.repeats)
    print(f"\n{args.model}: {len(small_layers)} INT8 weights, {nbytes / 1e6:.0f} MB; medians of "
          f"{args.repeats}, taking turns\n")
    print("| what | ms | GB/s |\n|---|---|---|")
    for name, samples in times.items():
        if samples:
            ms = statistics.median(samples)
            print(f"| {name} | {ms:.2f} | {nbytes / ms / 1e6:.1f} |")
    print(f"\nplan_step (one decode request): {hot:.0f} µs hot, {cold:.0f} µs right after "
          f"a plain read of the {nbytes / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

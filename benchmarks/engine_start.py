"""Time to ready, cold vs warm compiled-graph cache, and serve-while-compiling.

    .venv/bin/python benchmarks/engine_start.py [--model demo|smollm2-135m|PATH] [--repeats 3]

Each start is a fresh process running vLLM's offline engine on our platform with
neuron-serve's serving defaults (16 sequences, 256 tokens per step, max_model_len 1024:
the default grid, 17 bucket graphs) and a fixed 1 GiB KV cache. Timed from process spawn
(imports included) to "ready" (engine constructed) and to the first served request (8
greedy tokens):

    eager       compile_mode eager: no graphs at all
    cold        compile_mode ahead, empty cache directory (kernel build cache included)
    warm        compile_mode ahead, the directory the cold start just filled
    background  compile_mode background, empty cache directory: ready at once, eager
                until graphs arrive (the background compiler dies with the engine)

Prints a markdown table of medians (min-max) and the graph counters of each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = """
import json, os, sys, time
os.environ["NEURON_SERVE_DEVICE"] = "neuron"
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, mode, cache = sys.argv[1:4]
    llm = LLM(model=model, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30,
              additional_config={"neuron": {"compile_mode": mode, "cache_dir": cache}})
    print("READY", flush=True)
    llm.generate({"prompt_token_ids": list(range(5, 45))},
                 SamplingParams(max_tokens=8, min_tokens=8, temperature=0), use_tqdm=False)
    print("FIRST", flush=True)
    print("STATS " + json.dumps(llm.collective_rpc("graph_stats")[0]), flush=True)
    llm.llm_engine.engine_core.shutdown()
"""


def start_once(model: str, mode: str, cache: str) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, model, mode, cache],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    result = {}
    for line in proc.stdout:
        if line.startswith(("READY", "FIRST")):
            result[line.split()[0].lower()] = time.monotonic() - t0
        elif line.startswith("STATS "):
            result["stats"] = json.loads(line.removeprefix("STATS "))
    if proc.wait() != 0 or len(result) != 3:
        raise RuntimeError(f"{mode} start failed (exit {proc.returncode}): {result}")
    return result


MODES = ("eager", "cold", "warm", "background")


def one_round(model: str, modes: list[str]) -> dict[str, dict]:
    runs = {}
    with tempfile.TemporaryDirectory() as cold_dir, tempfile.TemporaryDirectory() as bg_dir:
        for mode in modes:  # warm reuses the directory cold filled
            compile_mode, cache = {"eager": ("eager", "off"), "cold": ("ahead", cold_dir),
                                   "warm": ("ahead", cold_dir),
                                   "background": ("background", bg_dir)}[mode]
            runs[mode] = start_once(model, compile_mode, cache)
    return runs


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    from shapes import SHAPES, checkpoint

    from neuron_serve.models import DEMO_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    model = str(DEMO_MODEL_DIR if args.model == "demo" else
                checkpoint(args.model) if args.model in SHAPES else args.model)
    rounds = [one_round(model, args.modes.split(",")) for _ in range(args.repeats)]
    print(f"model: {args.model}, {args.repeats} rounds, torch threads {os.cpu_count()} cores")
    print("| mode | ready s | first request s | graphs loaded | compiled | eager steps |")
    print("|---|---|---|---|---|---|")
    for mode in rounds[0]:
        runs = [r[mode] for r in rounds]
        last = runs[-1]["stats"]
        print(f"| {mode} | {spread([r['ready'] for r in runs])} | "
              f"{spread([r['first'] for r in runs])} | {last['cache_hits']} | "
              f"{last['cache_misses']} | {last['eager_steps']} |")
    med = lambda mode, key: statistics.median(r[mode][key] for r in rounds)  # noqa: E731
    if {"warm", "cold"} <= rounds[0].keys():
        print(f"warm / cold ready: {med('warm', 'ready') / med('cold', 'ready'):.1%}")
    if {"background", "eager"} <= rounds[0].keys():
        print(f"background / eager: ready {med('background', 'ready') / med('eager', 'ready'):.2f}, "
              f"first request {med('background', 'first') / med('eager', 'first'):.2f}")


if __name__ == "__main__":
    main()

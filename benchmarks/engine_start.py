"""Engine start time on the neuron platform: eager vs compiled (every bucket warmed up).

    .venv/bin/python benchmarks/engine_start.py [MODEL] [--repeats N]

Starts vLLM's offline engine on our platform with neuron-serve's default serving limits
(the same bucket grid `neuron-serve serve` uses), in fresh processes, and prints the
median / min / max seconds from constructor call to ready, plus the graph count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import json, os, sys, time
os.environ["NEURON_SERVE_DEVICE"] = "neuron"
from vllm import LLM
if __name__ == "__main__":
    model, eager, seqs, tokens = sys.argv[1], sys.argv[2] == "eager", int(sys.argv[3]), int(sys.argv[4])
    t0 = time.monotonic()
    llm = LLM(model=model, enforce_eager=eager, max_num_seqs=seqs, max_num_batched_tokens=tokens,
              kv_cache_memory_bytes=1 << 30)
    ready = time.monotonic() - t0
    after = sum(llm.collective_rpc("compiles_after_warmup"))
    print("RESULT " + json.dumps({"seconds": ready, "compiles_after_warmup": after}), flush=True)
"""


def start_once(model: str, mode: str) -> dict:
    """mode: eager | compiled (inductor caches off: a true cold start) | compiled-warm
    (inductor's own on-disk FX-graph cache left on and primed by the previous runs)."""
    from neuron_serve.cli import SERVE_DEFAULTS

    env = dict(os.environ)
    if mode == "compiled":
        env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    out = subprocess.run([sys.executable, "-c", CHILD, model, mode.split("-")[0],
                          str(SERVE_DEFAULTS["max_num_seqs"]), str(SERVE_DEFAULTS["max_num_batched_tokens"])],
                         capture_output=True, text=True, env=env, check=True)
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    from neuron_serve.models import DEMO_MODEL_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"model: {args.model}")
    print("| mode | median s | min s | max s | compiles after warm-up |")
    print("|---|---|---|---|---|")
    for mode in ("eager", "compiled", "compiled-warm"):
        runs = [start_once(args.model, mode) for _ in range(args.repeats)]
        secs = [r["seconds"] for r in runs]
        print(f"| {mode} | {statistics.median(secs):.1f} | {min(secs):.1f} | {max(secs):.1f} | "
              f"{max(r['compiles_after_warmup'] for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()

"""The cost of a JSON schema: output tok/s with and without one, ours beside vLLM's CPU
backend, in one run.

    .venv/bin/python benchmarks/structured_outputs.py [--model smollm2-135m] [--batches 1,8]
        [--output 128] [--repeats 3]

Each system runs in its own process (systems.py); turns alternate plain / schema, so both
see the same machine. Every sequence generates exactly `--output` tokens: the schema (an
array of at least 1,000 bounded integers) cannot end sooner, and EOS is ignored. The
grammar's cost per step is the difference of the two step times (1 step = 1 token per
sequence); it holds vLLM's scheduler-side mask (xgrammar) and the runner applying it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCHEMA = {"type": "array", "minItems": 1000,
          "items": {"type": "integer", "minimum": 0, "maximum": 999}}


def main() -> None:
    from compare import SystemProcess
    from shapes import SHAPES, checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="neuron,vllm-cpu")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = checkpoint(args.model)
    flags = ["--max-num-seqs", str(max(batches)), "--max-num-batched-tokens", "256",
             "--max-model-len", str(args.prompt + args.output + 16), "--kv-cache-gb", "1"]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for system in args.systems.split(","):
            proc = SystemProcess(system, model, flags, Path(logs) / f"{system}.log")
            try:
                for batch in batches:
                    job = {"batch": batch, "prompt": args.prompt, "output": args.output, "seed": 0}
                    proc.run(job)  # warm: first-touch costs, grammar compiler caches
                    proc.run({**job, "schema": SCHEMA})
                    tps = {"plain": [], "schema": []}
                    for _ in range(args.repeats):
                        for kind in tps:
                            r = proc.run({**job, **({"schema": SCHEMA} if kind == "schema" else {})})
                            tps[kind].append(r["output_tokens"] / r["seconds"])
                    rows.append((system, batch, {k: statistics.median(v) for k, v in tps.items()},
                                 {k: (min(v), max(v)) for k, v in tps.items()}))
            finally:
                proc.close()
    print(f"{args.model}, prompt {args.prompt}, output {args.output}, medians of {args.repeats}")
    print("| system | seqs | tok/s plain [min-max] | tok/s JSON schema [min-max] | schema ÷ plain "
          "| grammar ms per step |")
    print("|---|---|---|---|---|---|")
    for system, batch, med, span in rows:
        step_ms = {k: 1000 * batch / v for k, v in med.items()}
        print(f"| {system} | {batch} | {med['plain']:.1f} [{span['plain'][0]:.1f}-{span['plain'][1]:.1f}] | "
              f"{med['schema']:.1f} [{span['schema'][0]:.1f}-{span['schema'][1]:.1f}] | "
              f"{med['schema'] / med['plain']:.2f} | {step_ms['schema'] - step_ms['plain']:.2f} |")


if __name__ == "__main__":
    main()

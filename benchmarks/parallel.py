"""Tensor and data parallel on one host: our server against `vllm serve` on vLLM's CPU
backend, at the same tensor-parallel (TP) and data-parallel (DP) sizes, in one run.

    .venv/bin/python benchmarks/parallel.py [--model qwen3-0.6b] [--layouts 1x1,2x1,1x2]

A layout is TPxDP. For each one, both servers come up with the same flags, then take
turns, burst by burst: a burst is `batch` streamed completions sent at once (random
prompts of --prompt tokens, --output tokens each, EOS ignored). Output tok/s and TPOT
p50 are medians over --repeats bursts. Every rank gets its own core: vLLM's CPU backend
is told so with VLLM_CPU_OMP_THREADS_BIND ("0|1"; its automatic binding wants a NUMA node
per rank), ours divides the cores by itself. KV bytes are given per rank: vLLM's CPU
backend would otherwise give every rank of a NUMA node most of its memory.

--sequential serves one system at a time, for layouts whose two servers do not fit in
memory together (DP 2 of the Qwen3-0.6B shape on 24 GB). The report keeps the rows of
layouts measured by earlier runs and not by this one.

Writes benchmarks/results/parallel-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hardware  # noqa: E402
from online import Server, _load, summarize  # noqa: E402
from shapes import checkpoint  # noqa: E402
from systems import OTHER_SYSTEM_IDLE_S  # noqa: E402

SYSTEMS = ("neuron", "vllm-cpu")


def layout_flags(tp: int, dp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp)]


def core_binding(ranks: int) -> dict[str, str]:
    """vLLM CPU's per-rank core lists: one core each, shared round-robin past the count."""
    if ranks == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(ranks))}


def run_layout(args, model: Path, vocab: int, tp: int, dp: int) -> list[dict]:
    flags = ["--max-num-seqs", str(max(args.batches)), "--max-num-batched-tokens", "256",
             "--max-model-len", "1024", "--kv-cache-memory-bytes",
             str(int(args.kv_cache_gb * 2**30)), *layout_flags(tp, dp)]
    os.environ.update(core_binding(tp * dp))
    runs = {}
    try:
        for group in ([[s] for s in SYSTEMS] if args.sequential else [SYSTEMS]):
            measure(args, model, vocab, flags, tp, dp, group, runs)
    finally:
        for key in core_binding(tp * dp):
            os.environ.pop(key)
    return [dict(system=system, tp=tp, dp=dp, batch=batch, repeats=len(rs),
                 tok_s=[sum(r["tokens"] for r in run["results"]) / run["wall"] for run in rs],
                 **summarize(rs))
            for (system, batch), rs in runs.items()]


def measure(args, model: Path, vocab: int, flags: list[str], tp: int, dp: int,
            systems: list[str], runs: dict) -> None:
    """Serve `systems` together, taking turns burst by burst; bursts into `runs`."""
    servers = []
    try:
        for system in systems:
            print(f"TP {tp} DP {dp}: starting {system} ...", flush=True)
            start = time.monotonic()
            log = args.out / ".logs" / f"parallel-{args.model}-{system}-tp{tp}-dp{dp}.log"
            servers.append(Server(system, model, flags, log, args.neuron_config))
            print(f"  up in {time.monotonic() - start:.0f} s", flush=True)
        for s in servers:  # warm-up: every bucket the bursts reach
            for batch in args.batches:
                asyncio.run(_load(s.base_url, math.inf, batch, args.prompt, 8, vocab, seed=1))
        for rep in range(args.repeats):
            for batch in args.batches:
                for s in servers:
                    time.sleep(OTHER_SYSTEM_IDLE_S)
                    run = asyncio.run(_load(s.base_url, math.inf, batch, args.prompt, args.output,
                                            vocab, seed=100 * rep + batch))
                    runs.setdefault((s.system, batch), []).append(run)
                    print(f"  rep {rep + 1} {s.system:9s} seqs {batch:2d}: "
                          f"{summarize([run])['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        for s in servers:
            s.stop()


def markdown(report: dict) -> str:
    rows = report["rows"]
    by = {(r["system"], r["tp"], r["dp"], r["batch"]): r for r in rows}
    lines = [f"## Tensor and data parallel, {report['model']} shape ({report['date']})", "",
             f"`{'`, then `'.join([*report.get('earlier', []), report['command']])}`. "
             f"Machine: {report['machine']}. Bursts of streamed "
             f"completions, prompt {report['prompt']}, output {report['output']}; medians of "
             f"{report['repeats']} (min-max).", "",
             "| TP × DP | sequences | ours tok/s | vLLM CPU tok/s | ours ÷ vLLM | ours TPOT p50 ms "
             "| vLLM TPOT p50 ms | ours ÷ ours at 1 × 1 | vLLM ÷ vLLM at 1 × 1 |",
             "|---|---|---|---|---|---|---|---|---|"]

    def spread(r: dict) -> str:
        return f"{r['output_tok_s']:.1f} ({min(r['tok_s']):.1f}-{max(r['tok_s']):.1f})"

    def vs_single(system: str, tp: int, dp: int, batch: int) -> str:
        base = by.get((system, 1, 1, batch))
        r = by[(system, tp, dp, batch)]
        return f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"

    for tp, dp, batch in sorted({(r["tp"], r["dp"], r["batch"]) for r in rows}):
        ours, theirs = by.get(("neuron", tp, dp, batch)), by.get(("vllm-cpu", tp, dp, batch))
        if not (ours and theirs):
            continue
        lines.append(f"| {tp} × {dp} | {batch} | {spread(ours)} | {spread(theirs)} | "
                     f"{ours['output_tok_s'] / theirs['output_tok_s']:.2f} | "
                     f"{ours['tpot_p50_ms']:.1f} | {theirs['tpot_p50_ms']:.1f} | "
                     f"{vs_single('neuron', tp, dp, batch)} | {vs_single('vllm-cpu', tp, dp, batch)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxDP, comma-separated")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="per rank")
    parser.add_argument("--neuron-config", default=None, metavar="JSON")
    parser.add_argument("--sequential", action="store_true",
                        help="one server at a time (for layouts that do not fit in memory twice)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    (args.out / ".logs").mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.model)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    report = dict(model=args.model, date=time.strftime("%Y-%m-%d %H:%M"),
                  command=" ".join([".venv/bin/python benchmarks/parallel.py", *sys.argv[1:]]),
                  machine=hardware.describe(), prompt=args.prompt, output=args.output,
                  repeats=args.repeats, rows=[])
    path = args.out / f"parallel-{args.model}.json"
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    if path.exists():  # an earlier run's layouts that this one does not measure
        earlier = json.loads(path.read_text())
        report["rows"] = [r for r in earlier["rows"] if (r["tp"], r["dp"]) not in layouts]
        report["earlier"] = earlier.get("earlier", []) + [earlier["command"]]
    for tp, dp in layouts:
        report["rows"] += run_layout(args, model, vocab, tp, dp)
        path.write_text(json.dumps(report, indent=1))  # a later layout failing keeps these
        path.with_suffix(".md").write_text(markdown(report) + "\n")
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

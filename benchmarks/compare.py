"""Side by side, same run: our platform (compiled) vs vLLM's CPU backend vs Transformers.

    .venv/bin/python benchmarks/compare.py [--model smollm2-135m] [--repeats 3]

Offline: output tokens/s for every (sequences, prompt length) pair, the systems taking
turns job by job so that machine noise hits all of them alike; median of --repeats with
min and max. The limit column is this machine's speed limit for the same work (read
bandwidth and fp32 GEMM rate measured by this script; benchmarks/hardware.py), measured
again just before every turn: on a shared machine the neighbours' load moves the read
bandwidth by half within an hour, so each sample is set against the limit of its own
moment and the share of the limit is the median of those ratios. Online
(--online): our server vs `vllm serve` on the CPU backend under a request-rate sweep
(benchmarks/online.py). Kernels (--kernels): our ragged paged attention vs vLLM's CPU
attention op (benchmarks/attention_bench.py).

Writes <out>/<name>.json, <name>.md and <name>.png (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hardware  # noqa: E402
from shapes import SHAPES, checkpoint  # noqa: E402
from systems import OTHER_SYSTEM_IDLE_S, SYSTEMS  # noqa: E402

# The reading before each turn: best of 20 reads of 512 MB and of 5 GEMMs (~1.5 s).
TURN_READ_REPEATS, TURN_GEMM_REPEATS = 20, 5
READING_KEYS = ("read_gb_per_s", "fp32_gemm_gflop_per_s")  # what a turn's reading keeps


def read_machine() -> dict:
    """The two rates the limit depends on, measured now."""
    machine = hardware.measure(TURN_READ_REPEATS, TURN_GEMM_REPEATS).as_dict()
    return {k: machine[k] for k in READING_KEYS}

LABELS = {"neuron": "neuron-serve (emulated, compiled)", "vllm-cpu": "vLLM CPU backend",
          "transformers": "Transformers generate (static cache, compiled)"}


class SystemProcess:
    """One system's long-lived process: jobs in on stdin, RESULT lines out on stdout."""

    def __init__(self, system: str, model: Path, engine_flags: list[str], log: Path):
        self.system = system
        self._log = open(log, "w")
        # A session of its own: close() ends the whole group, vLLM's engine-core child too,
        # which outlives a killed parent and spins a core (seen: 20 % of one, 38 min).
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "systems.py"), system, str(model), *engine_flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True)
        try:
            self.ready_seconds = self._result()["ready_seconds"]
        except BaseException:
            self.close(kill=True)
            raise

    def _result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            self._log.write(line)
        raise RuntimeError(f"{self.system} exited with {self.proc.wait()}; see {self._log.name}")

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        return self._result()

    def close(self, kill: bool = False) -> None:
        """End the system: let it exit (stdin closed), or `kill` it at once (a failed or
        interrupted run); either way nothing of its process group is left running."""
        try:
            if not kill:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._log.close()


def run_offline(args, model: Path, machine: dict, shape: hardware.ModelShape) -> list[dict]:
    engine_flags = ["--max-num-seqs", str(max(args.batches)),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                    "--max-model-len", str(args.max_model_len), "--kv-cache-gb", str(args.kv_cache_gb)]
    if args.neuron_config:
        engine_flags += ["--neuron-config", args.neuron_config]
    if args.eager:
        engine_flags.append("--eager")
    procs = []
    try:
        for system in args.systems:
            print(f"starting {system} ...", flush=True)
            procs.append(SystemProcess(system, model, engine_flags, args.logs / f"{args.name}.{system}.log"))
            print(f"  ready in {procs[-1].ready_seconds:.0f} s", flush=True)
        jobs = [dict(batch=b, prompt=p, output=args.output, seed=1000 * b + p)
                for p, b in product(args.prompts, args.batches)]
        for job in jobs:  # warm-up: compiles what is compiled per shape (Transformers)
            for proc in procs:
                proc.run(job)
        samples = {(p.system, j["batch"], j["prompt"]): [] for p in procs for j in jobs}
        readings = {key: [] for key in samples}  # the machine just before each sample
        for rep in range(args.repeats):
            for job in jobs:
                for proc in procs:  # the systems take turns, job by job
                    time.sleep(OTHER_SYSTEM_IDLE_S)
                    key = (proc.system, job["batch"], job["prompt"])
                    readings[key].append(read_machine())
                    r = proc.run(job)
                    samples[key].append(r["output_tokens"] / r["seconds"])
                    print(f"  rep {rep + 1} {proc.system:12s} seqs {job['batch']:3d} prompt "
                          f"{job['prompt']:4d}: {samples[key][-1]:8.1f} tok/s (read "
                          f"{readings[key][-1]['read_gb_per_s']:.1f} GB/s)", flush=True)
    except BaseException:
        for proc in procs:
            proc.close(kill=True)
        raise
    for proc in procs:
        proc.close()
    return [offline_row(system, batch, prompt, args.output, tps, shape,
                        readings[(system, batch, prompt)], machine)
            for (system, batch, prompt), tps in samples.items()]


def offline_row(system: str, batch: int, prompt: int, output: int, tps: list[float],
                shape: hardware.ModelShape, readings: list[dict] | None, machine: dict) -> dict:
    """One system at one job: tok/s samples, each against the limit of the `machine` at the
    rates read just before it (`readings`, one per sample); runs from before those readings
    set every sample against the rates measured at their start."""
    machines = [{**machine, **r} for r in readings] if readings else [machine] * len(tps)
    limits = [batch * output / hardware.generation_limit_seconds(
        shape, hardware.Machine(**m), batch, prompt, output) for m in machines]
    median = statistics.median(tps)
    return dict(system=system, batch=batch, prompt=prompt, output=output, tok_s_median=median,
                tok_s_min=min(tps), tok_s_max=max(tps), samples=tps,
                **({"readings": readings} if readings else {}),
                limit_tok_s=statistics.median(limits), limit_tok_s_min=min(limits),
                limit_tok_s_max=max(limits),
                share_of_limit=statistics.median(t / lim for t, lim in zip(tps, limits)))


def rerender(path: Path, remeasure: bool = False) -> None:
    """Recompute limits and ratios of a saved run (e.g. after a fix to the limit model) and
    rewrite its markdown and chart; the measurements are kept as they are. `remeasure`
    first measures the machine again (after a fix to hardware.measure), and says so."""
    report = json.loads(path.read_text())
    if remeasure:
        report["machine"] = hardware.measure().as_dict()
        report["remeasured"] = time.strftime("%Y-%m-%d %H:%M")
    shape = hardware.ModelShape(**report["shape"])
    # Remeasured: one machine for every sample, in place of the readings per turn.
    report["offline"] = [offline_row(r["system"], r["batch"], r["prompt"], r["output"], r["samples"],
                                     shape, None if remeasure else r.get("readings"), report["machine"])
                         for r in report["offline"]]
    report["ratios"] = ratio_table(report["offline"])
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown(report))
    chart(report, path.with_suffix(".png"))


def ratio_table(rows: list[dict]) -> list[dict]:
    by = {(r["system"], r["batch"], r["prompt"]): r["tok_s_median"] for r in rows}

    def ratio(ours: float, other: str, batch: int, prompt: int) -> float | None:
        theirs = by.get((other, batch, prompt))
        return ours / theirs if theirs else None

    return [dict(batch=batch, prompt=prompt, vs_vllm_cpu=ratio(value, "vllm-cpu", batch, prompt),
                 vs_transformers=ratio(value, "transformers", batch, prompt))
            for (system, batch, prompt), value in by.items() if system == "neuron"]


def _times(value: float | None) -> str:
    return f"{value:.2f}×" if value else "–"


def markdown(report: dict) -> str:
    m = report["machine"]
    title = report["name"] if report["name"] == report["model"] else f"{report['name']}: {report['model']}"
    lines = [f"# {title}", "",
             f"Command: `{report['command']}`  ",
             *([f"Resumed after a failure with: `{report['resumed']}`  "] if "resumed" in report else []),
             f"Date: {report['date']}  ",
             *(["**Eager (--eager): no system compiled; these figures are no measure.**  "]
               if report.get("eager") else []),
             *([f"Machine measured again after the run: {report['remeasured']}  "]
               if "remeasured" in report else []),
             f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, ISA "
             f"{m['isa']} ({' '.join(m['flags'])}); measured read bandwidth "
             f"{m['read_gb_per_s']:.1f} GB/s, fp32 GEMM {m['fp32_gemm_gflop_per_s']:.0f} GFLOP/s "
             "at the start", *_turn_readings(report["offline"]), "",
             f"## Offline throughput (output tok/s, median of {report['repeats']}, [min–max])", "",
             *_limit_note(report["offline"]),
             "| seqs | prompt | " + " | ".join(LABELS[s] for s in report["systems"]) +
             " | limit | ours ÷ limit | ours ÷ vLLM CPU | ours ÷ Transformers |",
             "|---|---|" + "---|" * (len(report["systems"]) + 4)]
    rows = {(r["system"], r["batch"], r["prompt"]): r for r in report["offline"]}
    ratios = {(r["batch"], r["prompt"]): r for r in report["ratios"]}
    for (batch, prompt) in sorted({(r["batch"], r["prompt"]) for r in report["offline"]},
                                  key=lambda k: (k[1], k[0])):
        cells = []
        for s in report["systems"]:
            r = rows.get((s, batch, prompt))
            cells.append(f"{r['tok_s_median']:.1f} [{r['tok_s_min']:.1f}–{r['tok_s_max']:.1f}]" if r else "–")
        ours = rows.get(("neuron", batch, prompt))
        first = ours or next(r for (s, b, p), r in rows.items() if b == batch and p == prompt)
        limit = f"{first['limit_tok_s']:.0f}"
        if first.get("limit_tok_s_min") and first["limit_tok_s_min"] != first["limit_tok_s_max"]:
            limit += f" [{first['limit_tok_s_min']:.0f}–{first['limit_tok_s_max']:.0f}]"
        ratio = ratios.get((batch, prompt), {})
        share = f"{ours['share_of_limit'] * 100:.0f} %" if ours else "–"
        lines.append(f"| {batch} | {prompt} | " + " | ".join(cells) + f" | {limit} | {share} | "
                     f"{_times(ratio.get('vs_vllm_cpu'))} | {_times(ratio.get('vs_transformers'))} |")
    for extra in ("online_markdown", "kernels_markdown"):
        if report.get(extra):
            lines += ["", report[extra]]
    return "\n".join(lines) + "\n"


def _limit_note(rows: list[dict]) -> list[str]:
    if not any("readings" in r for r in rows):
        return ["Limit: from the machine measured at the start.", ""]
    return ["Limit: this machine's tok/s for the same work at the reading taken before each of "
            "our turns, median [min–max]; ours ÷ limit is the median of each sample's ratio to "
            "its own turn's limit.", ""]


def _turn_readings(rows: list[dict]) -> list[str]:
    """The range of the machine readings taken before the turns (none in older runs)."""
    readings = [m for r in rows for m in r.get("readings", [])]
    if not readings:
        return []
    read = [m["read_gb_per_s"] for m in readings]
    gemm = [m["fp32_gemm_gflop_per_s"] for m in readings]
    return ["", f"Before each of the {len(readings)} turns: read bandwidth median "
            f"{statistics.median(read):.1f} [{min(read):.1f}–{max(read):.1f}] GB/s, fp32 GEMM "
            f"{statistics.median(gemm):.0f} [{min(gemm):.0f}–{max(gemm):.0f}] GFLOP/s  "]


def chart(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["batch"], r["prompt"]) for r in report["offline"]}, key=lambda k: (k[1], k[0]))
    rows = {(r["system"], r["batch"], r["prompt"]): r for r in report["offline"]}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4.5))
    width = 0.8 / (len(report["systems"]) + 1)
    for i, system in enumerate(report["systems"]):
        xs, ys, lo, hi = [], [], [], []
        for k, key in enumerate(keys):
            r = rows.get((system, *key))
            if r:
                xs.append(k + i * width)
                ys.append(r["tok_s_median"])
                lo.append(r["tok_s_median"] - r["tok_s_min"])
                hi.append(r["tok_s_max"] - r["tok_s_median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=LABELS[system])
    limits = [(rows.get(("neuron", *key)) or next(r for (s, b, p), r in rows.items() if (b, p) == key))
              ["limit_tok_s"] for key in keys]
    ax.bar([k + len(report["systems"]) * width for k in range(len(keys))], limits, width,
           color="lightgrey", hatch="//", label="machine limit")
    ax.set_xticks([k + width * len(report["systems"]) / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"{b} seqs\nprompt {p}" for b, p in keys])
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"{report['model']}, fp32, output {report['output']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    # Killed (SIGTERM), still close every system: the `finally` blocks run on SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"one of {sorted(SHAPES)} (random weights, built once), or a checkpoint dir")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", default="128,512")
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=2)
    parser.add_argument("--neuron-config", default=None, metavar="JSON",
                        help="our platform's `neuron` additional config, e.g. a bucket grid "
                             "'{\"token_buckets\": [64, 256]}' (default: derived)")
    parser.add_argument("--online", action="store_true", help="also the request-rate sweep")
    parser.add_argument("--online-rates", default="0.5,1,2")
    parser.add_argument("--online-requests", type=int, default=16)
    parser.add_argument("--kernels", action="store_true", help="also the attention microbenchmark")
    parser.add_argument("--eager", action="store_true",
                        help="no system compiles: checks the harness quickly; its figures are no measure")
    parser.add_argument("--name", default=None, help="file stem (default: the model name)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--resume", action="store_true",
                        help="add the phases missing from this run's saved report (after a failure)")
    parser.add_argument("--rerender", type=Path, metavar="JSON",
                        help="only rebuild the markdown and chart of a saved run")
    parser.add_argument("--remeasure", action="store_true",
                        help="with --rerender: measure the machine's limits again first")
    args = parser.parse_args()
    if args.rerender:
        return rerender(args.rerender, args.remeasure)
    args.systems = args.systems.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prompts = [int(p) for p in args.prompts.split(",")]
    args.online_rates_list = [float(r) for r in args.online_rates.split(",")]
    args.logs = args.out / ".logs"  # each system's own output, kept out of the results
    args.logs.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.model) if args.model in SHAPES else Path(args.model)
    args.name = args.name or Path(args.model).name

    from transformers import AutoConfig
    shape = hardware.ModelShape.of(AutoConfig.from_pretrained(model))
    path = args.out / f"{args.name}.json"
    if args.resume:  # phases already in the report are kept, with its machine facts
        report = json.loads(path.read_text())
        machine = hardware.Machine(**report["machine"])
        report["resumed"] = " ".join(["benchmarks/compare.py", *sys.argv[1:]])
    else:
        machine = hardware.measure()
        print(f"machine: {machine}", flush=True)
        command = " ".join(["benchmarks/compare.py", *sys.argv[1:]])
        report = dict(name=args.name, model=args.model, command=command,
                      date=time.strftime("%Y-%m-%d %H:%M"), machine=machine.as_dict(), shape=shape.__dict__,
                      systems=args.systems, repeats=args.repeats, output=args.output,
                      eager=args.eager)
    if "offline" not in report:
        report["offline"] = run_offline(args, model, report["machine"], shape)
        report["ratios"] = ratio_table(report["offline"])
        save(report, path)
    if args.online and "online" not in report:
        import online
        report["online"] = online.sweep(args, model)
        report["online_markdown"] = online.markdown(report["online"])
        save(report, path)
    if args.kernels and "kernels" not in report:
        import attention_bench
        report["kernels"] = attention_bench.run(shape, repeats=max(args.repeats, 3))
        report["kernels_markdown"] = attention_bench.markdown(report["kernels"])
        save(report, path)
    print(path.with_suffix(".md").read_text())


def save(report: dict, path: Path) -> None:
    """After every phase: a later phase failing keeps what was measured (--resume)."""
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown(report))
    chart(report, path.with_suffix(".png"))


if __name__ == "__main__":
    main()

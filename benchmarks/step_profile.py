"""Where a step's time goes on our platform: linear-layer matmuls, attention, collectives,
the rest.

    .venv/bin/python benchmarks/step_profile.py [--model smollm2-135m] [--batches 1,8,32]
        [--tensor-parallel-size N] [--quantization METHOD]

Runs our engine (compiled; graph cache off, so every graph is built with inductor's kernel
profiling) with compare.py's engine settings, records one generate per batch size with the
worker's step profiler, and splits every compiled step into matmuls (the linear layers and
the LM head, on oneDNN or the skinny kernel), attention (our paged-attention kernels:
paged_attention.cpp's ops, or the reference set's fused softmax kernels and batched
matmuls) and everything else. A step with query tiles is a mixed (prefill) step, one
without a decode step. At tensor parallel above 1, every rank's steps are split, and
the collectives (the all-reduces and the logits' all-gather, with their waits) are a kind
of their own: a rank's time in them includes waiting for the slower rank.
Prints a markdown table and writes it to benchmarks/results/step_profile-<model>-<isa>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KINDS = ("matmul", "attention", "collective", "other")


def classify(name: str) -> str | None:
    if name.startswith("_c10d_functional::"):  # all_reduce_, all_gather_into_tensor, wait_tensor
        return "collective"
    if name in ("_C::onednn_mm", "neuron_serve::skinny_matmul"):
        return "matmul"
    # Query tiles: the reference set's batched matmuls, or the "cpu" set's op.
    if name in ("aten::bmm", "neuron_serve::paged_attention_tiles"):
        return "tiles"
    if name == "neuron_serve::paged_attention":  # the "cpu" kernel set's single tokens
        return "attention"
    # Kernels of a decoder layer compiled once (compile_regions.py) carry no graph_ prefix.
    if "cpp_fused" in name:
        return "attention" if "softmax" in name else "other"
    return None


def split_steps(trace_path: str) -> list[dict]:
    """Per compiled-graph call: its wall time and the time of each kind of kernel in it."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    calls = sorted((e for e in events if e.get("name", "").startswith("## Call CompiledFxGraph")),
                   key=lambda e: e["ts"])
    kernels = sorted((e["ts"], e["dur"], kind) for e in events if "dur" in e
                     for kind in [classify(e.get("name", ""))] if kind)
    steps, i = [], 0
    for call in calls:
        start, end = call["ts"], call["ts"] + call["dur"]
        step = dict.fromkeys(("ms", *KINDS, "tiles"), 0.0)
        step["ms"] = call["dur"] / 1000
        step["period"] = None  # from this call's start to the next one's: the whole step
        while i < len(kernels) and kernels[i][0] < start:
            i += 1
        while i < len(kernels) and kernels[i][0] <= end:
            _, dur, kind = kernels[i]
            step[kind] += dur / 1000
            i += 1
        step["attention"] += step["tiles"]
        steps.append(step)
    for step, call, following in zip(steps, calls, calls[1:]):
        step["period"] = (following["ts"] - call["ts"]) / 1000
    return steps


def summarize(steps: list[dict]) -> dict[str, dict]:
    """Median step of each kind (decode: no query tiles; mixed: with them)."""
    rows = {}
    for kind, chosen in (("decode", [s for s in steps if not s["tiles"]]),
                         ("mixed", [s for s in steps if s["tiles"]])):
        if chosen:
            periods = [s["period"] for s in chosen if s["period"] is not None]
            rows[kind] = {"steps": len(chosen),
                          "period": statistics.median(periods) if periods else float("nan"),
                          **{k: statistics.median(s[k] for s in chosen) for k in ("ms", *KINDS)}}
    return rows


def markdown(model: str, results: dict[tuple[int, int], dict[str, dict]], prompt: int,
             output: int, machine: str, tp: int) -> str:
    lines = [f"## Step profile, {model} shape, tensor parallel {tp} (prompt {prompt}, output "
             f"{output}; median step, ms)", "",
             f"`.venv/bin/python {' '.join(['benchmarks/step_profile.py', *sys.argv[1:]])}`: "
             "inductor's kernel profiler inside "
             f"our compiled steps. Machine: {machine}.", "",
             "Step period: from one graph call to the next, the graph and everything the "
             "engine does between two steps (scheduling, sampling, the runner's inputs).", "",
             "| sequences | rank | step | steps | step period ms | step ms | matmuls | "
             "attention | collectives | other kernels | outside kernels |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (batch, rank), rows in results.items():
        for kind, r in rows.items():
            rest = r["ms"] - sum(r[k] for k in KINDS)
            lines.append(f"| {batch} | {rank} | {kind} | {r['steps']} | {r['period']:.1f} | "
                         f"{r['ms']:.1f} | "
                         f"{r['matmul']:.1f} | {r['attention']:.1f} | {r['collective']:.1f} | "
                         f"{r['other']:.1f} | {rest:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--quantization", help="vLLM's --quantization, e.g. int8_weight_only")
    parser.add_argument("--name", help="file stem suffix (default: the ISA torch reports, "
                                       "tp<N> above 1 and the quantization)")
    args = parser.parse_args()
    os.environ["NEURON_SERVE_DEVICE"] = "neuron"
    os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"
    from shapes import checkpoint
    from systems import prompts_for
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    model = checkpoint(args.model)
    llm = LLM(model=str(model), dtype="float32", seed=0, max_model_len=1024,
              max_num_seqs=max(batches), max_num_batched_tokens=256, kv_cache_memory_bytes=2 << 30,
              enable_prefix_caching=False, tensor_parallel_size=args.tensor_parallel_size,
              quantization=args.quantization,
              additional_config={"neuron": {"cache_dir": "off"}})
    params = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0, detokenize=False)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            prompts = prompts_for({"batch": batch, "prompt": args.prompt, "seed": batch}, vocab)
            requests = [{"prompt_token_ids": p} for p in prompts]
            llm.generate(requests, params, use_tqdm=False)  # warm
            llm.collective_rpc("start_step_profile", args=(tmp,))
            llm.generate(requests, params, use_tqdm=False)
            for rank, files in enumerate(llm.collective_rpc("stop_step_profile")):
                results[(batch, rank)] = summarize(split_steps(files["trace"]))
    import hardware
    import torch
    tp = args.tensor_parallel_size
    text = markdown(args.model, results, args.prompt, args.output, hardware.describe(), tp)
    print(text)
    suffix = args.name or torch.backends.cpu.get_cpu_capability().lower() + \
        (f"-tp{tp}" if tp > 1 else "") + (f"-{args.quantization}" if args.quantization else "")
    (HERE / "results" / f"step_profile-{args.model}-{suffix}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

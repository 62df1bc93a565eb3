"""8-bit weights and KV cache on our platform against fp32, vLLM's CPU backend and
Transformers, in one run.

    .venv/bin/python benchmarks/quantized.py [--model smollm2-135m] [--repeats 3]

Speed: output tok/s of decode-heavy jobs (--batches sequences, --prompt tokens, --output
tokens each) for our platform (compiled) with fp32 weights, FP8 weights and INT8 weights
(compressed-tensors checkpoints with a scale per output channel, written from the fp32
one by neuron_serve.models.quantized), beside vLLM's CPU backend and Transformers on the
fp32 checkpoint. The systems take turns job by job (compare.py), medians of --repeats;
each sample is set against the machine's limit read just before it, for the bytes that
configuration reads per step: 8-bit layers and the LM head's 8-bit copy read one byte a
weight (quantized_linear.py), so their limit moves.

Capacity: how many concurrent 1k-token sequences a GiB of KV cache holds, fp32 and FP8,
read off an engine given that budget (its block count).

Quality: the demo model's held-out loss through our engine (prompt logprobs, 4 windows of
256 tokens) per weight format and KV dtype, against Transformers' fp32 loss.

Writes <out>/quantized-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tools")]

import hardware  # noqa: E402
from compare import SystemProcess, read_machine  # noqa: E402
from shapes import SHAPES, checkpoint  # noqa: E402
from systems import OTHER_SYSTEM_IDLE_S  # noqa: E402

# name: (system, weight format or None, bytes a weight reads)
VARIANTS = {"neuron fp32": ("neuron", None, 4), "neuron fp8": ("neuron", "fp8-channel", 1),
            "neuron int8": ("neuron", "int8-w8a16", 1), "vllm-cpu fp32": ("vllm-cpu", None, 4),
            "transformers fp32": ("transformers", None, 4)}
# label: (checkpoint format or None, --quantization, --kv-cache-dtype)
QUALITY = {"fp32": (None, None, "auto"),
           "fp8 weights (vLLM fp8 checkpoint, per tensor)": ("fp8", None, "auto"),
           "fp8 weights (compressed-tensors, per channel)": ("fp8-channel", None, "auto"),
           "fp8 weights at load (--quantization fp8_per_tensor)": (None, "fp8_per_tensor", "auto"),
           "int8 weights (compressed-tensors W8A16, per channel)": ("int8-w8a16", None, "auto"),
           "int8 weights at load (--quantization int8_weight_only)": (None, "int8_weight_only", "auto"),
           "fp32 weights, fp8 (e4m3) KV": (None, None, "fp8"),
           "fp32 weights, fp8_e5m2 KV": (None, None, "fp8_e5m2"),
           "int8 weights, fp8 (e4m3) KV": ("int8-w8a16", None, "fp8")}


def measure_speed(args, models: dict[str, Path], shape) -> list[dict]:
    flags = ["--max-num-seqs", str(max(args.batches)), "--max-num-batched-tokens", "256",
             "--max-model-len", "1024", "--kv-cache-gb", "1"]
    procs = {}
    try:
        for name in args.variants:
            system, fmt, _ = VARIANTS[name]
            print(f"starting {name} ...", flush=True)
            procs[name] = SystemProcess(system, models[fmt], flags,
                                        args.logs / f"quantized.{name.replace(' ', '-')}.log")
        jobs = [dict(batch=b, prompt=args.prompt, output=args.output, seed=1000 * b)
                for b in args.batches]
        for job in jobs:  # warm-up
            for proc in procs.values():
                proc.run(job)
        samples = {(n, j["batch"]): [] for n in procs for j in jobs}
        readings = {key: [] for key in samples}
        for rep in range(args.repeats):
            for job in jobs:
                for name, proc in procs.items():
                    time.sleep(OTHER_SYSTEM_IDLE_S)
                    key = (name, job["batch"])
                    readings[key].append(read_machine())
                    r = proc.run(job)
                    samples[key].append(r["output_tokens"] / r["seconds"])
                    print(f"  rep {rep + 1} {name:18s} seqs {job['batch']:2d}: "
                          f"{samples[key][-1]:7.1f} tok/s", flush=True)
    finally:
        for proc in procs.values():
            proc.close()
    machine = hardware.measure().as_dict()
    rows = []
    for (name, batch), tps in samples.items():
        limits = [batch * args.output / hardware.generation_limit_seconds(
            shape, hardware.Machine(**{**machine, **r}), batch, args.prompt, args.output,
            weight_bytes=VARIANTS[name][2]) for r in readings[(name, batch)]]
        rows.append(dict(variant=name, batch=batch, tok_s_median=statistics.median(tps),
                         tok_s_min=min(tps), tok_s_max=max(tps), samples=tps,
                         limit_tok_s=statistics.median(limits),
                         share_of_limit=statistics.median(t / lim for t, lim in zip(tps, limits))))
    return rows


def measure_capacity(model: Path) -> list[dict]:
    from vllm import LLM

    rows = []
    for kv in ("auto", "fp8"):
        llm = LLM(model=str(model), dtype="float32", max_model_len=1024, max_num_seqs=4,
                  kv_cache_memory_bytes=2**30, kv_cache_dtype=kv, enforce_eager=True,
                  additional_config={"neuron": {"compile_mode": "eager"}})
        config = llm.llm_engine.vllm_config.cache_config
        tokens = config.num_gpu_blocks * config.block_size
        rows.append(dict(kv_cache_dtype="fp32" if kv == "auto" else kv, tokens_per_gib=tokens,
                         sequences_1k_per_gib=tokens // 1024))
        llm.llm_engine.engine_core.shutdown()
        del llm
    return rows


def measure_quality(tmp: Path) -> list[dict]:
    import torch
    from train_demo import heldout_windows
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from neuron_serve.models import DEMO_MODEL_DIR
    from neuron_serve.models.quantized import write_quantized

    windows = heldout_windows(4)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(input_ids=windows, labels=windows).loss.item()
    rows = [dict(config="Transformers fp32", loss=reference, vs_fp32=0.0)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    for label, (fmt, quantization, kv) in QUALITY.items():
        path = DEMO_MODEL_DIR
        if fmt:
            path = tmp / fmt
            write_quantized(DEMO_MODEL_DIR, path, fmt)
        llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=4,
                  max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20,
                  quantization=quantization, kv_cache_dtype=kv, enforce_eager=True,
                  additional_config={"neuron": {"compile_mode": "eager"}})
        outs = llm.generate([{"prompt_token_ids": w} for w in windows.tolist()], params,
                            use_tqdm=False)
        nll = [-entry[t].logprob for out, w in zip(outs, windows.tolist())
               for entry, t in zip(out.prompt_logprobs[1:], w[1:])]
        loss = sum(nll) / len(nll)
        rows.append(dict(config=f"neuron-serve, {label}", loss=loss,
                         vs_fp32=(loss - reference) / reference))
        print(f"  {label}: loss {loss:.4f} ({rows[-1]['vs_fp32']:+.2%})", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return rows


def markdown(report: dict) -> str:
    lines = [f"# 8-bit weights and KV cache: {report['model']}", "",
             f"{report['machine_description']}; decode jobs of {report['prompt']}-token prompts, "
             f"{report['output']} output tokens; medians of {report['repeats']} runs (min-max).",
             "", "| system | seqs | tok/s | limit tok/s | share of limit | ÷ our fp32 | "
             "÷ vLLM CPU | ÷ Transformers |", "|---|---|---|---|---|---|---|---|"]
    speed = {(r["variant"], r["batch"]): r for r in report["speed"]}

    def ratio(row: dict, other: str) -> str:
        o = speed.get((other, row["batch"]))
        return f"{row['tok_s_median'] / o['tok_s_median']:.2f}x" if o else "-"

    for r in report["speed"]:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s_median']:.1f} "
                     f"({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) | {r['limit_tok_s']:.1f} | "
                     f"{r['share_of_limit']:.0%} | {ratio(r, 'neuron fp32')} | "
                     f"{ratio(r, 'vllm-cpu fp32')} | {ratio(r, 'transformers fp32')} |")
    lines += ["", "KV capacity on a 1 GiB budget (max model length 1024):", "",
              "| KV cache | tokens | concurrent 1k-token sequences |", "|---|---|---|"]
    lines += [f"| {r['kv_cache_dtype']} | {r['tokens_per_gib']} | {r['sequences_1k_per_gib']} |"
              for r in report["capacity"]]
    lines += ["", "Held-out loss of the demo model (4 windows of 256 tokens):", "",
              "| configuration | loss | vs Transformers fp32 |", "|---|---|---|"]
    lines += [f"| {r['config']} | {r['loss']:.4f} | {r['vs_fp32']:+.2%} |" for r in report["quality"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ["NEURON_SERVE_DEVICE"] = "neuron"  # the in-process engines: ours
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"one of {sorted(SHAPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.logs = args.out / ".logs"
    args.logs.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    from neuron_serve.models.quantized import write_quantized

    model = checkpoint(args.model)
    shape = hardware.ModelShape.of(AutoConfig.from_pretrained(model))
    with tempfile.TemporaryDirectory() as tmp:
        models = {None: model}
        for fmt in {VARIANTS[v][1] for v in args.variants} - {None}:
            models[fmt] = Path(tmp) / fmt
            write_quantized(model, models[fmt], fmt)
        speed = measure_speed(args, models, shape)
        capacity = measure_capacity(model)
        quality = measure_quality(Path(tmp))
    report = dict(model=args.model, machine_description=hardware.describe(), prompt=args.prompt,
                  output=args.output, repeats=args.repeats, speed=speed, capacity=capacity,
                  quality=quality)
    stem = args.out / f"quantized-{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

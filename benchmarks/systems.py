"""One system under benchmark in its own process, driven by compare.py over stdin/stdout.

    python benchmarks/systems.py SYSTEM MODEL_DIR --max-num-seqs 32 ...

SYSTEM is `neuron` (our platform, compiled), `vllm-cpu` (vLLM's own CPU backend, same
install) or `transformers` (`generate` with a static cache and torch.compile, batched).
`--eager` runs each without compiling: a quick check of a harness, its figures no measure.
Each stdin line is a JSON job {"batch", "prompt", "output", "seed"}, optionally with a
"schema" (vLLM systems: every sequence's output constrained to that JSON schema, vLLM's
structured outputs; the schema must not end within `output` tokens); the answer is one
stdout line `RESULT {"seconds": ..., "output_tokens": ...}` (vLLM logs to stdout too, so
results carry a prefix). Prompts are random token ids from the seed, the same for every
system; every sequence generates exactly `output` tokens (EOS ignored), nothing detokenized.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

SYSTEMS = ("neuron", "vllm-cpu", "transformers")
# Pause before measuring a system while the others stay up: vLLM's CPU worker spins
# (sched_yield) for 1 s after its last message before it sleeps (shm_broadcast busy_loop_s),
# and the system measured next would share the 2 cores with that spin (seen: our server's
# TPOT 60 ms instead of 2.9 ms on the tiny model).
OTHER_SYSTEM_IDLE_S = 2.0
Generate = Callable[..., int]  # prompts, output length, schema → tokens generated


def prompts_for(job: dict, vocab_size: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(job["seed"])
    ids = rng.integers(16, vocab_size - 16, size=(job["batch"], job["prompt"]))
    return ids.tolist()


def vllm_engine(system: str, args: argparse.Namespace) -> Generate:
    if system == "neuron":
        os.environ["NEURON_SERVE_DEVICE"] = "neuron"
    else:
        os.environ.pop("NEURON_SERVE_DEVICE", None)
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    from vllm import LLM, SamplingParams

    # Every graph before the first measurement: the emulated device's default would start
    # eager and compile in the background.
    mode = "eager" if args.eager else "ahead"
    ours = {"additional_config": {"neuron": {"compile_mode": mode, **(args.neuron_config or {})}}} \
        if system == "neuron" else {"enforce_eager": args.eager}
    llm = LLM(model=args.model, dtype="float32", seed=0, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), enable_prefix_caching=False,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, **ours)

    def generate(prompts: list[list[int]], output: int, schema: dict | None = None) -> int:
        from vllm.sampling_params import StructuredOutputsParams

        constrained = StructuredOutputsParams(json=schema) if schema else None
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0,
                                detokenize=False, structured_outputs=constrained)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return generate


def transformers_generate(args: argparse.Namespace) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    compile_config._compile_all_devices = not args.eager  # else transformers compiles on GPUs only

    @torch.inference_mode()
    def generate(prompts: list[list[int]], output: int) -> int:
        ids = torch.tensor(prompts)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output,
                             min_new_tokens=output, do_sample=False,
                             cache_implementation="static", compile_config=compile_config)
        return out[:, ids.shape[1]:].numel()
    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=SYSTEMS)
    parser.add_argument("model")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=2)
    parser.add_argument("--neuron-config", type=json.loads, default=None)
    parser.add_argument("--quantization", default=None, help="vLLM's --quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype")
    parser.add_argument("--eager", action="store_true", help="compile nothing (a harness check)")
    args = parser.parse_args()

    import transformers
    vocab_size = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    start = time.perf_counter()
    generate = (transformers_generate(args) if args.system == "transformers"
                else vllm_engine(args.system, args))
    print("RESULT " + json.dumps({"ready_seconds": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        prompts = prompts_for(job, vocab_size)
        t0 = time.perf_counter()
        tokens = generate(prompts, job["output"], **({"schema": job["schema"]} if "schema" in job else {}))
        seconds = time.perf_counter() - t0
        print("RESULT " + json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()

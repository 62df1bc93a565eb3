"""Decode step time must not grow with the KV cache size (no whole-cache copy per step).

    .venv/bin/python benchmarks/decode_vs_kv_size.py [--sizes-mb 32 3000]

Compiled demo model, one sequence, 128 greedy tokens, fresh process per size; prints
ms/token for each KV cache size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import os, sys, time
os.environ["NEURON_SERVE_DEVICE"] = "neuron"
from vllm import LLM, SamplingParams
from neuron_serve.models import DEMO_MODEL_DIR
if __name__ == "__main__":
    llm = LLM(model=str(DEMO_MODEL_DIR), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory_bytes=int(sys.argv[1]) << 20, seed=0, additional_config={"neuron": {
                  "token_buckets": [64], "request_buckets": [1, 4], "block_buckets": [32],
                  "compile_mode": "ahead"}})
    params = SamplingParams(max_tokens=128, min_tokens=128, temperature=0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # first run
    t0 = time.monotonic()
    llm.generate([{"prompt_token_ids": [1, 5, 3]}], params, use_tqdm=False)
    print(f"RESULT {(time.monotonic() - t0) / 128 * 1000:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[32, 3000])
    args = parser.parse_args()
    print("| KV cache MB | ms/token |\n|---|---|")
    for mb in args.sizes_mb:
        out = subprocess.run([sys.executable, "-c", CHILD, str(mb)], capture_output=True,
                             text=True, check=True).stdout
        (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        print(f"| {mb} | {line.split()[1]} |", flush=True)


if __name__ == "__main__":
    main()

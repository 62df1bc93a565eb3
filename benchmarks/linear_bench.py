"""Linear-layer microbenchmark: aten's CPU GEMM vs a oneDNN matmul on a prepacked weight
(what the emulated backend runs, neuron_serve/model_runner/packed_linear.py), for every
weight shape of a model, all its layers, at decode and prefill row counts.

    .venv/bin/python benchmarks/linear_bench.py [--model smollm2-135m] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROWS = (1, 8, 32, 256)


def _median_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def weight_shapes(config) -> dict[str, tuple[int, int, int]]:
    """name: (out features, in features, count) of a Llama/Qwen-style decoder's linears."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return {"qkv_proj": (qkv, hidden, layers),
            "o_proj": (hidden, config.num_attention_heads * head_dim, layers),
            "gate_up_proj": (2 * inter, hidden, layers),
            "down_proj": (hidden, inter, layers),
            "lm_head": (config.vocab_size, hidden, 1)}


def run(config) -> list[dict]:
    import vllm._custom_ops as ops

    rows_out = []
    for name, (n, k, count) in weight_shapes(config).items():
        weights = [torch.randn(n, k) / k ** 0.5 for _ in range(count)]
        handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        megabytes = count * n * k * 4 / 1e6
        for m in ROWS:
            x = torch.randn(m, k)
            torch.testing.assert_close(ops.onednn_mm(handles[0], x, None), x @ weights[0].t(),
                                       rtol=1e-4, atol=1e-4)
            aten = _median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights])
            packed = _median_ms(lambda: [ops.onednn_mm(h, x, None) for h in handles])
            gflop = 2 * m * n * k * count / 1e9
            rows_out.append(dict(weight=name, layers=count, rows=m, megabytes=megabytes,
                                 aten_ms=aten, packed_ms=packed, gflop=gflop))
            print(f"{name:13s} x{count:<3d} rows {m:4d}: aten {aten:8.2f} ms, "
                  f"packed {packed:8.2f} ms ({aten / packed:4.1f}x)", flush=True)
    return rows_out


def markdown(model: str, rows: list[dict]) -> str:
    lines = [f"# Linear layers of {model}: aten GEMM vs prepacked oneDNN", "",
             "Command: `benchmarks/linear_bench.py --model " + model + "`  ",
             f"torch threads {torch.get_num_threads()}, fp32, median of 5; GB/s counts "
             "weight bytes read once, GFLOP/s the products.", "",
             "| weight | rows | aten ms | packed ms | aten ÷ packed | packed GB/s | packed GFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weight']} ×{r['layers']} | {r['rows']} | {r['aten_ms']:.2f} | "
                     f"{r['packed_ms']:.2f} | {r['aten_ms'] / r['packed_ms']:.1f}× | "
                     f"{r['megabytes'] / r['packed_ms']:.0f} | {r['gflop'] / r['packed_ms'] * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from shapes import SHAPES, checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    import transformers
    config = transformers.AutoConfig.from_pretrained(checkpoint(args.model))
    text = markdown(args.model, run(config))
    out = Path(args.out) / f"linear_kernels-{args.model}.md"
    out.write_text(text)
    print(text + f"\nwritten: {out}")


if __name__ == "__main__":
    main()

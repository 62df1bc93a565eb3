"""Linear-layer microbenchmark: aten's CPU GEMM, a oneDNN matmul on a prepacked weight and
our skinny decode kernel (the emulated backend runs the last two: neuron_serve/device/
emulated/linear.py and skinny_matmul.py), for every weight shape of a model, all its layers,
at decode and prefill row counts, with a plain sum of as many bytes as the weights for the
memory's pace. The skinny kernel also runs INT8 and float8 e4m3 copies of the weights (a
scale per output column, as quantized_linear.py stores them): a quarter of the bytes. A
second table runs all of the model's layers in a decode step's order, each format: a
shape's layers alone may fit a large L3 cache, a whole model's weights do not. A third
table times one thread on a weight that stays in L2: how fast the kernel widens 8-bit
weights when the memory is not the limit.

    .venv/bin/python benchmarks/linear_bench.py [--model smollm2-135m] [--out DIR]
        [--whole-model-only] [--avx2-only]
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
ROWS = (1, 2, 4, 8, 16, 32, 64, 256)


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

    from neuron_serve.device.emulated import skinny_matmul
    from neuron_serve.device.emulated.quantized_linear import quantize_rows

    skinny_matmul.load()
    rows_out = []
    for name, (n, k, count) in weight_shapes(config).items():
        weights = [torch.randn(n, k) / k ** 0.5 for _ in range(count)]
        handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        blocks = [skinny_matmul.pack_weight(w) for w in weights]
        eight_bit = {}  # format: [(blocks, packed scale)] per layer
        for fmt, dtype in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
            copies = [quantize_rows(w, dtype) for w in weights]
            eight_bit[fmt] = [(skinny_matmul.pack_weight(q), skinny_matmul.pack_scale(sc, dtype))
                              for q, sc in copies]
        flat = torch.ones(count * n * k)  # the same bytes, read by a plain sum
        megabytes = count * n * k * 4 / 1e6
        for m in ROWS:
            x = torch.randn(m, k)
            expected = x @ weights[0].t()
            torch.testing.assert_close(ops.onednn_mm(handles[0], x, None), expected,
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(skinny_matmul.skinny_matmul(x, blocks[0], None, n),
                                       expected, rtol=1e-4, atol=1e-4)
            # Taking turns, so a noisy neighbour slows all of them alike.
            aten, packed, skinny, read = [], [], [], []
            quantized = {fmt: [] for fmt in eight_bit}
            for _ in range(3):
                aten.append(_median_ms(lambda: [torch.nn.functional.linear(x, w) for w in weights]))
                packed.append(_median_ms(lambda: [ops.onednn_mm(h, x, None) for h in handles]))
                skinny.append(_median_ms(
                    lambda: [skinny_matmul.skinny_matmul(x, b, None, n) for b in blocks]))
                for fmt, layers in eight_bit.items():
                    quantized[fmt].append(_median_ms(
                        lambda: [skinny_matmul.skinny_matmul(x, b, None, n, sc) for b, sc in layers]))
                read.append(_median_ms(lambda: flat.sum()))
            row = dict(weight=name, layers=count, rows=m, megabytes=megabytes,
                       aten_ms=statistics.median(aten), packed_ms=statistics.median(packed),
                       skinny_ms=statistics.median(skinny), sum_ms=statistics.median(read),
                       int8_ms=statistics.median(quantized["int8"]),
                       e4m3_ms=statistics.median(quantized["e4m3"]),
                       gflop=2 * m * n * k * count / 1e9)
            rows_out.append(row)
            print(f"{name:13s} x{count:<3d} rows {m:4d}: aten {row['aten_ms']:8.2f} ms, "
                  f"packed {row['packed_ms']:8.2f} ms, skinny {row['skinny_ms']:8.2f} ms "
                  f"({row['packed_ms'] / row['skinny_ms']:4.2f}x packed), int8 "
                  f"{row['int8_ms']:8.2f} ms, e4m3 {row['e4m3_ms']:8.2f} ms, "
                  f"sum {row['sum_ms']:6.2f} ms", flush=True)
    return rows_out


def whole_model(config, rows=(1, 2, 8)) -> list[dict]:
    """One pass over every layer's weights in a decode step's order on the skinny kernel,
    float32, INT8 and e4m3, beside a plain sum of the float32 bytes."""
    from neuron_serve.device.emulated import skinny_matmul
    from neuron_serve.device.emulated.quantized_linear import quantize_rows

    shapes = weight_shapes(config)
    order = [name for _ in range(config.num_hidden_layers) for name in shapes
             if name != "lm_head"] + ["lm_head"]
    formats = {"fp32": None, "int8": torch.int8, "e4m3": torch.float8_e4m3fn}
    layers, nbytes = {f: [] for f in formats}, dict.fromkeys(formats, 0)
    for name in order:
        n, k, _ = shapes[name]
        weight = torch.randn(n, k) / k ** 0.5
        for fmt, dtype in formats.items():
            if dtype is None:
                layers[fmt].append((skinny_matmul.pack_weight(weight), None, n, k))
            else:
                values, scale = quantize_rows(weight, dtype)
                layers[fmt].append((skinny_matmul.pack_weight(values),
                                    skinny_matmul.pack_scale(scale, dtype), n, k))
            nbytes[fmt] += n * k * (4 if dtype is None else 1)
    flat = torch.ones(nbytes["fp32"] // 4)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k) for *_, k in layers["fp32"]}
        times, read = {f: [] for f in formats}, []
        for _ in range(3):  # taking turns
            for fmt in formats:
                times[fmt].append(_median_ms(lambda: [
                    skinny_matmul.skinny_matmul(xs[k], b, None, n, sc) for b, sc, n, k in layers[fmt]]))
            read.append(_median_ms(lambda: flat.sum()))
        sum_gb_s = nbytes["fp32"] / 1e6 / statistics.median(read)
        for fmt in formats:
            ms = statistics.median(times[fmt])
            out.append(dict(format=fmt, rows=m, megabytes=nbytes[fmt] / 1e6, ms=ms,
                            sum_gb_s=sum_gb_s))
            print(f"all layers {fmt:5s} rows {m}: {ms:7.2f} ms, {nbytes[fmt] / 1e6 / ms:5.1f} GB/s "
                  f"(sum {sum_gb_s:5.1f} GB/s)", flush=True)
    return out


def in_cache(in_features: int = 576, out_features: int = 1536) -> list[dict]:
    """Weights a second that one thread multiplies at 1 row, each format, on a weight small
    enough to stay in L2 (8-bit: 885 KB), with a call's fixed cost (a 64-output weight's
    time) taken off: the kernel's own pace when the memory is not the limit. An 8-bit
    format can stream at the memory's pace only where this is well above the memory's
    share per thread."""
    from neuron_serve.device.emulated import skinny_matmul
    from neuron_serve.device.emulated.quantized_linear import quantize_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(1, in_features)
    out = []
    try:
        for fmt, dtype in (("fp32", None), ("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
            ms = {}
            for n in (64, out_features):
                weight = torch.randn(n, in_features) / in_features ** 0.5
                if dtype is None:
                    blocks, scale = skinny_matmul.pack_weight(weight), None
                else:
                    values, scale = quantize_rows(weight, dtype)
                    blocks = skinny_matmul.pack_weight(values)
                    scale = skinny_matmul.pack_scale(scale, dtype)
                ms[n] = _median_ms(lambda: [skinny_matmul.skinny_matmul(x, blocks, None, n, scale)
                                            for _ in range(200)], repeats=9) / 200
            rate = (out_features - 64) * in_features / (ms[out_features] - ms[64]) / 1e6
            out.append(dict(format=fmt, g_weights_per_s=rate, call_us=ms[64] * 1e3))
            print(f"in cache {fmt:5s}: {rate:5.1f} G weights/s a thread", flush=True)
    finally:
        torch.set_num_threads(threads)
    return out


def markdown(model: str, rows: list[dict], whole: list[dict],
             cached: list[dict]) -> str:
    import hardware

    from neuron_serve.device.emulated import skinny_matmul

    lines = [f"# Linear layers of {model}: aten GEMM, prepacked oneDNN, skinny kernel", "",
             f"Command: `{' '.join(['benchmarks/linear_bench.py', *sys.argv[1:]])}`  ",
             f"torch threads {torch.get_num_threads()}, fp32, median of 3 rounds (each a "
             "median of 5) taking turns. GB/s counts weight bytes read once; \"sum GB/s\" is "
             "a plain sum of as many bytes, the memory's pace in the same round; the INT8 and "
             "e4m3 columns are the skinny kernel on 8-bit copies of the same weights, their "
             "GB/s counting one byte a weight. The emulated "
             "backend runs the skinny kernel up to `skinny_matmul.max_rows()` rows, oneDNN "
             f"above: {skinny_matmul.max_rows()} on this CPU ({hardware.describe()}).",
             "",
             "| weight | rows | aten ms | packed ms | skinny ms | packed ÷ skinny | "
             "packed GB/s | skinny GB/s | sum GB/s | best GFLOP/s | INT8 ms | INT8 GB/s | "
             "e4m3 ms | e4m3 GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = min(r["packed_ms"], r["skinny_ms"])
        lines.append(f"| {r['weight']} ×{r['layers']} | {r['rows']} | {r['aten_ms']:.2f} | "
                     f"{r['packed_ms']:.2f} | {r['skinny_ms']:.2f} | "
                     f"{r['packed_ms'] / r['skinny_ms']:.2f}× | "
                     f"{r['megabytes'] / r['packed_ms']:.1f} | {r['megabytes'] / r['skinny_ms']:.1f} | "
                     f"{r['megabytes'] / r['sum_ms']:.1f} | {r['gflop'] / best * 1e3:.0f} | "
                     f"{r['int8_ms']:.2f} | {r['megabytes'] / 4 / r['int8_ms']:.1f} | "
                     f"{r['e4m3_ms']:.2f} | {r['megabytes'] / 4 / r['e4m3_ms']:.1f} |")
    lines += ["", "All layers in a decode step's order, one pass (median of 3 rounds taking "
              "turns); GB/s counts each format's own bytes.", "",
              "| format | rows | MB | ms | GB/s | sum GB/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['rows']} | {r['megabytes']:.0f} | {r['ms']:.2f} | "
              f"{r['megabytes'] / r['ms']:.1f} | {r['sum_gb_s']:.1f} |" for r in whole]
    lines += ["", "One thread, 1 row, a 1536 × 576 weight in L2 (a call's fixed cost taken off): "
              "the kernel's pace where the memory is not the limit. fp32's 3.5 MB may not fit "
              "L2.", "", "| format | G weights/s a thread | fixed cost a call, µs |",
              "|---|---|---|"]
    lines += [f"| {r['format']} | {r['g_weights_per_s']:.1f} | {r['call_us']:.1f} |"
              for r in cached]
    return "\n".join(lines) + "\n"


def main() -> None:
    from shapes import SHAPES, checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--name", help="file stem suffix (default: the ISA torch reports)")
    parser.add_argument("--whole-model-only", action="store_true",
                        help="only the all-layer table")
    parser.add_argument("--avx2-only", action="store_true",
                        help="the skinny kernel's AVX2 tiles on a CPU with AVX-512 too")
    args = parser.parse_args()
    import transformers

    from neuron_serve.device.emulated import skinny_matmul
    skinny_matmul.load()
    isa = torch.ops.neuron_serve.skinny_matmul_isa("avx2" if args.avx2_only else "avx512-vnni")
    config = transformers.AutoConfig.from_pretrained(checkpoint(args.model))
    per_shape = [] if args.whole_model_only else run(config)
    text = (markdown(args.model, per_shape, whole_model(config), in_cache())
            + f"\nSkinny kernel tiles: {isa}.\n")
    suffix = args.name or torch.backends.cpu.get_cpu_capability().lower()
    out = Path(args.out) / f"linear_kernels-{args.model}-{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwritten: {out}")


if __name__ == "__main__":
    main()

"""What this machine can do, measured by the benchmark itself, and the speed limit of a
generation on it (DESIGN §8).

Limit of one decode step = max(bytes read ÷ read bandwidth, FLOPs ÷ fp32 GEMM rate): the
weights once per step (the tied embedding read whole as the LM head), every sequence's KV
cache, and 2 FLOPs per weight per token plus attention. A prefill is bounded by its FLOPs.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    torch_threads: int
    isa: str
    flags: list[str]
    read_gb_per_s: float
    fp32_gemm_gflop_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_facts() -> tuple[str, list[str]]:
    name, flags = platform.processor() or "unknown", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and name in ("unknown", "", platform.processor()):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
                flags = [f for f in line.split(":", 1)[1].split() if f in wanted]
                break
    except OSError:
        pass
    return name, flags


def describe() -> str:
    """One line naming this machine: CPU, cores, the ISA torch uses."""
    return f"{_cpu_facts()[0]}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


def _best_seconds(fn, repeats: int = 15) -> float:
    """The fastest of `repeats` runs: other work on a shared machine only ever slows a run
    down, so the best time is the closest to what the hardware can do (a median once read
    38 GB/s where the best of 60 runs read 50 on the same machine)."""
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@functools.cache
def _read_buffer() -> torch.Tensor:
    """512 MB of fp32, far beyond any cache, in huge pages as our kernel's weights are: a
    page walk every 4 KB slows a stream (memory_effects.py), so the fastest read this
    machine does is a read of huge pages. Made once: on some VMs mapping it takes seconds."""
    from neuron_serve.device.emulated import huge_pages

    return torch.frombuffer(huge_pages.mapping(512 << 20), dtype=torch.float32).fill_(1.0)


def measure(read_repeats: int = 60, gemm_repeats: int = 15) -> Machine:
    """The machine's facts and its best read bandwidth and fp32 GEMM rate right now. Fewer
    repeats (~1.5 s instead of ~3.8) for the readings compare.py takes before every turn."""
    buf = _read_buffer()
    read_s = _best_seconds(lambda: buf.sum(), repeats=read_repeats)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    # The fastest fp32 GEMM this install has: aten's BLAS, or oneDNN on a prepacked weight
    # (vLLM's CPU extension; 2x aten on AMD EPYC), so the limit is no easier to reach.
    gemm_s = _best_seconds(lambda: torch.mm(a, b), repeats=gemm_repeats)
    try:
        import vllm._custom_ops as ops
        packed = ops.create_onednn_mm(b, 32)
        gemm_s = min(gemm_s, _best_seconds(lambda: ops.onednn_mm(packed, a, None), repeats=gemm_repeats))
    except (ImportError, AttributeError, RuntimeError):
        pass
    name, flags = _cpu_facts()
    return Machine(cpu=name, cores=os.cpu_count() or 1, torch_threads=torch.get_num_threads(),
                   isa=str(torch.backends.cpu.get_cpu_capability()), flags=flags,
                   read_gb_per_s=buf.numel() * 4 / read_s / 1e9,
                   fp32_gemm_gflop_per_s=2 * n ** 3 / gemm_s / 1e9)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size)

    @property
    def matmul_weights(self) -> int:
        """Weights every token multiplies through: attention and MLP projections, LM head."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, context: int) -> int:
        """QK and PV for one query token over `context` keys, all layers."""
        return self.layers * 4 * self.heads * self.head_dim * context


def generation_limit_seconds(shape: ModelShape, machine: Machine, batch: int, prompt: int,
                             output: int, dtype_bytes: int = 4, weight_bytes: float | None = None,
                             kv_dtype_bytes: int | None = None) -> float:
    """Fastest possible time for `batch` sequences of `prompt` tokens to generate `output`
    tokens each: the prefill's FLOPs (the first token), then output-1 decode steps at
    their limit. Weights and KV cache are `dtype_bytes` per value unless `weight_bytes`
    (8-bit weights: 1) or `kv_dtype_bytes` say otherwise."""
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    gemm = machine.fp32_gemm_gflop_per_s * 1e9
    bandwidth = machine.read_gb_per_s * 1e9
    body = shape.matmul_weights - shape.vocab * shape.hidden  # every prompt token
    prefill_flops = batch * (sum(2 * body + shape.attention_flops(c + 1) for c in range(prompt))
                             + 2 * shape.vocab * shape.hidden)  # logits of the last token only
    total = prefill_flops / gemm
    for step in range(1, output):
        context = prompt + step
        read = (shape.matmul_weights * weight_bytes
                + batch * context * shape.kv_bytes_per_token(kv_dtype_bytes))
        flops = batch * (2 * shape.matmul_weights + shape.attention_flops(context))
        total += max(read / bandwidth, flops / gemm)
    return total

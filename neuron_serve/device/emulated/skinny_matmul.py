"""Emulated backend: the matmuls of decode steps (a few to ~100 rows) on our own kernel.

At 1-8 rows a matmul reads every weight once and does little else, so its speed is the
speed the weight streams from memory; from ~16 rows on the FMAs count too, and the kernel
must keep both busy at once. oneDNN's matmul on a prepacked weight streams the weight well
below the memory's pace at those sizes; `skinny_matmul.cpp` streams it closer to that pace,
with AVX-512 tiles (up to 8 rows x 48 or 6 x 64 columns, prefetching the weight ahead) where
the CPU has them, and is faster than oneDNN at decode sizes. One row of INT8 weights runs as
integer dot products on AVX-512 VNNI, widening no weight to a float, and one row of e4m3
weights as bfloat16 dot products on AVX-512 BF16. Its lead shrinks as the rows
grow and the FMAs take over, until oneDNN catches up: sooner on AVX2 than on AVX-512
(measured per weight shape of SmolLM2 with `benchmarks/linear_bench.py`:
benchmarks/README.md, "Design measurements").

So steps of up to `max_rows()` rows, a limit per vector ISA below that crossing, run on it,
larger ones on oneDNN; each linear keeps both weight layouts, twice the weight memory.

The kernel is part of the emulated backend's C++ library (extension.py).
"""

from __future__ import annotations

import functools

import torch

from neuron_serve.device.emulated import extension, huge_pages

# Steps of up to this many rows run on the kernel, by torch's CPU capability (see above).
_MAX_ROWS = {"AVX2": 64, "AVX512": 128}
_BLOCK = 16  # output columns per weight block; kBlock in the C++ source


def max_rows() -> int:
    """Steps of up to this many rows run on the kernel on this CPU; 0 without AVX2."""
    return _MAX_ROWS.get(torch.backends.cpu.get_cpu_capability(), 0)


def load() -> None:
    """Load the kernel library (extension.py), building it first if needed."""
    extension.load()
    _register_fake()


@functools.cache
def _register_fake() -> None:
    @torch.library.register_fake("neuron_serve::skinny_matmul")
    def _(x, weight_blocks, bias, out_features, scale=None):
        return x.new_empty((x.shape[0], out_features))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: column blocks the kernel streams front to back
    (float32, int8 or float8_e4m3fn), in huge pages (huge_pages.py)."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // _BLOCK)
    padded = weight.new_zeros(blocks * _BLOCK, in_features)
    padded[:out_features] = weight
    out = huge_pages.empty((blocks, in_features, _BLOCK), weight.dtype)
    return out.copy_(padded.view(blocks, _BLOCK, in_features).transpose(1, 2))


def pack_scale(scale: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """Per-column scales [N] of 8-bit weights as the kernel takes them: padded to whole
    blocks, times 2^8 for e4m3 (the kernel reads e4m3 bytes as halves, 2^-8 of their value)."""
    unit = 256.0 if weight_dtype == torch.float8_e4m3fn else 1.0
    blocks = -(-scale.numel() // _BLOCK)
    out = scale.new_zeros(blocks * _BLOCK, dtype=torch.float32)
    out[:scale.numel()] = scale.float().flatten() * unit
    return out


def skinny_matmul(x: torch.Tensor, weight_blocks: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for x [rows, in_features] and W packed by `pack_weight`; 8-bit
    weights are W / scale per column, with `scale` packed by `pack_scale`."""
    return torch.ops.neuron_serve.skinny_matmul(x, weight_blocks, bias, out_features, scale)

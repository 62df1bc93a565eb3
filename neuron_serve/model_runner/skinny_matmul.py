"""Emulated backend: the matmuls of decode steps (a few to ~100 rows) on our own kernel.

At 1-8 rows a matmul reads every weight once and does little else, so its speed is the
speed the weight streams from memory; from ~16 rows on the FMAs count too, and the kernel
must keep both busy at once. Per weight shape of SmolLM2, all layers
(`benchmarks/linear_bench.py`, results/linear_kernels-smollm2-135m-<isa>.md):

* 2-core AMD EPYC (Zen 3, AVX2; a plain sum reads 17-23 GB/s): oneDNN's matmul on a
  prepacked weight streams the weights at 7-13 GB/s at 1 row, `skinny_matmul.cpp` at
  14-20 GB/s. The kernel is 1.4-1.9x oneDNN at 1 row, 1.4-1.6x at 8, 1.1-1.5x at 16-32,
  1.0-1.35x at 64 and 0.9-1.05x at 256.
* 2-core Intel Xeon (Emerald Rapids, AVX-512), where oneDNN runs AVX-512 kernels of its own:
  the kernel's AVX-512 tiles (up to 8 rows x 48 or 6 x 64 columns, prefetching the weight
  ahead) are faster than oneDNN from 1 to 128 rows and even with it at 256.

So steps of up to `max_rows()` rows run on it, larger ones on oneDNN; each linear keeps
both weight layouts, twice the weight memory.

The kernel is part of the emulated backend's C++ library (cpu_extension.py).
"""

from __future__ import annotations

import functools

import torch

from neuron_serve.model_runner import cpu_extension

# Steps of up to this many rows run on the kernel, by torch's CPU capability (see above).
_MAX_ROWS = {"AVX2": 64, "AVX512": 128}
_BLOCK = 16  # output columns per weight block; kBlock in the C++ source


def max_rows() -> int:
    """Steps of up to this many rows run on the kernel on this CPU; 0 without AVX2."""
    return _MAX_ROWS.get(torch.backends.cpu.get_cpu_capability(), 0)


def load() -> None:
    """Load the kernel library (cpu_extension.py), building it first if needed."""
    cpu_extension.load()
    _register_fake()


@functools.cache
def _register_fake() -> None:
    @torch.library.register_fake("neuron_serve::skinny_matmul")
    def _(x, weight_blocks, bias, out_features):
        return x.new_empty((x.shape[0], out_features))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: column blocks the kernel streams front to back."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // _BLOCK)
    padded = weight.new_zeros(blocks * _BLOCK, in_features)
    padded[:out_features] = weight
    return padded.view(blocks, _BLOCK, in_features).transpose(1, 2).contiguous()


def skinny_matmul(x: torch.Tensor, weight_blocks: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """`x @ W.T + bias` for x [rows, in_features] and W packed by `pack_weight`."""
    return torch.ops.neuron_serve.skinny_matmul(x, weight_blocks, bias, out_features)

"""Emulated backend: the matmuls of decode steps (a few rows) on our own kernel.

At 1-8 rows a matmul reads every weight once and does little else, so its speed is the
speed the weight streams from memory. Per weight shape of SmolLM2, all layers
(`benchmarks/linear_bench.py`, results/linear_kernels-smollm2-135m-<isa>.md):

* 2-core AMD EPYC (Zen 3, AVX2; a plain sum reads 17-23 GB/s): oneDNN's matmul on a
  prepacked weight streams the weights at 7-13 GB/s at 1 row, `skinny_matmul.cpp` at
  14-20 GB/s. The kernel is 1.4-1.9x oneDNN at 1 row, 1.4-1.6x at 8, 1.1-1.5x at 16-32,
  1.0-1.35x at 64 and 0.9-1.05x at 256.
* 2-core Intel Xeon (Emerald Rapids, AVX-512), where oneDNN runs AVX-512 kernels of its own:
  the kernel's AVX-512 tile is 1.0-1.4x oneDNN at 1 row and 0.6-1.35x from 2 rows on.

So steps of up to `max_rows()` rows run on it, larger ones on oneDNN; each linear keeps
both weight layouts, twice the weight memory.

The kernel is built with torch's extension builder on first use (~20 s; the venv setup
builds it ahead) and kept in $NEURON_SERVE_KERNEL_DIR.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from neuron_serve import envs

# Steps of up to this many rows run on the kernel, by torch's CPU capability (see above).
_MAX_ROWS = {"AVX2": 64, "AVX512": 1}
_BLOCK = 16  # output columns per weight block; kBlock in the C++ source
_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


def max_rows() -> int:
    """Steps of up to this many rows run on the kernel on this CPU; 0 without AVX2."""
    return _MAX_ROWS.get(torch.backends.cpu.get_cpu_capability(), 0)


def cpu_supported() -> bool:
    """The kernel needs AVX2 and FMA (every x86 CPU torch rates AVX2 or better has both)."""
    return max_rows() > 0


@functools.cache
def load() -> None:
    """Load the kernel, building it first if this source and torch have no build yet in
    $NEURON_SERVE_KERNEL_DIR; registers `torch.ops.neuron_serve.skinny_matmul`."""
    library = _library_path()
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _build_and_load(library)

    @torch.library.register_fake("neuron_serve::skinny_matmul")
    def _(x, weight_blocks, bias, out_features):
        return x.new_empty((x.shape[0], out_features))


def _library_path() -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(" ".join(_FLAGS + [torch.__version__]).encode())
    return Path(envs.NEURON_SERVE_KERNEL_DIR) / f"skinny_matmul-{digest.hexdigest()[:16]}.so"


def _build_and_load(library: Path) -> None:
    """Build in a private directory, then move the library into place in one rename: a
    concurrent process never sees half a file, and a finished build is only ever read
    (a read-only image can ship it)."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=library.parent) as build:
            built = cpp_extension.load(  # also loads it
                name="neuron_serve_skinny_matmul", sources=[str(_SOURCE)], build_directory=build,
                extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
            os.replace(built, library)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(
            f"could not build the emulated backend's decode matmul ({_SOURCE.name}) in "
            f"{library.parent}: {error}. It needs g++ with AVX2 support, as torch.compile "
            "does, and a writable NEURON_SERVE_KERNEL_DIR.") from error


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

"""Emulated backend: our C++ CPU kernels (AVX2 + FMA), one library built from every source
in SOURCES. Each kernel's Python module says what it is for; this one builds and loads.

The library is built with torch's extension builder on first use (a C++ build that delays
the first start; the venv setup builds it ahead) and kept in $NEURON_SERVE_KERNEL_DIR, one
file per sources, flags and torch version.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from neuron_serve import envs

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("skinny_matmul.cpp", "paged_attention.cpp",
                                          "program_call.cpp", "step_threads.cpp"))
HEADERS = (_CSRC / "float8.h", _CSRC / "step_threads.h")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def cpu_supported() -> bool:
    """The kernels need AVX2 and FMA (every x86 CPU torch rates AVX2 or better has both)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> None:
    """Load the library, building it first if these sources and torch have no build yet in
    $NEURON_SERVE_KERNEL_DIR; registers the `torch.ops.neuron_serve` kernels."""
    library = library_path()
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        _build_and_load(library)
    # Into the global symbol scope too: decode graphs call the ops' C entries
    # (aoti_torch_cpu_*), which the loader must find when it loads a compiled graph.
    ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_GLOBAL)


# The library's C entries for inductor's C++ wrapper, by op (their definitions end each
# source): a decode graph calls them directly instead of through the dispatcher.
_C_SHIMS = {
    "skinny_matmul": "AOTITorchError aoti_torch_cpu_skinny_matmul(AtenTensorHandle x, "
                     "AtenTensorHandle weight_blocks, AtenTensorHandle* bias, "
                     "int64_t out_features, AtenTensorHandle* scale, AtenTensorHandle* out)",
    "paged_attention": "AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle query, "
                       "AtenTensorHandle kv_cache, AtenTensorHandle block_table, "
                       "AtenTensorHandle token_req, AtenTensorHandle token_pos, double scale, "
                       "int64_t sliding_window, double soft_cap, AtenTensorHandle* k_scale, "
                       "AtenTensorHandle* v_scale, AtenTensorHandle* out)",
}


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """inductor's `aot_inductor.custom_ops_to_c_shims` for the loaded library's ops."""
    load()
    return {getattr(torch.ops.neuron_serve, op).default: [declaration]
            for op, declaration in _C_SHIMS.items()}


@functools.cache
def graph_caller() -> ctypes._CFuncPtr:
    """The library's `neuron_serve_call_graph` (program_call.cpp). Through `ctypes.PyDLL`,
    so it is called holding the GIL, which the graph's entry releases while it runs."""
    load()
    call = ctypes.PyDLL(str(library_path()))["neuron_serve_call_graph"]
    call.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64,
                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


def library_path() -> Path:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(_FLAGS + [torch.__version__]).encode())
    return Path(envs.NEURON_SERVE_KERNEL_DIR) / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _build_and_load(library: Path) -> None:
    """Build in a private directory, then move the library into place in one rename: a
    concurrent process never sees half a file, and a finished build is only ever read
    (a read-only image can ship it)."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=library.parent) as build:
            built = cpp_extension.load(  # also loads it
                name="neuron_serve_cpu_kernels", sources=[str(s) for s in SOURCES],
                build_directory=build, extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                is_python_module=False)
            os.replace(built, library)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(
            f"could not build the emulated backend's C++ kernels "
            f"({', '.join(s.name for s in SOURCES)}) in {library.parent}: {error}. They need "
            "g++ with AVX2 support, as torch.compile does, and a writable "
            "NEURON_SERVE_KERNEL_DIR.") from error

"""The only module that knows whether we run on Trainium (`neuron`) or emulate it on CPU.

Everything above this module asks `current()` for a `Device` and never branches on the
backend itself. The `neuron` branch is written against TorchNeuron (`torch_neuronx`) but
has never run: no Trainium exists where this project is developed and tested.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
from dataclasses import dataclass

import psutil
import torch

from neuron_serve import envs
from neuron_serve.logs import init_logger

logger = init_logger(__name__)

EMULATED_MEMORY_FRACTION = 0.25  # of physical RAM, unless NEURON_SERVE_EMULATED_MEMORY_GB


@dataclass(frozen=True)
class Device:
    backend: str  # "neuron" or "emulated"
    torch_device: torch.device
    compile_backend: str  # torch.compile backend standing for the Neuron compiler
    attention_kernel: str  # name in neuron_serve.attention.kernels' registry
    native_bf16: bool
    dispatch_key: str  # torch dispatch key of the device, for vLLM's custom-op registration

    def compute_dtype(self, requested: torch.dtype) -> torch.dtype:
        """The dtype to compute in: the requested one, except half precision on CPUs
        without native bf16, where bf16 matmul runs ~200x slower than fp32 (DESIGN §3)."""
        if requested in (torch.bfloat16, torch.float16) and not self.native_bf16:
            _log_once(f"emulated backend computes in float32: this CPU has no native "
                      f"bf16 (requested {requested})")
            return torch.float32
        return requested

    @property
    def capacity_hint(self) -> str:
        """How a user changes total_memory_bytes(), for error messages."""
        if self.backend == "emulated":
            return "set NEURON_SERVE_EMULATED_MEMORY_GB (default: a quarter of RAM)"
        return "the capacity is read from the Neuron runtime"

    def init_worker_process(self) -> None:
        """Per-process setup before vLLM loads a model on this device."""
        if self.backend == "emulated":
            # vLLM calls torch.accelerator.{empty_cache,empty_host_cache,synchronize}, which
            # raise when torch sees no accelerator; on the CPU there is nothing to flush or
            # wait for. Distinct functions: Dynamo keys its handling on the object.
            def empty_cache(*args, **kwargs) -> None:
                pass

            def empty_host_cache(*args, **kwargs) -> None:
                pass

            def synchronize(*args, **kwargs) -> None:
                pass

            torch.accelerator.empty_cache = empty_cache
            torch.accelerator.empty_host_cache = empty_host_cache
            torch.accelerator.synchronize = synchronize

            from neuron_serve.model_runner import inductor_strides
            inductor_strides.install()  # ~11% less compile time, same kernels

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Per-device rewrites of a loaded model. Emulated: linear layers on oneDNN with
        prepacked weights (3-4.6x aten's CPU GEMM at decode sizes, 2.3-2.9x at 256 rows),
        decode-sized ones on our own kernel (skinny_matmul.py), and each stack of decoder
        layers compiled once per graph (compile_regions.py)."""
        if self.packed_linear:
            from neuron_serve.model_runner import packed_linear
            count = packed_linear.pack_linear_layers(model)
            logger.info("emulated backend: %d linear layers on %s matmuls", count,
                        self._linear_kernels())
        if self.backend == "emulated":
            from neuron_serve.model_runner import compile_regions
            count = compile_regions.compile_layers_once(model)
            logger.info("emulated backend: %d decoder layers compiled once per graph", count)

    def kv_cache_memory(self) -> contextlib.AbstractContextManager:
        """Where vLLM allocates the KV cache. Emulated: host memory on huge pages
        (huge_pages.py); Trainium: the device's own memory, as vLLM allocates it."""
        if self.backend == "emulated":
            from neuron_serve.model_runner import huge_pages
            return huge_pages.kv_cache_zeros()
        return contextlib.nullcontext()

    @property
    def packed_linear(self) -> bool:
        from neuron_serve.model_runner import packed_linear
        return self.backend == "emulated" and packed_linear.supported()

    def _linear_kernels(self) -> str:
        from neuron_serve.model_runner import skinny_matmul
        if not self.packed_linear:
            return "aten"
        rows = skinny_matmul.max_rows()
        return f"onednn-packed+skinny<={rows}" if rows else "onednn-packed"

    def compile_options(self) -> dict:
        """Everything besides the traced program that decides the compiled code: part of
        every compiled-graph cache key."""
        options = {"backend": self.compile_backend}
        if self.backend == "emulated":
            # Inductor bakes the OpenMP thread count and the vector ISA into each kernel.
            options.update(threads=torch.get_num_threads(),
                           isa=torch.backends.cpu.get_cpu_capability(),
                           linear=self._linear_kernels(), attention=self.attention_kernel,
                           decode=self.inductor_options(decode=True))
        return options

    def inductor_options(self, decode: bool) -> dict | None:
        """torch.compile options of one bucket's graph. Emulated decode steps call their
        kernels from inductor's C++ wrapper, not its Python one: a decode step is ~20 ms,
        and the Python wrapper's per-kernel calls took 3-4 ms of it (SmolLM2 shape, 1 and
        8 sequences, 2-core AMD EPYC). Mixed steps (200+ ms) keep the Python wrapper, which
        builds in half the time."""
        if self.backend == "emulated" and decode:
            return {"cpp_wrapper": True}
        return None

    def total_memory_bytes(self) -> int:
        if self.backend == "emulated":
            gib = envs.NEURON_SERVE_EMULATED_MEMORY_GB
            return int(gib * 2**30) if gib else int(psutil.virtual_memory().total * EMULATED_MEMORY_FRACTION)
        return _neuron_memory_bytes()


def hardware_present() -> bool:
    """Trainium is usable: the SDK imports and the kernel driver exposes a device."""
    return bool(glob.glob("/dev/neuron*")) and importlib.util.find_spec("torch_neuronx") is not None


@functools.cache
def current() -> Device:
    backend = envs.NEURON_SERVE_BACKEND
    if backend == "auto":
        backend = "neuron" if hardware_present() else "emulated"
    device = _neuron_device() if backend == "neuron" else _emulated_device()
    logger.info("neuron-serve device backend: %s (compile backend %s)", device.backend,
                device.compile_backend)
    return device


def _emulated_device() -> Device:
    from neuron_serve.model_runner import cpu_extension
    return Device(backend="emulated", torch_device=torch.device("cpu"),
                  compile_backend="inductor",
                  attention_kernel="cpu" if cpu_extension.cpu_supported() else "reference",
                  native_bf16=cpu_has_native_bf16(), dispatch_key="CPU")


def _neuron_device() -> Device:
    try:
        import torch_neuronx  # noqa: F401  (registers the "neuron" device and compile backend)
    except ImportError as exc:
        raise RuntimeError(
            "The neuron backend needs the AWS Neuron SDK, but `import torch_neuronx` failed "
            f"({exc}). Install torch-neuronx from the Neuron SDK on a Trainium host, or run "
            "the CPU emulation with NEURON_SERVE_BACKEND=emulated.") from exc
    return Device(backend="neuron", torch_device=torch.device("neuron"),
                  compile_backend="neuron", attention_kernel="reference", native_bf16=True,
                  dispatch_key="PrivateUse1")  # out-of-tree devices register under PrivateUse1


def _neuron_memory_bytes() -> int:
    free_total = getattr(getattr(torch, "neuron", None), "mem_get_info", None)
    if free_total is None:
        raise RuntimeError("cannot read Neuron device memory (torch.neuron.mem_get_info is "
                           "missing); pass --kv-cache-memory-bytes explicitly")
    return int(free_total()[1])


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True if the CPU computes bf16 natively (AVX512-BF16 or AMX); else bf16 is emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)

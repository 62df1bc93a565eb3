"""Every change the emulated backend makes to torch, inductor and the environment.

Nothing else in neuron-serve patches a library or writes a compiler setting. Each change
is made here, once per process, and logged once at INFO with what it changes and why:

* `torch.accelerator.{empty_cache, empty_host_cache, synchronize}`: no-ops (vLLM calls
  them, and they raise when torch sees no accelerator; a CPU has nothing to flush).
* inductor's CPU vectorizer stride query: answered by inductor_strides.py first.
* inductor's vector ISA check (`cpp.vec_isa_ok`): the CPU's flags are trusted.
* `TORCHINDUCTOR_CACHE_DIR`: inside the compiled-graph cache, so that the kernels a graph
  was built from are cached, pruned and exported with it.
* `torch.zeros`, for vLLM's one KV-cache allocation only: kv_memory.py's huge pages.
* CPU affinity, torch's thread count and inductor's compile threads of a model rank: its
  share of the host's cores.
* pickling a torch op (`OpOverload`): by its name.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from neuron_serve.device.emulated import inductor_strides, kv_memory
from neuron_serve.logs import init_logger

logger = init_logger(__name__)


@functools.cache
def _log_once(what: str, why: str) -> None:
    logger.info("emulated backend: %s (%s)", what, why)


@functools.cache
def every_process() -> None:
    """The patches every process that resolves the platform needs: an engine process
    whose workers are its children still flushes the accelerator at shutdown."""
    # Distinct functions: Dynamo keys its handling of a callable on the object.
    def empty_cache(*args, **kwargs) -> None:
        pass

    def empty_host_cache(*args, **kwargs) -> None:
        pass

    def synchronize(*args, **kwargs) -> None:
        pass

    torch.accelerator.empty_cache = empty_cache
    torch.accelerator.empty_host_cache = empty_host_cache
    torch.accelerator.synchronize = synchronize
    _log_once("torch.accelerator.empty_cache, empty_host_cache and synchronize are no-ops",
              "vLLM calls them; they raise without an accelerator")


@functools.cache
def worker_process() -> None:
    """The patches every process that runs a model needs."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen import cpp as cpp_codegen

    every_process()
    cpp_codegen.stride_at_vec_range = inductor_strides.stride_at_vec_range
    _log_once("inductor's stride_at_vec_range answers affine indices without sympy.simplify",
              "same kernels, less compile time")
    inductor_config.cpp.vec_isa_ok = True
    _log_once("inductor trusts the CPU's flags for its vector ISA (cpp.vec_isa_ok)",
              "else every compiling process builds and dlopen-probes a test program per ISA: "
              "seconds before its first graph")
    copyreg.pickle(torch._ops.OpOverload, _pickle_op)
    _log_once("torch ops pickle by name",
              "a decode graph's options name ops (aot_inductor.custom_ops_to_c_shims); "
              "unpicklable, they leave AOT autograd's cache a nonce key from `random`, which "
              "vLLM seeds alike in every process: one graph's entry loaded for another")


def _pickle_op(op: torch._ops.OpOverload) -> tuple:
    from torch._library.utils import lookup_op

    return lookup_op, (f"{op._schema.name}.{op._overloadname or 'default'}",)


def share_cores(slot: int, ranks_on_host: int, compilers_on_host: int = 1) -> None:
    """Model rank `slot` of `ranks_on_host` (tensor × data parallel) runs on its own slice
    of this process's cores; with more ranks than cores, one core each, shared. Inductor
    builds a graph's kernels on as many threads, split among `compilers_on_host` siblings
    (background compile processes, one per core)."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks_on_host <= 1:  # all of them: a Ray actor starts with OMP_NUM_THREADS=1
        _use_cores(len(cores), compilers_on_host)
        return
    per_rank = len(cores) // ranks_on_host
    if per_rank:
        mine = cores[slot * per_rank:(slot + 1) * per_rank]
    else:
        mine = [cores[slot % len(cores)]]
        logger.warning("emulated backend: %d model ranks on %d cores: each runs one thread, "
                       "and ranks share cores", ranks_on_host, len(cores))
    os.sched_setaffinity(0, mine)
    _use_cores(len(mine), compilers_on_host)
    logger.info("emulated backend: model rank %d of %d on this host runs on cores %s",
                slot, ranks_on_host, mine)


def _use_cores(n: int, compilers: int) -> None:
    from torch._inductor import config as inductor_config

    torch.set_num_threads(n)
    inductor_config.compile_threads = max(1, n // compilers)
    _log_once(f"inductor builds a graph's kernels on {inductor_config.compile_threads} threads",
              "importing vLLM sets TORCHINDUCTOR_COMPILE_THREADS=1 against process pools in "
              "daemonic processes, which C++ kernels do not use: a graph's kernels would "
              "build one after another")


def inductor_cache(directory: Path) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    _log_once(f"TORCHINDUCTOR_CACHE_DIR={directory}",
              "inductor's kernel builds live in the compiled-graph cache")


@contextlib.contextmanager
def kv_cache_allocation() -> Iterator[None]:
    """vLLM's one `torch.zeros(nbytes, dtype=torch.int8)` for the KV cache →
    `kv_memory.zeros`; other calls of torch.zeros inside pass through."""
    plain = torch.zeros

    def kv_zeros(*size, dtype=None, device=None, **kwargs):
        if (len(size) == 1 and isinstance(size[0], int) and dtype == torch.int8
                and not kwargs and torch.device(device or "cpu").type == "cpu"):
            return kv_memory.zeros(size[0])
        return plain(*size, dtype=dtype, device=device, **kwargs)

    _log_once("torch.zeros is redirected while vLLM allocates the KV cache",
              "the cache goes on huge pages, committed as it is first written")
    torch.zeros = kv_zeros
    try:
        yield
    finally:
        torch.zeros = plain

"""NeuronWorker: the vLLM worker lifecycle around NeuronModelRunner.

init_device → load_model → get_kv_cache_spec → determine_available_memory →
initialize_from_config → compile_or_warm_up_model → execute_model / sample_tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Iterator

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from neuron_serve import device, envs, ray_cluster
from neuron_serve.logs import init_logger
from neuron_serve.model_runner.runner import NeuronModelRunner
from neuron_serve.profiler import StepProfiler

logger = init_logger(__name__)


class NeuronWorker(WorkerBase):
    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.model_runner: NeuronModelRunner | None = None
        self.profiler = StepProfiler(
            f"engine{self.parallel_config.data_parallel_index}-rank{rank}")

    def init_device(self) -> None:
        dev = device.current()
        slot, self.ranks_on_host = self._share_of_host()
        dev.init_worker_process(slot, self.ranks_on_host)
        self.device = dev.torch_device
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method, self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self.model_runner = NeuronModelRunner(self.vllm_config, self.device)

    def _share_of_host(self) -> tuple[int, int]:
        """(this rank's slot among its host's model ranks, how many the host holds)."""
        if self.parallel_config.use_ray:  # the actor's NeuronCore among its node's
            return ray_cluster.node_share()
        # vLLM numbers a data-parallel engine's devices after those of the engines before it.
        return (current_platform.device_id_to_physical_device_id(self.local_rank),
                envs.NEURON_SERVE_RANKS_ON_HOST)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model()

    def get_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: --kv-cache-memory-bytes if given, else the device's
        capacity × --gpu-memory-utilization, minus weights and the largest step's scratch."""
        self.model_runner.config.check_attention_scratch(self._kv_heads_and_head_size())
        explicit = self.cache_config.kv_cache_memory_bytes
        dev = device.current()
        ranks = self.ranks_on_host
        if explicit:
            share = dev.rank_memory_bytes(ranks)
            if ranks > 1 and explicit > share:
                raise ValueError(
                    f"--kv-cache-memory-bytes {explicit} is per rank, and {ranks} ranks share "
                    f"this host's {dev.backend} memory: at most {share} bytes each "
                    f"({dev.capacity_hint})")
            return int(explicit)
        model = self.model_runner.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        weights += dev.extra_weight_bytes(model)  # e.g. prepacked copies
        scratch = self.model_runner.config.attention_scratch_bytes(self._kv_heads_and_head_size())
        budget = dev.rank_memory_bytes(ranks) * self.cache_config.gpu_memory_utilization
        available = int(budget - weights - scratch)
        if available <= 0:
            raise ValueError(
                f"no memory left for the KV cache: budget {budget / 2**30:.1f} GiB "
                f"({dev.backend} capacity × gpu_memory_utilization"
                f"{f', ÷ {ranks} ranks on this host' if ranks > 1 else ''}) minus weights "
                f"{weights / 2**30:.1f} GiB and step scratch {scratch / 2**30:.1f} GiB. "
                f"Pass --kv-cache-memory-bytes or raise --gpu-memory-utilization; {dev.capacity_hint}.")
        logger.info("KV cache budget %.2f GiB (weights %.2f GiB, scratch %.2f GiB)",
                    available / 2**30, weights / 2**30, scratch / 2**30)
        return available

    def _kv_heads_and_head_size(self) -> tuple[int, int, int]:
        spec = next(iter(self.get_kv_cache_spec().values()))
        return spec.num_kv_heads, spec.head_size, spec.dtype.itemsize

    def initialize_from_config(self, kv_cache_config) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        runner = self.model_runner
        runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        with _stoppable():
            seconds = self.model_runner.warm_up()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=seconds, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    @torch.no_grad()
    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    @torch.no_grad()
    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def reset_encoder_cache(self) -> None:
        pass

    def get_cache_block_size_bytes(self) -> int:
        spec = next(iter(self.get_kv_cache_spec().values()))
        return spec.page_size_bytes * len(self.get_kv_cache_spec())

    def compiles_after_warmup(self) -> int:
        """Graphs compiled while serving (RPC for tests and metrics; should stay 0)."""
        return self.model_runner.compiles_after_warmup

    def weight_bytes(self) -> dict[str, int]:
        """Bytes the loaded model's tensors hold, by dtype, the device's packed copies
        included (RPC for tests: which format the weights are stored in)."""
        sizes: dict[str, int] = {}
        model = self.model_runner.model
        for tensor in [*model.parameters(), *model.buffers()]:
            key = str(tensor.dtype).removeprefix("torch.")
            sizes[key] = sizes.get(key, 0) + tensor.numel() * tensor.element_size()
        return sizes

    def graph_stats(self) -> dict:
        """Compiled-graph counters (RPC for metrics and tests): `GraphStats.as_dict()`."""
        runner = self.model_runner
        return dataclasses.replace(
            runner.graphs.stats, num_graphs=len(runner.graphs.graphs),
            graphs_needed=len(runner.graphs.traced_on), num_buckets=len(runner.config.grid),
            compile_mode=runner.config.compile_mode,
            compiles_after_warmup=runner.compiles_after_warmup).as_dict()

    def start_step_profile(self, directory: str) -> None:
        """RPC from POST /admin/profile/start."""
        self.profiler.start(directory)

    def stop_step_profile(self) -> dict[str, str]:
        """RPC from POST /admin/profile/stop: the trace and Parquet paths."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        if self.model_runner is not None and self.model_runner.background is not None:
            self.model_runner.background.stop()

    def add_lora(self, lora_request) -> bool:
        raise NotImplementedError("LoRA is not supported by neuron-serve")

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported by neuron-serve")

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported by neuron-serve")

    def list_loras(self) -> set[int]:
        return set()


@contextlib.contextmanager
def _stoppable() -> Iterator[None]:
    """SIGTERM and SIGINT end the process during warm-up, as does the loss of its parent.
    vLLM's engine core only records a signal that arrives while it is being built and acts
    on it once built, which in compile mode `ahead` comes after every graph is compiled:
    minutes. Whatever the handler interrupts is safe to drop: cache writes are atomic."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def stop(signum, frame) -> None:
        chained = previous[signum]
        if callable(chained):
            chained(signum, frame)  # vLLM's: records the shutdown
        raise SystemExit(f"neuron-serve: {signal.Signals(signum).name} during warm-up")

    parent, done = os.getppid(), threading.Event()

    def watch_parent() -> None:
        while not done.wait(0.5):
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    for sig in previous:
        signal.signal(sig, stop)
    threading.Thread(target=watch_parent, daemon=True, name="warm-up-parent-watch").start()
    try:
        yield
    finally:
        done.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

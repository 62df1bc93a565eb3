"""A child process of compile mode `background` (background.py starts one per core):
builds the serving runner's twin on dummy weights and an uncommitted KV cache, and
compiles the graphs it is given into the shared graph cache, at the lowest CPU priority,
until every one is stored (by it or a sibling) or its parent is gone.

    python -m neuron_serve.model_runner.compile_job INDEX  < pickled job
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import vllm.ir
from vllm.config import set_current_vllm_config
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from neuron_serve import device
from neuron_serve.model_runner.graphs import log_progress
from neuron_serve.model_runner.runner import NeuronModelRunner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent() -> None:
    """Stop compiling for a server that is gone (re-parented means the parent died)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def _lowest_priority() -> None:
    """Serving steps first; compiling takes what they leave. SCHED_IDLE (Linux) runs only
    on otherwise idle cores: a mere nice level still preempts the server's OpenMP threads,
    and one late thread stalls a whole parallel region. Inherited by the compiler workers."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _init_distributed(vllm_config) -> None:
    """vLLM's parallel state, as the serving rank has it. Tensor-parallel ranks compile in
    a world without peers: torch's fake process group, whose collectives only keep shapes,
    so this rank's graphs trace its shard and name its group, as the rank's own world does
    when it runs them (vLLM creates the groups in a fixed order; the group's name is part
    of every graph's key)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1:
        init_worker_distributed_environment(vllm_config, 0, f"tcp://127.0.0.1:{_free_port()}",
                                            0, "gloo")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    rank = parallel.rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank,
                            world_size=parallel.world_size)
    real_new_group, real_queue = dist.new_group, MessageQueue.create_from_process_group

    def fake_new_group(*args, **kwargs):  # vLLM's CPU-side groups ask for gloo by name
        return real_new_group(*args, **{**kwargs, "backend": "fake"})

    def no_queue(*args, **kwargs) -> None:  # the broadcast queue waits for its peers
        return None

    dist.new_group, MessageQueue.create_from_process_group = fake_new_group, no_queue
    try:
        init_worker_distributed_environment(vllm_config, rank, "env://", rank, "fake")
    finally:
        dist.new_group, MessageQueue.create_from_process_group = real_new_group, real_queue


def main(index: int) -> None:
    _exit_with_parent()
    _lowest_priority()
    vllm_config, kv_cache_config, graphs, threads, siblings = pickle.load(sys.stdin.buffer)
    # Siblings start on different graphs instead of queueing on the first one's lock.
    graphs = graphs[index:] + graphs[:index]
    vllm_config.load_config.load_format = "dummy"
    dev = device.current()
    dev.init_worker_process(compilers_on_host=siblings)
    torch.set_num_threads(threads)  # the serving rank's, part of every graph's key: after
    # init_worker_process, which sets this process's own
    # What vLLM's WorkerBase sets for a worker's lifetime: without it the model's IR ops
    # trace as opaque custom ops that compile regions reject.
    vllm_config.kernel_config.ir_op_priority.set_default()
    vllm.ir.set_default_torch_wrap(vllm_config.compilation_config.ir_enable_torch_wrap)
    with set_current_vllm_config(vllm_config):
        _init_distributed(vllm_config)
        runner = NeuronModelRunner(vllm_config, dev.torch_device)
        runner.load_model()
        runner.initialize_kv_cache(kv_cache_config)
        runner.graphs.warm_up(graphs=graphs, progress=log_progress, load=False)


if __name__ == "__main__":
    main(int(sys.argv[1]))

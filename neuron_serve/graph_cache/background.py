"""Compile mode `background`: a separate process compiles the buckets that had no cached
graph and stores them in the cache; the serving worker loads each graph as it appears.

A process, not a thread: tracing reads vLLM's process-global forward context, which the
serving thread rewrites every step, and compiling holds the GIL for seconds at a time.
The child builds the same runner on dummy weights (weights are not part of a graph's key)
with an uncommitted KV cache of the same shape, so its graphs hit in the parent.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from neuron_serve.logs import init_logger

logger = init_logger(__name__)


@contextlib.contextmanager
def uncommitted_zeros() -> Iterator[None]:
    """torch.zeros → torch.empty for one allocation: pages stay uncommitted until written."""
    zeros = torch.zeros
    torch.zeros = lambda *a, **kw: torch.empty(*a, **kw)
    try:
        yield
    finally:
        torch.zeros = zeros


class BackgroundCompile:
    def __init__(self, process: subprocess.Popen, pending: list, manifest: Path):
        self.process, self.pending, self.manifest = process, pending, manifest
        self._seen_mtime = 0.0

    @classmethod
    def start(cls, vllm_config, kv_cache_config, buckets: list) -> BackgroundCompile:
        from neuron_serve.config import NeuronConfig

        root = Path(NeuronConfig.from_vllm_config(vllm_config).cache_dir)
        fd, job = tempfile.mkstemp(dir=root, prefix=".background-", suffix=".pkl")
        # Without the layers registered in the forward context (they hold the KV cache):
        # the child builds its own.
        compilation = vllm_config.compilation_config
        layers, compilation.static_forward_context = compilation.static_forward_context, {}
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump((vllm_config, kv_cache_config, buckets, torch.get_num_threads()), f)
        finally:
            compilation.static_forward_context = layers
        process = subprocess.Popen([sys.executable, "-m", __name__, job])
        logger.info("compiling %d bucket graphs in background process %d", len(buckets), process.pid)
        return cls(process, list(buckets), root / "manifest.json")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def poll(self, graphs) -> bool:
        """Load graphs the child has stored since the last call (cheap when none has: one
        stat). True when nothing is left to wait for."""
        try:
            mtime = self.manifest.stat().st_mtime
        except FileNotFoundError:
            mtime = 0.0
        if mtime != self._seen_mtime:
            self._seen_mtime = mtime
            for bucket in graphs.load_ready(self.pending):
                self.pending.remove(bucket)
                logger.info("bucket %s now runs its compiled graph", bucket)
        if not self.pending:
            return True
        if self.process.poll() not in (None, 0):
            logger.warning("background compilation exited with %s; buckets %s keep running "
                           "eager", self.process.returncode, [str(b) for b in self.pending])
            return True
        return False


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


def main(job: str) -> None:
    _exit_with_parent()
    _lowest_priority()
    with open(job, "rb") as f:
        vllm_config, kv_cache_config, buckets, threads = pickle.load(f)
    os.unlink(job)
    torch.set_num_threads(threads)  # part of every graph's key
    vllm_config.load_config.load_format = "dummy"
    from vllm.config import set_current_vllm_config

    from neuron_serve.model_runner.graphs import log_progress
    from neuron_serve.worker import NeuronWorker

    worker = NeuronWorker(vllm_config, local_rank=0, rank=0,
                          distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    with set_current_vllm_config(vllm_config):
        worker.init_device()
        worker.load_model()
        worker.model_runner.initialize_kv_cache(kv_cache_config, lazy=True)
        worker.model_runner.graphs.warm_up(buckets=buckets, progress=log_progress)


if __name__ == "__main__":
    main(sys.argv[1])

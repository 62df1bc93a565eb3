"""Compile mode `background`: a separate process compiles the buckets that had no cached
graph and stores them in the cache; the serving worker loads each graph as it appears.

A process, not a thread: tracing reads vLLM's process-global forward context, which the
serving thread rewrites every step, and compiling holds the GIL for seconds at a time.
The child (compile_job.py) builds the same runner on dummy weights (weights are not part
of a graph's key) with an uncommitted KV cache of the same shape, so its graphs hit in the
parent.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from neuron_serve.logs import init_logger

logger = init_logger(__name__)

JOB_MODULE = "neuron_serve.model_runner.compile_job"


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
        process = subprocess.Popen([sys.executable, "-m", JOB_MODULE, job])
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

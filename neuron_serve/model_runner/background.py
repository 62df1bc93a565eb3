"""Compile mode `background`: separate processes compile the graphs that had no cached
entry and store them in the cache; the serving worker loads each graph as it appears.

Processes, not threads: tracing reads vLLM's process-global forward context, which the
serving thread rewrites every step, and compiling holds the GIL for seconds at a time.
One process per core: each compiles one graph at a time (the graph cache's per-graph locks
hand each graph to one of them), and all run at idle priority, so a serving step always
takes the cores first. Each child (compile_job.py) builds the same runner on dummy weights
(weights are not part of a graph's key) with an uncommitted KV cache of the same shape,
so its graphs hit in the parent.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import torch

from neuron_serve.logs import init_logger

logger = init_logger(__name__)

JOB_MODULE = "neuron_serve.model_runner.compile_job"


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class BackgroundCompile:
    def __init__(self, processes: list[subprocess.Popen], pending: list, manifest: Path):
        self.processes, self.pending, self.manifest = processes, pending, manifest
        self._seen_mtime = 0.0

    @classmethod
    def start(cls, vllm_config, kv_cache_config, graphs: list,
              workers: int | None = None) -> BackgroundCompile:
        from neuron_serve.config import NeuronConfig

        root = Path(NeuronConfig.from_vllm_config(vllm_config).cache_dir)
        # Without the layers registered in the forward context (they hold the KV cache):
        # each child builds its own.
        compilation = vllm_config.compilation_config
        count = max(1, min(len(graphs), workers or available_cores()))
        layers, compilation.static_forward_context = compilation.static_forward_context, {}
        try:
            job = pickle.dumps((vllm_config, kv_cache_config, graphs, torch.get_num_threads(),
                                count))
        finally:
            compilation.static_forward_context = layers
        processes = []
        for index in range(count):
            process = subprocess.Popen([sys.executable, "-m", JOB_MODULE, str(index)],
                                       stdin=subprocess.PIPE)
            process.stdin.write(job)
            process.stdin.close()
            processes.append(process)
        logger.info("compiling %d graphs in %d background processes (%s)", len(graphs), count,
                    ", ".join(str(p.pid) for p in processes))
        return cls(processes, list(graphs), root / "manifest.json")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()

    def poll(self, graphs) -> bool:
        """Load graphs the children have stored since the last call (cheap when none has:
        one stat). True when nothing is left to wait for."""
        try:
            mtime = self.manifest.stat().st_mtime
        except FileNotFoundError:
            mtime = 0.0
        if mtime != self._seen_mtime:
            self._seen_mtime = mtime
            for graph in graphs.load_ready(self.pending):
                self.pending.remove(graph)
                logger.info("graph %s now runs its compiled graph", graph)
            if not self.pending:
                logger.info("every graph is compiled: full speed")
        if not self.pending:
            return True
        codes = [p.poll() for p in self.processes]
        if None not in codes:
            logger.warning("background compilation exited with %s; graphs %s keep running "
                           "eager", codes, [str(g) for g in self.pending])
            return True
        return False

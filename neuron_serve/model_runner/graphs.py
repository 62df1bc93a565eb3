"""One compiled graph per bucket: the whole step (model forward + last-token logits).

Graphs are traced with static shapes and `fullgraph=True`. Each bucket owns persistent
input buffers and a persistent vLLM forward context, so the guards installed when its
graph was traced hold on every later step: a compile after warm-up means a shape or an
object escaped the bucket discipline, and is counted (`compiles_after_warmup`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from vllm.forward_context import create_forward_context, override_forward_context

from neuron_serve.logs import init_logger
from neuron_serve.model_runner.buckets import Bucket
from neuron_serve.model_runner.inputs import BucketBuffers

logger = init_logger(__name__)


class StepGraphs:
    def __init__(self, model: torch.nn.Module, vllm_config, layer_names: list[str],
                 grid: list[Bucket], device: torch.device, compile_backend: str | None):
        self.model, self.vllm_config, self.layer_names = model, vllm_config, layer_names
        self.buffers = {b: BucketBuffers(b, device) for b in grid}
        self._contexts = {b: create_forward_context(
            {name: buf.attn_metadata for name in layer_names}, vllm_config)
            for b, buf in self.buffers.items()}
        self.num_compiles = 0
        self._warm_compiles: int | None = None
        self._fn: Callable = self._step
        if compile_backend is not None:
            # One code object, one graph per input shape: lift dynamo's per-code cap.
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit, 2 * len(grid) + 8)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4 * len(grid) + 64)
            self._fn = torch.compile(self._step, backend=self._counting(compile_backend),
                                     fullgraph=True, dynamic=False)

    def _counting(self, backend: str) -> Callable:
        inner = torch._dynamo.lookup_backend(backend)

        def compile_and_count(gm, example_inputs):
            self.num_compiles += 1
            return inner(gm, example_inputs)
        return compile_and_count

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor,
              logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, positions=positions)
        return self.model.compute_logits(hidden[logits_indices])

    def run(self, bucket: Bucket) -> torch.Tensor:
        """Logits [bucket.num_reqs, vocab] for the inputs already in the bucket's buffers."""
        buf = self.buffers[bucket]
        # no_grad here, not at the call sites: grad mode is part of every graph's guards.
        with torch.no_grad(), override_forward_context(self._contexts[bucket]):
            return self._fn(buf.input_ids, buf.positions, buf.logits_indices)

    def warm_up(self) -> float:
        """Trace and compile every bucket on padding-only inputs (they write only into the
        null block). Returns the seconds spent."""
        start = time.monotonic()
        for i, bucket in enumerate(self.buffers, 1):
            t0 = time.monotonic()
            self.buffers[bucket].fill({})
            self.run(bucket)
            logger.info("warm-up bucket %d/%d %s: %.1f s", i, len(self.buffers), bucket,
                        time.monotonic() - t0)
        self._warm_compiles = self.num_compiles
        return time.monotonic() - start

    @property
    def compiles_after_warmup(self) -> int:
        return 0 if self._warm_compiles is None else self.num_compiles - self._warm_compiles

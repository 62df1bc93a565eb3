"""One compiled graph per bucket: the whole step (model forward + last-token logits).

Each bucket's graph is compiled ahead of time (`torch.compile(...).aot_compile`) with
static shapes and `fullgraph=True`, for that bucket's persistent input buffers and
persistent vLLM forward context. Nothing is traced on the hot path: `run` calls the
bucket's graph, or runs the step eagerly while the bucket has none (compile mode
`background`, or `eager`). Graphs are stored in, and loaded from, the persistent
compiled-graph cache (neuron_serve.graph_cache).

Where the device keeps the context dimensions symbolic (Device.symbolic_context), the
buckets that differ only in block-table width share one graph, traced on the widest of
them with that width and the KV cache's block count left symbolic.

A step calls its bucket's graph through the device's caller (Device.graph_caller), which
may skip the graph's own calling machinery: the emulated backend calls the compiled
program straight with the arguments it recorded (device/emulated/replay.py).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from vllm.distributed import parallel_state
from vllm.forward_context import create_forward_context, override_forward_context

from neuron_serve.buckets import Bucket
from neuron_serve.device import Device
from neuron_serve.device.base import GraphCaller
from neuron_serve.graph_cache.store import GraphCache, GraphKey
from neuron_serve.logs import init_logger
from neuron_serve.model_runner import compile_regions
from neuron_serve.model_runner.inputs import BucketBuffers
from neuron_serve.stats import GraphStats

logger = init_logger(__name__)

_DYNAMO_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides",
                 "_specialize_on", "_has_dynamo_dim_marking")  # torch._dynamo.mark_dynamic's


def step(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
         logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The program of every graph: each request's last-token logits, and the final hidden
    states of every token row (prompt logprobs run the LM head on some of them). The model
    is an argument, not a constant: its weights are graph inputs, so one compiled graph
    serves any weights of the architecture."""
    hidden = model(input_ids=input_ids, positions=positions)
    return model.compute_logits(hidden[logits_indices]), hidden


class StepGraphs:
    def __init__(self, model: torch.nn.Module, vllm_config, grid: list[Bucket], device: Device,
                 compile: bool, cache: GraphCache | None = None,
                 key_of: Callable[[Bucket], GraphKey] | None = None,
                 kv_caches: Sequence[torch.Tensor] = ()):
        self.model, self.vllm_config, self.device = model, vllm_config, device
        self.compile_backend = device.compile_backend if compile else None
        self.cache, self.key_of = cache, key_of
        self.buffers = {b: BucketBuffers(b, device.torch_device) for b in grid}
        # One metadata object for all layers, not one per layer name (attention/layer.py).
        self._contexts = {b: create_forward_context(buf.attn_metadata, vllm_config)
                          for b, buf in self.buffers.items()}
        # bucket → the graph it runs (its id: the bucket, or any width), graph → bucket it
        # is traced on (the widest: no symbolic dimension may be traced at size 1).
        self.graph_of = {b: b.any_width() if device.symbolic_context else b for b in grid}
        self.traced_on: dict[Bucket, Bucket] = {}
        for bucket in sorted(grid, key=lambda b: b.num_blocks):
            self.traced_on[self.graph_of[bucket]] = bucket
        self.kv_caches = list(kv_caches)
        self.graphs: dict[Bucket, Callable] = {}  # graph id → compiled graph
        self.callers: dict[Bucket, GraphCaller | None] = {}  # bucket → Device.graph_caller
        self.stats = GraphStats()
        self.num_compiles = 0
        self._warm_compiles: int | None = None
        # Tensor-parallel ranks run a graph's collectives together: a graph's first run
        # waits until every rank has all of its graphs, then all run them in one order.
        self.lockstep = (parallel_state.model_parallel_is_initialized()
                         and parallel_state.get_tensor_model_parallel_world_size() > 1)

    # ---- serving ---------------------------------------------------------------------

    def run(self, bucket: Bucket, num_real_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [bucket.num_reqs, vocab] and hidden states [bucket.num_tokens, hidden] for
        the inputs already in the bucket's buffers."""
        buf = self.buffers[bucket]
        fn = self.graphs.get(self.graph_of[bucket])
        self.device.before_step(bucket.is_decode)
        self.stats.real_tokens += num_real_tokens
        self.stats.padded_tokens += bucket.num_tokens
        self.stats.bucket_steps[str(bucket)] += 1
        if fn is None and self.compile_backend is not None:
            self.stats.eager_steps += 1
        caller = self._caller(bucket) if fn is not None else None
        # no_grad here, not at the call sites: grad mode is part of every graph's guards.
        with torch.no_grad(), override_forward_context(self._contexts[bucket]):
            if caller is None:
                return (fn or step)(self.model, buf.input_ids, buf.positions, buf.logits_indices)
            self.stats.replayed_steps += caller.replaying
            return caller(lambda: fn(self.model, buf.input_ids, buf.positions, buf.logits_indices))

    def _caller(self, bucket: Bucket) -> GraphCaller | None:
        """The device's caller of a bucket's graph, made on its first compiled step (a
        bucket's graph, once there, is never replaced)."""
        if bucket not in self.callers:
            self.callers[bucket] = self.device.graph_caller(bucket.is_decode)
        return self.callers[bucket]

    # ---- compiling and loading -------------------------------------------------------

    def warm_up(self, compile_missing: bool = True, progress: Callable | None = None,
                graphs: Iterable[Bucket] | None = None, load: bool = True) -> float:
        """Give every graph id (default: all) its graph: load it from the cache, else
        compile (and store) it if `compile_missing`. Under the cache's per-graph lock:
        processes sharing a cache directory compile each graph once and load the others'
        work. `load=False` (a compile-only process) leaves cached graphs in the cache.
        Returns seconds."""
        start = time.monotonic()
        pending = [b for b in (graphs or self.traced_on) if b not in self.graphs]
        total = len(pending)

        def attempt(graph: Bucket, blocking: bool) -> bool:
            with self._graph_lock(graph, blocking) as got:
                if not got:
                    return False
                how = self._load_or_compile(graph, compile_missing, load)
            pending.remove(graph)
            if progress and how != "missing":
                progress(total - len(pending), total, graph, how, time.monotonic() - start)
            return True

        while pending:
            # Skip graphs another process is compiling; wait only when nothing else is left.
            progressed = False
            for graph in list(pending):
                progressed |= attempt(graph, blocking=False)
            if not progressed:
                attempt(pending[0], blocking=True)
        if self.lockstep and load:
            self._first_runs_in_lockstep()
        self._warm_compiles = self.num_compiles
        return time.monotonic() - start

    def _first_runs_in_lockstep(self) -> None:
        """Every graph id once, in the same order on every rank, compiled or (still
        missing) eager: each rank's compiles and loads took their own order and time, and
        a graph run alone would wait for its collectives' peers forever."""
        for graph in self.traced_on:
            with self._traced_layers(graph):
                self._smoke_run(graph, self.graphs.get(graph))

    def _graph_lock(self, graph: Bucket, blocking: bool):
        if self.cache is None:
            return contextlib.nullcontext(True)
        return self.cache.lock(self.key_of(graph).digest, blocking=blocking)

    def _load_or_compile(self, graph: Bucket, compile_missing: bool, load: bool = True) -> str:
        key = self.key_of(graph) if self.cache is not None else None
        if key is not None and not load and self.cache.has(key):
            return "cached"
        if key is not None and load and self.try_load(graph, key):
            return "loaded"
        if not compile_missing:
            return "missing"
        t0 = time.monotonic()
        fn = self._compile(graph)
        seconds = time.monotonic() - t0
        self.stats.cache_misses += 1
        self.stats.compile_seconds += seconds
        if key is not None:
            data = type(fn).serialize(fn).serialized_data
            self.cache.store(key, data, seconds)
        self.graphs[graph] = fn
        return f"compiled in {seconds:.1f} s"

    def try_load(self, graph: Bucket, key: GraphKey | None = None) -> bool:
        """Load a graph from the cache; one that fails to load is evicted (warning) and
        False returned. Neither run nor guard-checked: the entry's key holds everything
        that shapes the graph and its checksum passed, and with symbolic context sizes the
        loaded graph's guards on vLLM's forward context failed in every other process
        (torch 2.13), where the graph itself ran correctly (tests/e2e/test_graph_cache.py
        holds its tokens against Transformers)."""
        key = key or self.key_of(graph)
        t0 = time.monotonic()
        data = self.cache.load(key)
        if data is None:
            return False
        try:
            with self._traced_layers(graph):
                fn = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=step.__globals__)
        except Exception as e:  # noqa: BLE001 - any unusable entry is rebuilt, never fatal
            self.cache.evict(key.digest, f"cannot load: {type(e).__name__}: {e}")
            return False
        fn.disable_guard_check()
        self.graphs[graph] = fn
        self.stats.cache_hits += 1
        self.stats.load_seconds += time.monotonic() - t0
        return True

    def _compile(self, graph: Bucket) -> Callable:
        options = self.device.graph_options(graph.is_decode)
        with self._traced_layers(graph), self._context_symbolic(graph):
            try:
                fn = self._aot_compile(graph, options)
            except Exception as error:  # the plain build below still serves
                if not options:
                    raise
                logger.warning("graph %s: compiling with %s failed (%s: %s); compiling it "
                               "without them", graph, options, type(error).__name__, error)
                fn = self._aot_compile(graph, None)
            self.num_compiles += 1
            if not self.lockstep:
                self._smoke_run(graph, fn)
        return fn

    def _aot_compile(self, graph: Bucket, options: dict | None) -> Callable:
        buf = self.buffers[self.traced_on[graph]]
        buf.fill({})  # padding only: writes reach the null block alone
        compiled = torch.compile(step, backend=self.compile_backend, fullgraph=True,
                                 dynamic=False, options=options)
        with torch.no_grad(), override_forward_context(self._contexts[buf.bucket]):
            return compiled.aot_compile(
                ((self.model, buf.input_ids, buf.positions, buf.logits_indices), {}))

    @contextlib.contextmanager
    def _context_symbolic(self, graph: Bucket) -> Iterator[None]:
        """While a graph is traced and first run: the KV cache's block count and the
        block-table width are symbolic sizes (Device.symbolic_context). The marks go
        afterwards: a serialized graph's guards expect tensors without them."""
        block_table = self.buffers[self.traced_on[graph]].block_table
        marks = [(kv_cache, 0) for kv_cache in self.kv_caches]
        if block_table.shape[1] > 1:  # dynamo specializes sizes 0 and 1
            marks.append((block_table, 1))
        if not self.device.symbolic_context:
            marks = []
        for tensor, dim in marks:
            torch._dynamo.mark_dynamic(tensor, dim)
        try:
            yield
        finally:
            for tensor, _ in marks:
                for attr in _DYNAMO_MARKS:
                    if hasattr(tensor, attr):
                        delattr(tensor, attr)

    def _traced_layers(self, graph: Bucket) -> contextlib.AbstractContextManager:
        """A graph whose device compiles it without regions (Device.inline_layers) is
        traced, loaded and checked with every layer inlined."""
        if self.device.inline_layers(graph.is_decode):
            return compile_regions.layers_inlined(self.model)
        return contextlib.nullcontext()

    def _smoke_run(self, graph: Bucket, fn: Callable | None) -> None:
        """One padding-only run of a graph (`fn`), or of the eager step (None)."""
        bucket = self.traced_on[graph]
        buf = self.buffers[bucket]
        buf.fill({})
        with torch.no_grad(), override_forward_context(self._contexts[bucket]):
            logits, _ = (fn or step)(self.model, buf.input_ids, buf.positions, buf.logits_indices)
        if logits.shape[0] != bucket.num_reqs:
            raise RuntimeError(f"graph returned {tuple(logits.shape)} logits for bucket {bucket}")
        # The call above checked dynamo's guards; every later call passes the same model and
        # the same persistent buffers, so re-checking them would be pure overhead, and a
        # visible share of a short decode step (measured: benchmarks/README.md, "Design
        # measurements").
        if fn is not None:
            fn.disable_guard_check()

    def load_ready(self, graphs: Iterable[Bucket]) -> list[Bucket]:
        """Load whichever of `graphs` the cache now has (background compilation)."""
        return [g for g in graphs if g not in self.graphs and self.try_load(g)]

    def missing(self) -> list[Bucket]:
        """Graph ids without a graph yet."""
        return [g for g in self.traced_on if g not in self.graphs]

    @property
    def compiles_after_warmup(self) -> int:
        return 0 if self._warm_compiles is None else self.num_compiles - self._warm_compiles


def log_progress(done: int, total: int, bucket: Bucket, how: str, elapsed: float) -> None:
    """One line per graph: a bar, bucket i of N, elapsed and an ETA from the mean so far."""
    width = 20
    filled = width * done // total
    eta = elapsed / done * (total - done)
    logger.info("graphs [%s%s] %d/%d %s %s | elapsed %.0f s | ETA %.0f s",
                "#" * filled, "." * (width - filled), done, total, bucket, how, elapsed, eta)

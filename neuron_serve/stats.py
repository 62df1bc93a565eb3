"""What a worker reports about its bucket graphs, typed once for both sides: the runner
counts into `GraphStats`, the worker sends it over vLLM's RPC (`as_dict`), and the
server's /metrics reads it back (`from_dict`) and names each field's series from its
metadata."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field


def _counter(metric: str, doc: str, default=0):
    return field(default=default, metadata={"metric": metric, "doc": doc})


@dataclass
class GraphStats:
    cache_hits: int = _counter("graph_cache_hits",
                               "Bucket graphs loaded from the compiled-graph cache")
    cache_misses: int = _counter("graph_cache_misses",
                                 "Bucket graphs compiled because the cache had none")
    compile_seconds: float = _counter("graph_compile_seconds",
                                      "Seconds spent compiling bucket graphs", 0.0)
    load_seconds: float = _counter("graph_load_seconds",
                                   "Seconds spent loading bucket graphs from the cache", 0.0)
    eager_steps: int = _counter("eager_steps",
                                "Steps run eagerly because their bucket had no graph yet")
    replayed_steps: int = _counter("replayed_steps",
                                   "Steps whose compiled program was called with its recorded "
                                   "arguments, past the graph's calling machinery")
    real_tokens: int = _counter("real_tokens", "Scheduled tokens run through the model")
    padded_tokens: int = _counter("padded_tokens",
                                  "Tokens run through the model including bucket padding")
    bucket_steps: Counter = field(default_factory=Counter)  # str(bucket) -> steps run
    # Filled in by the worker when it reports:
    num_graphs: int = 0  # graphs ready
    graphs_needed: int = 0  # graphs the grid needs (buckets may share one)
    num_buckets: int = 0  # buckets in the grid
    compile_mode: str = ""
    compiles_after_warmup: int = 0  # graphs compiled while serving; should stay 0

    @staticmethod
    def counters() -> list[dataclasses.Field]:
        """The fields exported as Prometheus counters, with their names and help."""
        return [f for f in dataclasses.fields(GraphStats) if "metric" in f.metadata]

    def as_dict(self) -> dict:
        """Plain data for vLLM's RPC (msgpack: no dataclasses, no Counter)."""
        out = dataclasses.asdict(self)
        out["bucket_steps"] = dict(self.bucket_steps)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> GraphStats:
        return cls(**{**data, "bucket_steps": Counter(data["bucket_steps"])})

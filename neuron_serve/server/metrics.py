"""`/metrics`: vLLM's own series (`vllm:` prefix, recorded by the engine's Prometheus stat
logger: running/waiting requests, KV-cache usage, TTFT, inter-token and end-to-end latency,
token counters) followed by neuron-serve's (`neuron_serve:` prefix).

Ours live in the engine's worker (compiled graphs, padding, eager fallbacks); they are
fetched over vLLM's collective RPC at scrape time and summed over ranks.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from vllm.v1.metrics.prometheus import get_prometheus_registry

_COUNTERS = {
    "cache_hits": ("graph_cache_hits", "Bucket graphs loaded from the compiled-graph cache"),
    "cache_misses": ("graph_cache_misses", "Bucket graphs compiled because the cache had none"),
    "compile_seconds": ("graph_compile_seconds", "Seconds spent compiling bucket graphs"),
    "load_seconds": ("graph_load_seconds", "Seconds spent loading bucket graphs from the cache"),
    "eager_steps": ("eager_steps", "Steps run eagerly because their bucket had no graph yet"),
    "real_tokens": ("real_tokens", "Scheduled tokens run through the model"),
    "padded_tokens": ("padded_tokens", "Tokens run through the model including bucket padding"),
}


class _Snapshot:
    def __init__(self, stats: list[dict]):
        self.stats = stats

    def collect(self):
        total = {k: sum(s[k] for s in self.stats) for k in _COUNTERS}
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"neuron_serve:{name}", doc, value=total[key])
        waste = GaugeMetricFamily("neuron_serve:padding_waste_ratio",
                                  "Padded ÷ real tokens over all steps so far (1 = no padding)")
        waste.add_metric([], total["padded_tokens"] / total["real_tokens"] if total["real_tokens"] else 0.0)
        yield waste
        yield GaugeMetricFamily("neuron_serve:graphs_ready", "Bucket graphs ready to run",
                                value=sum(s["num_graphs"] for s in self.stats))
        yield GaugeMetricFamily("neuron_serve:buckets", "Buckets in the grid",
                                value=sum(s["num_buckets"] for s in self.stats))
        usage = CounterMetricFamily("neuron_serve:bucket_steps", "Steps run per bucket",
                                    labels=["bucket"])
        steps = sum((Counter(s["bucket_steps"]) for s in self.stats), Counter())
        for bucket, n in sorted(steps.items()):
            usage.add_metric([bucket], n)
        yield usage


async def render(engine) -> bytes:
    ours = CollectorRegistry(auto_describe=False)
    ours.register(_Snapshot(await engine.collective_rpc("graph_stats")))
    return generate_latest(get_prometheus_registry()) + generate_latest(ours)

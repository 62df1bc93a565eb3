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

from neuron_serve.stats import GraphStats


class _Snapshot:
    def __init__(self, stats: list[GraphStats]):
        self.stats = stats

    def collect(self):
        total = {f.name: sum(getattr(s, f.name) for s in self.stats) for f in GraphStats.counters()}
        for f in GraphStats.counters():
            yield CounterMetricFamily(f"neuron_serve:{f.metadata['metric']}", f.metadata["doc"],
                                      value=total[f.name])
        real, padded = total["real_tokens"], total["padded_tokens"]
        waste = GaugeMetricFamily("neuron_serve:padding_waste_ratio",
                                  "Padded ÷ real tokens over all steps so far (1 = no padding)")
        waste.add_metric([], padded / real if real else 0.0)
        yield waste
        yield GaugeMetricFamily("neuron_serve:graphs_ready", "Bucket graphs ready to run",
                                value=sum(s.num_graphs for s in self.stats))
        yield GaugeMetricFamily("neuron_serve:graphs_needed",
                                "Graphs the bucket grid needs (buckets may share one)",
                                value=sum(s.graphs_needed for s in self.stats))
        yield GaugeMetricFamily("neuron_serve:buckets", "Buckets in the grid",
                                value=sum(s.num_buckets for s in self.stats))
        usage = CounterMetricFamily("neuron_serve:bucket_steps", "Steps run per bucket",
                                    labels=["bucket"])
        steps = sum((s.bucket_steps for s in self.stats), Counter())
        for bucket, n in sorted(steps.items()):
            usage.add_metric([bucket], n)
        yield usage


async def render(engine) -> bytes:
    ours = CollectorRegistry(auto_describe=False)
    stats = await engine.collective_rpc("graph_stats")
    ours.register(_Snapshot([GraphStats.from_dict(s) for s in stats]))
    return generate_latest(get_prometheus_registry()) + generate_latest(ours)

"""`/metrics`: vLLM's own series (`vllm:` prefix, recorded by the engine's Prometheus stat
logger: running/waiting requests, KV-cache usage, TTFT, inter-token and end-to-end latency,
token counters) followed by neuron-serve's (`neuron_serve:` prefix).

Ours live in the engines' workers (compiled graphs, padding, eager fallbacks); they are
fetched from every data-parallel engine at scrape time, summed over its tensor-parallel
ranks, and labelled as vLLM labels its own: `model_name` and `engine`.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from vllm.v1.metrics.prometheus import get_prometheus_registry

from neuron_serve.server.engines import per_engine
from neuron_serve.stats import GraphStats


class _Snapshot:
    def __init__(self, model_name: str, stats: dict[str, list[GraphStats]]):
        self.model_name, self.stats = model_name, stats  # engine index → its ranks' stats

    def collect(self):
        labels = ["model_name", "engine"]
        families = {f.name: CounterMetricFamily(f"neuron_serve:{f.metadata['metric']}",
                                                f.metadata["doc"], labels=labels)
                    for f in GraphStats.counters()}
        waste = GaugeMetricFamily("neuron_serve:padding_waste_ratio",
                                  "Padded ÷ real tokens over all steps so far (1 = no padding)",
                                  labels=labels)
        gauges = {name: GaugeMetricFamily(f"neuron_serve:{name}", doc, labels=labels) for name, doc in (
            ("graphs_ready", "Bucket graphs ready to run"),
            ("graphs_needed", "Graphs the bucket grid needs (buckets may share one)"),
            ("buckets", "Buckets in the grid"))}
        usage = CounterMetricFamily("neuron_serve:bucket_steps", "Steps run per bucket",
                                    labels=[*labels, "bucket"])
        for engine, ranks in sorted(self.stats.items()):
            values = [self.model_name, engine]
            total = {f.name: sum(getattr(s, f.name) for s in ranks) for f in GraphStats.counters()}
            for name, family in families.items():
                family.add_metric(values, total[name])
            real, padded = total["real_tokens"], total["padded_tokens"]
            waste.add_metric(values, padded / real if real else 0.0)
            for name, attr in (("graphs_ready", "num_graphs"), ("graphs_needed", "graphs_needed"),
                               ("buckets", "num_buckets")):
                gauges[name].add_metric(values, sum(getattr(s, attr) for s in ranks))
            for bucket, n in sorted(sum((s.bucket_steps for s in ranks), Counter()).items()):
                usage.add_metric([*values, bucket], n)
        yield from families.values()
        yield waste
        yield from gauges.values()
        yield usage


async def render(engine) -> bytes:
    ours = CollectorRegistry(auto_describe=False)
    stats = await per_engine(engine, "graph_stats")
    ours.register(_Snapshot(engine.model_config.served_model_name,
                            {e: [GraphStats.from_dict(s) for s in ranks] for e, ranks in stats.items()}))
    return generate_latest(get_prometheus_registry()) + generate_latest(ours)

"""`neuron-serve compile [MODEL]`: every bucket's graph into the cache, then exit."""

from __future__ import annotations

import argparse

from neuron_serve.cli.engine import add_engine_parser, engine_args
from neuron_serve.stats import GraphStats


def add_parser(subparsers) -> None:
    compile_ = add_engine_parser(
        subparsers, "compile", help="compile every bucket's graph into the cache, then exit",
        description="Compile (or load) every bucket graph MODEL needs into the compiled-graph "
                    "cache without serving: for CI, a Kubernetes Job, or a build host. Takes "
                    "the same flags as `serve`; give the same ones for the graphs to match. "
                    "Weights default to dummy values: they are not part of a graph's key.")
    compile_.set_defaults(load_format="dummy")


def run(args: argparse.Namespace) -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    args.compile_mode, args.require_precompiled = "ahead", False
    engine = LLMEngine.from_engine_args(engine_args(args))
    try:
        stats = engine.collective_rpc("graph_stats")
    finally:
        engine.engine_core.shutdown()
    for rank, s in enumerate(map(GraphStats.from_dict, stats)):
        print(f"rank {rank}: {s.num_graphs}/{s.graphs_needed} graphs ready for "
              f"{s.num_buckets} buckets: "
              f"{s.cache_hits} loaded from the cache, {s.cache_misses} compiled "
              f"({s.compile_seconds:.1f} s)")

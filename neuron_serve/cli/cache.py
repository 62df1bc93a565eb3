"""`neuron-serve cache ls | verify | prune | export | import`: the compiled-graph cache."""

from __future__ import annotations

import argparse

from neuron_serve import envs
from neuron_serve.graph_cache.store import GraphCache


def add_parser(subparsers) -> None:
    cache = subparsers.add_parser("cache", help="list, verify, prune, export or import the "
                                  "compiled-graph cache")
    cache.add_argument("--dir", default=None, help="cache directory (default: "
                       "$NEURON_SERVE_CACHE_DIR or ~/.cache/neuron-serve/graphs)")
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="one line per graph")
    actions.add_parser("verify", help="check every graph's checksum; evict the bad ones")
    prune = actions.add_parser("prune", help="evict least recently used graphs")
    prune.add_argument("--max-gb", type=float, required=True, help="size to prune down to")
    export = actions.add_parser("export", help="write the cache into one .tar.gz")
    export.add_argument("archive")
    import_ = actions.add_parser("import", help="merge an exported .tar.gz into the cache")
    import_.add_argument("archive")


def _open(args: argparse.Namespace) -> GraphCache:
    root = args.dir or envs.NEURON_SERVE_CACHE_DIR
    if root.lower() == "off":
        raise SystemExit("neuron-serve cache: the cache is off (NEURON_SERVE_CACHE_DIR=off); "
                         "pass --dir")
    return GraphCache(root)


def _ls(cache: GraphCache) -> int:
    entries = cache.entries()
    print(f"{cache.root}: {len(entries)} graphs, {cache.size_bytes() / 1e6:.1f} MB "
          "(kernel build cache included)")
    if entries:
        print(f"{'digest':<14}{'graph':<36}{'MB':>7}{'compile s':>11}  {'created':<27}last used")
    for digest, e in sorted(entries.items(), key=lambda kv: kv[1].get("label", "")):
        print(f"{digest[:12]:<14}{e.get('label', '?'):<36}{e.get('bytes', 0) / 1e6:>7.2f}"
              f"{e.get('compile_seconds', 0):>11.1f}  {e.get('created', '?'):<27}{e.get('last_used', '?')}")
    return 0


def _verify(cache: GraphCache) -> int:
    report = cache.verify()
    for digest, problem in report.items():
        print(f"{digest[:12]}  {'ok' if problem is None else 'EVICTED: ' + problem}")
    bad = sum(p is not None for p in report.values())
    print(f"{len(report) - bad} ok, {bad} evicted")
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    cache = _open(args)
    if args.action == "ls":
        return _ls(cache)
    if args.action == "verify":
        return _verify(cache)
    if args.action == "prune":
        removed = cache.prune(int(args.max_gb * 1e9))
        print(f"evicted {len(removed)} graphs; cache now {cache.size_bytes() / 1e6:.1f} MB")
        return 0
    if args.action == "export":
        n = cache.export(args.archive)
        print(f"exported {n} graphs to {args.archive}")
        return 0
    n = cache.import_(args.archive)
    print(f"imported {n} graphs into {cache.root}")
    return 0

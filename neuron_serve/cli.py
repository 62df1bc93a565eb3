"""`neuron-serve` command line.

    serve [MODEL]      the OpenAI-compatible server
    compile [MODEL]    compile (or load) every bucket's graph into the cache, then exit
    cache ls | verify | prune | export | import    the compiled-graph cache
    buckets suggest --trace FILE --max-graphs N    a bucket set fitted to a trace
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable

from neuron_serve.config import ADDITIONAL_CONFIG_KEY, COMPILE_MODES
from neuron_serve.models import DEMO_MODEL_DIR

DEMO_NAME = "demo"
SERVE_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 256}


def _add_engine_parser(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand taking MODEL, vLLM's engine flags and ours for buckets and compiling."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = subparsers.add_parser(name, **kwargs)
    parser.add_argument("model_path", nargs="?", default=None,
                        help="local checkpoint directory (default: the embedded demo model, "
                             f"served as {DEMO_NAME!r} unless --served-model-name says otherwise)")
    group = parser.add_argument_group("neuron-serve", "buckets and compiled graphs (the same "
                                      "keys as --additional-config '{\"neuron\": {...}}')")
    for axis in ("token", "request", "block"):
        group.add_argument(f"--{axis}-buckets", type=_int_list, default=None, metavar="N,N,...",
                           help=f"{axis} buckets (sorted, comma-separated)")
    group.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                       help="ahead (default): all graphs before ready; background: ready at "
                            "once, eager until each graph is compiled; eager: never compile")
    group.add_argument("--graph-cache-dir", default=None,
                       help="compiled-graph cache directory, 'off' to disable "
                            "(default: $NEURON_SERVE_CACHE_DIR or ~/.cache/neuron-serve/graphs)")
    group.add_argument("--graph-cache-max-gb", type=float, default=None,
                       help="size cap of the cache (least recently used entries go first)")
    AsyncEngineArgs.add_cli_args(parser)
    # A small default bucket grid (~10 graphs): warm-up compiles every bucket.
    parser.set_defaults(max_num_seqs=SERVE_DEFAULTS["max_num_seqs"],
                        max_num_batched_tokens=SERVE_DEFAULTS["max_num_batched_tokens"])
    return parser


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_NEURON_FLAGS = {"token_buckets": "token_buckets", "request_buckets": "request_buckets",
                 "block_buckets": "block_buckets", "compile_mode": "compile_mode",
                 "graph_cache_dir": "cache_dir", "graph_cache_max_gb": "cache_max_gb"}


def _merge_neuron_flags(args: argparse.Namespace) -> None:
    """Our flags into vLLM's --additional-config, where the platform reads them."""
    section = dict((args.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {})
    for flag, key in _NEURON_FLAGS.items():
        if getattr(args, flag) is not None:
            section[key] = getattr(args, flag)
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: section}


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def _add_serve_parser(subparsers) -> None:
    serve = _add_engine_parser(
        subparsers, "serve",
        help="serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a local Hugging Face checkpoint directory; default: the "
                    "embedded demo model). Accepts vLLM's engine flags.")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    server = serve.add_argument_group("server", "HTTP front: keys, limits, shutdown")
    server.add_argument("--api-key", action="append", default=None, dest="api_keys",
                        help="required as 'Authorization: Bearer KEY' on /v1/* and "
                             "/tokenize (repeat for several keys; default: no key)")
    server.add_argument("--allowed-origins", action="append", default=None,
                        help="CORS origin allowed to call the API (repeatable, '*' for any)")
    server.add_argument("--max-queued-requests", type=_positive(int), default=None,
                        help="generation requests in flight beyond which new ones get 429 "
                             "with Retry-After (default: unbounded)")
    server.add_argument("--max-request-body-bytes", type=_positive(int), default=10 << 20,
                        help="larger request bodies get 413")
    server.add_argument("--drain-timeout", type=_positive(float), default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before exiting")
    server.add_argument("--request-timeout", type=_positive(float), default=None,
                        help="seconds a generation request may take; past it the request is "
                             "aborted and answered 504 (default: no limit)")
    server.add_argument("--profile-dir", default=None,
                        help="where POST /admin/profile/stop writes traces and Parquet tables "
                             "(default: $NEURON_SERVE_PROFILE_DIR or ~/.cache/neuron-serve/profiles)")


def _add_compile_parser(subparsers) -> None:
    compile_ = _add_engine_parser(
        subparsers, "compile", help="compile every bucket's graph into the cache, then exit",
        description="Compile (or load) every bucket graph MODEL needs into the compiled-graph "
                    "cache without serving: for CI, a Kubernetes Job, or a build host. Takes "
                    "the same flags as `serve`; give the same ones for the graphs to match. "
                    "Weights default to dummy values: they are not part of a graph's key.")
    compile_.set_defaults(load_format="dummy")


def _add_cache_parser(subparsers) -> None:
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


def _add_buckets_parser(subparsers) -> None:
    buckets = subparsers.add_parser("buckets", help="plan bucket sets")
    actions = buckets.add_subparsers(dest="action", required=True)
    suggest = actions.add_parser(
        "suggest", help="the bucket set that pads a request-length trace least",
        description="Read a JSONL trace ({\"prompt_tokens\": P, \"output_tokens\": O} per "
                    "line) and propose the bucket set with the fewest padded tokens within "
                    "--max-graphs graphs, next to the default set's waste.")
    suggest.add_argument("--trace", required=True)
    suggest.add_argument("--max-graphs", type=int, required=True)
    suggest.add_argument("--max-num-seqs", type=int, default=SERVE_DEFAULTS["max_num_seqs"])
    suggest.add_argument("--max-num-batched-tokens", type=int,
                         default=SERVE_DEFAULTS["max_num_batched_tokens"])
    suggest.add_argument("--max-model-len", type=int, required=True)
    suggest.add_argument("--block-size", type=int, default=32)
    suggest.add_argument("--request-buckets", type=_int_list, default=None)


# Subcommands that need neither torch nor vLLM: parsed without importing them (~15 s on a
# 2-core host), so `neuron-serve cache ls` answers in well under a second.
LIGHT_COMMANDS = ("cache", "buckets")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser, or only the light subcommands' when argv runs one of them."""
    light = bool(argv) and argv[0] in LIGHT_COMMANDS
    if light:
        parser = argparse.ArgumentParser(prog="neuron-serve", description=__doc__)
    else:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser(prog="neuron-serve", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=__import__("neuron_serve").__version__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    if not light:
        _add_serve_parser(subparsers)
        _add_compile_parser(subparsers)
    _add_cache_parser(subparsers)
    _add_buckets_parser(subparsers)
    return parser


def resolve_model_path(args: argparse.Namespace) -> str:
    """Positional MODEL wins, then vLLM's --model, then the embedded demo model."""
    from vllm.engine.arg_utils import EngineArgs

    if args.model_path:
        return args.model_path
    if getattr(args, "model", EngineArgs.model) != EngineArgs.model:
        return args.model
    return str(DEMO_MODEL_DIR)


def _engine_args(args: argparse.Namespace):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args.model = args.model_path
    _merge_neuron_flags(args)
    if args.served_model_name is None and args.model_path == str(DEMO_MODEL_DIR):
        args.served_model_name = [DEMO_NAME]
    return AsyncEngineArgs.from_cli_args(args)


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn
    from vllm.v1.engine.async_llm import AsyncLLM

    from neuron_serve.server.app import build_app
    from neuron_serve.server.lifecycle import DrainingServer, Lifecycle, ServerLimits

    engine_args = _engine_args(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        names = engine_args.served_model_name or [engine_args.model]
        names = [names] if isinstance(names, str) else list(names)
        app = build_app(engine, names, request_timeout_s=args.request_timeout,
                        profile_dir=args.profile_dir)
        if args.allowed_origins:
            from fastapi.middleware.cors import CORSMiddleware
            app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                               allow_methods=["*"], allow_headers=["*"])
        lifecycle = Lifecycle(app, ServerLimits(
            api_keys=tuple(args.api_keys or ()), max_queued_requests=args.max_queued_requests,
            max_request_body_bytes=args.max_request_body_bytes, drain_timeout_s=args.drain_timeout))
        config = uvicorn.Config(lifecycle, host=args.host, port=args.port, log_level="info",
                                access_log=False,  # ours: JSON lines with request ids
                                timeout_graceful_shutdown=args.drain_timeout)
        await DrainingServer(config, lifecycle).serve()
    finally:
        engine.shutdown()


def _compile(args: argparse.Namespace) -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    args.compile_mode = "ahead"
    engine = LLMEngine.from_engine_args(_engine_args(args))
    try:
        stats = engine.collective_rpc("graph_stats")
    finally:
        engine.engine_core.shutdown()
    for rank, s in enumerate(stats):
        print(f"rank {rank}: {s['num_graphs']}/{s['num_buckets']} graphs ready: "
              f"{s['cache_hits']} loaded from the cache, {s['cache_misses']} compiled "
              f"({s['compile_seconds']:.1f} s)")


def _check_model(args: argparse.Namespace) -> None:
    args.model_path = resolve_model_path(args)
    if not os.path.isdir(args.model_path):
        sys.exit(f"neuron-serve: model {args.model_path!r} is not a local checkpoint "
                 "directory (models are never downloaded; pass a path to config.json's folder)")


def _config_names_model(argv: list[str]) -> bool:
    """vLLM's `--config FILE` (YAML of flags) names the model with a `model` key."""
    if "--config" not in argv[:-1]:
        return False
    import yaml
    try:
        with open(argv[argv.index("--config") + 1]) as f:
            return "model" in (yaml.safe_load(f) or {})
    except OSError:
        return False  # vLLM's parser reports the unreadable file


def _with_default_model(argv: list[str]) -> list[str]:
    """`serve --flags` means the demo model unless a --config file names one; vLLM's parser
    rejects `serve` followed by a flag when --served-model-name is among them, so name the
    model explicitly."""
    if (len(argv) > 1 and argv[0] == "serve" and argv[1].startswith("-")
            and not any(a == "--model" or a.startswith("--model=") for a in argv)
            and not _config_names_model(argv)
            and not any(a in ("-h", "--help") for a in argv)):
        return [argv[0], str(DEMO_MODEL_DIR), *argv[1:]]
    return argv


def main(argv: list[str] | None = None) -> None:
    from neuron_serve import activation

    activation.activate()  # our server always runs on our platform
    argv = _with_default_model(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHT_COMMANDS:
        from neuron_serve.logs import init_plain_logging
        init_plain_logging()
    args = build_parser(argv).parse_args(argv)
    if args.command in ("serve", "compile"):
        _check_model(args)
        if args.command == "serve":
            asyncio.run(_serve(args))
        else:
            _compile(args)
    elif args.command == "cache":
        from neuron_serve.graph_cache.commands import run_cache_command
        sys.exit(run_cache_command(args))
    elif args.command == "buckets":
        from neuron_serve.model_runner.bucket_planner import run_suggest
        sys.exit(run_suggest(args))


if __name__ == "__main__":
    main()

"""`neuron-serve serve [MODEL]`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from neuron_serve import envs
from neuron_serve.cli.engine import add_engine_parser, engine_args


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


def add_parser(subparsers) -> None:
    from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs

    serve = add_engine_parser(
        subparsers, "serve",
        help="serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a local Hugging Face checkpoint directory; default: the "
                    "embedded demo model). Accepts vLLM's engine flags.")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--headless", action="store_true",
                       help="no HTTP server: run this node's data-parallel engines "
                            "(--data-parallel-size-local from --data-parallel-start-rank), "
                            "which join the API server at --data-parallel-address and "
                            "--data-parallel-rpc-port (multi-node data parallel)")
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
    # vLLM's OpenAI-frontend flags: chat template, tool and reasoning parsers, and the rest.
    BaseFrontendArgs.add_cli_args(serve)


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn
    from vllm.v1.engine.async_llm import AsyncLLM

    from neuron_serve.server.app import build_app
    from neuron_serve.server.lifecycle import DrainingServer, Lifecycle, ServerLimits

    engine_args_ = engine_args(args)
    engine = AsyncLLM.from_engine_args(engine_args_)
    try:
        names = engine_args_.served_model_name or [engine_args_.model]
        args.served_model_name = [names] if isinstance(names, str) else list(names)
        app = await build_app(engine, args, request_timeout_s=args.request_timeout,
                              profile_dir=args.profile_dir or envs.NEURON_SERVE_PROFILE_DIR)
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
        watch = app.state.engine_watch

        def engine_lost() -> str | None:
            if engine.errored and not engine.is_running:
                return "the engine has stopped"
            return watch.lost
        server = DrainingServer(config, lifecycle, engine_lost=engine_lost)
        watching = asyncio.create_task(watch.run())
        await server.serve()
        watching.cancel()
    finally:
        engine.shutdown()
    if server.engine_failed:
        raise SystemExit(1)


def _run_headless(args: argparse.Namespace) -> None:
    """vLLM's headless node, with our flags merged into the engine arguments it reads."""
    from vllm.entrypoints.cli.serve import run_headless

    engine_args(args)  # merges our flags into `args`, which run_headless reads again
    args.api_server_count = 0
    run_headless(args)


def run(args: argparse.Namespace) -> None:
    if args.headless:
        return _run_headless(args)
    asyncio.run(_serve(args))

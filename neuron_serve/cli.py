"""`neuron-serve` command line: `serve` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from neuron_serve.models import DEMO_MODEL_DIR

DEMO_NAME = "demo"
SERVE_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 256}


def _add_serve_parser(subparsers) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    serve = subparsers.add_parser(
        "serve", help="serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a local Hugging Face checkpoint directory; default: the "
                    "embedded demo model). Accepts vLLM's engine flags.")
    serve.add_argument("model_path", nargs="?", default=None,
                       help="local checkpoint directory (default: the embedded demo model, "
                            f"served as {DEMO_NAME!r} unless --served-model-name says otherwise)")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    AsyncEngineArgs.add_cli_args(serve)
    # A small default bucket grid (~10 graphs): warm-up compiles every bucket.
    serve.set_defaults(max_num_seqs=SERVE_DEFAULTS["max_num_seqs"],
                       max_num_batched_tokens=SERVE_DEFAULTS["max_num_batched_tokens"])


def build_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="neuron-serve", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=__import__("neuron_serve").__version__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(subparsers)
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
    if args.served_model_name is None and args.model_path == str(DEMO_MODEL_DIR):
        args.served_model_name = [DEMO_NAME]
    return AsyncEngineArgs.from_cli_args(args)


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn
    from vllm.v1.engine.async_llm import AsyncLLM

    from neuron_serve.server.app import build_app

    engine_args = _engine_args(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        names = engine_args.served_model_name or [engine_args.model]
        names = [names] if isinstance(names, str) else list(names)
        app = build_app(engine, names)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info")
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    from neuron_serve import activation

    activation.activate()  # our server always runs on our platform
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        args.model_path = resolve_model_path(args)
        if not os.path.isdir(args.model_path):
            sys.exit(f"neuron-serve: model {args.model_path!r} is not a local checkpoint "
                     "directory (models are never downloaded; pass a path to config.json's folder)")
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()

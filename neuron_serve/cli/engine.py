"""What `serve` and `compile` share: MODEL, vLLM's engine flags, ours for buckets and
compiling (merged into `--additional-config '{"neuron": {...}}'`), and the engine args."""

from __future__ import annotations

import argparse
import os
import sys

from neuron_serve.config import ADDITIONAL_CONFIG_KEY, COMPILE_MODES
from neuron_serve.models import DEMO_MODEL_DIR

DEMO_NAME = "demo"
SERVE_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 256}


def add_engine_parser(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand taking MODEL, vLLM's engine flags and ours for buckets and compiling."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = subparsers.add_parser(name, **kwargs)
    parser.add_argument("model_path", nargs="?", default=None,
                        help="local checkpoint directory (default: the embedded demo model, "
                             f"served as {DEMO_NAME!r} unless --served-model-name says otherwise)")
    group = parser.add_argument_group("neuron-serve", "buckets and compiled graphs (the same "
                                      "keys as --additional-config '{\"neuron\": {...}}')")
    for axis in ("token", "request", "block"):
        group.add_argument(f"--{axis}-buckets", type=int_list, default=None, metavar="N,N,...",
                           help=f"{axis} buckets (sorted, comma-separated)")
    group.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                       help="ahead: all graphs compiled or loaded before ready; background: "
                            "ready at once, eager until each graph is compiled; eager: never "
                            "compile. Default: the device's, background on the emulated "
                            "device, ahead (from a cache filled by `neuron-serve compile`) on "
                            "Trainium")
    group.add_argument("--require-precompiled", action="store_true", default=None,
                       help="refuse to start unless the graph cache holds every graph, naming "
                            "the missing ones and the `neuron-serve compile` command that "
                            "fills them (fleets: compile once, start fast everywhere)")
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


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_NEURON_FLAGS = {"token_buckets": "token_buckets", "request_buckets": "request_buckets",
                 "block_buckets": "block_buckets", "compile_mode": "compile_mode",
                 "graph_cache_dir": "cache_dir", "graph_cache_max_gb": "cache_max_gb",
                 "require_precompiled": "require_precompiled"}


def merge_neuron_flags(args: argparse.Namespace) -> None:
    """Our flags into vLLM's --additional-config, where the platform reads them."""
    section = dict((args.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {})
    for flag, key in _NEURON_FLAGS.items():
        if getattr(args, flag) is not None:
            section[key] = getattr(args, flag)
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: section}


def resolve_model_path(args: argparse.Namespace) -> str:
    """Positional MODEL wins, then vLLM's --model, then the embedded demo model."""
    from vllm.engine.arg_utils import EngineArgs

    if args.model_path:
        return args.model_path
    if getattr(args, "model", EngineArgs.model) != EngineArgs.model:
        return args.model
    return str(DEMO_MODEL_DIR)


def engine_args(args: argparse.Namespace):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args.model = args.model_path
    merge_neuron_flags(args)
    if args.served_model_name is None and args.model_path == str(DEMO_MODEL_DIR):
        args.served_model_name = [DEMO_NAME]
    return AsyncEngineArgs.from_cli_args(args)


def check_model(args: argparse.Namespace) -> None:
    args.model_path = resolve_model_path(args)
    if not os.path.isdir(args.model_path):
        sys.exit(f"neuron-serve: model {args.model_path!r} is not a local checkpoint "
                 "directory (models are never downloaded; pass a path to config.json's folder)")

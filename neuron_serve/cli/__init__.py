"""`neuron-serve` command line, one module per command.

    serve [MODEL]      the OpenAI-compatible server (serve.py)
    compile [MODEL]    compile (or load) every bucket's graph into the cache, then exit
    cache ls | verify | prune | export | import    the compiled-graph cache
    buckets suggest --trace FILE --max-graphs N    a bucket set fitted to a trace
"""

from __future__ import annotations

import argparse
import importlib
import sys

from neuron_serve import plugin
from neuron_serve.cli.engine import check_model
from neuron_serve.logs import init_logger, init_plain_logging
from neuron_serve.models import DEMO_MODEL_DIR

# Subcommands that need neither torch nor vLLM: parsed without importing them, which takes
# seconds, so `neuron-serve cache ls` answers at once.
LIGHT_COMMANDS = ("cache", "buckets")
COMMANDS = ("serve", "compile", *LIGHT_COMMANDS)  # each a module with add_parser and run


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
    for name in COMMANDS if not light else LIGHT_COMMANDS:
        _command(name).add_parser(subparsers)
    return parser


def _command(name: str):
    return importlib.import_module(f"neuron_serve.cli.{name}")


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
    argv = _with_default_model(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHT_COMMANDS:
        init_plain_logging()
    else:
        init_logger(__name__)  # vLLM's handler and format, before vLLM logs anything
        plugin.activate()  # our engines always run on our platform
    args = build_parser(argv).parse_args(argv)
    if args.command in ("serve", "compile"):
        check_model(args)
    sys.exit(_command(args.command).run(args))


if __name__ == "__main__":
    main()

"""Loggers under `neuron_serve.*`, printed through vLLM's handler in the same format."""

from __future__ import annotations

import logging

_ROOT = "neuron_serve"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        import vllm.logger  # noqa: F401  (configures the "vllm" logger and its handler)

        vllm_root = logging.getLogger("vllm")
        for handler in vllm_root.handlers:
            root.addHandler(handler)
        root.setLevel(vllm_root.level or logging.INFO)
        root.propagate = False
    return logging.getLogger(name)


def init_plain_logging() -> None:
    """For commands that never load a model: records go to stderr in vLLM's layout without
    importing vLLM, which costs seconds."""
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False

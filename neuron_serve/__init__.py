"""neuron-serve: vLLM platform plugin for AWS Trainium (and its CPU emulation)."""

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM `vllm.platform_plugins` entry point; returns None until the platform exists."""
    return None

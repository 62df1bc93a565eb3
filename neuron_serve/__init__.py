"""neuron-serve: vLLM platform plugin for AWS Trainium (and its CPU emulation)."""

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM `vllm.platform_plugins` entry point: our platform if asked for, else None."""
    from neuron_serve import plugin

    if not plugin.requested():
        return None
    plugin.activate()
    return plugin.PLATFORM

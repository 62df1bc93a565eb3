"""neuron-serve: vLLM platform plugin for AWS Trainium (and its CPU emulation)."""

__version__ = "0.1.0"


def register() -> str | None:
    """vLLM `vllm.platform_plugins` entry point: our platform if asked for, else None."""
    from neuron_serve import plugin

    if not plugin.requested():
        return None
    plugin.activate()
    return plugin.PLATFORM


def register_general() -> None:
    """vLLM `vllm.general_plugins` entry point, run in every vLLM process before it builds a
    config: the quantization methods our device adds, when our platform is active."""
    from neuron_serve import plugin

    if plugin.requested():
        from neuron_serve import device

        device.current().register_quantization()

"""neuron-serve: vLLM platform plugin for AWS Trainium (and its CPU emulation)."""

__version__ = "0.1.0"

PLATFORM = "neuron_serve.platform.NeuronPlatform"


def register() -> str | None:
    """vLLM `vllm.platform_plugins` entry point: our platform if asked for, else None."""
    from neuron_serve import activation

    if not activation.requested():
        return None
    activation.activate()
    return PLATFORM

"""Trainium through TorchNeuron (`torch_neuronx`): its `neuron` torch device and its
torch.compile backend.

Written against TorchNeuron's documented interfaces but never run: no Trainium exists
where this project is developed and tested. Kept thin on purpose; everything it does not
override is the device-independent default of base.py.
"""

from __future__ import annotations

import torch

from neuron_serve.device.base import Device


class NeuronDevice(Device):
    """Compile mode "ahead" (the base default): a Neuron graph takes minutes to compile and
    eager execution is no serving path, so a Trainium server loads every graph from a cache
    filled beforehand by `neuron-serve compile` (a Job, a build host; deploy/README.md) and
    answers only once all are ready. Shapes are fully static (`symbolic_context` off)."""

    backend = "neuron"
    dist_backend = "neuron"  # registered by `import torch_neuronx` (TorchNeuron's torch.distributed guide)

    def __init__(self) -> None:
        try:
            import torch_neuronx  # noqa: F401  (registers the "neuron" device and compile backend)
        except ImportError as exc:
            raise RuntimeError(
                "The neuron backend needs the AWS Neuron SDK, but `import torch_neuronx` failed "
                f"({exc}). Install torch-neuronx from the Neuron SDK on a Trainium host, or run "
                "the CPU emulation with NEURON_SERVE_BACKEND=emulated.") from exc
        self.torch_device = torch.device("neuron")
        self.compile_backend = "neuron"
        self.dispatch_key = "PrivateUse1"  # out-of-tree devices register under PrivateUse1
        self.native_bf16 = True

    def total_memory_bytes(self) -> int:
        free_total = getattr(getattr(torch, "neuron", None), "mem_get_info", None)
        if free_total is None:
            raise RuntimeError("cannot read Neuron device memory (torch.neuron.mem_get_info is "
                               "missing); pass --kv-cache-memory-bytes explicitly")
        return int(free_total()[1])

    @property
    def capacity_hint(self) -> str:
        return "the capacity is read from the Neuron runtime"

    def accept_quantization(self, method: str) -> None:
        raise NotImplementedError(
            f"{method} quantization: 8-bit weights need Trainium matmul kernels, which "
            "neuron-serve does not have yet (the emulated backend has its own); serve a "
            "full-precision checkpoint without --quantization")

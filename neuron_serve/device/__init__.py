"""The only package that knows which hardware we run on.

`current()` returns the process's `Device` (base.py): Trainium through TorchNeuron
(neuron.py) or its CPU emulation (emulated/). Everything above this package asks the
device and never branches on the backend itself; a new device is one more entry in
`DEVICES` and one more module here.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util

from neuron_serve import envs
from neuron_serve.device.base import Device
from neuron_serve.logs import init_logger

logger = init_logger(__name__)

# NEURON_SERVE_BACKEND value -> the Device class, imported only when chosen.
DEVICES = {"neuron": "neuron_serve.device.neuron:NeuronDevice",
           "emulated": "neuron_serve.device.emulated:EmulatedDevice"}

__all__ = ["DEVICES", "Device", "current", "hardware_present"]


def hardware_present() -> bool:
    """Trainium is usable: the SDK imports and the kernel driver exposes a device."""
    return bool(glob.glob("/dev/neuron*")) and importlib.util.find_spec("torch_neuronx") is not None


@functools.cache
def current() -> Device:
    backend = envs.NEURON_SERVE_BACKEND
    if backend == "auto":
        backend = "neuron" if hardware_present() else "emulated"
    module, name = DEVICES[backend].split(":")
    device = getattr(importlib.import_module(module), name)()
    logger.info("neuron-serve device backend: %s (compile backend %s)", device.backend,
                device.compile_backend)
    return device

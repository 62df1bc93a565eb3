"""The package's import rules (issue 29), read from the source with `ast`: every import
counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "neuron_serve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The neuron_serve modules `name` imports (a package import means its __init__)."""
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when that is a module, else pkg.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                       else node.module for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_the_graph_sees_function_level_imports():
    assert "neuron_serve.device" in GRAPH["neuron_serve.plugin"]  # imported inside requested()


def test_no_import_cycle_between_modules():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH))


def _package(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(_package(name), set()).update(
            _package(t) for t in targets if _package(t) != _package(name))
    assert _cycle(packages) is None, " -> ".join(_cycle(packages))


BANNED = [  # (importer prefix, banned prefixes)
    ("neuron_serve.device", ("neuron_serve.model_runner", "neuron_serve.server",
                             "neuron_serve.worker")),
    ("neuron_serve.graph_cache", ("neuron_serve.model_runner", "neuron_serve.worker")),
    ("neuron_serve.buckets", ("neuron_serve.",)),
    ("neuron_serve.stats", ("neuron_serve.",)),
]


@pytest.mark.parametrize("importer,banned", BANNED)
def test_banned_imports(importer, banned):
    bad = [(name, t) for name, targets in GRAPH.items()
           if name == importer or name.startswith(importer + ".")
           for t in targets if t.startswith(banned)]
    assert not bad


def test_the_server_imports_only_vllm_itself_and_stats():
    bad = [(name, t) for name, targets in GRAPH.items() if name.startswith("neuron_serve.server")
           for t in targets
           if not t.startswith("neuron_serve.server") and t not in ("neuron_serve.stats",)]
    assert not bad


def test_only_the_device_package_patches_libraries():
    """Assignments to attributes of torch (or its submodules) happen only in the emulated
    device's setup.py; writes to os.environ there (compiler settings), in plugin.py (the
    hand-off to child processes), platform.py (vLLM process settings) and envs.py (tests'
    overrides)."""
    allowed_env = {"neuron_serve.plugin", "neuron_serve.platform", "neuron_serve.envs",
                   "neuron_serve.device.emulated.setup"}
    patches = {name: _patches(path) for name, path in MODULES.items()}
    offenders = [(name, text) for name, found in patches.items() for text in found
                 if (text.startswith("os.environ") and name not in allowed_env)
                 or (not text.startswith("os.environ")
                     and name != "neuron_serve.device.emulated.setup")]
    assert not offenders
    assert "torch.zeros" in patches["neuron_serve.device.emulated.setup"]  # the check sees them


def _patches(path: Path) -> list[str]:
    """Targets of assignments to torch's attributes, inductor's, or os.environ."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for target in node.targets if isinstance(node, ast.Assign) else []:
            text = ast.unparse(target)
            if text.startswith(("torch.", "cpp_codegen.", "os.environ")):
                found.append(text)
    return found

"""Offline English text that ships with CPython: the pydoc topic pages and stdlib docstrings.

Used to train tokenizers and the demo model without downloading anything.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

MIN_DOCSTRING_CHARS = 120
_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def topic_documents() -> dict[str, str]:
    """The Python reference pages behind `help('TOPIC')`, keyed by topic name."""
    return {name: text.strip() for name, text in sorted(topics.items())}


def stdlib_docstrings() -> dict[str, str]:
    """Docstrings of the pure-Python stdlib (tests excluded), keyed by qualified name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                docs.setdefault(name, doc.strip())
    return docs

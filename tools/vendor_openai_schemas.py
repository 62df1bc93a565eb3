"""Vendor the parts of OpenAI's published OpenAPI document that the tests hold our
requests and responses against (tests/data/openai_schemas.json).

    git clone https://github.com/openai/openai-openapi /tmp/openai-openapi
    .venv/bin/python tools/vendor_openai_schemas.py /tmp/openai-openapi/openapi.json [COMMIT]

Keeps the named schemas and everything they reference, with OpenAPI 3.0's `nullable`
turned into JSON Schema's `"type": [..., "null"]` so `jsonschema` can check them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOTS = ("CreateCompletionRequest", "CreateCompletionResponse", "CreateChatCompletionRequest",
         "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "ErrorResponse",
         "CreateResponse", "Response", "ResponseStreamEvent")
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "openai_schemas.json"


def refs(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if "$ref" in node else set()
        return found.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def nullable(node):
    if isinstance(node, list):
        return [nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if "type" in node:
            kinds = [node["type"]] if isinstance(node["type"], str) else node["type"]
            node["type"] = [*kinds, "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


def main(path: str, commit: str | None = None) -> None:
    spec = json.loads(Path(path).read_text())
    schemas = spec["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(refs(schemas[name]) - keep)
    commit = commit or subprocess.run(["git", "-C", str(Path(path).parent), "rev-parse", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()
    out = {"source": f"github.com/openai/openai-openapi {commit or '?'} openapi.json",
           "components": {"schemas": {n: nullable(schemas[n]) for n in sorted(keep)}}}
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(keep)} schemas → {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""schemathesis over the server's own OpenAPI document, against the live server: valid
and invalid requests generated for every operation (examples, coverage and fuzzing
phases); no 5xx, every status and content type documented, every body matching its
schema. The case count goes to pytest's summary. A schema-invalid request may be
accepted: the request bodies are vLLM's models, lenient as under `vllm serve` (a token id
given as a string is coerced, vLLM's extras take any JSON). /v1/responses is left out: its
request schema (vLLM's) makes the coverage phase send over 10,000 requests; the Responses
API is tested in test_openai_surface.py.

Run through schemathesis' CLI: its pytest plugin does not work with pytest 9.2."""

import os
import re
import subprocess

import pytest
from conftest import REPO, VENV_BIN

pytestmark = pytest.mark.slow

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance")


def test_openapi_conformance_under_generated_requests(tiny_server, tmp_path, record_property):
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": str(REPO / "tests"), "NO_COLOR": "1"}
    out = subprocess.run(
        [str(VENV_BIN / "st"), "run", f"{tiny_server.base_url}/openapi.json",
         "--checks", ",".join(CHECKS), "--max-examples", "100", "--seed", "0",
         "--exclude-path", "/v1/responses",
         "--request-timeout", "120", "--no-color"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    summary = re.search(r"(\d+) generated", out.stdout)
    assert out.returncode == 0 and summary, out.stdout[-6000:] + out.stderr[-2000:]
    record_property("schemathesis_cases", {"all operations": int(summary.group(1))})
    tested = re.search(r"Tested: (\d+)", out.stdout)
    assert tested and int(tested.group(1)) == 11, out.stdout[-3000:]

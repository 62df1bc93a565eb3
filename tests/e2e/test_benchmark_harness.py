"""The benchmark harness runs end to end on a tiny model and writes its files; speed itself
is measured by benchmarks/compare.py, never asserted here."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, TEST_BUCKETS

pytestmark = pytest.mark.slow


def test_compare_writes_json_markdown_and_chart(tiny_llama, tmp_path):
    # Eager: this checks the harness, not the systems' speed or compiled numerics.
    cmd = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--model", str(tiny_llama),
           "--batches", "1,4", "--prompts", "16", "--output", "8", "--repeats", "1",
           "--max-num-batched-tokens", "64", "--max-model-len", "512",
           "--kv-cache-gb", str((64 << 20) / 2**30), "--neuron-config", json.dumps(TEST_BUCKETS),
           "--kernels", "--online", "--online-rates", "4", "--online-requests", "2",
           "--eager", "--name", "smoke", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert {(r["system"], r["batch"]) for r in report["offline"]} == {
        (s, b) for s in ("neuron", "vllm-cpu", "transformers") for b in (1, 4)}
    assert all(r["tok_s_median"] > 0 and 0 < r["share_of_limit"] for r in report["offline"])
    # Every sample has the reading taken just before its turn.
    assert all(len(r["readings"]) == len(r["samples"]) and
               all(m["read_gb_per_s"] > 0 for m in r["readings"]) for r in report["offline"])
    assert all(r["vs_vllm_cpu"] > 0 and r["vs_transformers"] > 0 for r in report["ratios"])
    assert {r["system"] for r in report["online"]} == {"neuron", "vllm-cpu"}
    sys.path.insert(0, str(REPO / "benchmarks"))
    from attention_bench import CASES
    assert [r["case"] for r in report["kernels"]] == list(CASES)
    table = (tmp_path / "smoke.md").read_text()
    assert "ours ÷ vLLM CPU" in table and "TTFT p50" in table and "Attention kernel" in table
    assert report["eager"] and "no system compiled" in table
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_profile_splits_each_compiled_step_by_kernel_kind(tmp_path):
    """benchmarks/step_profile.py's split of a trace: kernels fall in the graph call that
    contains them; a call with query tiles (batched matmuls or our tile op) is a mixed step;
    collectives are a kind of their own."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_profile import split_steps, summarize

    call = lambda ts, dur: {"name": "## Call CompiledFxGraph abc", "ts": ts, "dur": dur}  # noqa: E731
    kernel = lambda name, ts, dur: {"name": name, "ts": ts, "dur": dur}  # noqa: E731
    # A decode step: the skinny kernel's matmuls, our C++ attention, and a decoder layer
    # compiled once, whose kernels have no graph_ prefix.
    events = [call(0, 10_000), kernel("neuron_serve::skinny_matmul", 100, 4000),
              kernel("neuron_serve::paged_attention", 4200, 700),
              kernel("cpp_fused_index_put_softmax_7", 5000, 3000),
              kernel("graph_0_cpp_fused_add_mul_rsqrt_2", 8500, 500),
              # At tensor parallel above 1: an all-reduce and its wait.
              kernel("_c10d_functional::all_reduce_", 9100, 250),
              kernel("_c10d_functional::wait_tensor", 9400, 250),
              call(20_000, 30_000), kernel("_C::onednn_mm", 20_100, 12_000),
              kernel("aten::bmm", 33_000, 6000), kernel("graph_0_cpp_fused__softmax_3", 40_000, 2000),
              kernel("_C::onednn_mm", 60_000, 9000),  # outside every call: not counted
              # A mixed step on the "cpu" kernel set: its query tiles are our C++ op.
              call(70_000, 20_000), kernel("_C::onednn_mm", 70_100, 10_000),
              kernel("neuron_serve::paged_attention_tiles", 80_200, 3000),
              kernel("neuron_serve::paged_attention", 83_300, 1000)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    steps = split_steps(str(tmp_path / "t.json"))
    assert [(s["ms"], s["matmul"], s["attention"], s["collective"], s["other"])
            for s in steps] == [(10.0, 4.0, 3.7, 0.5, 0.5), (30.0, 12.0, 8.0, 0.0, 0.0),
                                (20.0, 10.0, 4.0, 0.0, 0.0)]
    # A step's period runs to the next call's start; the last call has none.
    assert [s["period"] for s in steps] == [20.0, 50.0, None]
    rows = summarize(steps)
    assert rows["decode"]["steps"] == 1 and rows["mixed"]["steps"] == 2
    assert rows["decode"]["period"] == 20.0 and rows["mixed"]["period"] == 50.0
    assert rows["mixed"]["attention"] == 6.0  # the median of 8 and 4


def test_each_sample_is_set_against_the_limit_of_its_own_turn():
    """A sample read at twice the bandwidth and GEMM rate has twice the limit: twice the
    tok/s there is the same share of the limit, where one machine for both would not."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare import offline_row
    from hardware import ModelShape

    shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                       vocab=256)
    machine = {"cpu": "x", "cores": 2, "torch_threads": 2, "isa": "AVX2", "flags": [],
               "read_gb_per_s": 10.0, "fp32_gemm_gflop_per_s": 100.0}
    slow, fast = ({"read_gb_per_s": 10.0 * k, "fp32_gemm_gflop_per_s": 100.0 * k} for k in (1, 2))
    alone = offline_row("neuron", 1, 16, 8, [10.0], shape, None, machine)
    paired = offline_row("neuron", 1, 16, 8, [10.0, 20.0], shape, [slow, fast], machine)
    one_machine = offline_row("neuron", 1, 16, 8, [10.0, 20.0], shape, None, machine)
    assert paired["share_of_limit"] == pytest.approx(alone["share_of_limit"])
    assert one_machine["share_of_limit"] == pytest.approx(1.5 * alone["share_of_limit"])
    assert paired["limit_tok_s_max"] == pytest.approx(2 * paired["limit_tok_s_min"])
    assert paired["readings"] == [slow, fast] and "readings" not in one_machine

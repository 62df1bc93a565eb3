"""Tensor parallel on the neuron platform: vLLM's multiprocessing executor, one worker per
rank, gloo collectives inside each bucket's graph.

Oracle: Transformers' greedy tokens on the same weights (fp32); at TP 2 also prefix
caching, seeded sampling, chunked prefill (a 150-token prompt in 64-token steps) and
preemption. The tiny checkpoints have 4 query heads over 2 KV heads: at TP 4 each
rank holds one query head and a replica of a KV head (num_kv_heads < TP).
"""

import subprocess
import time

import pytest
from conftest import FEW_BUCKETS, VENV_BIN
from oracles import greedy, hf_greedy, make_llm, prompts, seeded_draw

pytestmark = pytest.mark.slow


def shut(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


# Llama at TP 2 is held against Transformers by the tests below (prefix caching, preemption).
@pytest.mark.parametrize("family,tp", [("llama", 4), ("qwen3", 2), ("qwen3", 4), ("gemma", 2)])
def test_eager_greedy_matches_transformers(checkpoints, family, tp):
    llm = make_llm(checkpoints[family], tensor_parallel_size=tp)
    try:
        batch = prompts()
        for prompt, out in zip(batch, greedy(llm, batch)):
            assert list(out.outputs[0].token_ids) == hf_greedy(checkpoints[family], prompt)
    finally:
        shut(llm)


def assert_compiled_greedy_matches_transformers(llm, checkpoint) -> None:
    for prompt, out in zip(prompts(), greedy(llm, prompts())):
        assert list(out.outputs[0].token_ids) == hf_greedy(checkpoint, prompt)
    assert llm.collective_rpc("compiles_after_warmup") == [0, 0]


def test_compiled_greedy_in_background_mode_matches_transformers(checkpoints):
    """Background processes compile each rank's graphs in a world of their own; once every
    rank runs every graph, served graphs run the collectives."""
    llm = make_llm(checkpoints["qwen3"], tensor_parallel_size=2, enforce_eager=False,
                   additional_config={"neuron": {**FEW_BUCKETS, "compile_mode": "background"}})
    try:
        deadline = time.monotonic() + 600
        while not all(s["num_graphs"] == s["graphs_needed"]
                      for s in llm.collective_rpc("graph_stats")):
            assert time.monotonic() < deadline, llm.collective_rpc("graph_stats")
            greedy(llm, prompts()[:1], n=1)  # eager steps pick up the graphs
            time.sleep(2)
        assert_compiled_greedy_matches_transformers(llm, checkpoints["qwen3"])
    finally:
        shut(llm)


@pytest.fixture(scope="module")
def tp2(checkpoints):
    llm = make_llm(checkpoints["llama"], tensor_parallel_size=2)
    yield llm
    shut(llm)


def test_prefix_cache_hit_gives_the_same_tokens(tp2, checkpoints):
    prompt = prompts()[2]  # 150 tokens: four full 32-token blocks to reuse
    first, second = greedy(tp2, [prompt])[0], greedy(tp2, [prompt])[0]
    assert second.num_cached_tokens >= 128
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids) \
        == hf_greedy(checkpoints["llama"], prompt)


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(tp2):
    assert seeded_draw(tp2, 1) == seeded_draw(tp2, 1)
    assert seeded_draw(tp2, 1) != seeded_draw(tp2, 2)


def test_preemption_and_resume_keep_outputs_exact(checkpoints):
    """20 blocks per rank (each rank caches 1 of the 2 KV heads) for 4 requests needing
    4-7 each: vLLM preempts and resumes."""
    block_bytes = 32 * 1 * 2 * 32 * 4 * 2  # block × kv heads × (K+V) × head 32 × fp32 × layers
    llm = make_llm(checkpoints["llama"], tensor_parallel_size=2,
                   kv_cache_memory_bytes=20 * block_bytes, enable_prefix_caching=False,
                   disable_log_stats=False)
    try:
        batch = [p for p in prompts() if len(p) > 60] * 2  # 4 requests, 70-150 tokens
        outs = greedy(llm, batch, n=60)
        preempted = [m for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
        assert preempted and preempted[0].value > 0
        for prompt, out in zip(batch, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(checkpoints["llama"], prompt, n=60)
    finally:
        shut(llm)


def test_compile_command_fills_every_ranks_entries(checkpoints, tmp_path):
    """`neuron-serve compile --tensor-parallel-size 2` (each rank compiles ahead, on dummy
    weights), then a TP 2 engine that refuses to start on a missing graph loads all of them
    on both ranks and serves Transformers' tokens through them, replaying each rank's
    programs, collectives and all (replay.py)."""
    cache = tmp_path / "graphs"
    subprocess.run(
        [str(VENV_BIN / "neuron-serve"), "compile", str(checkpoints["qwen3"]),
         "--tensor-parallel-size", "2", "--graph-cache-dir", str(cache), "--dtype", "float32",
         "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--kv-cache-memory-bytes", str(64 << 20), "--token-buckets", "64",
         "--request-buckets", "1,4", "--block-buckets", "16"], check=True, timeout=900)
    llm = make_llm(checkpoints["qwen3"], tensor_parallel_size=2, enforce_eager=False,
                   additional_config={"neuron": {**FEW_BUCKETS, "compile_mode": "ahead",
                                                 "require_precompiled": True,
                                                 "cache_dir": str(cache)}})
    try:
        stats = llm.collective_rpc("graph_stats")
        assert [(s["cache_hits"], s["cache_misses"]) for s in stats] == [(4, 0), (4, 0)]
        assert_compiled_greedy_matches_transformers(llm, checkpoints["qwen3"])
        assert all(s["replayed_steps"] > 0 for s in llm.collective_rpc("graph_stats"))
    finally:
        shut(llm)

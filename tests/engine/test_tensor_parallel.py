"""Tensor parallel on the neuron platform: vLLM's multiprocessing executor, one worker per
rank, gloo collectives inside each bucket's graph.

Oracles: Transformers' greedy tokens on the same weights (fp32), and the same engine at
tensor parallel 1. The tiny checkpoints have 4 query heads over 2 KV heads: at TP 4 each
rank holds one query head and a replica of a KV head (num_kv_heads < TP).
"""

import time

import pytest
from conftest import FEW_BUCKETS
from oracles import greedy, hf_greedy, make_llm, prompts

pytestmark = pytest.mark.slow


def shut(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("family,tp", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4),
                                       ("gemma", 2)])
def test_eager_greedy_matches_transformers(checkpoints, family, tp):
    llm = make_llm(checkpoints[family], tensor_parallel_size=tp)
    try:
        batch = prompts()
        for prompt, out in zip(batch, greedy(llm, batch)):
            assert list(out.outputs[0].token_ids) == hf_greedy(checkpoints[family], prompt)
    finally:
        shut(llm)


@pytest.mark.parametrize("mode", ["ahead", "background"])
def test_compiled_greedy_matches_transformers(checkpoints, mode):
    """Every rank compiles (ahead) or has background processes compile in a world of their
    own (background) the graphs of its shard; served graphs run the collectives."""
    llm = make_llm(checkpoints["qwen3"], tensor_parallel_size=2, enforce_eager=False,
                   additional_config={"neuron": {**FEW_BUCKETS, "compile_mode": mode}})
    try:
        batch = prompts()
        if mode == "background":  # eager steps until every rank runs every graph
            deadline = time.monotonic() + 600
            while not all(s["num_graphs"] == s["graphs_needed"]
                          for s in llm.collective_rpc("graph_stats")):
                assert time.monotonic() < deadline, llm.collective_rpc("graph_stats")
                greedy(llm, batch[:1], n=1)
                time.sleep(2)
        for prompt, out in zip(batch, greedy(llm, batch)):
            assert list(out.outputs[0].token_ids) == hf_greedy(checkpoints["qwen3"], prompt)
        assert llm.collective_rpc("compiles_after_warmup") == [0, 0]
    finally:
        shut(llm)

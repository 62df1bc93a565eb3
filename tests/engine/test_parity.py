"""Tokens from vLLM on the neuron platform match Transformers on the same weights.

Engines are vLLM's offline `LLM` on our platform (engine core in a child process), one per
configuration, shared by the tests of a module. Oracle: Transformers' greedy decoding in
fp32 with end-of-sequence suppressed for the same number of tokens (min_tokens).
"""

import pytest
from conftest import FEW_BUCKETS, TEST_BUCKETS
from oracles import greedy, hf_greedy, make_llm, prompts

from neuron_serve.models.tiny import FAMILIES

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(checkpoints, family, mode):
    """Llama keeps the full grid, whose graphs every tiny-Llama engine of the session shares;
    the other families compile one decode and two prefill graphs (block-width and request
    padding are family-independent)."""
    buckets = TEST_BUCKETS if family == "llama" else {**FEW_BUCKETS, "request_buckets": [4]}
    llm = make_llm(checkpoints[family], enforce_eager=mode == "eager",
                   additional_config={"neuron": buckets})
    try:
        batch = prompts()
        for prompt, out in zip(batch, greedy(llm, batch)):
            assert list(out.outputs[0].token_ids) == hf_greedy(checkpoints[family], prompt), family
        assert sum(llm.collective_rpc("compiles_after_warmup")) == 0
        if mode == "compiled":  # past two steps, a bucket's program is replayed (replay.py)
            (stats,) = llm.collective_rpc("graph_stats")
            assert stats["replayed_steps"] > 0
    finally:
        llm.llm_engine.engine_core.shutdown()

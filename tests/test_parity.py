"""Tokens from vLLM on the neuron platform match Transformers on the same weights.

Engines are vLLM's offline `LLM` on our platform (engine core in a child process), one per
configuration, shared by the tests of a module. Oracle: Transformers' greedy decoding in
fp32 with end-of-sequence suppressed for the same number of tokens (min_tokens).
"""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

from conftest import FEW_BUCKETS, TEST_BUCKETS
from neuron_serve.models.tiny import FAMILIES

pytestmark = pytest.mark.slow

NEW_TOKENS = 10


def prompts(vocab: int = 1000) -> list[list[int]]:
    """Batched together: short and long prompts, one longer than a step (chunked prefill,
    mixed with the others' decodes) and one past Mistral's 64-token sliding window."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 17, 150, 70]
    return [[1] + torch.randint(10, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


def make_llm(path, **kw) -> LLM:
    args = dict(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=4,
                max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20, seed=0,
                enforce_eager=True, additional_config={"neuron": TEST_BUCKETS})
    return LLM(**{**args, **kw})


@functools.cache
def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def greedy(llm: LLM, batch: list[list[int]], n: int = NEW_TOKENS):
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


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
    finally:
        llm.llm_engine.engine_core.shutdown()

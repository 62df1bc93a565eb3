"""Oracles and engines the tests share: Transformers' greedy tokens on the same weights,
vLLM's offline engine on our platform, and the demo corpus's English words."""

import functools
import re

import torch
from conftest import TEST_BUCKETS
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

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


def seeded_draw(llm: LLM, seed: int) -> list[int]:
    """12 sampled tokens (temperature 1, top-p 0.9, top-k 50) of a fixed prompt, seeded."""
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=1.0, top_p=0.9, top_k=50,
                            seed=seed)
    return list(llm.generate({"prompt_token_ids": prompts()[1]}, params,
                             use_tqdm=False)[0].outputs[0].token_ids)


def english_words(documents) -> set[str]:
    return {w.lower() for doc in documents["train"] for w in re.findall(r"[A-Za-z]+", doc)}

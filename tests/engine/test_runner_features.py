"""The compiled runner: parity, no compiles after warm-up, prefix caching, preemption,
sampling parameters. One compiled engine on the tiny Llama serves the module."""

import math
import os
from collections import Counter

import pytest
import torch
from oracles import greedy, hf_greedy, hf_model, make_llm, prompts, seeded_draw
from vllm import SamplingParams, envs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(tiny_llama):
    """An in-process engine core: `generate` adds every request before the first step, so
    which requests share a step never depends on when they reach another process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        engine = make_llm(tiny_llama, enforce_eager=False)
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        envs.disable_envs_cache()  # the engine core froze vLLM's env reads; later engines reread
    yield engine
    engine.llm_engine.engine_core.shutdown()


def compiles_after_warmup(llm) -> int:
    return sum(llm.collective_rpc("compiles_after_warmup"))


def test_compiled_matches_transformers_without_recompiling(llm, tiny_llama):
    batch = prompts()
    for prompt, out in zip(batch, greedy(llm, batch)):
        assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt)
    # Different batch sizes and lengths land in other buckets, never in a new graph.
    for size in (1, 2, 3):
        greedy(llm, batch[:size], n=3)
    assert compiles_after_warmup(llm) == 0


def bucket_steps(llm) -> Counter:
    return sum((Counter(s["bucket_steps"]) for s in llm.collective_rpc("graph_stats")), Counter())


def test_a_step_its_query_tiles_cannot_pack_runs_untiled_and_matches_transformers(llm, tiny_llama):
    """Four 17-token prompts fill one 64-token step: its 2 query tiles take two of them, the
    other 34 tokens exceed its 4 single-token slots, so the step runs in the untiled bucket
    (the widest: 16 blocks); the next step (3 decodes, the last 4 prompt tokens) fits the tiled one."""
    gen = torch.Generator().manual_seed(1)
    batch = [[1] + torch.randint(10, 1000, (16,), generator=gen).tolist() for _ in range(4)]
    before = bucket_steps(llm)
    for prompt, out in zip(batch, greedy(llm, batch)):
        assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt)
    ran = bucket_steps(llm) - before
    assert ran["t64-r4-b16"] == 1 and ran["t64-r4-b4-q32"] == 1, ran


def test_prefix_cache_hit_gives_the_same_tokens(llm, tiny_llama):
    prompt = prompts()[2]  # 150 tokens: four full 32-token blocks to reuse
    first = greedy(llm, [prompt])[0]
    second = greedy(llm, [prompt])[0]
    assert second.num_cached_tokens >= 128
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids) \
        == hf_greedy(tiny_llama, prompt)


def test_padding_does_not_change_outputs(llm):
    """The same request alone (small bucket) and with three others (padded mixed bucket)."""
    batch = prompts()
    alone = greedy(llm, [batch[1]])[0].outputs[0].token_ids
    together = greedy(llm, batch)[1].outputs[0].token_ids
    assert list(alone) == list(together)


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(llm):
    assert seeded_draw(llm, 1) == seeded_draw(llm, 1)
    assert seeded_draw(llm, 1) != seeded_draw(llm, 2)


def test_logprobs_match_transformers(llm, tiny_llama):
    prompt = prompts()[1]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(tiny_llama)(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)
    for token, lp in out.outputs[0].logprobs[0].items():
        assert math.isclose(lp.logprob, expected[token].item(), abs_tol=1e-4)
    assert set(out.outputs[0].logprobs[0]) >= set(expected.topk(3).indices.tolist())


def test_logit_bias_stop_tokens_and_min_tokens(llm, tiny_llama):
    prompt = {"prompt_token_ids": prompts()[1]}
    forced = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0,
                                                 logit_bias={777: 100.0}), use_tqdm=False)
    assert list(forced[0].outputs[0].token_ids) == [777, 777, 777]
    expected = hf_greedy(tiny_llama, prompt["prompt_token_ids"])
    stopped = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0,
                                                  stop_token_ids=[expected[2]]), use_tqdm=False)
    assert list(stopped[0].outputs[0].token_ids) == expected[:3]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_preemption_and_resume_keep_outputs_exact(tiny_llama):
    """A KV cache of 20 blocks for 4 requests needing 4-7 each: vLLM preempts and resumes."""
    block_bytes = 32 * 2 * 2 * 32 * 4 * 2  # block × kv heads × (K+V) × head 32 × fp32 × layers
    engine = make_llm(tiny_llama, kv_cache_memory_bytes=20 * block_bytes, max_num_seqs=4,
                      enable_prefix_caching=False, disable_log_stats=False)
    try:
        batch = [p for p in prompts() if len(p) > 60] * 2  # 4 requests, 70-150 tokens
        outs = greedy(engine, batch, n=60)
        preempted = [m for m in engine.get_metrics() if m.name == "vllm:num_preemptions"]
        assert preempted and preempted[0].value > 0
        for prompt, out in zip(batch, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt, n=60)
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_transformers_model_implementation(tiny_llama):
    engine = make_llm(tiny_llama, model_impl="transformers")
    try:
        batch = prompts()
        for prompt, out in zip(batch, greedy(engine, batch)):
            assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt)
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_repetition_penalty_matches_transformers(llm, tiny_llama):
    prompt = prompts()[1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=12, min_tokens=12, temperature=0, repetition_penalty=1.5), use_tqdm=False)
    ids = torch.tensor([prompt])
    expected = hf_model(tiny_llama).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
        do_sample=False, repetition_penalty=1.5)[0, len(prompt):].tolist()
    assert list(out[0].outputs[0].token_ids) == expected

"""8-bit weights and an 8-bit KV cache on the neuron platform, through vLLM's quantization
methods, on the trained demo model (a trained model's greedy tokens are decided by margins
that rounding does not flip; a random one's often are not).

Oracles: Transformers on the same checkpoint with the quantized layers' weights replaced by
their dequantized values (full-precision activations), for greedy tokens; Transformers'
full-precision loss on held-out documents, for the quality bound (within 2 %). Checkpoints
are written by neuron_serve.models.quantized from the demo's weights.
"""

from __future__ import annotations

import functools
import subprocess

import pytest
import torch
from conftest import VENV_BIN, engine_flags
from oracles import make_llm
from train_demo import heldout_windows
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import SamplingParams

from neuron_serve.models import DEMO_MODEL_DIR
from neuron_serve.models.quantized import FP8, write_quantized

pytestmark = pytest.mark.slow

LOSS_BOUND = 0.02  # relative to Transformers' full-precision loss
DEMO_BUCKETS = {"token_buckets": [64, 256], "request_buckets": [1, 4], "block_buckets": [16]}
PROMPTS = ["The for statement is used to", "A list is a sequence of", "Exceptions are raised"]


@functools.cache
def windows() -> list[list[int]]:
    return heldout_windows(4).tolist()


@functools.cache
def hf_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def untied_hf_model(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Transformers on the demo with `weights` replaced; the LM head gets its own tensor."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(weights.pop("lm_head.weight"))
    missing = set(weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(weights, strict=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


def hf_greedy(model, prompt_ids: list[int], n: int = 16) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def hf_loss(model) -> float:
    ids = torch.tensor(windows())
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def engine_loss(llm) -> float:
    """Mean negative log-likelihood of each window's tokens after its first, from vLLM's
    prompt logprobs (the same next-token loss Transformers computes)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows()], params, use_tqdm=False)
    nll = [-entry[token].logprob for out, window in zip(outs, windows())
           for entry, token in zip(out.prompt_logprobs[1:], window[1:])]
    return sum(nll) / len(nll)


def online_fp8_weights() -> dict[str, torch.Tensor]:
    """The demo's linear weights as vLLM's online per-tensor FP8 leaves them: one scale per
    fused layer (q, k, v together; gate and up together), amax / 448."""
    state = hf_model().state_dict()
    out = {}
    for layer in range(hf_model().config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for group in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["mlp.gate_proj", "mlp.up_proj"], ["self_attn.o_proj"], ["mlp.down_proj"]):
            names = [f"{prefix}{g}.weight" for g in group]
            scale = max(state[n].abs().max() for n in names).float() / torch.finfo(FP8).max
            for n in names:
                out[n] = (state[n] / scale).clamp(-448, 448).to(FP8).float() * scale
    return out


def check(llm, oracle, kv_quantized: bool = False) -> float:
    """Greedy parity with `oracle` (weights) and the loss bound; returns the engine's loss."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if not kv_quantized:  # an 8-bit cache is held to the loss bound only
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(oracle, prompt)
    loss, reference = engine_loss(llm), hf_loss(hf_model())
    assert abs(loss - reference) <= LOSS_BOUND * reference, (loss, reference)
    return loss


def demo_llm(path, **kw):
    return make_llm(path, max_num_batched_tokens=256,
                    additional_config={"neuron": DEMO_BUCKETS}, **kw)


def eight_bit_bytes(llm) -> dict[str, int]:
    (sizes,) = llm.collective_rpc("weight_bytes")
    return {k: v for k, v in sizes.items() if k in ("int8", "float8_e4m3fn")}


def with_lm_head(dequantized: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """The oracle's weights with the LM head as the engine's 8-bit copy holds it
    (quantized_linear.quantize_lm_head: a scale per vocabulary row)."""
    head = hf_model().get_output_embeddings().weight.detach()
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = head.abs().amax(dim=1, keepdim=True) / top
    values = head / scale
    values = (values.round() if dtype == torch.int8 else values).clamp(-top, top).to(dtype)
    return {**dequantized, "lm_head.weight": values.float() * scale}


def linear_weights() -> int:
    config = hf_model().config
    return sum(t.numel() for name, t in hf_model().state_dict().items()
               if name.endswith("_proj.weight")) + config.vocab_size * config.hidden_size


@pytest.mark.parametrize("fmt,dtype", [("fp8", FP8), ("fp8-channel", FP8), ("fp8-tensor", FP8),
                                       ("int8-w8a16", torch.int8)])
def test_checkpoint_formats_load_8bit_and_match_their_dequantized_weights(tmp_path, fmt, dtype):
    dequantized = write_quantized(DEMO_MODEL_DIR, tmp_path / fmt, fmt)
    llm = demo_llm(tmp_path / fmt)
    try:
        stored = eight_bit_bytes(llm)  # one byte a weight: the layers' and the head's copy
        assert stored == {str(dtype).removeprefix("torch."): linear_weights()}
        check(llm, untied_hf_model(with_lm_head(dequantized, dtype)))
    finally:
        llm.llm_engine.engine_core.shutdown()


def online_int8_weights() -> dict[str, torch.Tensor]:
    """The demo's linear weights as `int8_weight_only` leaves them: rounded, a scale per
    output channel (largest magnitude → 127)."""
    out = {}
    for name, weight in hf_model().state_dict().items():
        if name.endswith("_proj.weight"):
            scale = weight.abs().amax(dim=1, keepdim=True) / 127
            out[name] = (weight / scale).round().clamp(-127, 127) * scale
    return out


@pytest.mark.parametrize("method,dtype,oracle", [
    ("fp8", FP8, online_fp8_weights),  # vLLM's deprecated name for fp8_per_tensor
    ("int8_weight_only", torch.int8, online_int8_weights)])  # ours, for dense layers
def test_online_quantization_at_load(method, dtype, oracle):
    llm = demo_llm(DEMO_MODEL_DIR, quantization=method)
    try:
        assert eight_bit_bytes(llm) == {str(dtype).removeprefix("torch."): linear_weights()}
        check(llm, untied_hf_model(with_lm_head(oracle(), dtype)))
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_holds_four_times_the_tokens_within_the_loss_bound(kv_cache_dtype):
    llm = demo_llm(DEMO_MODEL_DIR, kv_cache_dtype=kv_cache_dtype)
    try:
        check(llm, None, kv_quantized=True)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        bytes_per_token = (2 * 2 * 64) * hf_model().config.num_hidden_layers  # K+V, 2 heads
        assert blocks * 32 * bytes_per_token == pytest.approx(64 << 20, rel=0.01)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_graphs_compiled_ahead_read_8bit_weights_and_an_fp8_cache(tmp_path):
    """`neuron-serve compile` builds every bucket's graph for an INT8 checkpoint and an FP8
    cache, on dummy weights; an engine with the same settings loads them all (the key holds
    both formats), compiles none, and computes with the checkpoint's real weights through
    them (decode steps and the chunked prefill on the 8-bit skinny kernel)."""
    model, cache = tmp_path / "int8", tmp_path / "graphs"
    write_quantized(DEMO_MODEL_DIR, model, "int8-w8a16")
    buckets = {**DEMO_BUCKETS, "token_buckets": [64]}
    # engine_flags are make_llm's settings as command-line flags: the keys must match.
    out = subprocess.run([str(VENV_BIN / "neuron-serve"), "compile", str(model),
                          "--graph-cache-dir", str(cache), "--kv-cache-dtype", "fp8",
                          *engine_flags(buckets)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4/4 graphs ready for 4 buckets: 0 loaded from the cache, 4 compiled" in out.stdout
    llm = make_llm(model, enforce_eager=False, kv_cache_dtype="fp8", additional_config={
        "neuron": {**buckets, "cache_dir": str(cache), "require_precompiled": True}})
    try:
        (stats,) = llm.collective_rpc("graph_stats")
        assert (stats["cache_hits"], stats["cache_misses"]) == (4, 0)
        check(llm, None, kv_quantized=True)
        (stats,) = llm.collective_rpc("graph_stats")
        assert stats["eager_steps"] == 0 and stats["compiles_after_warmup"] == 0
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_2_shards_the_8bit_weights_and_cache(tmp_path):
    """Each rank holds half the 8-bit weights (a scale per channel follows its shard) and
    its KV heads' FP8 cache; a shard read with the wrong scales would miss the loss bound."""
    write_quantized(DEMO_MODEL_DIR, tmp_path / "fp8", "fp8-channel")
    llm = demo_llm(tmp_path / "fp8", tensor_parallel_size=2, kv_cache_dtype="fp8")
    try:
        ranks = llm.collective_rpc("weight_bytes")
        assert [r["float8_e4m3fn"] for r in ranks] == [linear_weights() // 2] * 2
        check(llm, None, kv_quantized=True)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_kv_scales_of_a_checkpoint_are_the_ones_the_cache_is_written_with(tmp_path):
    """Scales far too small for the demo's keys and values (the largest storable value
    becomes 0.448) saturate the cache: the loss leaves the bound that scales of 1.0, vLLM's
    default without any, keep (test_an_fp8_kv_cache_...)."""
    write_quantized(DEMO_MODEL_DIR, tmp_path / "fp8", "fp8", kv_scales=(1e-3, 1e-3))
    llm = demo_llm(tmp_path / "fp8", kv_cache_dtype="fp8")
    try:
        assert engine_loss(llm) > (1 + 5 * LOSS_BOUND) * hf_loss(hf_model())
    finally:
        llm.llm_engine.engine_core.shutdown()

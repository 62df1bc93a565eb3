"""Tiny checkpoints: every family loads in Transformers, generates, and is reproducible."""

import hashlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from neuron_serve.models.tiny import FAMILIES, write_checkpoint


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_loads_and_generates(checkpoints, family):
    path = checkpoints[family]
    assert AutoConfig.from_pretrained(path).model_type == FAMILIES[family]["model_type"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok("The return statement leaves the current function call", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 12
    # A random model that repeats one token would make token-level parity tests vacuous.
    assert len(set(new)) >= 4, f"{family} greedy output collapsed: {new}"
    assert all(0 <= t < model.config.vocab_size for t in new)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chat_template_renders_turns(checkpoints, family):
    tok = AutoTokenizer.from_pretrained(checkpoints[family])
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is a list?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nWhat is a list?<|end|>\n<|assistant|>\n"


def test_same_seed_same_bytes_other_seed_other_weights(checkpoints, tmp_path):
    again = write_checkpoint("qwen3", tmp_path / "again", seed=0)
    other = write_checkpoint("qwen3", tmp_path / "other", seed=1)
    original = checkpoints["qwen3"]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha256(again / name) == sha256(original / name), name
    assert sha256(other / "model.safetensors") != sha256(original / "model.safetensors")


def test_overrides_shape_the_model(tmp_path):
    path = write_checkpoint("llama", tmp_path / "wide", hidden_size=256, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.hidden_size == 256 and len(model.model.layers) == 3
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)


def test_unknown_family_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        write_checkpoint("gpt5", tmp_path / "x")

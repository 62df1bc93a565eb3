"""Tiny random-weight Hugging Face checkpoints, built offline and deterministically.

    write_checkpoint("qwen3", path, seed=0)  # config.json, model.safetensors, tokenizer

Tests use them as the oracle's input (Transformers and vLLM load the same files); the
benchmarks use `shape=` overrides to build real-model shapes with random weights.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from neuron_serve.models.corpus import topic_documents
from neuron_serve.models.tokenizer import (
    END,
    EOS,
    THINK_TOKENS,
    save_hf_tokenizer,
    special_token_ids,
    train_bpe,
)

TOKENIZER_VOCAB = 1024

# Shared small shape: grouped-query attention (4 query heads over 2 KV heads), 2 layers.
# Head dim 32 is the smallest vLLM's CPU attention kernel accepts (benchmarks compare to it).
_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", **_SMALL),
    "qwen2": dict(model_type="qwen2", **_SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=32, **_SMALL),
    "mistral": dict(model_type="mistral", sliding_window=64, **_SMALL),
    "gemma": dict(model_type="gemma", head_dim=32, hidden_act="gelu_pytorch_tanh", **_SMALL),
    "phi3": dict(model_type="phi3", **_SMALL),
}


# Random-init scales chosen so greedy decoding of a random model does not collapse onto one
# token (token-level comparisons need varied outputs). Gemma scales embeddings by
# sqrt(hidden) and ties them to the LM head, so its random model echoes the input token
# unless the layers' output projections outweigh the embedding.
_INIT_SCALES = {"default": dict(embed_std=0.5, out_proj_gain=1.0),
                "gemma": dict(embed_std=0.01, out_proj_gain=10.0)}


@functools.cache
def _tokenizer(vocab_size: int):
    """`vocab_size` tokens, the last two `<think>` and `</think>`: added, not special (kept in
    decoded text), as in Qwen3's tokenizer, so vLLM's reasoning parsers find them."""
    from tokenizers import AddedToken

    tok = train_bpe(topic_documents().values(), vocab_size - len(THINK_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def make_config(family: str, **overrides: Any):
    """The family's tiny `PretrainedConfig`, with special-token ids of our tokenizer."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    fields = {**FAMILIES[family], **overrides}
    ids = special_token_ids(_tokenizer(TOKENIZER_VOCAB))
    fields.setdefault("vocab_size", TOKENIZER_VOCAB)
    fields.update(bos_token_id=ids["<s>"], eos_token_id=ids[EOS], pad_token_id=ids["<pad>"])
    fields.setdefault("tie_word_embeddings", family == "gemma")
    fields.setdefault("dtype", "float32")
    return AutoConfig.for_model(**fields)


def write_checkpoint(family: str, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight checkpoint of `family` to `out_dir`; same seed, same bytes.

    Args:
        family: one of FAMILIES.
        out_dir: directory to create (existing files are overwritten).
        seed: seeds the weight initialisation.
        overrides: config fields to change, e.g. hidden_size or num_hidden_layers.
    Returns:
        out_dir as a Path.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = make_config(family, **overrides)
    tok = _tokenizer(TOKENIZER_VOCAB)
    if config.vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's "
                         f"{tok.get_vocab_size()} tokens; raise vocab_size")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_init(model, seed, **_INIT_SCALES.get(family, _INIT_SCALES["default"]))
    model.save_pretrained(out_dir, safe_serialization=True)
    save_hf_tokenizer(tok, out_dir, model_max_length=config.max_position_embeddings)
    _write_generation_config(out_dir, config, special_token_ids(tok)[END])
    return out_dir


def _scale_init(model: torch.nn.Module, seed: int, embed_std: float, out_proj_gain: float) -> None:
    """Re-draw every parameter from one seeded generator so the bytes are reproducible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:  # perturb the family's own init (1 for Llama, 0 for Gemma's 1+w)
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            else:
                std = embed_std if "embed" in name else param.shape[-1] ** -0.5
                if "o_proj" in name or "down_proj" in name:
                    std *= out_proj_gain
                param.copy_(std * torch.randn(param.shape, generator=gen))


def _write_generation_config(out_dir: Path, config, end_id: int) -> None:
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": [config.eos_token_id, end_id],
           "pad_token_id": config.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

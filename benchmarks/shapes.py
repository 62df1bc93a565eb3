"""Real-model shapes with random weights (DESIGN §8), built locally once and reused.

    from shapes import checkpoint
    path = checkpoint("smollm2-135m")   # benchmarks/.checkpoints/smollm2-135m
"""

from __future__ import annotations

from pathlib import Path

from neuron_serve.models.tiny import write_checkpoint

ROOT = Path(__file__).resolve().parent / ".checkpoints"

SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                                   vocab_size=49152, tie_word_embeddings=True,
                                   max_position_embeddings=8192)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=40960)),
}


def checkpoint(name: str) -> Path:
    family, shape = SHAPES[name]
    path = ROOT / name
    if not (path / "config.json").exists():
        write_checkpoint(family, path, seed=0, **shape)
    cover_vocabulary(path, shape["vocab_size"])
    return path


def cover_vocabulary(path: Path, vocab_size: int) -> None:
    """Give the tokenizer one (added) token per id the model can emit, so that a server
    detokenizes any generated id: the small trained vocabulary is padded with `<wN>`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    missing = vocab_size - len(tok)
    if missing > 0:
        tok.add_tokens([f"<w{i}>" for i in range(missing)])
        tok.save_pretrained(path)

"""Train the embedded demo model: a small Llama on Python's own documentation, offline.

    .venv/bin/python tools/train_demo.py [--steps N] [--out DIR]

Corpus: the pydoc topic pages and stdlib docstrings that ship with CPython (neuron_serve/models/corpus.py).
Documents are split 90/5/5 into train / validation (picks the best checkpoint) / held-out
test (reported). Half of the documents are shown as chat turns ("What does X do?" →
the docstring) so the chat template yields answers. Prints and records in training.json
the final train, validation and held-out losses. Fits in ~20 min on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from neuron_serve.models import DEMO_MODEL_DIR
from neuron_serve.models.corpus import stdlib_docstrings, topic_documents
from neuron_serve.models.tokenizer import BOS, END, EOS, save_hf_tokenizer, special_token_ids, train_bpe


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 700
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_windows: int = 48


def build_documents(seed: int) -> dict[str, list[str]]:
    """Split every document once into train / val / test, then render it as text."""
    named = [(f"the {name.replace('-', ' ')} topic", text) for name, text in topic_documents().items()]
    named += [(f"`{name}`", doc) for name, doc in stdlib_docstrings().items()]
    rng = random.Random(seed)
    rng.shuffle(named)
    n = len(named)
    splits = {"train": named[: int(0.9 * n)], "val": named[int(0.9 * n): int(0.95 * n)],
              "test": named[int(0.95 * n):]}
    return {split: [_render(subject, text, rng.random() < 0.5) for subject, text in docs]
            for split, docs in splits.items()}


def _render(subject: str, text: str, as_chat: bool) -> str:
    if not as_chat:
        return BOS + text + EOS
    return (f"{BOS}<|user|>\nWhat does the Python documentation say about {subject}?{END}\n"
            f"<|assistant|>\n{text}{END}\n")


def tokenize(tok, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc, add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.long)


def make_model(cfg: TrainConfig, tok_ids: dict[str, int]):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tok_ids[BOS], eos_token_id=tok_ids[EOS], pad_token_id=tok_ids["<pad>"],
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def random_windows(stream: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (n,), generator=gen)
    return torch.stack([stream[s: s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def heldout_windows(count: int, seq_len: int = 256, seed: int = 1) -> torch.Tensor:
    """`count` random windows of the shipped demo's held-out documents, as token ids: the
    quality oracle of the tests and benchmarks that run the demo model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    record = json.loads((DEMO_MODEL_DIR / "training.json").read_text())
    stream = tokenize(tok.backend_tokenizer, build_documents(record["config"]["seed"])["test"])
    return random_windows(stream, count, seq_len, torch.Generator().manual_seed(seed))


def mean_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig, out_dir: Path) -> dict:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(torch.get_num_threads())
    start = time.monotonic()
    docs = build_documents(cfg.seed)
    tok = train_bpe(docs["train"], cfg.vocab_size)
    streams = {split: tokenize(tok, d) for split, d in docs.items()}
    gen = torch.Generator().manual_seed(cfg.seed)
    evals = {s: random_windows(streams[s], cfg.eval_windows, cfg.seq_len, gen) for s in ("val", "test")}
    model = make_model(cfg, special_token_ids(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    best_val, best_state, recent = float("inf"), None, []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = random_windows(streams["train"], cfg.batch_size, cfg.seq_len, gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-50:]
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            val = mean_loss(model, evals["val"], cfg.batch_size)
            print(f"step {step + 1}/{cfg.steps} train {sum(recent) / len(recent):.3f} "
                  f"val {val:.3f} ({time.monotonic() - start:.0f} s)", flush=True)
            if val < best_val:
                best_val, best_step = val, step + 1
                best_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    record = {
        "best_step": best_step,
        "train_loss_last50": round(sum(recent) / len(recent), 4),
        "train_loss": round(mean_loss(model, random_windows(streams["train"], cfg.eval_windows,
                                                            cfg.seq_len, gen), cfg.batch_size), 4),
        "val_loss": round(best_val, 4),
        "heldout_test_loss": round(mean_loss(model, evals["test"], cfg.batch_size), 4),
        "tokens": {s: len(v) for s, v in streams.items()},
        "train_seconds": round(time.monotonic() - start, 1),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": "pydoc_data.topics + stdlib docstrings of CPython "
                  + __import__("platform").python_version(),
        "config": asdict(cfg),
    }
    save(model, tok, out_dir, record)
    return record


def save(model, tok, out_dir: Path, record: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_hf_tokenizer(tok, out_dir, model_max_length=model.config.max_position_embeddings)
    ids = special_token_ids(tok)
    gen = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[END]],
           "pad_token_id": ids["<pad>"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    args = parser.parse_args()
    record = train(TrainConfig(steps=args.steps), args.out)
    print(f"final: train loss {record['train_loss']:.3f}, validation {record['val_loss']:.3f}, "
          f"held-out test {record['heldout_test_loss']:.3f} in {record['train_seconds']:.0f} s; "
          f"saved to {args.out}")


if __name__ == "__main__":
    main()

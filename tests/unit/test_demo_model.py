"""The embedded demo model: small, trained, and answering in recognisable English."""

import json
import re

import pytest
import torch
from oracles import english_words
from train_demo import build_documents, random_windows, tokenize
from transformers import AutoModelForCausalLM, AutoTokenizer

from neuron_serve.models import DEMO_MODEL_DIR

MAX_WEIGHT_BYTES = 30 * 2**20


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def record():
    return json.loads((DEMO_MODEL_DIR / "training.json").read_text())


@pytest.fixture(scope="module")
def documents(record):
    return build_documents(record["config"]["seed"])


def test_ships_small_weights_and_a_chat_template(model):
    assert model.config.model_type == "llama"
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES
    assert "<|assistant|>" in (DEMO_MODEL_DIR / "chat_template.jinja").read_text()


def test_heldout_loss_is_recorded_and_reproduced(model, tokenizer, record, documents):
    """Recompute the loss on held-out documents; it must match the record and beat unigram."""
    stream = tokenize(tokenizer.backend_tokenizer, documents["test"])
    windows = random_windows(stream, 8, 256, torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()
    train = tokenize(tokenizer.backend_tokenizer, documents["train"])
    freq = torch.bincount(train, minlength=model.config.vocab_size).float() + 1
    unigram = -(freq / freq.sum()).log()[windows[:, 1:]].mean().item()
    assert abs(loss - record["heldout_test_loss"]) < 0.3
    assert loss < unigram - 1.5, f"held-out loss {loss:.2f} vs unigram {unigram:.2f}"


def test_greedy_continuation_is_english(model, tokenizer, documents):
    ids = tokenizer("The for statement is used to", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    known = english_words(documents)
    assert len(words) >= 10, text
    assert sum(w in known for w in words) / len(words) >= 0.9, text

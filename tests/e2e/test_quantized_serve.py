"""`vllm serve --device neuron --quantization fp8 --kv-cache-dtype fp8`: FP8 weights quantized
at load and an FP8 KV cache, in a real server process, with the official `openai` client.
Oracle: Transformers' full-precision loss on the demo's held-out documents, which the
server's prompt logprobs must come within 2 % of (tests/engine/test_quantized.py holds the
formats to greedy parity)."""

import os

import openai
import pytest
import torch
from conftest import VENV_BIN, free_port, start_server
from train_demo import heldout_windows
from transformers import AutoModelForCausalLM

from neuron_serve.models import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    port = free_port()
    cmd = [str(VENV_BIN / "vllm"), "serve", str(DEMO_MODEL_DIR), "--device", "neuron",
           "--port", str(port), "--served-model-name", "demo", "--quantization", "fp8",
           "--kv-cache-dtype", "fp8", "--max-model-len", "512", "--max-num-seqs", "4",
           "--kv-cache-memory-bytes", str(64 << 20)]
    server = start_server(cmd, port, tmp_path_factory.mktemp("logs") / "vllm-fp8.log",
                          env={**os.environ, "NEURON_SERVE_COMPILE_MODE": "eager"})
    yield server
    server.stop()


def test_fp8_weights_and_kv_cache_serve_within_the_loss_bound(fp8_server):
    window = heldout_windows(1)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(input_ids=window, labels=window).loss.item()
    client = openai.OpenAI(base_url=f"{fp8_server.base_url}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    resp = client.completions.create(model="demo", prompt=window[0].tolist(), max_tokens=8,
                                     temperature=0, extra_body={"prompt_logprobs": 0})
    ids = window[0].tolist()
    entries = resp.choices[0].prompt_logprobs[1:]  # the first token has none
    loss = -sum(entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])) / len(entries)
    assert abs(loss - reference) <= 0.02 * reference, (loss, reference)
    assert resp.usage.completion_tokens == 8
    log = fp8_server.log_path.read_text()
    assert "fp8" in log and "Fp8WeightKernel" in log  # vLLM names the kernel it picked

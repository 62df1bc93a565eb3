"""`neuron-serve serve` on a real port, queried with the official `openai` client.

Oracle: Transformers' greedy generation on the same checkpoint.
"""

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["The return statement", "A list is a sequence of"]
NEW_TOKENS = 12


def hf_greedy(path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def test_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(client, tiny_llama, prompt):
    prompt_ids, expected = hf_greedy(tiny_llama, prompt, NEW_TOKENS)
    resp = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == expected
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == NEW_TOKENS


def test_stream_concatenates_to_the_same_text(client):
    args = dict(model="tiny", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"min_tokens": NEW_TOKENS})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text_where_transformers_text_has_it(client, tiny_llama):
    """The stop string is a piece of the greedy continuation itself (tokens 6-7), so the
    answer is that continuation up to its first occurrence, finish_reason "stop"."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    _, expected = hf_greedy(tiny_llama, PROMPTS[1], NEW_TOKENS)
    full, stop = tok.decode(expected), tok.decode(expected[5:7]).strip()
    assert stop and stop in full
    resp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=NEW_TOKENS,
                                     temperature=0, stop=[stop], extra_body={"min_tokens": 4})
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_batch_of_prompts_n_and_seed(client):
    args = dict(model="tiny", prompt=PROMPTS, n=2, max_tokens=6, seed=7, temperature=1.0,
                extra_body={"min_tokens": 6, "return_token_ids": True})
    first, again = client.completions.create(**args), client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
    assert first.usage.completion_tokens == 4 * 6
    tokens = [c.token_ids for c in sorted(first.choices, key=lambda c: c.index)]
    assert tokens == [c.token_ids for c in sorted(again.choices, key=lambda c: c.index)]
    assert tokens[0] != tokens[1]  # two samples of one prompt, not one sample twice


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "nope" in err.value.body["message"] and err.value.body["param"] == "model"


def test_prompt_longer_than_context_is_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=1)
    assert "maximum context length is 512" in err.value.body["message"]


def test_invalid_parameter_is_400_not_422(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=5)
    assert err.value.body["param"] == "temperature"
    assert err.value.body["type"] == "invalid_request_error"


def test_vllm_serve_device_neuron_matches_transformers(vllm_server, tiny_llama):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        _, expected = hf_greedy(tiny_llama, prompt, NEW_TOKENS)
        resp = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
        assert resp.choices[0].token_ids == expected
    assert "NeuronPlatform" in vllm_server.log_path.read_text() or "neuron platform" in \
        vllm_server.log_path.read_text()


def test_chat_and_completions_text_identical_to_vllm_serve(vllm_server, tiny_server):
    """Same checkpoint, same greedy request, through vLLM's own server and ours."""
    ours, theirs = (openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
                    for s in (tiny_server, vllm_server))
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    chat = [c.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body={"min_tokens": NEW_TOKENS})
            for c in (ours, theirs)]
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content
    assert chat[0].usage.prompt_tokens == chat[1].usage.prompt_tokens
    for prompt in PROMPTS:
        text = [c.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                     temperature=0, stop=["\n\n"]).choices[0].text
                for c in (ours, theirs)]
        assert text[0] == text[1]


def test_vllm_serve_rejects_an_overlong_prompt_and_keeps_serving(vllm_server):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=1)
    assert "512" in err.value.message
    ok = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_vllm_serve_without_device_flag_does_not_activate_us(tiny_llama, tmp_path):
    """No --device, no NEURON_SERVE_DEVICE, no Trainium: vLLM keeps its own CPU platform."""
    import os
    import subprocess
    import time

    from conftest import VENV_BIN, free_port

    log = tmp_path / "plain_vllm.log"
    env = {**os.environ, "NEURON_SERVE_DEVICE": ""}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(VENV_BIN / "vllm"), "serve", str(tiny_llama), "--port",
                                 str(free_port())], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while "Initializing a V1 LLM engine" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = log.read_text()
    assert "Initializing a V1 LLM engine" in text, text[-3000:]
    assert "[cpu.py:" in text  # vLLM's CpuPlatform configured the engine...
    assert "neuron platform (" not in text  # ...and ours never did

"""`/v1/chat/completions`, `/tokenize`, `/detokenize`, `/ready`, `/version` on a real
server, with the official `openai` client. Oracle: Transformers' chat template and greedy
decoding on the same checkpoint."""

import asyncio
import http.client
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does a list hold?"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def hf_chat(path, messages, n: int) -> tuple[list[int], str]:
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ids[0].tolist(), tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat_args(**kw) -> dict:
    return dict(model="tiny", messages=MESSAGES, max_completion_tokens=NEW_TOKENS, temperature=0,
                extra_body={"min_tokens": NEW_TOKENS}, **kw)


def test_chat_applies_the_template_and_matches_transformers(client, tiny_llama):
    prompt_ids, expected = hf_chat(tiny_llama, MESSAGES, NEW_TOKENS)
    resp = client.chat.completions.create(**chat_args())
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == NEW_TOKENS


def test_chat_stream_starts_with_the_role_and_adds_up_to_the_same_text(client):
    whole = client.chat.completions.create(**chat_args()).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **chat_args()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n_and_seed_through_the_async_client(tiny_server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                                    max_retries=0)
        args = dict(model="tiny", messages=MESSAGES, n=2, max_completion_tokens=8, seed=3,
                    temperature=1.0, extra_body={"min_tokens": 8})
        return await asyncio.gather(client.chat.completions.create(**args),
                                    client.chat.completions.create(**args))
    first, again = asyncio.run(run())
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 16


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None),  # not a multimodal model
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_tokens"),
    ({}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(tiny_server, body, param):
    resp = httpx.post(f"{tiny_server.base_url}/v1/chat/completions",
                      json={"model": "tiny", **body}, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_chat_with_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**chat_args(), "model": "gpt-9"})


def test_tokenize_and_detokenize_round_trip(tiny_server, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    url = tiny_server.base_url
    text = "A list is a sequence of"
    out = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert out["tokens"] == tok(text).input_ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512
    back = httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": out["tokens"]}).json()
    assert back["prompt"] == tok.decode(out["tokens"])
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == hf_chat_ids(tok)


def hf_chat_ids(tok) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
    ("/tokenize", {}, "prompt"),
])
def test_bad_tokenize_requests_are_400(tiny_server, path, body, param):
    resp = httpx.post(f"{tiny_server.base_url}{path}", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_ready_and_version(tiny_server):
    assert httpx.get(f"{tiny_server.base_url}/ready").status_code == 200
    version = httpx.get(f"{tiny_server.base_url}/version").json()
    assert version["version"] == __import__("neuron_serve").__version__
    assert version["vllm"].startswith("0.32.0")


def test_streamed_usage_chunk_counts_every_token(client):
    chat = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, n=2, seed=1,
        **{**chat_args(), "temperature": 1.0}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 2 * NEW_TOKENS
    assert chat[-1].usage.total_tokens == chat[-1].usage.prompt_tokens + 2 * NEW_TOKENS
    assert all(c.usage is None for c in chat[:-1])
    text = list(client.completions.create(
        model="tiny", prompt=["A list", "The return statement"], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"min_tokens": 5}))
    assert text[-1].choices == [] and text[-1].usage.completion_tokens == 10
    assert {c.choices[0].index for c in text[:-1]} == {0, 1}


def test_a_request_vllm_itself_rejects_is_400_not_500(client):
    with pytest.raises(openai.BadRequestError) as err:  # n > 1 needs sampling in vLLM
        client.chat.completions.create(n=2, **chat_args())
    assert "greedy" in err.value.body["message"]


def test_a_400_keeps_the_connection_for_the_next_request(tiny_server):
    """A client's pooled connection must outlive an error answer (uvicorn closed it,
    unannounced, whenever the error was re-raised past the handler that answered it)."""
    conn = http.client.HTTPConnection(*tiny_server.base_url.split("//")[1].split(":"))
    headers = {"Content-Type": "application/json"}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "n": 2}), headers)
    rejected = conn.getresponse()
    assert rejected.status == 400 and rejected.getheader("connection") != "close"
    assert "greedy" in json.loads(rejected.read())["error"]["message"]
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    assert conn.getresponse().status == 200  # the same socket: http.client never reconnects
    conn.close()


def hf_logprobs(path, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """Log-softmax of Transformers' logits at each generated position."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + new_ids])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)


def test_completion_logprobs_match_transformers(client, tiny_llama):
    resp = client.completions.create(model="tiny", prompt="A list is a sequence of", max_tokens=4,
                                     temperature=0, logprobs=3,
                                     extra_body={"min_tokens": 4, "return_token_ids": True})
    choice = resp.choices[0]
    expected = hf_logprobs(tiny_llama, choice.prompt_token_ids, choice.token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for step, token in enumerate(choice.token_ids):
        assert abs(lp.token_logprobs[step] - expected[step, token].item()) < 1e-4
        assert len(lp.top_logprobs[step]) >= 3
        assert max(lp.top_logprobs[step].values()) == pytest.approx(lp.token_logprobs[step])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text


def test_chat_logprobs_list_the_top_alternatives(client):
    resp = client.chat.completions.create(logprobs=True, top_logprobs=2, **chat_args())
    content = resp.choices[0].logprobs.content
    assert len(content) == NEW_TOKENS
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = list(client.chat.completions.create(stream=True, logprobs=True, top_logprobs=2,
                                                   **chat_args()))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]

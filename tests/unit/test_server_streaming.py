"""Server-sent events, in process: `data: <json>` events ending with `data: [DONE]`, chat's
role chunk per choice, the usage chunk, in-band errors, and streamed pieces adding up to
the whole response. End to end: tests/e2e/test_serve.py, test_chat_and_tokenize.py,
test_lifecycle.py (the in-band timeout error)."""

import json

import pytest
from fastapi.testclient import TestClient
from server_fakes import SERVED, engine, sse_chunks, sse_events, tokenizer  # noqa: F401 - fixtures

from neuron_serve.server.app import build_app

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does a list hold?"}]
COMPLETION = {"model": SERVED, "prompt": "A list", "max_tokens": 3}
CHAT = {"model": SERVED, "messages": MESSAGES, "max_completion_tokens": 3}
IN_BAND_ERROR = {"error": {"message": "internal server error", "type": "server_error"}}


@pytest.fixture
def client(engine, tmp_path) -> TestClient:
    return TestClient(build_app(engine, [SERVED], profile_dir=str(tmp_path)))


def stream(client, path: str, body: dict) -> list[dict]:
    resp = client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    return sse_chunks(resp.text)


def texts_by_index(chunks: list[dict], field=lambda c: c["text"]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            out[c["index"]] = out.get(c["index"], "") + (field(c) or "")
    return out


def test_completion_stream_is_data_events_ending_with_done(client):
    chunks = stream(client, "/v1/completions", COMPLETION)
    whole = client.post("/v1/completions", json=COMPLETION).json()
    assert len(chunks) == 3 and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == SERVED for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert texts_by_index(chunks) == {0: whole["choices"][0]["text"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_chat_stream_starts_each_choice_with_the_assistant_role(client):
    body = {**CHAT, "n": 2}
    chunks = stream(client, "/v1/chat/completions", body)
    assert [c["choices"] for c in chunks[:2]] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}}] for i in (0, 1)]
    rest = [c["choices"][0] for c in chunks[2:]]
    assert rest and all("role" not in c["delta"] for c in rest)
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    whole = client.post("/v1/chat/completions", json=body).json()
    assert texts_by_index(chunks, lambda c: c["delta"].get("content")) == {
        c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert [c["finish_reason"] for c in rest if c.get("finish_reason")] == ["length", "length"]


@pytest.mark.parametrize("path,body,tokens", [  # 3 tokens per choice
    ("/v1/completions", {**COMPLETION, "prompt": ["A list", "The return statement"], "n": 2}, 12),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 6),
])
def test_include_usage_adds_a_last_chunk_without_choices(client, path, body, tokens):
    chunks = stream(client, path, {**body, "stream_options": {"include_usage": True}})
    whole = client.post(path, json=body).json()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == tokens
    assert all(c.get("usage") is None for c in chunks[:-1])


def test_include_usage_false_adds_no_usage_chunk(client):
    chunks = stream(client, "/v1/completions",
                    {**COMPLETION, "stream_options": {"include_usage": False}})
    assert all(c["choices"] and c["usage"] is None for c in chunks)


@pytest.mark.parametrize("path,body,before", [("/v1/completions", COMPLETION, 1),
                                              ("/v1/chat/completions", CHAT, 2)])
def test_engine_error_mid_stream_is_an_error_event_then_done(client, engine, path, body, before):
    engine.fail_after = 1
    resp = client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert len(events) == before + 2 and events[-1] == "[DONE]"
    assert json.loads(events[-2]) == IN_BAND_ERROR
    assert all("choices" in json.loads(e) for e in events[:before])


def test_streamed_logprobs_match_the_whole_response_offsets_included(client):
    body = {**COMPLETION, "prompt": [[5, 6], [7]], "n": 2, "echo": True, "logprobs": 2}
    whole = {c["index"]: c for c in client.post("/v1/completions", json=body).json()["choices"]}
    chunks = stream(client, "/v1/completions", body)
    for index, choice in whole.items():
        lp = choice["logprobs"]
        pieces = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert "".join(p["text"] for p in pieces) == choice["text"]
        assert [o for p in pieces for o in p["logprobs"]["text_offset"]] == lp["text_offset"]
        assert [t for p in pieces for t in p["logprobs"]["tokens"]] == lp["tokens"]
        for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert choice["text"][offset:offset + len(token)] == token
        assert all(len(top) == 3 for top in lp["top_logprobs"])  # the sampled token + 2


def test_chat_logprobs_streamed_and_whole_list_the_same_tokens(client):
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"][
        "content"]
    assert len(content) == 3
    for entry in content:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True)
        assert entry["bytes"] == list(entry["token"].encode())
    streamed = [e for c in stream(client, "/v1/chat/completions", body) for ch in c["choices"]
                if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert streamed == content

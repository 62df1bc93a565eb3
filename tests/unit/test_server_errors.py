"""Error responses in OpenAI's shape, in process, over stand-in serving objects: malformed
JSON and unknown routes, vLLM's own error results, refused fields, and engine failures as
500 without internals (in-band once a stream has begun). The errors vLLM's serving raises
for bad values: end to end, tests/e2e/test_serve.py, test_chat_and_tokenize.py."""

import asyncio

import pytest
from fastapi.testclient import TestClient
from server_fakes import SERVED, engine, sse_chunks, stand_in_app, tokenizer  # noqa: F401 - fixtures

MESSAGES = [{"role": "user", "content": "What does a list hold?"}]
COMPLETION = {"model": SERVED, "prompt": "A list", "max_tokens": 2}
CHAT = {"model": SERVED, "messages": MESSAGES, "max_tokens": 2}


@pytest.fixture
def client(engine, tmp_path) -> TestClient:
    app = asyncio.run(stand_in_app(engine, profile_dir=str(tmp_path)))
    return TestClient(app)  # raises what the app re-raises after answering


def error_of(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


@pytest.mark.parametrize("body", [b"{bad", b"", b'{"model": "tiny",}', b"[1, 2]"])
def test_malformed_json_is_400(client, body):
    resp = client.post("/v1/completions", content=body,
                       headers={"Content-Type": "application/json"})
    error_of(resp, 400, "bad_request")


def test_unknown_route_and_wrong_method_in_openai_shape(client):
    assert error_of(client.get("/v1/nothing"), 404, "not_found")["message"] == "Not Found"
    wrong = client.get("/v1/completions")
    assert error_of(wrong, 405, "method_not_allowed")["message"] == "Method Not Allowed"
    assert wrong.headers["allow"] == "POST"


def test_an_error_result_of_vllms_serving_keeps_its_status_and_param(client, engine):
    error = error_of(client.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"}),
                     404, "not_found")
    assert "gpt-9" in error["message"] and error["param"] == "model"
    assert not engine.requests


def test_a_refused_field_never_reaches_the_engine(client, engine):
    error = error_of(client.post("/v1/chat/completions", json={**CHAT, "store": True}),
                     400, "bad_request")
    assert error["param"] == "store" and not engine.requests


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
def test_engine_failure_is_500_without_internals(client, engine, path, body):
    engine.fail_after = 0
    resp = client.post(path, json=body)
    assert error_of(resp, 500, "internal_server_error")["message"] == "internal server error"
    for leak in ("Traceback", "worker failed", "EngineGenerateError", "server_fakes", ".py"):
        assert leak not in resp.text


def test_a_stream_failing_midway_reports_in_band_with_a_string_code_then_done(client, engine):
    engine.fail_after = 1
    resp = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status_code == 200
    chunks = sse_chunks(resp.text)
    assert "choices" in chunks[0]
    assert chunks[-1]["error"]["code"] == "internal_server_error"
    assert chunks[-1]["error"]["message"] == "internal server error"

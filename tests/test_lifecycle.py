"""The server's front door on a real port: API keys, request ids and access logs, body
size, admission (429), and draining on SIGTERM (503, in-flight streams finish, exit 0)."""

import concurrent.futures
import json
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import TEST_ENGINE_FLAGS, VENV_BIN, free_port, start_server

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
NEW_TOKENS = 400  # long enough for SIGTERM to land mid-stream


def serve(tiny_llama, tmp_path_factory, name: str, *flags: str):
    port = free_port()
    cmd = [str(VENV_BIN / "neuron-serve"), "serve", str(tiny_llama), "--port", str(port),
           "--served-model-name", "tiny", *TEST_ENGINE_FLAGS, *flags]
    return start_server(cmd, port, tmp_path_factory.mktemp("logs") / f"{name}.log")


@pytest.fixture(scope="module")
def guarded(tiny_llama, tmp_path_factory):
    server = serve(tiny_llama, tmp_path_factory, "guarded", "--api-key", KEY,
                   "--max-queued-requests", "4", "--max-request-body-bytes", "100000")
    yield server
    server.stop()


def test_api_key_is_required_on_the_api_but_not_on_probes(guarded):
    url = guarded.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        resp = httpx.get(f"{url}/v1/models", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == 401 and "API key" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_request_id_is_echoed_and_logged_as_json(guarded):
    resp = httpx.get(f"{guarded.base_url}/health", headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    assert len(httpx.get(f"{guarded.base_url}/health").headers["x-request-id"]) == 32
    time.sleep(0.5)
    lines = [json.loads(line) for line in guarded.log_path.read_text().splitlines()
             if line.startswith("{")]
    mine = [entry for entry in lines if entry["request_id"] == "abc-123"]
    assert mine and mine[0]["path"] == "/health" and mine[0]["status"] == 200


def test_oversized_body_is_413(guarded):
    resp = httpx.post(f"{guarded.base_url}/v1/completions", content=b"x" * 200_000,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert resp.status_code == 413
    assert "100000" in resp.json()["error"]["message"]


def test_overload_gets_429_with_retry_after_and_the_rest_succeed(guarded):
    def one(_):
        return httpx.post(f"{guarded.base_url}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "prompt": "A list", "max_tokens": 24,
                                "min_tokens": 24, "temperature": 0})
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(one, range(32)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 4
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert "--max-queued-requests" in rejected.json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses if r.status_code == 200)
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200


def wait_for_status(url: str, status: int, timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (resp := httpx.get(url)).status_code != status and time.monotonic() < deadline:
        time.sleep(0.01)
    return resp


def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_llama, tmp_path_factory):
    # One sequence at a time: the eight streams take eight generations' time, so the drain
    # outlasts the checks below on any machine.
    server = serve(tiny_llama, tmp_path_factory, "draining", "--drain-timeout", "120",
                   "--max-num-seqs", "1")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    started = threading.Semaphore(0)

    def stream(_):
        response = client.completions.create(
            model="tiny", prompt="A list is", max_tokens=NEW_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"min_tokens": NEW_TOKENS})
        started.release()  # headers received: admitted and in flight
        return list(response)[-1].usage.completion_tokens
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            for _ in range(8):
                assert started.acquire(timeout=120)
            server.proc.send_signal(signal.SIGTERM)
            ready = wait_for_status(f"{server.base_url}/ready", 503)
            during = httpx.post(f"{server.base_url}/v1/completions",
                                json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert [f.result(timeout=180) for f in futures] == [NEW_TOKENS] * 8
        assert during.status_code == 503 and during.headers["retry-after"] == "1"
        assert ready.status_code == 503
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()

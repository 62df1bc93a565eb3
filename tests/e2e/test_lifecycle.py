"""The server's front door on a real port: API keys, request ids and access logs, body
size, admission (429), request timeouts (504), client disconnects, memory under overload,
profiling, and draining on SIGTERM (503, in-flight streams finish, exit 0)."""

import asyncio
import concurrent.futures
import json
import signal
import socket
import threading
import time

import httpx
import openai
import psutil
import pyarrow.parquet as pq
import pytest
from conftest import TEST_ENGINE_FLAGS, VENV_BIN, free_port, metric, start_server

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
NEW_TOKENS = 400  # long enough for SIGTERM to land mid-stream


def serve(tiny_llama, tmp_path_factory, name: str, *flags: str):
    port = free_port()
    cmd = [str(VENV_BIN / "neuron-serve"), "serve", str(tiny_llama), "--port", str(port),
           "--served-model-name", "tiny", *TEST_ENGINE_FLAGS, *flags]
    return start_server(cmd, port, tmp_path_factory.mktemp("logs") / f"{name}.log")


REQUEST_TIMEOUT_S = 1
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_llama, tmp_path_factory):
    server = serve(tiny_llama, tmp_path_factory, "guarded", "--api-key", KEY,
                   "--max-queued-requests", "4", "--max-request-body-bytes", "100000",
                   "--profile-dir", str(tmp_path_factory.mktemp("profiles")))
    yield server
    server.stop()


def test_api_key_is_required_on_the_api_but_not_on_probes(guarded):
    url = guarded.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        resp = httpx.get(f"{url}/v1/models", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "unauthorized" and "API key" in resp.json()["error"]["message"]
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
    error = resp.json()["error"]
    assert error["code"] == "request_entity_too_large" and error["type"] == "invalid_request_error"
    assert "100000" in error["message"] and "--max-request-body-bytes" in error["message"]


def server_rss_bytes(server) -> int:
    """Resident memory of the server and its engine process."""
    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True)))


def test_overload_gets_429_with_retry_after_and_the_rest_succeed(guarded):
    """Limit 4, 32 concurrent requests, five rounds: 429s with Retry-After, the rest served
    in full, the server healthy, and memory flat from the second round to the last."""
    barrier = threading.Barrier(32)

    def one(client):
        barrier.wait()  # all 32 at once
        return client.post("/v1/completions", headers=AUTH,
                           json={"model": "tiny", "prompt": "A list", "max_tokens": 48,
                                 "min_tokens": 48, "temperature": 0})

    rss, served = [], []
    with httpx.Client(base_url=guarded.base_url, timeout=120,
                      limits=httpx.Limits(max_connections=64)) as client, \
            concurrent.futures.ThreadPoolExecutor(32) as pool:
        for _ in range(5):
            responses = list(pool.map(one, [client] * 32))
            codes = [r.status_code for r in responses]
            assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 4
            rejected = next(r for r in responses if r.status_code == 429)
            assert rejected.headers["retry-after"] == "1"
            assert "--max-queued-requests" in rejected.json()["error"]["message"]
            assert all(r.json()["usage"]["completion_tokens"] == 48
                       for r in responses if r.status_code == 200)
            rss.append(server_rss_bytes(guarded))
            served.append(codes.count(200))
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200
    growth = rss[-1] - rss[1]
    print(f"\noverload: served per round of 32 {served} (the rest 429); "
          f"server RSS per round (MiB) {[r >> 20 for r in rss]}")
    assert growth < 64 << 20, f"memory grew {growth >> 20} MiB over four overload rounds"


def generated_tokens_after_idle(base_url: str) -> float:
    """vllm:generation_tokens_total once nothing runs or waits (a request cut short stops
    adding tokens; one still generating would add all of them before going idle)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metric(base_url, "vllm:num_requests_running") == 0 and \
                metric(base_url, "vllm:num_requests_waiting") == 0:
            return metric(base_url, "vllm:generation_tokens_total")
        time.sleep(0.05)
    raise TimeoutError("the engine never went idle")


@pytest.fixture(scope="module")
def timed(tiny_llama, tmp_path_factory):
    """A short request timeout and one sequence at a time: a long request cannot finish.
    Eager: the timeout is the server's, and one sequence would need graphs of its own."""
    server = serve(tiny_llama, tmp_path_factory, "timed", "--request-timeout",
                   str(REQUEST_TIMEOUT_S), "--max-num-seqs", "1", "--compile-mode", "eager")
    yield server
    server.stop()


def test_request_timeout_is_504_and_stops_the_generation(timed):
    """128 prompts × 480 tokens, one sequence at a time, is over 60,000 decode steps: far
    more than 1 s on any machine; on timeout the answer is 504 and the engine stops."""
    body = {"model": "tiny", "prompt": ["A list"] * 128, "max_tokens": 480, "min_tokens": 480}
    before = generated_tokens_after_idle(timed.base_url)
    resp = httpx.post(f"{timed.base_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 504
    assert resp.json()["error"] == {"message": f"the request did not finish within "
                                    f"{REQUEST_TIMEOUT_S} s (--request-timeout)",
                                    "type": "server_error", "param": None, "code": "gateway_timeout"}
    assert generated_tokens_after_idle(timed.base_url) - before < 128 * 480

    with httpx.stream("POST", f"{timed.base_url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "--request-timeout" in json.loads(events[-2][6:])["error"]["message"]


def test_client_disconnect_aborts_the_request_in_the_engine(tiny_server):
    """Streamed and not: the client leaves early, the engine stops generating for it.
    128 × 480 tokens at 4 sequences a step is 15,360 steps: the margin for the abort to
    reach the engine is seconds, not the 480 steps of one choice (CI once generated all 480
    before a starved API process passed the abort on). The non-streamed abort goes through
    the API process's disconnect watch, which three clean-clone CI runs of the tiered suite
    saw land 5-40 s late, with the other worker busy: for it the test asks that the engine
    stopped before the end of the request, not within a quarter of it."""
    url = tiny_server.base_url
    body = {"model": "tiny", "prompt": "A list", "max_tokens": 480, "min_tokens": 480, "n": 128}
    # The first requests of a fresh server pay one-time costs in the API process (in the
    # tiered suite this test is often the shared server's first user): warm both paths.
    for stream in (False, True):
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={**body, "max_tokens": 1, "min_tokens": 1, "stream": stream})
    before = generated_tokens_after_idle(url)
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
        next(line for line in stream.iter_lines() if line.startswith("data: "))
    after_stream = generated_tokens_after_idle(url)
    assert 0 < after_stream - before < 128 * 480 // 4
    many = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(many), many))
        deadline = time.monotonic() + 60
        while metric(url, "vllm:generation_tokens_total") == after_stream:
            assert time.monotonic() < deadline, "the engine never started the request"
            time.sleep(0.02)
    assert 0 < generated_tokens_after_idle(url) - after_stream < 128 * 480


def test_64_concurrent_streaming_clients_all_complete(tiny_server):
    client = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=300)

    async def one(i: int) -> tuple[int, int, int]:
        want = 8 + i % 24
        stream = await client.completions.create(
            model="tiny", prompt=f"Item {i} of the list", max_tokens=want, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"min_tokens": want, "return_token_ids": True})
        streamed, usage = 0, None
        async for chunk in stream:
            streamed += sum(len(c.token_ids) for c in chunk.choices)
            usage = chunk.usage or usage
        return want, streamed, usage.completion_tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert all(want == streamed == usage for want, streamed, usage in results), results


def test_metrics_carry_vllms_names_and_ours(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)
    client.completions.create(model="tiny", prompt="A list", max_tokens=12,
                              extra_body={"min_tokens": 12})
    text = httpx.get(f"{tiny_server.base_url}/metrics").text
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"\n{gauge}{{" in text, gauge
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:e2e_request_latency_seconds"):
        assert metric(tiny_server.base_url, f"{histogram}_count") > 0, histogram
    assert metric(tiny_server.base_url, "vllm:prompt_tokens_total") > 0
    assert metric(tiny_server.base_url, "vllm:generation_tokens_total") >= 12
    assert metric(tiny_server.base_url, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(tiny_server.base_url, "neuron_serve:real_tokens_total") > 0


def test_profiling_writes_a_trace_and_a_parquet_table(guarded):
    url = guarded.base_url
    assert httpx.post(f"{url}/admin/profile/start").status_code == 401
    stop_first = httpx.post(f"{url}/admin/profile/stop", headers=AUTH)
    assert stop_first.status_code == 409 and "start" in stop_first.json()["error"]["message"]
    assert httpx.post(f"{url}/admin/profile/start", headers=AUTH).status_code == 200
    assert httpx.post(f"{url}/admin/profile/start", headers=AUTH).status_code == 409
    done = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": "A list", "max_tokens": 8})
    assert done.status_code == 200
    stopped = httpx.post(f"{url}/admin/profile/stop", headers=AUTH, timeout=120)
    assert stopped.status_code == 200
    [files] = stopped.json()["files"]
    trace = json.loads(open(files["trace"]).read())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    table = pq.read_table(files["operators"]).to_pylist()
    assert set(table[0]) == {"name", "calls", "self_cpu_us", "total_cpu_us", "input_shapes"}
    ops = [row for row in table if row["name"].startswith("aten::")]
    assert ops and all(r["calls"] > 0 and r["total_cpu_us"] >= r["self_cpu_us"] >= 0 for r in ops)
    assert any(r["input_shapes"] not in ("", "[]") for r in ops)


def wait_for_status(http: httpx.Client, url: str, status: int,
                    timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (resp := http.get(url)).status_code != status and time.monotonic() < deadline:
        time.sleep(0.01)
    return resp


STREAMS = 16


def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_llama, tmp_path_factory):
    # One sequence at a time: the drain lasts sixteen generations (13 s on a 2-core EPYC, 26 s
    # with two busy loops beside it) where the checks take 0.01 s. With eight (~3 s) a loaded
    # CI machine once reached /ready only after the drain had ended (connection refused); one
    # HTTP client made beforehand also spares each check a new client (20-40 ms idle).
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
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool, httpx.Client() as http:
            futures = [pool.submit(stream, i) for i in range(STREAMS)]
            for _ in range(STREAMS):
                assert started.acquire(timeout=120)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            ready = wait_for_status(http, f"{server.base_url}/ready", 503)
            during = http.post(f"{server.base_url}/v1/completions",
                               json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            checked = time.monotonic() - signalled
            assert [f.result(timeout=180) for f in futures] == [NEW_TOKENS] * STREAMS
        assert during.status_code == 503 and during.headers["retry-after"] == "1"
        assert during.json()["error"] == {"message": "the server is shutting down; retry on "
                                          "another replica", "type": "server_error",
                                          "param": None, "code": "service_unavailable"}
        assert ready.status_code == 503
        assert server.proc.wait(timeout=60) == 0
        print(f"\ndrain: checked {checked:.2f} s after SIGTERM; {STREAMS} streams × "
              f"{NEW_TOKENS} tokens finished, exit 0 {time.monotonic() - signalled:.1f} s after")
    finally:
        server.stop()

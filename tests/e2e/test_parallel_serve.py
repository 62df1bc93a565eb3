"""Tensor and data parallel as real server processes, `neuron-serve serve` and `vllm serve
--device neuron`, each on the tiny Llama.

* `--tensor-parallel-size 2`: the same greedy answers as one rank; a rank killed
  mid-serving stops the server (no hang), and ours says so on /health and exits 1.
* `--data-parallel-size 2` on `neuron-serve serve`: two engines behind one endpoint (vLLM's
  DP coordinator and load balancing). Oracles: the same greedy requests on a server with one
  engine, and vLLM's per-engine metrics (both engines finished requests). `vllm serve`'s
  own DP front end over our engines is test_multi_node.py's (its head there).

Eager throughout: the ranks' compiled numerics are tests/engine/test_tensor_parallel.py's;
this tests the processes and the routing."""

import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from conftest import greedy_texts, metric, serve_tiny

pytestmark = pytest.mark.slow

REQUESTS = 32


EAGER = {"neuron-serve": ["--compile-mode", "eager"], "vllm-serve": ["--enforce-eager"]}
# A dead engine is noticed once a second by ours, every 5 s by vLLM's watchdog.
EXIT_WITHIN_S = 30


def parallel_server(kind: str, checkpoint, log_dir, flags: list[str]):
    return serve_tiny(kind, checkpoint, log_dir, [*flags, *EAGER[kind]])


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve"])
def tp_server(request, tiny_llama, tmp_path_factory):
    server = parallel_server(request.param, tiny_llama, tmp_path_factory.mktemp("logs"),
                             ["--tensor-parallel-size", "2"])
    yield request.param, server
    server.stop()


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    server = parallel_server("neuron-serve", tiny_llama, tmp_path_factory.mktemp("logs"),
                             ["--data-parallel-size", "2",
                              "--profile-dir", str(tmp_path_factory.mktemp("profiles"))])
    yield server
    server.stop()


def test_both_engines_serve_and_answer_as_one_engine_does(dp_server, tiny_server):
    texts = greedy_texts(dp_server.base_url, REQUESTS)
    per_engine = [metric(dp_server.base_url, "vllm:request_success_total", engine=str(e))
                  for e in (0, 1)]
    assert sum(per_engine) >= REQUESTS and min(per_engine) > 0, per_engine
    ours = [metric(dp_server.base_url, "neuron_serve:real_tokens_total", engine=str(e),
                   model_name="tiny") for e in (0, 1)]  # ours, labelled as vLLM labels its own
    assert min(ours) > 0, ours
    assert texts == greedy_texts(tiny_server.base_url, REQUESTS)


def test_a_profile_records_every_engine(dp_server):
    assert httpx.post(f"{dp_server.base_url}/admin/profile/start").status_code == 200
    greedy_texts(dp_server.base_url, REQUESTS)
    stopped = httpx.post(f"{dp_server.base_url}/admin/profile/stop", timeout=120).json()
    traces = sorted(f["trace"] for f in stopped["files"])
    assert [t.rsplit("-", 2)[-2:] for t in traces] == \
        [["engine0", "rank0.trace.json"], ["engine1", "rank0.trace.json"]], traces
    assert all(Path(t).stat().st_size > 0 for t in traces)


def test_two_ranks_answer_as_one_does(tp_server, tiny_server):
    _, server = tp_server
    assert greedy_texts(server.base_url, REQUESTS) == \
        greedy_texts(tiny_server.base_url, REQUESTS)


def rank_process(server, rank: int) -> psutil.Process:
    """The worker of TP rank `rank`: vLLM titles it VLLM::Worker_TP<rank>."""
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if f"Worker_TP{rank}" in " ".join(proc.cmdline()):
            return proc
    raise LookupError(f"no TP{rank} worker under {server.proc.pid}")


def test_a_rank_killed_mid_serving_stops_the_server(tp_server):
    """Runs after the parity test on the same server, which it ends. vLLM cannot replace a
    lost rank: the server must stop (for its supervisor to restart it), not hang."""
    kind, server = tp_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=EXIT_WITHIN_S)
    stream = client.completions.create(model="tiny", prompt="the", max_tokens=400,
                                       extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))  # generating
    rank_process(server, 1).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError):  # the stream ends in an error, not in 400 tokens
        for _ in stream:
            pass
    health = set()
    while server.proc.poll() is None and time.monotonic() - killed < EXIT_WITHIN_S:
        try:
            health.add(httpx.get(f"{server.base_url}/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert server.proc.poll() is not None, f"still running {EXIT_WITHIN_S} s after the kill"
    if kind == "neuron-serve":  # vLLM's own server exits 0, its choice
        assert 503 in health, health
        assert server.proc.returncode == 1, server.log_tail()

"""Our own routes, in process: the probes, /version, /metrics and /admin/profile. The
OpenAI routes and /tokenize are vLLM's serving classes: tests/e2e. Profiling end to end:
tests/e2e/test_lifecycle.py."""

import asyncio

import pytest
from fastapi.testclient import TestClient
from server_fakes import engine, stand_in_app, tokenizer  # noqa: F401 - fixtures


@pytest.fixture
def client(engine, tmp_path) -> TestClient:
    return TestClient(asyncio.run(stand_in_app(engine, profile_dir=str(tmp_path))))


def test_probes_and_version(client):
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    version = client.get("/version").json()
    assert version["version"] == __import__("neuron_serve").__version__
    assert version["vllm"] == __import__("vllm").__version__


def test_metrics_are_prometheus_text_with_the_workers_stats_asked_for(client, engine):
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert ("graph_stats", ()) in engine.rpc_calls


def test_profile_start_and_stop_alternate(client, engine, tmp_path):
    engine.rpc_results["stop_step_profile"] = [{"trace": "t.json", "operators": "o.parquet"}]
    stop_first = client.post("/admin/profile/stop")
    assert stop_first.status_code == 409 and "start" in stop_first.json()["error"]["message"]
    assert client.post("/admin/profile/start").json() == {"directory": str(tmp_path)}
    assert client.post("/admin/profile/start").status_code == 409
    stopped = client.post("/admin/profile/stop")
    assert stopped.json() == {"files": [{"trace": "t.json", "operators": "o.parquet"}]}
    assert [m for m, _ in engine.rpc_calls] == ["start_step_profile", "stop_step_profile"]
    assert engine.rpc_calls[0][1] == (str(tmp_path),)

"""/tokenize, /detokenize, /v1/models, the probes and /admin/profile, in process. End to
end: tests/e2e/test_chat_and_tokenize.py, test_serve.py, test_lifecycle.py (profiling)."""

import pytest
from fastapi.testclient import TestClient
from server_fakes import MAX_MODEL_LEN, SERVED, VOCAB, engine, tokenizer  # noqa: F401 - fixtures

from neuron_serve.server.app import build_app

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does a list hold?"}]
TEXT = "A list is a sequence of"


@pytest.fixture
def client(engine, tmp_path) -> TestClient:
    return TestClient(build_app(engine, [SERVED, "alias"], profile_dir=str(tmp_path)))


def bad_request(resp, param: str) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


def test_tokenize_and_detokenize_round_trip(client, tokenizer):
    out = client.post("/tokenize", json={"model": SERVED, "prompt": TEXT}).json()
    assert out == {"count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tokenizer.encode(TEXT)}
    back = client.post("/detokenize", json={"model": SERVED, "tokens": out["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(out["tokens"])} and back["prompt"].endswith(TEXT)


def test_tokenize_without_special_tokens_drops_bos(client, tokenizer):
    out = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert out["tokens"] == tokenizer.encode(TEXT)[1:]
    assert client.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"] == TEXT


def test_tokenize_messages_applies_the_chat_template(client, tokenizer):
    def template(generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    prompted = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    bare = client.post("/tokenize", json={"messages": MESSAGES,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert prompted == template(True) and bare == template(False) and prompted != bare


@pytest.mark.parametrize("body", [{"prompt": "x", "messages": MESSAGES}, {}])
def test_tokenize_needs_exactly_one_of_prompt_and_messages(client, body):
    assert "exactly one of prompt or messages" in bad_request(client.post("/tokenize", json=body),
                                                              "prompt")


@pytest.mark.parametrize("tokens,bad", [([5, 10**9], 10**9), ([-1, 5], -1), ([VOCAB], VOCAB)])
def test_detokenize_rejects_ids_outside_the_vocabulary(client, tokens, bad):
    message = bad_request(client.post("/detokenize", json={"tokens": tokens}), "tokens")
    assert f"[{bad}]" in message and f"[0, {VOCAB})" in message


def test_detokenize_accepts_the_last_id(client, tokenizer):
    resp = client.post("/detokenize", json={"tokens": [VOCAB - 1]})
    assert resp.status_code == 200 and resp.json()["prompt"] == tokenizer.decode([VOCAB - 1])


def test_models_lists_every_served_name(client):
    out = client.get("/v1/models").json()
    assert out["object"] == "list"
    assert [(m["id"], m["object"], m["root"], m["max_model_len"]) for m in out["data"]] == [
        (SERVED, "model", "/models/tiny", MAX_MODEL_LEN), ("alias", "model", "/models/tiny",
                                                            MAX_MODEL_LEN)]


def test_every_served_name_is_accepted(client):
    resp = client.post("/v1/completions", json={"model": "alias", "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 200 and resp.json()["model"] == "alias"


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

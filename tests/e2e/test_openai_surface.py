"""The rest of the OpenAI surface on a real server with the official `openai` client:
prompt logprobs against Transformers (both servers), the Responses API (both servers),
and on `neuron-serve serve` the refusal of every OpenAI request field it would not honour
and the shape of every body and stream chunk against OpenAI's published schemas
(tests/data/openai_schemas.json, from github.com/openai/openai-openapi)."""

import json
import math
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from oracles import hf_model

pytestmark = pytest.mark.slow

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "openai_schemas.json").read_text())
PROMPT = list(range(20, 170))  # 150 tokens: prefilled in chunks of the 64-token step
TOP = 3
LOGPROB_TOLERANCE = 2e-3  # float32 weights; ours and Transformers' kernels sum differently


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve"])
def any_server(request):
    return request.getfixturevalue("tiny_server" if request.param == "neuron-serve" else "vllm_server")


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row i: the distribution of token i + 1


# ---- prompt logprobs ----------------------------------------------------------------------


def test_echo_with_logprobs_gives_the_prompts_logprobs(any_server, tiny_llama):
    expected = hf_prompt_logprobs(tiny_llama, PROMPT)
    resp = client_of(any_server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=TOP)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs[0] is None  # the first token has no context
    for i in range(1, len(PROMPT)):
        want = expected[i - 1, PROMPT[i]].item()
        assert math.isclose(lp.token_logprobs[i], want, abs_tol=LOGPROB_TOLERANCE), i
        # Keyed by text, so tokens that decode alike share an entry: none beats their best.
        assert lp.top_logprobs[i]
        assert max(lp.top_logprobs[i].values()) <= expected[i - 1].max().item() + LOGPROB_TOLERANCE


def test_prompt_logprobs_extra_matches_transformers(any_server, tiny_llama):
    expected = hf_prompt_logprobs(tiny_llama, PROMPT)
    resp = client_of(any_server).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": TOP})
    rows = resp.choices[0].model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        got = {int(t): v["logprob"] for t, v in rows[i].items()}
        assert math.isclose(got[PROMPT[i]], expected[i - 1, PROMPT[i]].item(), abs_tol=LOGPROB_TOLERANCE)
        for token in expected[i - 1].topk(TOP).indices.tolist():
            assert math.isclose(got[token], expected[i - 1, token].item(), abs_tol=LOGPROB_TOLERANCE)


def test_prompt_logprobs_beside_other_requests(tiny_server, tiny_llama):
    """Batched with requests that want none: each gets its own rows, the others none."""
    import asyncio

    expected = hf_prompt_logprobs(tiny_llama, PROMPT[:40])
    client = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)

    async def both():
        return await asyncio.gather(
            client.completions.create(model="tiny", prompt=PROMPT[:40], max_tokens=8, temperature=0,
                                      extra_body={"prompt_logprobs": 0}),
            client.completions.create(model="tiny", prompt=PROMPT[5:90], max_tokens=8, temperature=0))
    wanted, plain = asyncio.run(both())
    rows = wanted.choices[0].model_extra["prompt_logprobs"]
    got = [next(iter(r.values()))["logprob"] if r else None for r in rows]
    assert got[0] is None
    assert got[1:] == pytest.approx([expected[i - 1, PROMPT[i]].item() for i in range(1, 40)],
                                    abs=LOGPROB_TOLERANCE)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


# ---- the Responses API ------------------------------------------------------------------


def test_responses_api_text_in_text_out(any_server):
    client = client_of(any_server)
    resp = client.responses.create(model="tiny", input="Say something.", max_output_tokens=8,
                                   temperature=0)
    assert resp.status in ("completed", "incomplete") and resp.output_text
    text, done = "", None
    with client.responses.stream(model="tiny", input="Say something.", max_output_tokens=8,
                                 temperature=0) as events:
        for event in events:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.completed":
                done = event.response
    assert done is not None and text == done.output_text == resp.output_text


# ---- no silently ignored field ----------------------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
# (endpoint, field, a value refused, a value honoured)
REFUSED = [
    ("chat", "audio", {"voice": "alloy", "format": "wav"}, None),
    ("chat", "modalities", ["text", "audio"], ["text"]),
    ("chat", "functions", [{"name": "f", "parameters": {}}], []),
    ("chat", "function_call", "auto", None),
    ("chat", "prediction", {"type": "content", "content": "Hi"}, None),
    ("chat", "web_search_options", {"search_context_size": "low"}, None),
    ("chat", "moderation", {"model": "omni-moderation-latest"}, None),
    ("chat", "store", True, False),
    ("chat", "service_tier", "flex", "auto"),
    ("chat", "verbosity", "low", "medium"),
    ("chat", "prompt_cache_retention", "24h", "in-memory"),
    ("chat", "prompt_cache_options", {"mode": "explicit"}, None),
    ("chat", "stream_options", {"include_obfuscation": True}, {"include_usage": True}),
    ("completions", "best_of", 3, 1),
]


@pytest.mark.parametrize("endpoint,field,refused,honoured", REFUSED,
                         ids=[f"{e}-{f}" for e, f, *_ in REFUSED])
def test_a_field_not_honoured_is_a_400_naming_it(tiny_server, endpoint, field, refused, honoured):
    url = f"{tiny_server.base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    body = CHAT if endpoint == "chat" else COMPLETION
    extra = {"stream": True} if field == "stream_options" else {}
    bad = httpx.post(url, json={**body, **extra, field: refused}, timeout=60)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == field and field in error["message"]
    ok = httpx.post(url, json={**body, **extra, field: honoured}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_fields_outside_openais_schema_stay_accepted(tiny_server):
    resp = httpx.post(f"{tiny_server.base_url}/v1/chat/completions",
                      json={**CHAT, "x_new_field_from_the_future": 1}, timeout=60)
    assert resp.status_code == 200


# ---- OpenAI's response schemas ------------------------------------------------------------


def conforms(body: dict, schema: str, relax_finish_reason: bool = False) -> None:
    root = {"$ref": f"#/components/schemas/{schema}", "components": SCHEMAS["components"]}
    if relax_finish_reason:  # OpenAI's own API sends null here, its schema says otherwise
        body = {**body, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                    for c in body["choices"]]}
    for choice in body.get("choices", ()) if schema == "CreateCompletionResponse" else ():
        lp = choice.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            # echo: OpenAI's own API gives the first prompt token null and no alternatives,
            # its schema a number and an object
            choice["logprobs"] = {**lp, "token_logprobs": [0.0, *lp["token_logprobs"][1:]],
                                  "top_logprobs": [{}, *lp["top_logprobs"][1:]]}
    jsonschema.validate(body, root)


def sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


CHAT_VARIANTS = [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "seed": 1, "temperature": 1.0},
                 {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                     "type": "object", "properties": {"a": {"type": "integer"}}}}}],
                  "tool_choice": "required", "max_tokens": 40}]
COMPLETION_VARIANTS = [{}, {"logprobs": 2}, {"echo": True, "logprobs": 1}, {"n": 2, "seed": 1}]


@pytest.mark.parametrize("variant", CHAT_VARIANTS, ids=["plain", "logprobs", "n", "tools"])
def test_chat_bodies_and_chunks_hold_against_openais_schema(tiny_server, variant):
    url = f"{tiny_server.base_url}/v1/chat/completions"
    conforms(httpx.post(url, json={**CHAT, **variant}, timeout=60).json(),
             "CreateChatCompletionResponse")
    stream = httpx.post(url, json={**CHAT, **variant, "stream": True,
                                   "stream_options": {"include_usage": True}}, timeout=60)
    for chunk in sse_chunks(stream):
        conforms(chunk, "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("variant", COMPLETION_VARIANTS, ids=["plain", "logprobs", "echo", "n"])
def test_completion_bodies_and_chunks_hold_against_openais_schema(tiny_server, variant):
    url = f"{tiny_server.base_url}/v1/completions"
    conforms(httpx.post(url, json={**COMPLETION, **variant}, timeout=60).json(),
             "CreateCompletionResponse")
    stream = httpx.post(url, json={**COMPLETION, **variant, "stream": True}, timeout=60)
    for chunk in sse_chunks(stream):
        if chunk["choices"]:
            conforms(chunk, "CreateCompletionResponse", relax_finish_reason=True)


@pytest.mark.parametrize("request_", [
    ("/v1/chat/completions", {**CHAT, "temperature": 9}),
    ("/v1/completions", {**COMPLETION, "model": "nope"}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 100000}),
    ("/v1/chat/completions", {**CHAT, "store": True}),
], ids=["invalid", "unknown-model", "too-long", "refused"])
def test_error_bodies_hold_against_openais_schema(tiny_server, request_):
    path, body = request_
    resp = httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=60)
    assert 400 <= resp.status_code < 500
    conforms(resp.json(), "ErrorResponse")

"""Structured outputs through a real server with the official `openai` client, on
`neuron-serve serve` and `vllm serve --device neuron` (the tiny Llama) and on the demo
model: `response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json,
regex, choice, grammar), greedy and sampled. Oracle: `jsonschema` and `re` on every sample;
a sample cut off by max_tokens counts as a failure (every valid output fits)."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 160
SAMPLES = 3  # n per request, sampled
# Bounded by a pattern of letters: xgrammar takes no maxLength beside a pattern, and a
# byte-level tokenizer's partial UTF-8 tokens would make a bare maxLength count bytes.
STR = {"type": "string", "pattern": "^[a-z]{0,6}$"}
INT = {"type": "integer", "minimum": -50, "maximum": 50}
NUM = {"type": "number", "minimum": 0, "maximum": 1}


def obj(required: bool = True, **props) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            **({"required": list(props)} if required else {})}


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS = {
    "string": obj(name=STR),
    "string length": obj(word={"type": "string", "maxLength": 4}),
    "integer range": obj(count=INT),
    "number range": obj(score=NUM),
    "exclusive bounds": obj(x={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 9}),
    "boolean": obj(ok={"type": "boolean"}),
    "null": obj(nothing={"type": "null"}),
    "enum": obj(color={"enum": ["red", "green", "blue"]}),
    "const": obj(kind={"const": "point"}, x=INT),
    "mixed scalars": obj(name=STR, age=INT, score=NUM, active={"type": "boolean"}),
    "bounded array": obj(tags=arr(STR, 1, 3)),
    "exact array": obj(pair=arr(INT, 2, 2)),
    "array of enums": obj(days=arr({"enum": ["mon", "tue", "wed"]}, 0, 2)),
    "nested object": obj(user=obj(name=STR, id=INT)),
    "deep nesting": obj(a=obj(b=obj(c=obj(d={"type": "boolean"})))),
    "array of objects": obj(points=arr(obj(x=INT, y=INT), 1, 2)),
    "optional fields": obj(required=False, nick=STR, age=INT),
    "some required": {**obj(id=INT, note=STR), "required": ["id"]},
    "nullable": obj(maybe={"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    "anyOf": obj(value={"anyOf": [INT, {"type": "boolean"}]}),
    "string pattern": obj(code={"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}),
    "nested arrays": obj(grid=arr(arr(INT, 1, 2), 1, 2)),
    "enum of numbers": obj(level={"enum": [1, 2, 3]}),
    "ref": {"$defs": {"pt": obj(x=INT, y=INT)}, **obj(a={"$ref": "#/$defs/pt"},
                                                      b={"$ref": "#/$defs/pt"})},
    "top-level array": arr(obj(id=INT), 1, 3),
}


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve", "demo"])
def server(request):
    name = request.param
    if name == "demo":
        return "demo", request.getfixturevalue("demo_server")
    return "tiny", request.getfixturevalue("tiny_server" if name == "neuron-serve" else "vllm_server")


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """`neuron-serve serve` on the embedded demo model (eager: these tests are about the
    grammar, not compiled numerics)."""
    from conftest import FRONTEND_FLAGS, VENV_BIN, free_port, start_server

    port = free_port()
    cmd = [str(VENV_BIN / "neuron-serve"), "serve", "--port", str(port), "--compile-mode",
           "eager", *FRONTEND_FLAGS]
    server = start_server(cmd, port, tmp_path_factory.mktemp("logs") / "demo_server.log")
    yield server
    server.stop()


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                              timeout=300)


def run_all(coros):
    async def gather():
        return await asyncio.gather(*coros)
    return asyncio.run(gather())


def texts_of(resp) -> list[str]:
    assert all(c.finish_reason == "stop" for c in resp.choices), \
        [(c.finish_reason, c.message.content) for c in resp.choices]
    return [c.message.content for c in resp.choices]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_validates(server, temperature):
    model, srv = server

    async def one(name, schema):
        client = aclient(srv)
        resp = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give me a {name}."}],
            max_completion_tokens=MAX_TOKENS, temperature=temperature, seed=7,
            n=1 if temperature == 0 else SAMPLES,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "out", "schema": schema, "strict": True}})
        return name, schema, texts_of(resp)

    results = run_all([one(n, s) for n, s in SCHEMAS.items()])
    assert len(results) >= 20
    for name, schema, texts in results:
        for text in texts:
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                pytest.fail(f"{name}: {text!r}: {exc}")


def test_json_object_is_an_object(server):
    """`response_format=json_object` leaves keys and nesting free, so no token budget fits
    every valid output: greedy, the text is a JSON object, or the start of one where it
    ran out of tokens."""
    model, srv = server
    resp = run_all([aclient(srv).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Some JSON please."}],
        max_completion_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"})])[0]
    text = resp.choices[0].message.content
    assert text.startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_and_grammar_hold_on_every_sample(server, endpoint):
    model, srv = server
    regex = r"[a-z]{2,5}-[0-9]{3}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'
    grammar_re = r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)"

    async def one(constraint):
        client = aclient(srv)
        extra = {"structured_outputs": constraint}
        common = dict(model=model, n=4, temperature=1.0, seed=11, max_tokens=40, extra_body=extra)
        if endpoint == "chat":
            resp = await client.chat.completions.create(
                messages=[{"role": "user", "content": "Answer."}], **common)
            return [(c.finish_reason, c.message.content) for c in resp.choices]
        resp = await client.completions.create(prompt="Answer:", **common)
        return [(c.finish_reason, c.text) for c in resp.choices]

    by_regex, by_choice, by_grammar = run_all(
        [one({"regex": regex}), one({"choice": choices}), one({"grammar": grammar})])
    for reason, text in by_regex:
        assert reason == "stop" and re.fullmatch(regex, text), text
    for reason, text in by_choice:
        assert reason == "stop" and text in choices, text
    for reason, text in by_grammar:
        assert reason == "stop" and re.fullmatch(grammar_re, text), text

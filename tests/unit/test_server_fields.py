"""server/fields.py against OpenAI's published request schemas (tests/data): every field of
the completions and chat-completions schemas is either one vLLM's request model knows (and
vLLM's serving classes honour) or one our rules decide; a refused value names its field."""

import json
from pathlib import Path

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from neuron_serve.server import fields
from neuron_serve.server.errors import ServerError

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "openai_schemas.json").read_text())


def openai_fields(name: str) -> set[str]:
    schemas = SCHEMAS["components"]["schemas"]
    node, names = schemas[name], set()
    for part in node.get("allOf", [node]):
        names |= openai_fields(part["$ref"].rsplit("/", 1)[1]) if "$ref" in part \
            else set(part.get("properties", {}))
    return names


@pytest.mark.parametrize("schema,model,rules", [
    ("CreateChatCompletionRequest", ChatCompletionRequest, fields.CHAT),
    ("CreateCompletionRequest", CompletionRequest, fields.COMPLETION)])
def test_every_openai_field_is_honoured_by_vllm_or_ruled_here(schema, model, rules):
    published = openai_fields(schema)
    assert len(published) > 15
    unknown_to_vllm = published - set(model.model_fields)
    assert unknown_to_vllm <= set(rules), unknown_to_vllm - set(rules)
    assert set(rules) <= published  # no rule for a field OpenAI does not have


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def request(field: str, value) -> ChatCompletionRequest:
    stream = {"stream": True} if field == "stream_options" else {}
    return ChatCompletionRequest(**CHAT, **stream, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("store", True), ("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["audio"]),
    ("service_tier", "priority"), ("verbosity", "high"), ("functions", [{"name": "f"}]),
    ("stream_options", {"include_obfuscation": True})])
def test_a_refused_value_is_a_400_naming_the_field(field, value):
    with pytest.raises(ServerError) as err:
        fields.refuse_unhonoured(request(field, value), fields.CHAT)
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


@pytest.mark.parametrize("field,value", [
    ("store", False), ("store", None), ("modalities", ["text"]), ("service_tier", "auto"),
    ("verbosity", "medium"), ("metadata", {"k": "v"}), ("user", "u1"),
    ("stream_options", {"include_usage": True}), ("prompt_cache_key", "abc")])
def test_defaults_and_values_that_change_nothing_pass(field, value):
    fields.refuse_unhonoured(request(field, value), fields.CHAT)


def test_best_of_is_honoured_only_as_n():
    base = {"model": "m", "prompt": "x"}
    fields.refuse_unhonoured(CompletionRequest(**base, n=2, best_of=2), fields.COMPLETION)
    with pytest.raises(ServerError):
        fields.refuse_unhonoured(CompletionRequest(**base, best_of=3), fields.COMPLETION)

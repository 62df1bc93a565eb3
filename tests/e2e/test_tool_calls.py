"""Tool calling through a real server with the official `openai` client, on
`neuron-serve serve` and `vllm serve --device neuron` (tiny Llama, `--enable-auto-tool-choice
--tool-call-parser hermes`). Oracle: the tools' JSON schemas (`jsonschema`), and vLLM's
Hermes parser reading back a call the model was made to write."""

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3,4}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve"])
def client(request):
    server = request.getfixturevalue("tiny_server" if request.param == "neuron-serve" else "vllm_server")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def create(client, stream: bool, **kw):
    """A chat completion with TOOLS; streamed ones are put back together from their deltas
    (checking each delta's shape on the way) into (finish_reason, content, calls)."""
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_completion_tokens=120,
                temperature=1.0, seed=5)
    if not stream:
        choice = client.chat.completions.create(**args, **kw).choices[0]
        calls = [(c.id, c.type, c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or ()]
        return choice.finish_reason, choice.message.content, calls
    calls: dict[int, list] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**args, **kw, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # the first delta of a call names it
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.id, delta.type, delta.function.name, ""]
                calls[delta.index][3] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return finish, content or None, [tuple(c) for _, c in sorted(calls.items())]


def check_calls(calls, names) -> None:
    assert calls, "no tool call"
    for call_id, kind, name, arguments in calls:
        assert call_id and kind == "function" and name in names
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_a_tool_with_valid_arguments(client, stream):
    finish, _, calls = create(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish in ("tool_calls", "stop")
    assert len(calls) == 1  # parallel_tool_calls=False: one call
    check_calls(calls, SCHEMA_OF)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_tool(client, stream):
    finish, _, calls = create(client, stream,
                              tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert finish in ("tool_calls", "stop")
    assert len(calls) == 1
    check_calls(calls, {"get_time"})


def test_none_answers_in_text(client):
    finish, content, calls = create(client, False, tool_choice="none")
    assert calls == [] and content is not None and finish in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_hermes_call_back_through_the_parser(client, stream):
    """tool_choice auto: the model writes free text the parser reads. Made to write a call
    (a regex over its output), the parser must return it as a tool call, not as text."""
    call = (r'<tool_call>\{"name": "get_weather", "arguments": '
            r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>')
    finish, content, calls = create(client, stream, tool_choice="auto",
                                    extra_body={"structured_outputs": {"regex": call}})
    assert finish == "tool_calls"
    assert not content
    check_calls(calls, {"get_weather"})


def test_tool_results_go_through_the_chat_template(client):
    """An assistant turn with tool_calls and a tool turn with its result: the server's
    rendering of them (/tokenize, then /detokenize) holds the call and the result, and the
    server answers the conversation."""
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_completion_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    rendered = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": follow,
                                                    "tools": TOOLS}, timeout=60)
    assert rendered.status_code == 200, rendered.text
    tokens = rendered.json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": tokens},
                      timeout=60).json()["prompt"]
    turn = text.split("<|assistant|>\n", 1)[1]  # the call, after the tools' instructions
    head = f'<tool_call>{{"name": "{call.function.name}", "arguments": '
    assert turn.startswith(head), turn[:200]
    rendered_arguments = turn[len(head):].split("}</tool_call>", 1)[0]
    assert json.loads(rendered_arguments) == json.loads(call.function.arguments)
    assert "<tool_response>sunny, 21 C</tool_response>" in text and "<tools>" in text
    second = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS,
                                            max_completion_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

"""`--reasoning-parser` through a real server with the official `openai` client, on
`neuron-serve serve` and `vllm serve --device neuron` (tiny Llama, whose tokenizer has
`<think>` and `</think>` tokens, with vLLM's `deepseek_r1` parser).

The model is made to write `REASONING</think>CONTENT`, as DeepSeek-R1 does after the `<think>`
its chat template opens (a regex, which `enable_in_reasoning` applies from the first token,
and a logit bias that picks the single `</think>` token as soon as the regex allows it).
Oracle: the same request on a server without a reasoning parser, whose `content` is the
unsplit text."""

import json
import re

import openai
import pytest
from conftest import serve_tiny
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

REGEX = r"[a-z]{3,12}</think>[a-z]{3,12}"
PARSER_FLAGS = ["--reasoning-parser", "deepseek_r1", "--structured-outputs-config",
                json.dumps({"backend": "xgrammar", "enable_in_reasoning": True})]


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve"])
def parsing_client(request, tiny_llama, tmp_path_factory):
    server = serve_tiny(request.param, tiny_llama, tmp_path_factory.mktemp("logs"),
                        PARSER_FLAGS)
    yield openai_client(server)
    server.stop()


@pytest.fixture(scope="module")
def request_args(tiny_llama) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    bias = {str(tokenizer.convert_tokens_to_ids("</think>")): 50}
    return dict(model="tiny", messages=[{"role": "user", "content": "Think, then answer."}],
                max_completion_tokens=40, temperature=0, logit_bias=bias,
                extra_body={"structured_outputs": {"regex": REGEX}})


@pytest.fixture(scope="module")
def unsplit(tiny_server, request_args) -> tuple[str, str]:
    """(reasoning, content) as the text a server without a parser returns them."""
    choice = openai_client(tiny_server).chat.completions.create(**request_args).choices[0]
    match = re.fullmatch(r"([a-z]+)</think>([a-z]+)", choice.message.content)
    assert match, choice.message.content
    return match.group(1), match.group(2)


def test_reasoning_is_split_from_content(parsing_client, request_args, unsplit):
    message = parsing_client.chat.completions.create(**request_args).choices[0].message
    assert (message.model_extra.get("reasoning"), message.content) == unsplit


def test_streamed_reasoning_is_split_from_content(parsing_client, request_args, unsplit):
    reasoning = content = ""
    for chunk in parsing_client.chat.completions.create(**request_args, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == unsplit

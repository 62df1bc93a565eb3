"""The README's main command (`make serve`) serves the demo model to the `openai` client."""

import re

import openai
import pytest

from conftest import REPO, free_port, start_server
from neuron_serve.models import DEMO_MODEL_DIR
from test_serve import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    port = free_port()
    server = start_server(["make", "-s", "-C", str(REPO), "serve", f"PORT={port}"], port,
                          tmp_path_factory.mktemp("logs") / "make_serve.log")
    yield server
    server.stop()


def test_main_command_answers_in_english_like_transformers(demo_server):
    client = openai.OpenAI(base_url=f"{demo_server.base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    prompt = "A list is a sequence of"
    resp = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"return_token_ids": True})
    text = resp.choices[0].text
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 5, text
    _, expected = hf_greedy(DEMO_MODEL_DIR, prompt, 24)
    got = resp.choices[0].token_ids
    if resp.choices[0].finish_reason == "stop":  # hf_greedy suppresses end-of-sequence
        got = got[:-1]
    assert got == expected[: len(got)]

"""Data parallel on one host: `--data-parallel-size 2` runs two engines behind one endpoint
(vLLM's DP coordinator and load balancing), on `neuron-serve serve` and `vllm serve
--device neuron`. Oracles: the same greedy requests on a server with one engine, and
vLLM's per-engine metrics (both engines finished requests)."""

import asyncio

import openai
import pytest
from conftest import metric, serve_tiny

pytestmark = pytest.mark.slow

REQUESTS = 32


@pytest.fixture(scope="module", params=["neuron-serve", "vllm-serve"])
def dp_server(request, tiny_llama, tmp_path_factory):
    # Eager: the engines' numerics are the single-engine server's; this tests the routing.
    server = serve_tiny(request.param, tiny_llama, tmp_path_factory.mktemp("logs"),
                        ["--data-parallel-size", "2", "--compile-mode", "eager"]
                        if request.param == "neuron-serve" else
                        ["--data-parallel-size", "2", "--enforce-eager"])
    yield request.param, server
    server.stop()


async def completions(base_url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                timeout=300)
    answers = await asyncio.gather(*(
        client.completions.create(model="tiny", prompt=f"request {i}: the", max_tokens=8,
                                  temperature=0) for i in range(REQUESTS)))
    return [a.choices[0].text for a in answers]


def test_both_engines_serve_and_answer_as_one_engine_does(dp_server, tiny_server):
    kind, dp_server = dp_server
    texts = asyncio.run(completions(dp_server.base_url))
    per_engine = [metric(dp_server.base_url, "vllm:request_success_total", engine=str(e))
                  for e in (0, 1)]
    assert sum(per_engine) >= REQUESTS and min(per_engine) > 0, per_engine
    if kind == "neuron-serve":  # ours, labelled as vLLM labels its own
        ours = [metric(dp_server.base_url, "neuron_serve:real_tokens_total", engine=str(e),
                       model_name="tiny") for e in (0, 1)]
        assert min(ours) > 0, ours
    assert texts == asyncio.run(completions(tiny_server.base_url))

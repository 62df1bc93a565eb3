"""The README's main command (`make serve`) serves the demo model to the `openai` client,
at once, and reaches full speed once its background compilers are done."""

import re
import time

import openai
import pytest
from conftest import REPO, free_port, metric, start_server
from oracles import english_words
from train_demo import build_documents

pytestmark = pytest.mark.slow


FULL_SPEED_BOUND_S = 600  # about 100 s on a quiet 2-core machine; here beside other tests


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    port = free_port()
    # As from a user's shell: under `make test ARGS=...` the outer make's variables reach
    # this make (through MAKEFLAGS and the environment), and pytest's flags the server's.
    # The device picks the compile mode, and the graphs start from an empty cache.
    shell = ["env", *(f"-u{name}" for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS",
                                                "MODEL", "COMPILE", "HOST", "PYTHON",
                                                "NEURON_SERVE_COMPILE_MODE")),
             f"NEURON_SERVE_CACHE_DIR={tmp_path_factory.mktemp('demo-graphs')}"]
    server = start_server([*shell, "make", "-s", "-C", str(REPO), "serve", f"PORT={port}"], port,
                          tmp_path_factory.mktemp("logs") / "make_serve.log")
    yield server
    server.stop()


def test_main_command_answers_in_english(demo_server):
    """Exact parity is tested in fp32 elsewhere; here the command runs as a user runs it
    (bf16 on CPUs with native bf16), so the oracle is the training text's vocabulary."""
    client = openai.OpenAI(base_url=f"{demo_server.base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    resp = client.completions.create(model="demo", prompt="A list is a sequence of",
                                     max_tokens=32, temperature=0)
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", resp.choices[0].text)]
    known = english_words(build_documents(seed=0))
    assert len(words) >= 8, resp.choices[0].text
    assert sum(w in known for w in words) / len(words) >= 0.9, resp.choices[0].text


def test_main_command_reaches_full_speed(demo_server):
    """Every graph compiled by the background processes and taken over by the server
    (between steps: requests keep it stepping); from then on no step runs eagerly."""
    client = openai.OpenAI(base_url=f"{demo_server.base_url}/v1", api_key="unused", max_retries=0)

    def count(name: str) -> float:
        return metric(demo_server.base_url, f"neuron_serve:{name}")
    needed = count("graphs_needed")
    assert needed == 9  # the demo's 17 buckets
    deadline = time.monotonic() + FULL_SPEED_BOUND_S
    while count("graphs_ready") < needed:
        assert time.monotonic() < deadline, demo_server.log_tail()
        assert "keep running eager" not in demo_server.log_path.read_text(), demo_server.log_tail()
        client.completions.create(model="demo", prompt="A tuple is", max_tokens=4)
        time.sleep(1)
    eager = count("eager_steps_total")
    assert eager > 0  # it answered before its graphs were ready
    client.completions.create(model="demo", prompt="A list is a sequence of", max_tokens=32)
    assert count("eager_steps_total") == eager
    # Handed over through the cache, compiled by the background processes.
    assert (count("graph_cache_hits_total"), count("graph_cache_misses_total")) == (needed, 0)

"""The compiled-graph cache with real servers in fresh processes, one cache directory per
scenario, counted through `/metrics`. Oracle for tokens: Transformers' greedy decoding.

The scenarios build on each other, in order: two servers racing on an empty directory;
a third start that hits every graph; corrupted entries rebuilt; other weights of the same
architecture hitting. `background` mode on an empty directory is tested on the README's
main command (test_main_command.py: every graph handed over through the cache, then no
eager step), on `vllm serve` while compiling (test_cold_start.py: Transformers' tokens),
and on an engine (test_tensor_parallel.py: Transformers' tokens through the graphs).
"""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import FEW_BUCKETS, VENV_BIN, RunningServer, engine_flags, free_port, start_server
from oracles import hf_greedy, prompts

from neuron_serve.graph_cache.store import GraphCache
from neuron_serve.models.tiny import write_checkpoint

pytestmark = pytest.mark.slow

ENGINE_FLAGS = engine_flags(FEW_BUCKETS)  # each scenario compiles from empty: few graphs
NUM_BUCKETS = 4
NEW_TOKENS = 10


def serve_cmd(model, port: int, cache_dir, *extra: str) -> list[str]:
    return [str(VENV_BIN / "neuron-serve"), "serve", str(model), "--port", str(port),
            "--served-model-name", "tiny", "--graph-cache-dir", str(cache_dir),
            *ENGINE_FLAGS, *extra]


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    totals: dict[str, float] = {}  # each series summed over its labels (engine, bucket)
    for m in re.finditer(r"^neuron_serve:(\w+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        totals[m[1]] = totals.get(m[1], 0.0) + float(m[2])
    return totals


def completion_tokens(server, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                    temperature=0, extra_body={"min_tokens": NEW_TOKENS,
                                                               "return_token_ids": True})
    return list(out.choices[0].token_ids)


def assert_serves_transformers_tokens(server, model) -> None:
    for prompt in prompts()[1:3]:  # 17 tokens; 150 tokens (chunked prefill, wide blocks)
        assert completion_tokens(server, prompt) == hf_greedy(model, prompt)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-graph-cache")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("cache-logs")


def test_two_servers_racing_on_an_empty_directory_compile_each_graph_once(tiny_llama, shared_dir, logs):
    ports = free_port(), free_port()
    servers = [RunningServer(serve_cmd(tiny_llama, port, shared_dir), port, logs / f"race{i}.log")
               for i, port in enumerate(ports)]
    try:
        for server in servers:
            server.wait_healthy()
        counts = [metrics(s) for s in servers]
        assert sum(c["graph_cache_misses_total"] for c in counts) == NUM_BUCKETS
        assert sum(c["graph_cache_hits_total"] for c in counts) == NUM_BUCKETS
        assert all(c["graphs_ready"] == NUM_BUCKETS for c in counts)
        for server in servers:
            assert_serves_transformers_tokens(server, tiny_llama)
    finally:
        for server in servers:
            server.stop()
    assert len(json.loads((shared_dir / "manifest.json").read_text())["entries"]) == NUM_BUCKETS


def test_a_second_start_in_a_fresh_process_compiles_nothing(tiny_llama, shared_dir):
    out = subprocess.run([str(VENV_BIN / "neuron-serve"), "compile", str(tiny_llama),
                          "--graph-cache-dir", str(shared_dir), *ENGINE_FLAGS],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{NUM_BUCKETS}/{NUM_BUCKETS} graphs ready for {NUM_BUCKETS} buckets: {NUM_BUCKETS} " \
           "loaded from the cache, 0 compiled" in out.stdout


def cache_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "neuron-serve"), "cache", *args],
                          capture_output=True, text=True, timeout=120)


def test_cache_commands_list_verify_and_move_the_cache(shared_dir, tmp_path):
    listing = cache_command("--dir", str(shared_dir), "ls").stdout
    assert f"{NUM_BUCKETS} graphs" in listing
    assert len(re.findall(r"LlamaForCausalLM t\d+-r\d+-b[*\d]+", listing)) == NUM_BUCKETS
    verify = cache_command("--dir", str(shared_dir), "verify")
    assert verify.returncode == 0 and f"{NUM_BUCKETS} ok, 0 evicted" in verify.stdout
    archive = tmp_path / "graphs.tar.gz"
    assert cache_command("--dir", str(shared_dir), "export", str(archive)).returncode == 0
    imported = cache_command("--dir", str(tmp_path / "other"), "import", str(archive))
    assert f"imported {NUM_BUCKETS} graphs" in imported.stdout
    assert cache_command("--dir", str(tmp_path / "other"), "verify").returncode == 0
    assert cache_command("--dir", str(tmp_path / "other"), "prune", "--max-gb", "0").returncode == 0
    assert "0 graphs" in cache_command("--dir", str(tmp_path / "other"), "ls").stdout


def corrupt_three_entries(cache_dir) -> None:
    manifest_path = cache_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    first, second, third = sorted(manifest["entries"])[:3]
    graph = lambda digest: cache_dir / "graphs" / f"{digest}.bin"  # noqa: E731
    graph(first).write_bytes(graph(first).read_bytes()[:100])  # truncated
    graph(second).write_bytes(os.urandom(graph(second).stat().st_size))  # garbage, same size
    manifest["entries"][third]["versions"]["torch"] = "1.0.0"  # built by another version
    manifest_path.write_text(json.dumps(manifest))


def test_corrupt_entries_are_rebuilt_with_a_warning(tiny_llama, shared_dir, logs):
    corrupt_three_entries(shared_dir)
    port = free_port()
    server = start_server(serve_cmd(tiny_llama, port, shared_dir), port, logs / "corrupt.log")
    try:
        counts = metrics(server)
        assert counts["graph_cache_misses_total"] == 3
        assert counts["graph_cache_hits_total"] == NUM_BUCKETS - 3
        log = server.log_path.read_text()
        for reason in ("truncated", "checksum mismatch", "built by"):
            assert re.search(f"WARNING.*evicting .*{reason}", log), reason
        assert_serves_transformers_tokens(server, tiny_llama)
    finally:
        server.stop()


def test_other_weights_of_the_same_architecture_hit_the_cache(shared_dir, logs, tmp_path):
    other = write_checkpoint("llama", tmp_path / "llama-seed1", seed=1)
    port = free_port()
    server = start_server(serve_cmd(other, port, shared_dir), port, logs / "other.log")
    try:
        counts = metrics(server)
        assert counts["graph_cache_hits_total"] == NUM_BUCKETS
        assert counts["graph_cache_misses_total"] == 0
        assert_serves_transformers_tokens(server, other)
    finally:
        server.stop()


HOLD_LOCK = """
import sys, time
from neuron_serve.graph_cache.store import GraphCache
with GraphCache(sys.argv[1]).lock("k"):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_the_lock_excludes_another_process_until_it_lets_go(tmp_path):
    cache = GraphCache(tmp_path / "cache")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(cache.root), "2"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with cache.lock("k", blocking=False) as got:
        assert not got
    start = time.monotonic()
    with cache.lock("k") as got:  # blocks until the holder exits
        assert got and time.monotonic() - start > 0.5
    holder.wait()

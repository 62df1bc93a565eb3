"""Cold start with real servers (issue 30): `vllm serve --device neuron` with no extra flags
answers while its graphs compile, with Transformers' tokens; SIGTERM ends a server whether
it is compiling ahead or serving beside background compilers, leaving neither a compile
process nor a damaged cache entry; `--require-precompiled` refuses an incomplete cache,
naming the command that fills it, and starts once that command has run."""

import os
import re
import shlex
import signal
import time

import httpx
import openai
import psutil
import pytest
from conftest import (
    FEW_BUCKETS,
    VENV_BIN,
    RunningServer,
    engine_flags,
    free_port,
    metric,
    start_server,
)
from oracles import hf_greedy, prompts

from neuron_serve.graph_cache.store import GraphCache

pytestmark = pytest.mark.slow

# Issue 30's goal is a first answer within 90 s on a 2-core machine; 3x for noisy ones.
# benchmarks/engine_start.py measures the real figure beside vLLM's CPU backend.
FIRST_ANSWER_BOUND_S = 270
EXIT_BOUND_S = 30  # the drain timeout


def device_default_env(cache_dir) -> dict[str, str]:
    env = dict(os.environ, NEURON_SERVE_CACHE_DIR=str(cache_dir))
    env.pop("NEURON_SERVE_COMPILE_MODE", None)  # the session's "ahead": here the device picks
    return env


def tokens(server, prompt: list[int], model: str = "tiny") -> list[int]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"min_tokens": 10, "return_token_ids": True})
    return list(out.choices[0].token_ids)


def compile_processes(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "neuron_serve.model_runner.compile_job" in " ".join(p.cmdline())]


def stop_with_sigterm(server, others: list[psutil.Process]) -> float:
    """SIGTERM to the server's own process, as Kubernetes sends it; seconds to exit. Every
    process in `others` must have exited too."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=EXIT_BOUND_S + 30)
    seconds = time.monotonic() - start
    _, alive = psutil.wait_procs(others, timeout=5)
    running = [p for p in alive if still_running(p)]
    assert not running, f"left running: {[(p.pid, p.name()) for p in running]}"
    return seconds


def still_running(process: psutil.Process) -> bool:
    """False once it has exited, reaped or not: an orphan's zombie waits for init to reap
    it (seen in CI), and has no command line left to read."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_cache_clean(cache_dir) -> None:
    cache = GraphCache(cache_dir)
    assert all(problem is None for problem in cache.verify().values())
    assert not list(cache_dir.rglob("*.tmp"))


def test_vllm_serve_with_no_flags_answers_while_compiling_then_stops_on_sigterm(tiny_llama, tmp_path):
    port = free_port()
    cmd = [str(VENV_BIN / "vllm"), "serve", str(tiny_llama), "--device", "neuron",
           "--port", str(port), "--served-model-name", "tiny"]
    start = time.monotonic()
    server = RunningServer(cmd, port, tmp_path / "vllm-serve.log",
                           env=device_default_env(tmp_path / "cache"))
    try:
        prompt = prompts()[1]
        while True:
            assert server.proc.poll() is None, server.log_tail()
            assert time.monotonic() - start < FIRST_ANSWER_BOUND_S, server.log_tail()
            try:
                first = tokens(server, prompt)
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        compilers = compile_processes(server)
        assert compilers, "the first answer should come while the graphs compile"
        assert first == hf_greedy(tiny_llama, prompt)
        long_prompt = prompts()[2]  # chunked prefill, wide blocks; still compiling
        assert tokens(server, long_prompt) == hf_greedy(tiny_llama, long_prompt)
        engine = psutil.Process(server.proc.pid).children(recursive=True)
        assert stop_with_sigterm(server, engine) < EXIT_BOUND_S
    finally:
        server.stop()
    assert_cache_clean(tmp_path / "cache")


def test_sigterm_during_an_ahead_compile_ends_the_server(tiny_llama, tmp_path):
    port = free_port()
    cache_dir = tmp_path / "cache"
    cmd = [str(VENV_BIN / "neuron-serve"), "serve", str(tiny_llama), "--port", str(port),
           "--compile-mode", "ahead", "--graph-cache-dir", str(cache_dir),
           *engine_flags(FEW_BUCKETS)]
    server = RunningServer(cmd, port, tmp_path / "ahead.log")
    try:
        deadline = time.monotonic() + 300
        while "graphs [" not in server.log_path.read_text(errors="replace"):  # one compiled
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.5)
        engine = psutil.Process(server.proc.pid).children(recursive=True)
        assert stop_with_sigterm(server, engine) < EXIT_BOUND_S
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base_url}/health", timeout=2)
    finally:
        server.stop()
    assert len(GraphCache(cache_dir).entries()) < 4  # stopped before every graph was built
    assert_cache_clean(cache_dir)


def test_require_precompiled_refuses_until_neuron_serve_compile_fills_the_cache(tiny_llama, tmp_path):
    import subprocess

    port = free_port()
    cache_dir = tmp_path / "cache"
    cmd = [str(VENV_BIN / "neuron-serve"), "serve", str(tiny_llama), "--port", str(port),
           "--served-model-name", "tiny", "--graph-cache-dir", str(cache_dir),
           "--require-precompiled", *engine_flags(FEW_BUCKETS)]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "lacks 4 of the 4 graphs" in log and "t1-r1-b*" in log, log[-3000:]
    command = shlex.split(re.search(r"neuron-serve compile .*$", log, re.M)[0])
    assert command[:3] == ["neuron-serve", "compile", str(tiny_llama)]
    filled = subprocess.run([str(VENV_BIN / "neuron-serve"), *command[1:]], capture_output=True,
                            text=True, timeout=600)
    assert filled.returncode == 0, filled.stderr[-3000:]
    assert "4/4 graphs ready" in filled.stdout
    server = start_server(cmd, port, tmp_path / "strict.log")
    try:
        assert metric(server.base_url, "neuron_serve:graphs_ready") == 4
        assert metric(server.base_url, "neuron_serve:graph_cache_misses_total") == 0
        prompt = prompts()[2]
        assert tokens(server, prompt) == hf_greedy(tiny_llama, prompt)
    finally:
        server.stop()

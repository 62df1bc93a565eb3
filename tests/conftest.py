"""Shared fixtures: tiny checkpoints built once per session, and real servers on real ports."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neuron_serve.models.tiny import FAMILIES, write_checkpoint

# Every vLLM engine this test session starts, in-process or in a child, runs on our platform.
os.environ["NEURON_SERVE_DEVICE"] = "neuron"
# Engines that compile have every graph before their first request: they test compiled
# numerics. The device's default (background on the emulated device) is tested on its own.
os.environ.setdefault("NEURON_SERVE_COMPILE_MODE", "ahead")  # eager: a quick local run
REPO = Path(__file__).resolve().parent.parent
# Scripts under tools/ (the demo's training data pipeline) are imported by tests as modules.
sys.path.insert(0, str(REPO / "tools"))

VENV_BIN = Path(sys.executable).parent
# A first start in `ahead` mode compiles every graph before it is healthy: the tiny model's 7
# take ~2.5 min on a 2-core AVX2 EPYC, the demo's 17 about 335 s. Below pytest's 900 s.
SERVER_START_TIMEOUT_S = 600
# Small bucket grid for tests, padding still exercised: 7 graphs (decode r1, r4 and tiled
# t64, each × block widths 4, 16; untiled t64-r4-b16), shared by every tiny-Llama engine.
TEST_BUCKETS = {"token_buckets": [64], "request_buckets": [1, 4], "block_buckets": [4, 16]}
# 4 graphs (t1-r1-b16, t4-r4-b16, t64-r4-b16-q32, t64-r4-b16) where the block-width
# buckets add nothing: cache scenarios that compile from empty.
FEW_BUCKETS = {**TEST_BUCKETS, "block_buckets": [16]}


def engine_flags(buckets: dict = TEST_BUCKETS) -> list[str]:
    return ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
            "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
            "--additional-config", json.dumps({"neuron": buckets})]


TEST_ENGINE_FLAGS = engine_flags()


FUZZ_CASES: Counter[str] = Counter()  # schemathesis cases generated (test_openapi_fuzz)


def pytest_runtest_logreport(report) -> None:
    """Collects the fuzz case counts a test records (`record_property("schemathesis_cases",
    {what: n})`), in pytest-xdist's controller too: reports reach it from the workers."""
    for name, value in report.user_properties if report.when == "call" else ():
        if name == "schemathesis_cases":
            FUZZ_CASES.update(value)


def pytest_terminal_summary(terminalreporter) -> None:
    for what, n in FUZZ_CASES.items():
        terminalreporter.write_line(f"schemathesis: {n} generated cases over {what}")


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of one Prometheus series on the server's /metrics over matching labels."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if (series == name or series.startswith(name + "{")) and \
                all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="session", autouse=True)
def graph_cache_dir(tmp_path_factory) -> Path:
    """One compiled-graph cache for the session, never the user's: engines of later tests
    load the graphs earlier ones compiled. pytest-xdist's workers share it (writes are
    atomic and locked: each graph is compiled once). Tests of the cache itself use their own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path = root / "graph-cache"
    path.mkdir(exist_ok=True)
    os.environ["NEURON_SERVE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random-weight checkpoint per family, written once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: write_checkpoint(family, root / family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> Path:
    return checkpoints["llama"]


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A server binds its port only after
    its engine is up, tens of seconds later; a port from the ephemeral range can be taken
    in between (seen: by a socket of another server's engine), one below it cannot."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10000, ephemeral_low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port


class RunningServer:
    """A server process started from a command line, reachable at `base_url`."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, cwd: Path = REPO,
                 env: dict[str, str] | None = None):
        self.port, self.log_path = port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    def wait_healthy(self, timeout: float = SERVER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def start_server(cmd: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> RunningServer:
    server = RunningServer(cmd, port, log_path, env=env)
    try:
        server.wait_healthy()
    except Exception:
        server.stop()
        raise
    return server


# Forced tool calls (required, named) constrained by the tools' JSON schemas, where vLLM's
# default, a Hermes structural tag, lets free whitespace into the arguments: a random-weight
# model emits it until max_tokens.
os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
# vLLM's frontend flags both servers take: Hermes tool calls (the tiny checkpoints' chat
# template renders tools in that format), and JSON without free whitespace, which a
# random-weight model would otherwise emit until max_tokens.
FRONTEND_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--structured-outputs-config",
                  json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]


def serve_tiny(kind: str, checkpoint: Path, log_dir: Path, flags: list[str]) -> RunningServer:
    """`neuron-serve serve` (kind "neuron-serve") or `vllm serve --device neuron` ("vllm-serve")
    on `checkpoint`, served as `tiny` with the test engine flags and `flags`."""
    port = free_port()
    head = {"neuron-serve": [str(VENV_BIN / "neuron-serve"), "serve", str(checkpoint)],
            "vllm-serve": [str(VENV_BIN / "vllm"), "serve", str(checkpoint), "--device", "neuron"]}
    cmd = [*head[kind], "--port", str(port), "--served-model-name", "tiny", *TEST_ENGINE_FLAGS,
           *flags]
    return start_server(cmd, port, log_dir / f"{kind}.log")


def greedy_texts(base_url: str, n: int = 32) -> list[str]:
    """`n` greedy completions sent at once through the official client (asyncio)."""
    import asyncio

    import openai

    async def send() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        answers = await asyncio.gather(*(
            client.completions.create(model="tiny", prompt=f"request {i}: the", max_tokens=8,
                                      temperature=0) for i in range(n)))
        return [a.choices[0].text for a in answers]
    return asyncio.run(send())


@pytest.fixture(scope="session")
def tiny_server(tiny_llama, tmp_path_factory) -> Iterator[RunningServer]:
    """`neuron-serve serve` on the tiny Llama checkpoint, served as `tiny`."""
    server = serve_tiny("neuron-serve", tiny_llama, tmp_path_factory.mktemp("logs"), FRONTEND_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_llama, tmp_path_factory) -> Iterator[RunningServer]:
    """vLLM's own OpenAI server, `vllm serve --device neuron`, on the same checkpoint."""
    server = serve_tiny("vllm-serve", tiny_llama, tmp_path_factory.mktemp("logs"), FRONTEND_FLAGS)
    yield server
    server.stop()

"""Beyond one machine, proven on one: two "nodes" with addresses of their own on loopback,
127.0.0.2 (the head) and 127.0.0.3, every process pinned to its node's address
(`VLLM_HOST_IP`, Ray's `--node-ip-address`, `--data-parallel-address`).

* Ray: a real two-node cluster, `ray start --head` and `ray start --address` for the
  second node, each declaring one NeuronCore (`neuron_cores`). The raylets start without
  neuron-serve's settings: only the runtime env our platform hands vLLM's Ray executor
  selects the platform in the worker actors. Tensor parallel 2 over the two nodes answers
  as one rank does; losing the worker node stops the server (503, exit 1), no hang; after
  the node and the server restart, it serves again.
* Multi-node data parallel with vLLM's flags: an API server with one engine on the head, a
  `--headless` node with the other; both engines serve. Each front end takes each role.
  Losing the headless node stops our head (503, exit 1) within a bounded time; vLLM's own
  head does not notice (it watches only its local engine processes), so that case is ours.

Eager engines: the numerics are the single-host tests'; these test placement and routing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import (
    TEST_ENGINE_FLAGS,
    VENV_BIN,
    RunningServer,
    free_port,
    greedy_texts,
    metric,
    start_server,
)

pytestmark = pytest.mark.slow

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
ONE_NEURON_CORE = '{"neuron_cores": 1}'
REQUESTS = 32
EXIT_WITHIN_S = 120  # Ray notices a lost node in seconds; vLLM's executor within 5 s more
SERVER = {"neuron-serve": [str(VENV_BIN / "neuron-serve"), "serve"],
          "vllm-serve": [str(VENV_BIN / "vllm"), "serve"]}
EAGER = {"neuron-serve": ["--compile-mode", "eager"],
         "vllm-serve": ["--device", "neuron", "--enforce-eager"]}


def node_env(address: str) -> dict[str, str]:
    """A node's environment: its own address, and none of neuron-serve's settings (the
    test session sets NEURON_SERVE_DEVICE; a real node has no reason to)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_SERVE_")}
    return {**env, "VLLM_HOST_IP": address}


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of `proc`'s session: a node's raylet, agents and actors."""
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                p.kill()
        except (ProcessLookupError, psutil.Error):
            pass
    proc.wait()


COUNT_NEURON_CORES = """
import sys, time, ray
ray.init(address=sys.argv[1], _node_ip_address=sys.argv[1].split(":")[0], logging_level="ERROR",
         log_to_driver=False)
n, deadline = float(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while sum(x["Resources"].get("neuron_cores", 0) for x in ray.nodes() if x["Alive"]) != n:
    if time.monotonic() > deadline:
        sys.exit(f"the live Ray nodes do not hold {n} neuron_cores: {ray.nodes()}")
    time.sleep(0.5)
"""


class RayCluster:
    """Two Ray nodes on this machine, each a `ray start --block` in a session of its own."""

    def __init__(self, logs: Path):
        self.logs, self.port = logs, free_port()
        self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # socket paths stay short
        self.head = self._node(HEAD, ["--head", "--port", str(self.port), "--temp-dir",
                                      self.temp, "--include-dashboard", "false"])
        self._wait_for_nodes(1)
        self.worker = self.start_worker()

    @property
    def address(self) -> str:
        return f"{HEAD}:{self.port}"

    def _node(self, address: str, flags: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"ray-{address}.log", "ab")
        return subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--block", "--node-ip-address", address,
             "--resources", ONE_NEURON_CORE, "--num-cpus", "1", "--disable-usage-stats",
             # Ray's object store would take 30 % of RAM per node; vLLM sends it little.
             "--object-store-memory", str(128 << 20),
             "--min-worker-port", "0", "--max-worker-port", "0", *flags],
            env=node_env(address), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_worker(self) -> subprocess.Popen:
        worker = self._node(WORKER, ["--address", self.address])
        self._wait_for_nodes(2)
        return worker

    def _wait_for_nodes(self, n: int, timeout: float = 120) -> None:
        """Until the live nodes hold `n` NeuronCores (`ray status` takes 20 s a call)."""
        subprocess.run([sys.executable, "-c", COUNT_NEURON_CORES, self.address, str(n),
                        str(timeout)], env=node_env(HEAD), check=True, timeout=timeout + 60)

    def lose_worker(self) -> None:
        kill_session(self.worker)

    def stop(self) -> None:
        for node in (self.worker, self.head):
            kill_session(node)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    cluster = RayCluster(tmp_path_factory.mktemp("ray-logs"))
    yield cluster
    cluster.stop()


def ray_tp_server(cluster: RayCluster, checkpoint, log: Path) -> RunningServer:
    port = free_port()
    return start_server(
        [*SERVER["neuron-serve"], str(checkpoint), *EAGER["neuron-serve"], "--port", str(port),
         "--served-model-name", "tiny", *TEST_ENGINE_FLAGS, "--distributed-executor-backend", "ray",
         "--tensor-parallel-size", "2"],
        port, log, env={**os.environ, "RAY_ADDRESS": cluster.address, "VLLM_HOST_IP": HEAD})


def worker_actor_nodes() -> list[tuple[str, str]]:
    """(Ray node id, node address) of every vLLM worker actor on this machine, read from
    the raylet that started it."""
    nodes = []
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0].startswith("ray::RayWorkerProc"):
            raylet = psutil.Process(int(proc.environ()["RAY_RAYLET_PID"])).cmdline()
            flags = dict(a[2:].split("=", 1) for a in raylet if a.startswith("--") and "=" in a)
            nodes.append((flags["node_id"], flags["node_ip_address"]))
    return nodes


def assert_stops(server: RunningServer, what: str) -> None:
    """Just after a node was lost: /health turns 503 and the server exits 1, in bounded time."""
    lost, health, unhealthy_after = time.monotonic(), set(), None
    while server.proc.poll() is None and time.monotonic() - lost < EXIT_WITHIN_S:
        try:
            health.add(httpx.get(f"{server.base_url}/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        if 503 in health and unhealthy_after is None:
            unhealthy_after = time.monotonic() - lost
        time.sleep(0.5)
    assert server.proc.poll() is not None, f"still running {EXIT_WITHIN_S} s after the loss"
    assert server.proc.returncode == 1 and 503 in health, (health, server.log_tail())
    print(f"{what}: /health 503 after {unhealthy_after:.1f} s, exit 1 after "
          f"{time.monotonic() - lost:.1f} s")


def test_ray_tensor_parallel_over_two_nodes(ray_cluster, tiny_llama, tiny_server, tmp_path):
    """TP 2 with one rank per node answers as TP 1; losing the worker node stops the server
    within a bounded time; the node and the server restarted, it serves again."""
    server = ray_tp_server(ray_cluster, tiny_llama, tmp_path / "ray-tp.log")
    try:
        nodes = worker_actor_nodes()
        assert len(nodes) == 2 and len({node for node, _ in nodes}) == 2, nodes
        assert sorted(address for _, address in nodes) == [HEAD, WORKER]
        expected = greedy_texts(tiny_server.base_url, REQUESTS)
        assert greedy_texts(server.base_url, REQUESTS) == expected

        ray_cluster.lose_worker()
        assert_stops(server, "Ray worker node lost")
    finally:
        server.stop()

    ray_cluster.worker = ray_cluster.start_worker()
    again = ray_tp_server(ray_cluster, tiny_llama, tmp_path / "ray-tp-again.log")
    try:
        assert greedy_texts(again.base_url, REQUESTS) == expected
    finally:
        again.stop()


@pytest.mark.parametrize("head,headless", [("vllm-serve", "neuron-serve"),
                                           ("neuron-serve", "vllm-serve")])
def test_data_parallel_over_two_nodes(head, headless, tiny_llama, tiny_server, tmp_path):
    """DP 2: rank 0 with the API server on the head, rank 1 on a --headless node."""
    rpc, port = free_port(), free_port()
    dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
          "--data-parallel-address", HEAD, "--data-parallel-rpc-port", str(rpc)]
    engine = [str(tiny_llama), "--served-model-name", "tiny", *TEST_ENGINE_FLAGS, *dp]
    with open(tmp_path / "headless.log", "wb") as log:
        node = subprocess.Popen([*SERVER[headless], *engine, *EAGER[headless], "--headless",
                                 "--data-parallel-start-rank", "1"],
                                env={**os.environ, "VLLM_HOST_IP": WORKER},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer([*SERVER[head], *engine, *EAGER[head], "--port", str(port)], port,
                           tmp_path / "head.log", env={**os.environ, "VLLM_HOST_IP": HEAD})
    try:
        server.wait_healthy()
        assert greedy_texts(server.base_url, REQUESTS) == \
            greedy_texts(tiny_server.base_url, REQUESTS)
        served = [metric(server.base_url, "vllm:request_success_total", engine=str(e))
                  for e in (0, 1)]
        assert min(served) > 0 and sum(served) >= REQUESTS, served
        if head == "neuron-serve":  # vLLM's own head stays healthy, routing to a lost engine
            kill_session(node)
            assert_stops(server, "headless node lost")
    finally:
        server.stop()
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_session(node)

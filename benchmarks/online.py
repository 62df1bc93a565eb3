"""Online: our server vs `vllm serve` on vLLM's CPU backend, same checkpoint and flags,
under Poisson arrivals at each rate of a sweep; streamed completions through the official
`openai` client. TTFT, TPOT ((e2e - TTFT) ÷ (tokens - 1)) and ITL (gap between streamed
chunks) p50 and p99, and output tok/s. Called by compare.py --online."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from systems import OTHER_SYSTEM_IDLE_S

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, system: str, model: Path, flags: list[str], log: Path,
                 neuron_config: str | None = None, eager: bool = False):
        self.system, self.port = system, _free_port()
        env = dict(os.environ)
        if system == "neuron":
            cmd = [str(VENV_BIN / "neuron-serve"), "serve", str(model), "--compile-mode",
                   "eager" if eager else "ahead"]
            if neuron_config:
                cmd += ["--additional-config", json.dumps({"neuron": json.loads(neuron_config)})]
        else:
            env.pop("NEURON_SERVE_DEVICE", None)
            env["VLLM_TARGET_DEVICE"] = "cpu"
            cmd = [str(VENV_BIN / "vllm"), "serve", str(model), *(["--enforce-eager"] if eager else [])]
        cmd += ["--port", str(self.port), "--served-model-name", "bench", "--dtype", "float32",
                "--no-enable-prefix-caching", *flags]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_healthy(system, log)
        except BaseException:
            self.stop()  # a server that never came up must not keep the cores
            raise

    def _wait_healthy(self, system: str, log: Path) -> None:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{system} server exited; see {log}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{system} server not up; see {log}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


async def _one(client, prompt: list[int], output: int, start_at: float) -> dict:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=output, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        # Every chunk with a choice is a step's tokens, even when they detokenize to nothing
        # yet (random weights emit partial UTF-8 sequences); the usage chunk closes.
        if chunk.choices:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    if not stamps:
        raise RuntimeError(f"a stream ended without a token (usage: {tokens} tokens)")
    e2e = stamps[-1] - t0
    return dict(ttft=stamps[0] - t0, e2e=e2e, tokens=tokens,
                tpot=(e2e - (stamps[0] - t0)) / max(1, tokens - 1),
                itl=[b - a for a, b in zip(stamps, stamps[1:])])


async def _load(base_url: str, rate: float, n: int, prompt_len: int, output: int,
                vocab: int, seed: int) -> dict:
    import openai

    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, vocab - 16, size=(n, prompt_len)).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=3600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, output, t0 + a)
                                         for p, a in zip(prompts, arrivals)))
        wall = time.perf_counter() - t0
    return dict(results=results, wall=wall)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(runs: list[dict]) -> dict:
    """Percentiles over every request of every repetition; throughput median over repetitions."""
    reqs = [r for run in runs for r in run["results"]]
    itl = [g for r in reqs for g in r["itl"]]
    ms = lambda v: 1000 * v  # noqa: E731
    return dict(ttft_p50_ms=ms(_pct([r["ttft"] for r in reqs], 50)),
                ttft_p99_ms=ms(_pct([r["ttft"] for r in reqs], 99)),
                tpot_p50_ms=ms(_pct([r["tpot"] for r in reqs], 50)),
                tpot_p99_ms=ms(_pct([r["tpot"] for r in reqs], 99)),
                itl_p50_ms=ms(_pct(itl, 50)), itl_p99_ms=ms(_pct(itl, 99)),
                output_tok_s=statistics.median(sum(r["tokens"] for r in run["results"]) / run["wall"]
                                               for run in runs))


def sweep(args, model: Path) -> list[dict]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    flags = ["--max-num-seqs", str(max(args.batches)), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
             "--kv-cache-memory-bytes", str(int(args.kv_cache_gb * 2**30))]
    systems = [s for s in args.systems if s in ("neuron", "vllm-cpu")]
    servers = []
    try:
        for system in systems:
            print(f"starting {system} server ...", flush=True)
            servers.append(Server(system, model, flags, args.logs / f"{args.name}.{system}-server.log",
                                  args.neuron_config, args.eager))
        runs = {(s.system, rate): [] for s in servers for rate in args.online_rates_list}
        for s in servers:  # warm-up
            asyncio.run(_load(s.base_url, 4.0, 4, args.prompts[0], 8, vocab, seed=1))
        for rep in range(args.repeats):
            for rate in args.online_rates_list:
                for s in servers:  # alternate the servers rate by rate
                    time.sleep(OTHER_SYSTEM_IDLE_S)
                    run = asyncio.run(_load(s.base_url, rate, args.online_requests, args.prompts[0],
                                            args.output, vocab, seed=100 * rep + int(rate * 10)))
                    runs[(s.system, rate)].append(run)
                    print(f"  rep {rep + 1} {s.system:9s} {rate} req/s: "
                          f"{summarize([run])['ttft_p50_ms']:.0f} ms TTFT p50", flush=True)
    finally:
        for s in servers:
            s.stop()
    return [dict(system=system, rate=rate, prompt=args.prompts[0], output=args.output,
                 requests=args.online_requests, repeats=len(rs), **summarize(rs))
            for (system, rate), rs in runs.items()]


def markdown(rows: list[dict]) -> str:
    lines = [f"## Online ({rows[0]['requests']} Poisson requests per rate and repetition, "
             f"prompt {rows[0]['prompt']}, output {rows[0]['output']}; ms)", "",
             "| server | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 "
             "| output tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["rate"], r["system"])):
        lines.append(f"| {r['system']} | {r['rate']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | "
                     f"{r['itl_p99_ms']:.1f} | {r['output_tok_s']:.1f} |")
    return "\n".join(lines)

"""The search behind `neuron-serve buckets suggest` (cli/buckets.py): the bucket set that
wastes the fewest padded tokens on a request-length trace, within a graph budget.

Trace: JSONL, one request per line, `{"prompt_tokens": P, "output_tokens": O}`.

Padding model (per request, as if it ran alone; the trace says nothing of concurrency):
  * token axis: each prefill chunk of c ≤ max_num_batched_tokens tokens runs in the
    smallest token bucket T ≥ c, wasting T - c tokens;
  * context axis: each step (prefill chunk, then one decode per output token) with
    context length n reads the smallest block bucket B ≥ ⌈n / block_size⌉ blocks, wasting
    B · block_size - n context tokens.
The request buckets are kept (they depend on concurrency). The grid has
(|request buckets| + |token buckets|) × |block buckets| graphs plus the untiled one
(neuron_serve.buckets), so the search tries every
split of the budget between the two axes and solves each axis exactly by dynamic
programming over the observed lengths (the largest bucket stays at the engine limit).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neuron_serve.buckets import build_grid


@dataclass(frozen=True)
class Demand:
    """How often each length occurs on each axis, in that axis's units."""
    chunk_tokens: Counter  # prefill chunk length → count
    context_blocks: Counter  # ⌈context / block_size⌉ → number of steps
    real_tokens: int  # Σ chunk lengths (token axis) …
    real_context: int  # … and Σ context lengths over all steps (context axis)


def read_trace(path: str | Path) -> list[tuple[int, int]]:
    requests = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p, o = int(row["prompt_tokens"]), int(row["output_tokens"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected {{\"prompt_tokens\": int, "
                             f"\"output_tokens\": int}}, got {line[:80]!r} ({e})") from None
        if p < 1 or o < 0:
            raise ValueError(f"{path}:{n}: prompt_tokens must be ≥ 1 and output_tokens ≥ 0")
        requests.append((p, o))
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    return requests


def demand(requests: list[tuple[int, int]], max_num_batched_tokens: int, block_size: int,
           max_model_len: int) -> Demand:
    chunks, contexts = Counter(), Counter()
    real_tokens = real_context = 0
    for prompt, output in requests:
        total = min(prompt + output, max_model_len)
        prompt = min(prompt, total)
        for start in range(0, prompt, max_num_batched_tokens):
            end = min(prompt, start + max_num_batched_tokens)
            chunks[end - start] += 1
            contexts[math.ceil(end / block_size)] += 1
            real_tokens += end - start
            real_context += end
        for n in range(prompt + 1, total + 1):  # decode steps: context n after the new token
            contexts[math.ceil(n / block_size)] += 1
            real_context += n
    return Demand(chunks, contexts, real_tokens, real_context)


def padded_cost(buckets: list[int], counts: Counter, unit: int = 1) -> int:
    """Σ count × (bucket(v) - v) × unit, bucket(v) = smallest bucket ≥ v."""
    edges = np.array(sorted(buckets))
    values = np.array(sorted(counts))
    weights = np.array([counts[v] for v in values])
    return int((weights * (edges[np.searchsorted(edges, values)] - values)).sum() * unit)


def best_buckets(counts: Counter, k: int, cap: int) -> tuple[list[int], int]:
    """Exactly optimal k buckets (largest = cap) minimising Σ count × (bucket - value)."""
    values = sorted(v for v in counts if v < cap)
    if not values or k == 1:
        return [cap], padded_cost([cap], counts)
    # Candidate edges: observed values (an optimal edge sits on one) plus the cap.
    edges = values + [cap]
    n = len(edges)
    w = np.array([counts[v] for v in values] + [counts.get(cap, 0)], dtype=np.float64)
    x = np.array(edges, dtype=np.float64)
    cw, cwx = np.concatenate([[0], np.cumsum(w)]), np.concatenate([[0], np.cumsum(w * x)])

    def span(i, j):  # cost of putting values edges[i..j] in bucket edges[j] (i or j arrays)
        return x[j] * (cw[j + 1] - cw[i]) - (cwx[j + 1] - cwx[i])

    # best[m][j]: min cost of values up to edges[j] with m buckets, the last at edges[j].
    best = np.full((k + 1, n), np.inf)
    arg = np.zeros((k + 1, n), dtype=np.int64)
    best[1] = span(0, np.arange(n))
    for m in range(2, k + 1):
        for j in range(n):
            prev = np.arange(j)
            if not len(prev):
                continue
            cand = best[m - 1][prev] + span(prev + 1, j)
            i = int(np.argmin(cand))
            best[m][j], arg[m][j] = cand[i], prev[i]
    m = int(np.argmin(best[1:, n - 1])) + 1  # fewer buckets may already be optimal
    chosen, j = [], n - 1
    while m >= 1:
        chosen.append(edges[j])
        j, m = arg[m][j], m - 1
    chosen = sorted(set(chosen))
    return chosen, padded_cost(chosen, counts)


@dataclass(frozen=True)
class Plan:
    token_buckets: list[int]
    request_buckets: list[int]
    block_buckets: list[int]
    padded_tokens: int  # token-axis padding + context-axis padding
    waste_ratio: float  # padded ÷ real, over both axes

    @property
    def num_graphs(self) -> int:
        return len(build_grid(self.token_buckets, self.request_buckets, self.block_buckets,
                              max(self.request_buckets)))


def evaluate(d: Demand, token_buckets: list[int], request_buckets: list[int],
             block_buckets: list[int], block_size: int) -> Plan:
    padded = (padded_cost(token_buckets, d.chunk_tokens)
              + padded_cost(block_buckets, d.context_blocks, unit=block_size)
              + _block_rounding(d, block_size))
    return Plan(list(token_buckets), list(request_buckets), list(block_buckets), padded,
                padded / (d.real_tokens + d.real_context))


def _block_rounding(d: Demand, block_size: int) -> int:
    """Context padding inside the last block, which no bucket choice removes."""
    return sum(c * b * block_size for b, c in d.context_blocks.items()) - d.real_context


def suggest(d: Demand, request_buckets: list[int], max_graphs: int, max_num_batched_tokens: int,
            max_blocks: int, block_size: int) -> Plan:
    r = len(request_buckets)
    budget = max_graphs - 1  # the untiled bucket
    best = None
    for k_blocks in range(1, budget // (r + 1) + 1):
        k_tokens = budget // k_blocks - r
        if k_tokens < 1:
            break
        tokens, _ = best_buckets(d.chunk_tokens, k_tokens, max_num_batched_tokens)
        blocks, _ = best_buckets(d.context_blocks, k_blocks, max_blocks)
        plan = evaluate(d, tokens, request_buckets, blocks, block_size)
        if best is None or plan.padded_tokens < best.padded_tokens:
            best = plan
    if best is None:
        raise ValueError(f"--max-graphs {max_graphs} cannot hold even one token bucket and one "
                         f"block bucket next to {r} request buckets; the least is {r + 2}")
    return best

"""Static step shapes: the bucket grid and the choice of a bucket for each step.

A step's shape is (tokens, requests, block-table width). Each compiled graph serves one
such `Bucket`. The grid holds two kinds of buckets:

    decode buckets   (r, r, b)   one token per request: every r in request_buckets
    mixed buckets    (t, R(t), b) prefill chunks mixed with decodes: every t in
                                  token_buckets, R(t) = smallest request bucket that can
                                  hold min(t, max_num_seqs) requests

each for every width b in block_buckets. A step runs in the cheapest bucket that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_reqs: int
    num_blocks: int  # block-table width: the longest context it holds, in blocks

    def holds(self, num_tokens: int, num_reqs: int, num_blocks: int) -> bool:
        return (num_tokens <= self.num_tokens and num_reqs <= self.num_reqs
                and num_blocks <= self.num_blocks)

    @property
    def cost(self) -> int:
        """Proportional to the work of one step: tokens through the weights, plus the
        token × context gather of paged attention."""
        return self.num_tokens * (1 + self.num_blocks)

    def __str__(self) -> str:
        return f"t{self.num_tokens}-r{self.num_reqs}-b{self.num_blocks}"


def powers_of_two(lo: int, hi: int, stride: int = 1) -> list[int]:
    """lo, lo*2**stride, ... up to hi, always ending with hi itself."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v <<= stride
    return out + [hi]


def default_token_buckets(max_num_batched_tokens: int) -> list[int]:
    return powers_of_two(min(64, max_num_batched_tokens), max_num_batched_tokens, stride=2)


def default_request_buckets(max_num_seqs: int) -> list[int]:
    return powers_of_two(1, max_num_seqs, stride=2)


def default_block_buckets(max_blocks_per_seq: int) -> list[int]:
    return powers_of_two(min(8, max_blocks_per_seq), max_blocks_per_seq, stride=2)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def build_grid(token_buckets: list[int], request_buckets: list[int], block_buckets: list[int],
               max_num_seqs: int) -> list[Bucket]:
    grid = set()
    for b in block_buckets:
        for r in request_buckets:
            grid.add(Bucket(r, r, b))
        for t in token_buckets:
            r = next((rb for rb in request_buckets if rb >= min(t, max_num_seqs)),
                     request_buckets[-1])
            grid.add(Bucket(t, r, b))
    return sorted(grid, key=lambda bk: (bk.cost, bk))


def select(grid: Sequence[Bucket], num_tokens: int, num_reqs: int, num_blocks: int) -> Bucket:
    """The cheapest bucket that holds the step; raises if none does (a planning bug:
    the largest buckets are sized from the engine's own limits)."""
    for bucket in grid:  # sorted by cost
        if bucket.holds(num_tokens, num_reqs, num_blocks):
            return bucket
    raise ValueError(f"no bucket holds {num_tokens} tokens / {num_reqs} requests / "
                     f"{num_blocks} blocks; largest: {max(grid, key=lambda b: b.cost)}")

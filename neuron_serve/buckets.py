"""Static step shapes: the bucket grid and the choice of a bucket for each step.

A step's shape is (tokens, requests, block-table width). Each compiled graph serves one
such `Bucket`. The grid holds two kinds of buckets:

    decode buckets   (r, r, b)   one token per request: every r in request_buckets
    mixed buckets    (t, R(t), b) prefill chunks mixed with decodes: every t in
                                  token_buckets, R(t) = smallest request bucket that can
                                  hold min(t, max_num_seqs) requests

each for every width b in block_buckets. A step runs in the cheapest bucket that holds it.

Mixed buckets attend in query tiles (neuron_serve.model_runner.query_tiles): t / QUERY_TILE
tiles of one request's consecutive tokens each, plus r slots for single tokens, so a step
whose tokens cannot be packed that way (many short chunks) does not fit them. One untiled
bucket at the largest shape, last in the grid, holds any step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Query rows of one attention tile. Larger tiles gather a long chunk's context fewer times,
# but gain little past 32 rows; smaller tiles pack short chunks better (measured on a
# prototype of the tile kernel: benchmarks/README.md, "Design measurements").
QUERY_TILE = 32


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_reqs: int
    num_blocks: int  # block-table width: the longest context it holds, in blocks (0: any)
    query_tile: int = 0  # rows per query tile; 0: every token attends on its own

    def holds(self, num_tokens: int, num_reqs: int, num_blocks: int) -> bool:
        return (num_tokens <= self.num_tokens and num_reqs <= self.num_reqs
                and num_blocks <= self.num_blocks)

    def any_width(self) -> Bucket:
        """The same step shape at any block-table width: the id of a graph that serves
        every width (Device.symbolic_context)."""
        return dataclasses.replace(self, num_blocks=0)

    @property
    def is_decode(self) -> bool:
        """One token per request: a decode bucket of the grid."""
        return self.num_tokens == self.num_reqs and not self.query_tile

    @property
    def num_tiles(self) -> int:
        return self.num_tokens // self.query_tile if self.query_tile else 0

    @property
    def single_token_slots(self) -> int:
        """Tokens attending on their own: one per request when tiled, else all."""
        return self.num_reqs if self.query_tile else self.num_tokens

    @property
    def cost(self) -> int:
        """Proportional to the work of one step: tokens through the weights, plus the
        token × context gather of paged attention."""
        return self.num_tokens * (1 + self.num_blocks)

    def __str__(self) -> str:
        tiles = f"-q{self.query_tile}" if self.query_tile else ""
        return f"t{self.num_tokens}-r{self.num_reqs}-b{self.num_blocks or '*'}{tiles}"


def powers_of_two(lo: int, hi: int, stride: int = 1) -> list[int]:
    """lo, lo*2**stride, ... up to hi, always ending with hi itself."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v <<= stride
    return out + [hi]


def default_token_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """A prefill chunk of 64, 128, 256, ... tokens beside a decode of every other running
    request (vLLM schedules both in one step), rounded up to 32 tokens; then the engine
    limit. Without the decodes' room a 128-token prompt arriving during decodes pads to 256,
    which lengthens its time to first token (measured: benchmarks/README.md, "Design
    measurements"). With one sequence there is no other request: a chunk fills its bucket."""
    chunks = powers_of_two(min(64, max_num_batched_tokens), max_num_batched_tokens)[:-1]
    others = max_num_seqs - 1
    return sorted({min(max_num_batched_tokens, -(-(c + others) // 32) * 32) for c in chunks}
                  | {max_num_batched_tokens})


def default_request_buckets(max_num_seqs: int) -> list[int]:
    """Every power of two: a decode step pads its requests less than 2x. With every other
    power, 8 sequences decode in the 16-request graph, markedly slower than in a graph of
    their own (measured: benchmarks/README.md, "Design measurements"). Each extra request
    bucket costs one graph per block bucket at warm-up."""
    return powers_of_two(1, max_num_seqs)


def default_block_buckets(max_blocks_per_seq: int) -> list[int]:
    return powers_of_two(min(8, max_blocks_per_seq), max_blocks_per_seq, stride=2)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def build_grid(token_buckets: list[int], request_buckets: list[int], block_buckets: list[int],
               max_num_seqs: int, query_tile: int = QUERY_TILE) -> list[Bucket]:
    grid = set()
    for b in block_buckets:
        for r in request_buckets:
            grid.add(Bucket(r, r, b))
        for t in token_buckets:
            r = next((rb for rb in request_buckets if rb >= min(t, max_num_seqs)),
                     request_buckets[-1])
            tiled = query_tile if r < t and t >= query_tile > 0 else 0
            grid.add(Bucket(t, r, b, tiled))
    grid = sorted(grid, key=lambda bk: (bk.cost, bk))
    largest = max(grid, key=lambda bk: (bk.num_tokens, bk.num_reqs, bk.num_blocks))
    if largest.query_tile:
        grid.append(Bucket(largest.num_tokens, largest.num_reqs, largest.num_blocks))
    return grid


def select(grid: Sequence[Bucket], num_tokens: int, num_reqs: int, num_blocks: int,
           fits_tiles: Callable[[Bucket], bool] = lambda bucket: True) -> Bucket:
    """The cheapest bucket that holds the step (and, if tiled, whose tiles can pack it);
    raises if none does (a planning bug: the largest buckets are sized from the engine's
    own limits)."""
    for bucket in grid:  # sorted by cost
        if bucket.holds(num_tokens, num_reqs, num_blocks) and (
                not bucket.query_tile or fits_tiles(bucket)):
            return bucket
    raise ValueError(f"no bucket holds {num_tokens} tokens / {num_reqs} requests / "
                     f"{num_blocks} blocks; largest: {max(grid, key=lambda b: b.cost)}")

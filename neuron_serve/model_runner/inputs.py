"""Flat ragged step inputs, padded into persistent per-bucket buffers.

One step packs every scheduled request's tokens back to back, decodes and prefill
chunks mixed, in the persistent batch's request order:

    tokens    | r0: prefill chunk (5) | r1 | r2 | r3: chunk (3) | pad ........ |
    token_req |  0  0  0  0  0        |  1 |  2 |  3  3  3      |  0  0 ... 0  |
    positions | 12 13 14 15 16        | 40 |  7 |  0  1  2      |  0  0 ... 0  |
    slots     | block_table[req, pos // bs] * bs + pos % bs      | null block   |

    block_table  [r, b]: rows 0..3 from the batch, the rest null (block 0)
    logits_idx   [r]:    last token of each request (4, 5, 6, 9), then 0

Buffers live as long as the runner and are written in place, so the graph traced for a
bucket sees the same tensors (and the same attention metadata object) on every step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from neuron_serve.attention.backend import NeuronAttentionMetadata
from neuron_serve.attention.kernels import QueryTiles
from neuron_serve.buckets import Bucket, blocks_needed, select
from neuron_serve.model_runner import query_tiles


class BucketBuffers:
    """Persistent input tensors of one bucket, plus its attention metadata."""

    def __init__(self, bucket: Bucket, device: torch.device):
        t, r, b = bucket.num_tokens, bucket.num_reqs, bucket.num_blocks
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.bucket = bucket
        self.input_ids, self.positions, self.slot_mapping, self.token_req = (zeros(t) for _ in range(4))
        self.block_table = zeros(r, b)
        self.logits_indices = zeros(r)
        self.tiles = QueryTiles(zeros(bucket.num_tiles, bucket.query_tile), zeros(bucket.num_tiles),
                                zeros(r), zeros(t)) if bucket.query_tile else None
        self.attn_metadata = NeuronAttentionMetadata(
            slot_mapping=self.slot_mapping, token_req=self.token_req,
            token_pos=self.positions, block_table=self.block_table, tiles=self.tiles)

    NAMES = ("input_ids", "positions", "slot_mapping", "token_req", "block_table", "logits_indices")
    TILE_NAMES = ("tile_token", "tile_req", "single_token", "token_slot")
    PADDING = {"single_token": -1}  # an unused slot (kernels.ragged_paged_attention)

    @functools.cached_property
    def _buffers(self) -> dict[str, torch.Tensor | np.ndarray]:
        """Each buffer by name, as a numpy view where it lives in host memory."""
        names = self.NAMES + (self.TILE_NAMES if self.tiles else ())
        tensors = {n: getattr(self.tiles if n in self.TILE_NAMES else self, n) for n in names}
        return {n: t.numpy() if t.device.type == "cpu" else t for n, t in tensors.items()}

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy the real part of each array in; the padding is 0 (null block, request 0,
        token 0) but for unused single-token slots (-1). Buffers in host memory are written
        through numpy views: a dozen torch ops per step cost more than the copies."""
        for name, buf in self._buffers.items():
            pad, arr = self.PADDING.get(name, 0), arrays.get(name)
            real = tuple(slice(0, n) for n in arr.shape) if arr is not None else None
            if isinstance(buf, np.ndarray):
                buf.fill(pad)
                if real:
                    buf[real] = arr
            else:
                buf.fill_(pad)
                if real:
                    buf[real].copy_(torch.from_numpy(arr))


@dataclass(frozen=True)
class StepPlan:
    bucket: Bucket
    num_reqs: int
    num_tokens: int
    partial_prefill: np.ndarray  # [num_reqs] bool: the step ends before the request's last known token


def plan_step(token_ids: np.ndarray, num_computed: np.ndarray, num_tokens_known: np.ndarray,
              block_table: np.ndarray, num_scheduled: np.ndarray, block_size: int,
              grid: Sequence[Bucket]) -> tuple[StepPlan, dict[str, np.ndarray]]:
    """Pack one step. All arrays are indexed by batch row, first `len(num_scheduled)` rows.

    Returns the plan and the unpadded arrays to copy into the bucket's buffers.
    """
    num_reqs = len(num_scheduled)
    seq_lens = num_computed + num_scheduled
    num_tokens = int(num_scheduled.sum())
    bucket = select(grid, num_tokens, num_reqs, blocks_needed(int(seq_lens.max()), block_size),
                    lambda b: query_tiles.fits(num_scheduled, b))
    token_req = np.repeat(np.arange(num_reqs), num_scheduled)
    ends = np.cumsum(num_scheduled)
    offsets = np.arange(num_tokens) - (ends - num_scheduled)[token_req]
    positions = num_computed[token_req] + offsets
    slots = block_table[token_req, positions // block_size] * block_size + positions % block_size
    arrays = {
        "input_ids": token_ids[token_req, positions],
        "positions": positions,
        "slot_mapping": slots,
        "token_req": token_req,
        "block_table": block_table[:num_reqs, : bucket.num_blocks],
        "logits_indices": ends - 1,
    }
    if bucket.query_tile:
        arrays.update(query_tiles.pack(num_scheduled, bucket))
    plan = StepPlan(bucket, num_reqs, num_tokens, partial_prefill=seq_lens < num_tokens_known)
    return plan, {k: v.astype(np.int64, copy=False) for k, v in arrays.items()}

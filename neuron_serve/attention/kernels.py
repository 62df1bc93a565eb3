"""Paged-attention kernels in plain PyTorch, traced by torch.compile into the step graph.

KV cache layout (one tensor per layer, token-major, K and V side by side):

    kv_cache[num_blocks, block_size, num_kv_heads, 2 * head_size]
        [..., :head_size] = key,  [..., head_size:] = value
    slot s = block_id * block_size + offset      (block 0 is vLLM's null block)

An 8-bit cache (`--kv-cache-dtype fp8`: float8_e4m3fn or float8_e5m2) holds key / k_scale
and value / v_scale, saturated to the format's range, with vLLM's per-tensor scales
(`kv_scales`, 0-d tensors: a graph reads them at run time, so cached graphs hold no
checkpoint's scales); kernels read `stored * scale`.

A registry maps a kernel-set name to its implementation, so that a hardware kernel (NKI)
can replace the reference one without touching the attention backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class QueryTiles:
    """A step's tokens packed into query tiles (neuron_serve.model_runner.query_tiles)."""

    tile_token: torch.Tensor  # [n, q] int64 token of each tile row (padding rows: 0)
    tile_req: torch.Tensor  # [n] int64 block_table row of each tile
    single_token: torch.Tensor  # [s] int64 tokens attending on their own (-1: unused)
    token_slot: torch.Tensor  # [T] int64 row of each token in cat(single outputs, tile rows)


KVScales = tuple[torch.Tensor, torch.Tensor]  # k_scale, v_scale of an 8-bit cache


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KernelSet:
    write_kv: Callable[..., None]
    ragged_paged_attention: Callable[..., torch.Tensor]


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Store each token's key and value at its slot, quantized by `kv_scales` in an 8-bit
    cache. Padding tokens carry slots inside the null block, which no request reads.

    An index_put on the cache itself, not index_copy_ on a flattened view: inductor turns
    a mutation through a view of a graph input into a copy of the whole cache on every
    step, so the step time would grow with the cache size (measured: benchmarks/README.md,
    "Design measurements").
    """
    block_size = kv_cache.shape[1]
    if is_quantized(kv_cache):
        # Saturated: torch's cast to e5m2 turns values past its range into inf.
        limit = torch.finfo(kv_cache.dtype).max
        key = (key.float() / kv_scales[0]).clamp(-limit, limit)
        value = (value.float() / kv_scales[1]).clamp(-limit, limit)
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = (
        torch.cat([key, value], dim=-1).to(kv_cache.dtype))


def read_kv(context: torch.Tensor, head_size: int, kv_scales: KVScales | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of cache rows `context` [..., 2D] in float32, dequantized."""
    context = context.float()
    key, value = context[..., :head_size], context[..., head_size:]
    if kv_scales is None:
        return key, value
    return key * kv_scales[0], value * kv_scales[1]


def ragged_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, token_req: torch.Tensor,
                           token_pos: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           tiles: QueryTiles | None = None,
                           kv_scales: KVScales | None = None,
                           attend_tokens: Callable[..., torch.Tensor] | None = None,
                           attend_tiles: Callable[..., torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """Causal attention of a flat ragged batch over the paged KV cache.

    Token t belongs to request token_req[t] and sits at position token_pos[t]; it attends
    to positions 0..token_pos[t] of its request (its own key already written), limited to
    the last `sliding_window` positions when given. Prefill chunks, prefix-cached context
    and decodes are the same case: only the positions differ.

    Args:
        query: [T, H, D] queries; H a multiple of the KV heads (grouped-query attention).
        kv_cache: [num_blocks, block_size, H_kv, 2D] (module docstring).
        block_table: [R, B] block ids of each request's context, in order.
        token_req: [T] row of block_table for each token.
        token_pos: [T] position of each token in its request.
        tiles: the step's tokens packed into query tiles (QueryTiles), or None: every
            token attends on its own.
        kv_scales: (k_scale, v_scale) of an 8-bit cache, else None.
        attend_tokens: the kernel for tokens that attend on their own (the arguments of
            `attend_each_token`, its default); a kernel set may bring a faster one.
        attend_tiles: the kernel for query tiles (the arguments of `attend_query_tiles`,
            its default).
    Returns:
        [T, H, D] attention output.
    """
    attend_tokens = attend_tokens or attend_each_token
    attend_tiles = attend_tiles or attend_query_tiles
    if tiles is None:
        return attend_tokens(query, kv_cache, block_table, token_req, token_pos, scale,
                             sliding_window, soft_cap, kv_scales)
    # An unused single slot (-1) attends as position 0 of request 0: one position for a
    # kernel that reads only what a token sees, where token 0 could see a whole chunk.
    used = tiles.single_token >= 0
    single = tiles.single_token.clamp(min=0)
    outputs = [attend_tokens(query[single], kv_cache, block_table,
                             torch.where(used, token_req[single], 0),
                             torch.where(used, token_pos[single], 0), scale, sliding_window,
                             soft_cap, kv_scales),
               attend_tiles(query, kv_cache, block_table, token_pos, tiles, scale,
                            sliding_window, soft_cap, kv_scales)]
    return torch.cat(outputs)[tiles.token_slot]


def attend_each_token(query, kv_cache, block_table, token_req, token_pos, scale,
                      sliding_window, soft_cap, kv_scales=None):
    """Each token over its own request's context (the block table gathered per token)."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = kv_cache.shape
    key, value = read_kv(kv_cache[block_table[token_req]], head_size,
                         kv_scales)  # [T, B, block_size, H_kv, D]
    q = query.float().view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_size)
    ctx_pos = torch.arange(key.shape[1] * block_size, device=query.device).view(-1, block_size)
    visible = ctx_pos <= token_pos[:, None, None]  # [T, B, block_size]
    if sliding_window:
        visible = visible & (ctx_pos > token_pos[:, None, None] - sliding_window)
    attend = _fused_attention if torch.compiler.is_compiling() else _matmul_attention
    out = attend(q, key, value, visible, scale, soft_cap)
    return out.reshape(num_tokens, num_heads, head_size).to(query.dtype)


def _fused_attention(q, key, value, visible, scale, soft_cap):
    """For torch.compile: scores and output as broadcast products summed over a dimension,
    so that inductor fuses the block-table gather into both reductions and reads the cache
    in place. A matmul first copies every token's whole context (once per query token of a
    prefill chunk), which is several times slower for decodes and more so for prefill
    chunks. Scores are laid out [T, H_kv, G, B, block_size], context last, so the softmax
    reads contiguous rows, and blocks stay a dimension of their own, so the gather indexes
    the block table once per block rather than dividing every position by the block size
    (measured: benchmarks/README.md, "Design measurements"). Eagerly, the products would be
    materialised whole."""
    key = key.permute(0, 3, 1, 2, 4)[:, :, None]  # [T, H_kv, 1, B, block_size, D]
    value = value.permute(0, 3, 1, 2, 4)[:, :, None]
    scores = (q[:, :, :, None, None, :] * key).sum(-1) * scale  # [T, H_kv, G, B, block_size]
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores.flatten(-2), dim=-1).view_as(scores)
    return (probs[..., None] * value).sum((-3, -2))  # [T, H_kv, G, D]


def attend_query_tiles(query, kv_cache, block_table, token_pos, tiles, scale, sliding_window,
                       soft_cap, kv_scales=None):
    """Each tile's rows (one request's consecutive tokens) against that request's context,
    gathered once per tile: two batched matmuls, [n, H_kv, q·G, D] × [n, H_kv, D, B·bs]."""
    num_tiles, rows = tiles.tile_token.shape
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    ctx = kv_cache[block_table[tiles.tile_req]]  # [n, B, bs, H_kv, 2D]
    ctx = ctx.permute(0, 3, 1, 2, 4).flatten(2, 3)  # [n, H_kv, C, 2D]
    key, value = read_kv(ctx, head_size, kv_scales)
    q = query[tiles.tile_token].float().view(num_tiles, rows, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows * group, head_size)
    scores = (q @ key.transpose(-1, -2)) * scale  # [n, H_kv, q·G, C]
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = token_pos[tiles.tile_token][:, :, None]  # [n, q, 1]
    ctx_pos = torch.arange(key.shape[2], device=query.device)
    visible = ctx_pos <= pos
    if sliding_window:
        visible = visible & (ctx_pos > pos - sliding_window)
    scores = scores.view(num_tiles, num_kv_heads, rows, group, -1)
    scores = scores.masked_fill(~visible[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_tiles, num_kv_heads, rows * group, -1)
    out = (probs @ value).view(num_tiles, num_kv_heads, rows, group, head_size)
    return out.permute(0, 2, 1, 3, 4).reshape(num_tiles * rows, num_heads, head_size).to(query.dtype)


def _matmul_attention(q, key, value, visible, scale, soft_cap):
    """Eager execution: batched matmuls over each token's gathered context."""
    key, value, visible = key.flatten(1, 2), value.flatten(1, 2), visible.flatten(1)
    scores = torch.einsum("tkgd,tckd->tkgc", q, key) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("tkgc,tckd->tkgd", torch.softmax(scores, dim=-1), value)


_REGISTRY: dict[str, Callable[[], KernelSet]] = {
    "reference": lambda: KernelSet(write_kv, ragged_paged_attention),
}


def register(name: str, factory: Callable[[], KernelSet]) -> None:
    """Add a device's kernel set (the emulated device's "cpu" set, NKI kernels on
    Trainium); the factory runs when a layer first asks for the set."""
    _REGISTRY[name] = factory


def get(name: str) -> KernelSet:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention kernel set {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()

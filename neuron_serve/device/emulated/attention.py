"""The emulated backend's kernel set ("cpu"): the reference kernels, with attention itself on
paged_attention.cpp, which reads only the positions each query token sees: tokens that
attend on their own (every decode) once per KV head, query tiles (prefill chunks) with
their keys transposed once per tile and KV head. The reference kernels, traced by
inductor, read the step's whole padded block table, visible or not."""

from __future__ import annotations

import functools

import torch

from neuron_serve.attention import kernels
from neuron_serve.device.emulated import extension


def kernel_set() -> kernels.KernelSet:
    extension.load()
    _register_fake()
    return kernels.KernelSet(kernels.write_kv, functools.partial(
        kernels.ragged_paged_attention, attend_tokens=attend_each_token,
        attend_tiles=attend_query_tiles))


def _supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """What the C++ kernels handle: float32 query, float32 or 8-bit cache, head size 64 or
    128 (decided when the graph is traced)."""
    return (query.dtype == torch.float32 and query.shape[-1] in (64, 128)
            and (kv_cache.dtype == torch.float32 or kernels.is_quantized(kv_cache)))


def attend_each_token(query, kv_cache, block_table, token_req, token_pos, scale,
                      sliding_window, soft_cap, kv_scales=None) -> torch.Tensor:
    """`kernels.attend_each_token` on the C++ kernel where it applies."""
    if not _supported(query, kv_cache):
        return kernels.attend_each_token(query, kv_cache, block_table, token_req, token_pos,
                                         scale, sliding_window, soft_cap, kv_scales)
    return torch.ops.neuron_serve.paged_attention(query, kv_cache, block_table, token_req,
                                                  token_pos, scale, sliding_window or 0,
                                                  soft_cap or 0.0, *(kv_scales or ()))


def attend_query_tiles(query, kv_cache, block_table, token_pos, tiles, scale, sliding_window,
                       soft_cap, kv_scales=None) -> torch.Tensor:
    """`kernels.attend_query_tiles` on the C++ kernel where it applies."""
    if not _supported(query, kv_cache):
        return kernels.attend_query_tiles(query, kv_cache, block_table, token_pos, tiles,
                                          scale, sliding_window, soft_cap, kv_scales)
    return torch.ops.neuron_serve.paged_attention_tiles(
        query, kv_cache, block_table, tiles.tile_token, tiles.tile_req, token_pos, scale,
        sliding_window or 0, soft_cap or 0.0, *(kv_scales or ()))


@functools.cache
def _register_fake() -> None:
    @torch.library.register_fake("neuron_serve::paged_attention")
    def _(query, kv_cache, block_table, token_req, token_pos, scale, sliding_window, soft_cap,
          k_scale=None, v_scale=None):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @torch.library.register_fake("neuron_serve::paged_attention_tiles")
    def _(query, kv_cache, block_table, tile_token, tile_req, token_pos, scale,
          sliding_window, soft_cap, k_scale=None, v_scale=None):
        return query.new_empty((tile_token.numel(), *query.shape[1:]))

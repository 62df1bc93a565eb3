"""The emulated backend's kernel set ("cpu"): the reference kernels, with tokens that attend
on their own (every decode) on paged_attention.cpp, which reads only the positions each
token sees, once per KV head. The reference kernel, traced by inductor, reads the step's
whole padded block table once per query head."""

from __future__ import annotations

import functools

import torch

from neuron_serve.attention import kernels
from neuron_serve.model_runner import cpu_extension


def kernel_set() -> kernels.KernelSet:
    cpu_extension.load()
    _register_fake()
    return kernels.KernelSet(kernels.write_kv, functools.partial(
        kernels.ragged_paged_attention, attend_tokens=attend_each_token))


def attend_each_token(query, kv_cache, block_table, token_req, token_pos, scale,
                      sliding_window, soft_cap) -> torch.Tensor:
    """`kernels.attend_each_token` on the C++ kernel where it applies: float32 query and
    cache, head size 64 or 128 (decided when the graph is traced)."""
    if (query.dtype != torch.float32 or kv_cache.dtype != torch.float32
            or query.shape[-1] not in (64, 128)):
        return kernels.attend_each_token(query, kv_cache, block_table, token_req, token_pos,
                                         scale, sliding_window, soft_cap)
    return torch.ops.neuron_serve.paged_attention(query, kv_cache, block_table, token_req,
                                                  token_pos, scale, sliding_window or 0,
                                                  soft_cap or 0.0)


@functools.cache
def _register_fake() -> None:
    @torch.library.register_fake("neuron_serve::paged_attention")
    def _(query, kv_cache, block_table, token_req, token_pos, scale, sliding_window, soft_cap):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

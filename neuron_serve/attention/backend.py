"""vLLM attention backend for the neuron platform: metadata, KV layout, forward.

The model runner owns the per-bucket metadata (padded, persistent tensors updated in
place, so each compiled graph is traced once); this backend only reads it. The kernels
are the reference set until the runner binds its device's set (layer.adopt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType
from vllm.v1.kv_cache_interface import KVCacheLayout

from neuron_serve.attention import BACKEND_NAME, kernels

# --kv-cache-dtype values served, and the dtype the cache holds (None: vLLM's own).
# vLLM allocates an fp8 cache as uint8 bytes: the runner views them as the format.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": None, "float16": None,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_torch_dtype(cache_dtype: str) -> torch.dtype | None:
    """The torch dtype of a `--kv-cache-dtype` cache, None where vLLM's is right; refuses
    the formats our kernels do not read."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise NotImplementedError(
            f"--kv-cache-dtype {cache_dtype}: the neuron attention kernels read "
            f"{', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3 with per-tensor scales)")
    return KV_CACHE_DTYPES[cache_dtype]


@dataclass
class NeuronAttentionMetadata:
    """One step's attention inputs, padded to the step's bucket (t tokens, r requests,
    b blocks). Padding tokens write into the null block and read only request 0's
    first position; their outputs are discarded."""

    slot_mapping: torch.Tensor  # [t] int64 KV slot of each token
    token_req: torch.Tensor  # [t] int64 row of block_table each token belongs to
    token_pos: torch.Tensor  # [t] int64 position of each token within its request
    block_table: torch.Tensor  # [r, b] int64 block ids per request, null-padded
    tiles: kernels.QueryTiles | None = None  # tiled buckets only


class NeuronAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[NeuronAttentionImpl]:
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[NeuronAttentionMetadataBuilder]:
        return NeuronAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major block interiors: one block is one contiguous [block_size, H, 2D] tile.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class NeuronAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronAttentionMetadata]):
    """Present because vLLM's interface requires one; NeuronModelRunner builds the
    metadata itself into per-bucket buffers, and vLLM's generic runners are not used."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        raise NotImplementedError("neuron attention metadata is built by NeuronModelRunner")


class NeuronAttentionImpl(AttentionImpl[NeuronAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs) -> None:
        unsupported = {"ALiBi slopes": alibi_slopes is not None, "attention sinks": sinks is not None,
                       "KV-cache sharing": kv_sharing_target_layer_name is not None,
                       f"attention type {attn_type}": attn_type != AttentionType.DECODER}
        if any(unsupported.values()):
            names = [k for k, v in unsupported.items() if v]
            raise NotImplementedError(f"neuron paged attention does not support {', '.join(names)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        cache_torch_dtype(kv_cache_dtype)  # refuses what the kernels cannot read
        self.kv_cache_dtype = kv_cache_dtype
        self.kernels = kernels.get("reference")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: NeuronAttentionMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's dummy/profile passes: no KV cache bound yet
            return output
        md = attn_metadata
        # Tensors, not vLLM's float copies: a graph then reads the checkpoint's scales at
        # run time, and every layer of a stack traces alike.
        scales = (layer._k_scale, layer._v_scale) if kernels.is_quantized(kv_cache) else None
        self.kernels.write_kv(kv_cache, key, value, md.slot_mapping, scales)
        out = self.kernels.ragged_paged_attention(
            query, kv_cache, md.block_table, md.token_req, md.token_pos, self.scale,
            self.sliding_window, self.logits_soft_cap, md.tiles, scales)
        output.copy_(out.view_as(output))
        return output

"""Emulated backend: 8-bit weights (float8 e4m3, int8) from vLLM's quantization methods,
computed weight-only.

vLLM's FP8 and mixed-precision linear methods pick their matmul from tables keyed by its
in-tree platforms; an out-of-tree platform has no entry, so they fail while the model is
built ("Failed to find a kernel"). `register()` adds ours for PlatformEnum.OOT: vLLM's
methods still create and load the weights (FP8 checkpoints, compressed-tensors FP8 and
INT8 W8A16, online `fp8_per_tensor`), then our kernels repack them. vLLM quantizes INT8 at
load for MoE experts only; `--quantization int8_weight_only` (Int8WeightOnlyConfig, our
own method) does it for dense layers, a scale per output channel.

Each layer keeps one copy, in the skinny kernel's column blocks (skinny_matmul.py) with a
float32 scale per output column (a per-tensor scale repeated): a decode step reads one
byte per weight. Prefill steps run on the same kernel. Its tiles widen each weight once
per 8 rows, so at hundreds of rows it runs close to oneDNN on float32 weights; the
alternative, dequantizing the whole weight inside the graph every step, costs more than
the matmul. Without the kernel (no AVX2, or bf16 activations) the blocks are dequantized for a
plain matmul. Activations stay float32, also for checkpoints that declare FP8 activations:
the emulation has no FP8 arithmetic to match, so such checkpoints run weight-only.

vLLM leaves the LM head in full precision. Of a small model's decode bytes it is a large
share (SmolLM2-135M's tied head: a fifth of the weights), so a model whose linear layers
are 8-bit gets an 8-bit copy of its head too (`quantize_lm_head`), in the layers' format
with a scale per vocabulary row; the input embedding keeps its float rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
    MPLinearKernel,
    MPLinearLayerConfig,
)
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from neuron_serve.device.emulated import skinny_matmul


class Packed8BitMethod:
    """`apply` of a layer whose 8-bit weight `pack()` stored. Plain picklable state only:
    compiled graphs serialize the method objects they call."""

    def __init__(self, out_features: int, skinny: bool) -> None:
        self.out_features = out_features
        self.skinny = skinny  # the CPU runs the skinny kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        rows = x.reshape(-1, x.shape[-1])
        if self.skinny and rows.dtype == torch.float32:
            out = skinny_matmul.skinny_matmul(rows, layer.weight_blocks, bias,
                                              self.out_features, layer.weight_block_scale)
        else:
            out = rows @ dequantize(layer)[:, :self.out_features].to(rows.dtype)
            if bias is not None:
                out = out + bias
        return out.view(*x.shape[:-1], self.out_features)


def dequantize(layer: nn.Module) -> torch.Tensor:
    """The float32 weight [in_features, padded out_features] of a packed layer."""
    blocks = layer.weight_blocks  # [N / 16, K, 16]
    scale = layer.weight_block_scale
    if blocks.dtype == torch.float8_e4m3fn:
        scale = scale / 256.0  # pack_scale's factor is for the kernel's e4m3 reading
    weight = blocks.float().permute(1, 0, 2).reshape(blocks.shape[1], -1)
    return weight * scale


def pack(layer: nn.Module, weight: torch.Tensor, scale: torch.Tensor,
         drop: tuple[str, ...] = ("weight", "weight_packed", "weight_scale")) -> None:
    """Store `weight` [N, K] (int8 or float8_e4m3fn; N / scale per output column, a 0-d or
    one-value scale for the whole tensor) in the packed layout, drop the layer's tensors
    named in `drop` (vLLM's copies, now unused), and route its matmuls to the packed kernels."""
    out_features = weight.shape[0]
    scale = scale.float().flatten()
    if scale.numel() == 1:
        scale = scale.expand(out_features)
    layer.register_buffer("weight_blocks", skinny_matmul.pack_weight(weight.contiguous()),
                          persistent=False)
    layer.register_buffer("weight_block_scale", skinny_matmul.pack_scale(scale, weight.dtype),
                          persistent=False)
    for name in drop:
        if isinstance(getattr(layer, name, None), torch.Tensor):
            delattr(layer, name)
            setattr(layer, name, None)
    layer.quant_method = Packed8BitMethod(out_features, skinny_matmul.max_rows() > 0)


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as `dtype` (int8: round to nearest; float8 e4m3) with a scale per row,
    its largest magnitude mapped to the format's largest value."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = (weight.abs().amax(dim=1) / top).clamp(min=1e-12).float()
    values = weight.float() / scale[:, None]
    if dtype == torch.int8:
        values = values.round()
    return values.clamp(-top, top).to(dtype), scale


def quantize_lm_head(model: nn.Module) -> torch.dtype | None:
    """An 8-bit copy of the LM head of a model whose linear layers are 8-bit, in their
    format (the module docstring); returns that format, or None."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    formats = {m.weight_blocks.dtype for m in model.modules() if hasattr(m, "weight_blocks")}
    head = getattr(model, "lm_head", None)
    if len(formats) != 1 or not isinstance(head, ParallelLMHead) or head.weight.dim() != 2:
        return None
    (dtype,) = formats
    pack(head, *quantize_rows(head.weight.detach(), dtype), drop=())  # a tied weight stays
    return dtype


class Fp8WeightKernel(FP8ScaledMMLinearKernel):
    """vLLM's FP8 linear layers (per-tensor or per-channel weight scales), weight-only."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return True, None

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        shape = c.weight_quant_key.scale.group_shape
        if not (shape.is_per_tensor() or shape.is_per_channel()):
            return False, "the neuron emulation reads per-tensor or per-channel FP8 weight scales"
        return True, None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale, _, _ = self._get_layer_params(layer)  # weight [K, N], vLLM's layout
        pack(layer, weight.t(), scale)

    def apply_scaled_mm(self, **kwargs) -> torch.Tensor:
        raise AssertionError("packed FP8 layers compute through Packed8BitMethod")


class Int8WeightKernel(MPLinearKernel):
    """compressed-tensors' INT8 W8A16 (symmetric, a scale per output channel)."""

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        from vllm.scalar_type import scalar_types

        if c.weight_type != scalar_types.uint8b128:
            return False, f"the neuron emulation reads 8-bit symmetric weights, not {c.weight_type}"
        if c.zero_points or c.group_size not in (-1, c.full_weight_shape[0]):
            return False, "the neuron emulation reads one INT8 scale per output channel"
        return True, None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            unpack_quantized_values_into_int32,
        )

        packed, scale, _ = self._get_weight_params(layer)  # [N, K / 4] int32, [N, 1]
        wtype = self.config.weight_type
        values = unpack_quantized_values_into_int32(packed.data, wtype, packed_dim=1)
        pack(layer, (values - wtype.bias).to(torch.int8), scale.data)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        raise AssertionError("packed INT8 layers compute through Packed8BitMethod")


INT8_ONLINE = "int8_weight_only"


class Int8WeightOnlyLinearMethod(UnquantizedLinearMethod):
    """A dense layer's float weight, loaded as vLLM loads it, then rounded to INT8."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pack(layer, *quantize_rows(layer.weight.detach(), torch.int8))


class Int8WeightOnlyConfig(QuantizationConfig):
    """Our `--quantization int8_weight_only`: every linear layer's weight rounded to INT8 at
    load, a scale per output channel."""

    def get_name(self) -> str:
        return INT8_ONLINE

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> Int8WeightOnlyConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str):
        return Int8WeightOnlyLinearMethod() if isinstance(layer, LinearBase) else None


@functools.cache
def register_online_int8() -> None:
    """Make `--quantization int8_weight_only` known to vLLM (in every process that builds a
    config: a general plugin, neuron_serve.register_general)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(INT8_ONLINE)(Int8WeightOnlyConfig)


@functools.cache
def accept_float32(method: str) -> None:
    """Let vLLM's `method` serve a float32 model: vLLM's FP8 methods list bf16 and fp16
    activations only (their GPU kernels' inputs), and our kernels compute in the model's
    dtype whatever the weights."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    if not method.startswith("fp8"):
        return  # compressed-tensors lists float32 itself
    # `--quantization fp8` on a checkpoint that is not FP8 quantizes it online.
    for config in {get_quantization_config(method), OnlineQuantizationConfig}:
        dtypes = config.get_supported_act_dtypes()
        if torch.float32 not in dtypes:
            config.get_supported_act_dtypes = classmethod(
                lambda cls, dtypes=dtypes: [*dtypes, torch.float32])


@functools.cache
def register() -> None:
    """Offer our kernels to vLLM's FP8 and mixed-precision linear methods on this platform
    (once per process, before a model is built), and give vLLM's FP8 quantizing op a body:
    the CPU build of vLLM declares `_C::static_scaled_fp8_quant` without one."""
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(Fp8WeightKernel, PlatformEnum.OOT, "fp8")
    register_linear_kernel(Int8WeightKernel, PlatformEnum.OOT, "mp")
    _custom_ops.scaled_fp8_quant = scaled_fp8_quant


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None, scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False, output=None,
                     group_shape=None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `scaled_fp8_quant` in torch: FP8 e4m3 of input / scale, saturated; without
    a scale, one per tensor (or per row) from the absolute maximum."""
    fp8 = torch.float8_e4m3fn
    limit = torch.finfo(fp8).max
    x = input.float()
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True) if use_per_token_if_dynamic else x.abs().amax()
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax / limit).clamp(min=1e-12).float()
    out = (x / scale).clamp(-limit, limit).to(fp8)
    if num_token_padding and out.shape[0] < num_token_padding:
        out = torch.cat([out, out.new_zeros(num_token_padding - out.shape[0], *out.shape[1:])])
    return out, scale.reshape(-1, 1) if use_per_token_if_dynamic else scale.reshape(1)

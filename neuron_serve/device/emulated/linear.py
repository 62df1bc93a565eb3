"""Emulated backend: linear layers on oneDNN with weights prepacked once at load.

aten's CPU GEMM re-packs the weight on every call and streams it slowly at decode sizes: a
oneDNN matmul on a weight prepacked once is several times faster there, and still well
ahead at prefill sizes (measured with benchmarks/linear_bench.py: benchmarks/README.md,
"Design measurements"). vLLM's CPU extension builds those matmuls
(`create_onednn_mm_handler`); the handle is a tensor buffer of the layer, so a compiled
graph reads it at run time and holds no pointer, and the cached graphs stay free of weights
and process state.

Steps of at most `skinny_matmul.max_rows()` rows (decode) run on our own kernel instead,
which streams the weight faster at those sizes (skinny_matmul.py); each layer then keeps
that kernel's copy of the weight beside oneDNN's.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from neuron_serve.device.emulated import skinny_matmul


@torch.library.custom_op("neuron_serve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, handle: torch.Tensor,
                  out_features: int) -> torch.Tensor:
    """`x @ W.T + bias` for the weight prepacked in `handle`; x is [rows, in_features]."""
    out = x.new_empty((x.shape[0], out_features))
    torch.ops._C.onednn_mm(out, x.contiguous(), bias, handle)
    return out


@packed_linear.register_fake
def _(x, bias, handle, out_features):
    return x.new_empty((x.shape[0], out_features))


def _register_lowering() -> None:
    """In compiled graphs the op becomes a direct call of vLLM's `_C::onednn_mm` into a
    fresh buffer: no Python in between, whose cost per call, paid by every linear layer of
    every step, adds up to a visible share of a decode step (measured: benchmarks/README.md,
    "Design measurements").
    The op stays functional up to then: vLLM's `onednn_mm` writes its output argument, and
    tracing cannot functionalize it inside a layer compiled once (compile_regions.py)."""
    from torch._inductor import ir
    from torch._inductor.lowering import empty_strided, lowerings, register_lowering

    op = torch.ops.neuron_serve.packed_linear.default
    if op in lowerings:
        return

    @register_lowering(op, type_promotion_kind=None)
    def _lower(x, bias, handle, out_features):
        out = empty_strided([x.get_size()[0], out_features], None, dtype=x.get_dtype(),
                            device=x.get_device())
        ir.FallbackKernel.create(torch.ops._C.onednn_mm.default, out,
                                 ir.ExternKernel.require_contiguous(x), bias, handle)
        return out


class _PackedApply:
    """`apply` on the packed matmul. Plain picklable state only: compiled graphs serialize
    the method objects they call."""

    def __init__(self, out_features: int, skinny_rows: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.skinny_rows = skinny_rows  # steps of up to this many rows: the skinny kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        rows = x.reshape(-1, x.shape[-1])
        # A graph's row count is its bucket's, so each graph calls one kernel per layer.
        if rows.shape[0] <= self.skinny_rows:
            out = skinny_matmul.skinny_matmul(rows, layer.skinny_weight, bias, self.out_features)
        else:
            out = packed_linear(rows, bias, layer.packed_handle, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinearMethod(_PackedApply, UnquantizedLinearMethod):
    pass


class PackedEmbeddingMethod(_PackedApply, UnquantizedEmbeddingMethod):
    """A tied LM head: `apply` computes logits packed, `embedding` still looks rows up."""


def supported() -> bool:
    return hasattr(torch.ops._C, "create_onednn_mm_handler")


def pack_linear_layers(model: nn.Module) -> int:
    """Run every unquantized fp32 linear (and a tied LM head) on a prepacked oneDNN matmul,
    and steps of up to `skinny_matmul.max_rows()` rows on the skinny kernel; returns the
    number of layers packed."""
    import vllm._custom_ops as ops

    _register_lowering()
    skinny_rows = skinny_matmul.max_rows()
    if skinny_rows:
        skinny_matmul.load()

    methods = {UnquantizedLinearMethod: PackedLinearMethod,
               UnquantizedEmbeddingMethod: PackedEmbeddingMethod}
    packed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (type(method) not in methods
                or weight is None or weight.dim() != 2 or weight.dtype != torch.float32):
            continue
        handler = ops.create_onednn_mm(weight.detach().t(), 32)
        module.register_buffer("packed_handle", handler.handler_tensor, persistent=False)
        if skinny_rows:
            module.register_buffer("skinny_weight", skinny_matmul.pack_weight(weight.detach()),
                                   persistent=False)
        module.packed_handler = handler  # owns the oneDNN primitive, freed with the layer
        module.packed_bytes = weight.numel() * weight.element_size()  # oneDNN's copy
        module.quant_method = methods[type(method)](handler.n, skinny_rows)
        if type(method) is UnquantizedLinearMethod:  # an embedding still looks rows up
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        packed += 1
    return packed


def packed_weight_bytes(model: nn.Module) -> int:
    """Memory the packed weights hold outside the model's parameters: oneDNN's copy of each
    layer, the skinny kernel's, and 8-bit layers' blocks (quantized_linear.py)."""
    total = 0
    for module in model.modules():
        total += getattr(module, "packed_bytes", 0)
        for name in ("skinny_weight", "weight_blocks", "weight_block_scale"):
            buffer = getattr(module, name, None)
            if buffer is not None:
                total += buffer.numel() * buffer.element_size()
    return total

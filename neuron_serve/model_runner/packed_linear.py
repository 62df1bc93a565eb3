"""Emulated backend: linear layers on oneDNN with weights prepacked once at load.

aten's CPU GEMM re-packs the weight on every call and streams it at 10-20 GB/s at decode
sizes: on the SmolLM2 shape, 30 layers' gate_up take 20.5 ms at 8 rows through aten and
4.9 ms through a oneDNN matmul on a prepacked weight, 175 vs 60 ms at 256 rows
(benchmarks/linear_bench.py, results/linear_kernels-smollm2-135m.md). vLLM's CPU
extension builds those matmuls (`create_onednn_mm_handler`); the handle is a tensor buffer
of the layer, so a compiled graph reads it at run time and holds no pointer, and the
cached graphs stay free of weights and process state.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod


def _register_fake_matmul() -> None:
    """vLLM's CPU extension ships `_C::onednn_mm` without a fake kernel, which tracing
    needs. Calling it straight from the graph costs 14 us less per call than wrapping it in
    a Python custom op (120 calls per SmolLM2 step)."""
    try:
        torch.library.register_fake("_C::onednn_mm")(lambda out, x, bias, handle: None)
    except RuntimeError:  # registered already (by us earlier, or by a later vLLM)
        pass


class _PackedApply:
    """`apply` on the packed matmul. Plain picklable state only: compiled graphs serialize
    the method objects they call."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        out = x.new_empty((*x.shape[:-1], self.out_features))
        torch.ops._C.onednn_mm(out.view(-1, self.out_features), x.reshape(-1, x.shape[-1]),
                               bias, layer.packed_handle)
        return out


class PackedLinearMethod(_PackedApply, UnquantizedLinearMethod):
    pass


class PackedEmbeddingMethod(_PackedApply, UnquantizedEmbeddingMethod):
    """A tied LM head: `apply` computes logits packed, `embedding` still looks rows up."""


def supported() -> bool:
    return hasattr(torch.ops._C, "create_onednn_mm_handler")


def pack_linear_layers(model: nn.Module) -> int:
    """Run every unquantized fp32 linear (and a tied LM head) on a prepacked oneDNN matmul;
    returns the number of layers packed."""
    import vllm._custom_ops as ops

    _register_fake_matmul()

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
        module.packed_handler = handler  # owns the oneDNN primitive, freed with the layer
        module.quant_method = methods[type(method)](handler.n)
        if type(method) is UnquantizedLinearMethod:  # an embedding still looks rows up
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        packed += 1
    return packed

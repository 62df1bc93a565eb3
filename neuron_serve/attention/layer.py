"""vLLM's attention layer, finding its KV cache and metadata through itself.

vLLM's `Attention.forward` looks both up by the layer's name, a string that tracing bakes
into the graph, so no two layers trace alike. This forward reads `self.kv_cache` and the
step's single metadata object instead: every layer of a stack traces to the same program,
which is what lets a layer be compiled once for all (model_runner/compile_regions.py), and
one metadata object serves every layer of a step.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.attention import Attention

from neuron_serve.attention.kernels import KernelSet


class NeuronAttentionLayer(Attention):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                output_shape: torch.Size | None = None,
                output_dtype: torch.dtype | None = None) -> torch.Tensor:
        num_tokens = query.shape[0]
        output_shape = output_shape or torch.Size((num_tokens, self.num_heads * self.head_size_v))
        output = torch.empty(output_shape, dtype=output_dtype or query.dtype, device=query.device)
        self.impl.forward(self, query.view(-1, self.num_heads, self.head_size),
                          key.view(-1, self.num_kv_heads, self.head_size),
                          value.view(-1, self.num_kv_heads, self.head_size_v), self.kv_cache,
                          get_forward_context().attn_metadata,
                          output.view(-1, self.num_heads, self.head_size_v))
        return output.view(-1, output_shape[-1])


def adopt(model: torch.nn.Module, kernel_set: KernelSet) -> int:
    """Give every vLLM `Attention` layer of `model` this forward and `kernel_set`; returns
    how many. Changes these layers only: no class or function shared with other code."""
    layers = [m for m in model.modules() if type(m) is Attention]
    for layer in layers:
        layer.__class__ = NeuronAttentionLayer
        layer.impl.kernels = kernel_set
    return len(layers)

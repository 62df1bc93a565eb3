"""Linear layers on prepacked oneDNN matmuls (emulated backend) against plain
`x @ W.T + b` on the same weights, eager and compiled into a graph."""

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from neuron_serve.device.emulated import linear as packed_linear
from neuron_serve.device.emulated import skinny_matmul

pytestmark = [pytest.mark.emulated, pytest.mark.skipif(not packed_linear.supported(),
                                reason="this vLLM build has no oneDNN matmul")]


class Layer(nn.Module):
    """What the packing sees of a vLLM layer: a weight, a bias and a quant_method."""

    def __init__(self, method, out_features: int, in_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5,
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.randn(out_features), requires_grad=False) if bias else None
        self.quant_method = method

    def forward(self, x):
        return self.quant_method.apply(self, x, self.bias)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Layer(UnquantizedLinearMethod(), 96, 64, bias=True)
        self.head = Layer(UnquantizedEmbeddingMethod(), 200, 96, bias=False)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 129])  # both sides of max_rows: 64 or 128
def test_packed_layers_match_plain_matmuls_eager_and_compiled(rows):
    torch.manual_seed(rows)
    model = Model()
    w1, b1, w2 = model.proj.weight.clone(), model.proj.bias.clone(), model.head.weight.clone()
    x = torch.randn(rows, 64)
    expected = torch.relu(x @ w1.T + b1) @ w2.T

    assert packed_linear.pack_linear_layers(model) == 2
    # Rows up to max_rows() run on the skinny kernel where the CPU has AVX2, more on oneDNN.
    skinny = skinny_matmul.max_rows() > 0
    assert hasattr(model.proj, "skinny_weight") == skinny
    # The KV-cache budget counts both copies: oneDNN's, and the skinny kernel's padded to
    # 16-column blocks (96 -> 96, 200 -> 208 outputs).
    expected_bytes = 4 * (96 * 64 + 200 * 96) + skinny * 4 * (96 * 64 + 208 * 96)
    assert packed_linear.packed_weight_bytes(model) == expected_bytes
    assert model.proj.weight.numel() == 0  # released: the packed copy is the only one
    assert torch.equal(model.head.weight, w2)  # a tied head still looks embeddings up
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)


def test_only_unquantized_fp32_linears_are_packed():
    model = Model()
    model.proj.weight.data = model.proj.weight.data.to(torch.bfloat16)
    assert packed_linear.pack_linear_layers(model) == 1
    assert type(model.proj.quant_method) is UnquantizedLinearMethod

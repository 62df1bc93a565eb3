"""A stack of identical layers is traced once and called per layer, each call with its own
weights and its own in-place cache, and the compiled model matches eager."""

import torch
from torch import nn

from neuron_serve.model_runner.compile_regions import compile_layers_once, layers_inlined


class Layer(nn.Module):
    """Like a decoder layer: its own weight, and a cache it writes in place (the KV cache)."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(16, 16, generator=gen) / 4, requires_grad=False)
        self.register_buffer("cache", torch.zeros(8, 16))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        self.cache.index_put_((slot,), x)
        return torch.tanh(x @ self.weight) + self.cache.sum(0)


class Stack(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(seed) for seed in range(depth))

    def forward(self, x, slot):
        for layer in self.layers:
            x = layer(x, slot)
        return x


def traced_regions(model, *args):
    """Run `model` compiled; return (output, [subgraph name each invoke_subgraph calls])."""
    calls = []

    def backend(gm, example_inputs):
        calls.extend(n.args[0].target for n in gm.graph.nodes
                     if n.target is torch.ops.higher_order.invoke_subgraph)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args)
    return out, calls


def test_identical_layers_compile_once_and_each_uses_its_own_weights_and_cache():
    x, slot = torch.randn(2, 16), torch.tensor([3, 5])
    eager, compiled = Stack(4), Stack(4)
    expected = eager(x, slot)

    assert compile_layers_once(compiled) == 4
    out, calls = traced_regions(compiled, x, slot)

    assert len(calls) == 4 and len(set(calls)) == 1  # one traced program, called per layer
    torch.testing.assert_close(out, expected)
    for mine, reference in zip(compiled.layers, eager.layers):
        torch.testing.assert_close(mine.cache, reference.cache)


def test_marking_twice_changes_nothing():
    model = Stack(3)
    compile_layers_once(model)
    region = type(model.layers[0])
    assert compile_layers_once(model) == 3
    assert type(model.layers[0]) is region and isinstance(model.layers[0], Layer)


def test_layers_inlined_traces_every_layer_inline_and_restores_the_regions():
    x, slot = torch.randn(2, 16), torch.tensor([3, 5])
    eager, compiled = Stack(3), Stack(3)
    expected = eager(x, slot)
    compile_layers_once(compiled)
    region = type(compiled.layers[0])

    with layers_inlined(compiled):
        assert all(type(layer) is Layer for layer in compiled.layers)
        out, calls = traced_regions(compiled, x, slot)

    assert calls == []  # no compile region left in the trace
    torch.testing.assert_close(out, expected)
    assert all(type(layer) is region for layer in compiled.layers)

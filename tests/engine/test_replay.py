"""A compiled graph replayed with its recorded arguments (device/emulated/replay.py) computes
what eager computes, step after step, from its persistent inputs and its in-place cache;
a graph given a new tensor per call is never replayed.

Oracle: the same module run eagerly on its own copy of the weights and cache.
"""

import copy
import functools
import gc

import pytest
import torch
from torch import nn

from neuron_serve.device.emulated.replay import ProgramReplay


class Model(nn.Module):
    """A weight, a KV-cache-like buffer written in place, and a cache whose row count is a
    symbolic size (as the KV cache's block count is in our graphs)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(16, 16, generator=gen) / 4, requires_grad=False)
        self.cache = torch.zeros(10, 16)

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(x @ self.weight)
        self.cache.index_put_((slot,), hidden)
        return hidden.sum(-1) + self.cache.sum(), hidden


def step(model, x, slot):
    return model(x, slot)


@pytest.fixture(scope="module", params=[True, False], ids=["cpp-wrapper", "python-wrapper"])
def compiled(request):
    """(compiled step, its model, persistent x, persistent slot, cpp_wrapper)."""
    model, x, slot = Model(), torch.zeros(2, 16), torch.zeros(2, dtype=torch.long)
    torch._dynamo.mark_dynamic(model.cache, 0)
    with torch.no_grad():
        fn = torch.compile(step, fullgraph=True, dynamic=False,
                           options={"cpp_wrapper": request.param}).aot_compile(((model, x, slot), {}))
    fn.disable_guard_check()  # as the runner does: later calls pass the same objects
    return fn, model, x, slot, request.param


def fresh_start(compiled):
    """An empty cache, its eager twin (the oracle) and a new replay."""
    fn, model, x, slot, cpp_wrapper = compiled
    model.cache.zero_()
    return fn, model, x, slot, copy.deepcopy(model), ProgramReplay(sizes_as_tensors=cpp_wrapper)


def test_replay_matches_eager_on_new_inputs_every_step(compiled):
    fn, model, x, slot, reference, replay = fresh_start(compiled)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i in range(6):
            x.copy_(torch.randn(2, 16, generator=gen))  # in place, as the runner fills buffers
            slot.copy_(torch.tensor([i, 9 - i]))
            logits, hidden = replay(lambda: fn(model, x, slot))
            expected_logits, expected_hidden = reference(x, slot)
            torch.testing.assert_close(logits, expected_logits)
            torch.testing.assert_close(hidden, expected_hidden)
            torch.testing.assert_close(model.cache, reference.cache)
            # Two calls through the graph prove its arguments the same; then it replays, a
            # C++-wrapper program through its C++ entry.
            assert replay.replaying == (i >= 1)
            assert (replay.native is not None) == (replay.replaying and compiled[-1])


def test_a_new_tensor_per_call_is_never_replayed(compiled):
    fn, model, _, slot, reference, replay = fresh_start(compiled)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i in range(4):
            fresh = torch.randn(2, 16, generator=gen)
            slot.copy_(torch.tensor([i, i + 1]))
            logits, _ = replay(functools.partial(fn, model, fresh, slot))
            torch.testing.assert_close(logits, reference(fresh, slot)[0])
            assert not replay.replaying


def test_replay_holds_a_cpp_reference_on_its_tensors_while_it_lives(compiled):
    """So the program's dropping of its input handles never hands a tensor's Python object
    back (under the GIL) mid-step; gone with the replay, so nothing is kept alive."""
    fn, model, x, slot, _, replay = fresh_start(compiled)
    before = model.weight._use_count()
    with torch.no_grad():
        for _ in range(3):
            replay(lambda: fn(model, x, slot))
    assert replay.replaying and model.weight._use_count() == before + 1
    del replay
    gc.collect()
    assert model.weight._use_count() == before

"""The vectorizer's stride queries answered without sympy.simplify: the same strides as
inductor's own analysis, and byte-identical generated kernels."""

import random

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import sizevars
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from neuron_serve.device.emulated import inductor_strides

pytestmark = pytest.mark.emulated

X = sympy.symbols("x0:4", integer=True, nonnegative=True)
TMP = sympy.Symbol("tmp0", integer=True)


def affine_indices() -> list[sympy.Expr]:
    rng = random.Random(0)
    return [sum(rng.choice([0, 1, 32, 64, 128, 4096]) * s for s in (*X, TMP)) + rng.randrange(64)
            for _ in range(40)]


OTHER_INDICES = [X[3] * TMP + X[1], X[3] ** 2 + 7, X[2] + 4096 * FloorDiv(X[3], 32),
                 64 * X[1] + 128 * ModularIndexing(X[3], 1, 32)]


@pytest.mark.parametrize("vec_length", [None, 8, 16])
def test_strides_equal_inductors_own(vec_length, monkeypatch):
    theirs = {i: sizevars.stride_at_vec_range(i, X[3], vec_length)
              for i in affine_indices() + OTHER_INDICES}
    for index in OTHER_INDICES:
        assert inductor_strides.stride_at_vec_range(index, X[3], vec_length) == theirs[index]

    def inductor_not_asked(*args):
        raise AssertionError("an affine index went to sympy.simplify")
    monkeypatch.setattr(inductor_strides, "_inductor_stride", inductor_not_asked)
    for index in affine_indices():
        ours = inductor_strides.stride_at_vec_range.__wrapped__(index, X[3], vec_length)
        assert ours == theirs[index], index


def paged_gather(cache, table, q):
    """The shape of our attention kernels' indexing: blocks picked by a table, permuted."""
    kv = cache[table].flatten(1, 2).permute(0, 2, 1, 3)
    return torch.softmax(q @ kv.transpose(-1, -2), -1) @ kv


def generated_code() -> str:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    cache, q = torch.randn(16, 8, 2, 32, generator=gen), torch.randn(3, 2, 5, 32, generator=gen)
    table = torch.tensor([[1, 4], [2, 0], [7, 3]])
    with inductor_config.patch(force_disable_caches=True):
        _, (code, *_) = run_and_get_code(torch.compile(paged_gather, fullgraph=True), cache, table, q)
    return "\n".join(line for line in code.splitlines() if not line.startswith("# AOT ID"))


def test_generated_kernels_are_identical(monkeypatch):
    before = generated_code()
    monkeypatch.setattr(cpp, "stride_at_vec_range", inductor_strides.stride_at_vec_range)
    inductor_strides.stride_at_vec_range.cache_clear()
    assert generated_code() == before
    assert inductor_strides.stride_at_vec_range.cache_info().misses > 0  # it was asked

"""The emulated backend's inductor pass: few-row matrix products become reductions, with
the same results as BLAS; larger ones are left alone."""

import pytest
import torch
import torch.nn.functional as F

from neuron_serve.model_runner.small_gemm import MAX_ROWS, SmallGemmAsReduction


@pytest.mark.parametrize("rows,rewritten", [(1, 2), (MAX_ROWS, 2), (MAX_ROWS + 1, 0)])
def test_few_row_products_are_rewritten_and_match_blas(rows, rewritten):
    gen = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((rows, 96), (160, 96), (160,)))
    pass_ = SmallGemmAsReduction()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: (F.linear(x, w), F.linear(x, w, b)), fullgraph=True,
                       dynamic=False, options={"post_grad_custom_post_pass": pass_,
                                               "fx_graph_cache": False})  # else a cache hit skips the pass
    plain, biased = fn(x, w, b)
    torch.testing.assert_close(plain, x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(biased, x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert pass_.rewritten == rewritten

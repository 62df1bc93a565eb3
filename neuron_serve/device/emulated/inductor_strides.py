"""Inductor's CPU vectorizer, answering its most frequent question without `sympy.simplify`.

For every memory access of every loop it considers, the vectorizer asks how far the index
moves when the loop variable steps by one, and answers with `sympy.simplify`, which is slow
even for a plain affine index such as `128*x0 + 64*x1 + x3` and, summed over the queries, a
large share of a small model's graph compile. For an index built only from symbols and
integers with + and ×, the stride is the exact difference `index(v + 1) - index(v)` once
expanded. When that is an integer it is the number simplify would return, found in
microseconds; the kernels inductor writes are byte-identical either way. Any other index
(floor division, modulo, a non-integer step) still goes to inductor's own analysis. Few
queries are left to it, and graphs compile measurably faster (measured:
benchmarks/README.md, "Design measurements").
"""

from __future__ import annotations

import functools

import sympy
from torch._inductor import sizevars

_inductor_stride = sizevars.stride_at_vec_range


@functools.cache
def stride_at_vec_range(index: sympy.Expr, var: sympy.Symbol, vec_length: int | None = None):
    """Drop-in for inductor's function of the same name (same arguments, same answers)."""
    if _is_polynomial(index):
        step = sympy.expand(index.xreplace({var: var + 1}) - index)
        if step.is_Integer:
            return step
    return _inductor_stride(index, var, vec_length)


def _is_polynomial(index: sympy.Expr) -> bool:
    return all(a.is_Symbol or a.is_Integer for a in index.atoms()) and \
        not index.atoms(sympy.Function)


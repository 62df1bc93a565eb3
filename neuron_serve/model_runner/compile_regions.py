"""Compile a stack of identical decoder layers once per graph, not once per layer.

A bucket's graph is the whole step, and inductor used to trace, lower, generate and build
every layer again: compile time grew with depth. A layer class whose forward is a nested
compile region is traced once and emitted once, as a function every layer calls with its
own weights and KV cache, so a deep model's graph compiles several times faster (measured:
benchmarks/README.md, "Design measurements"). A layer that traces differently (the first,
which starts the residual stream; one with another sliding window) gets a region of its own.
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from collections.abc import Iterator

import torch
from torch import nn


def compile_layers_once(model: nn.Module) -> int:
    """Mark each outermost stack of same-class layers in `model` as one compile region;
    returns the number of layers marked. The attention layers must be adopted first
    (attention/layer.py): no layer name may be in the traced program."""
    marked, inside = 0, []
    for name, stack in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if not (isinstance(stack, nn.ModuleList) and len(stack) > 1
                and len({type(m) for m in stack}) == 1):
            continue
        region = _region_class(type(stack[0]), max_variants=len(stack))
        for layer in stack:
            layer.__class__ = region
        marked += len(stack)
        inside.append(name + ".")
    return marked


@contextlib.contextmanager
def layers_inlined(model: nn.Module) -> Iterator[None]:
    """While tracing inside, every marked layer is its own class again: the graph inlines
    each layer (inductor's C++ wrapper cannot emit compile regions)."""
    marked = [(m, type(m)) for m in model.modules() if type(m).__module__ == __name__]
    for module, region in marked:
        module.__class__ = region.__mro__[1]
    try:
        yield
    finally:
        for module, region in marked:
            module.__class__ = region


def _region_class(cls: type, max_variants: int) -> type:
    """`cls` with its forward a compile region. Created once per class and kept in this
    module's namespace: compiled graphs pickle the classes of the modules they guard on."""
    if cls.__module__ == __name__:
        return cls
    name = f"{cls.__name__}_{zlib.crc32(f'{cls.__module__}.{cls.__qualname__}'.encode()):08x}"
    if name not in globals():
        region = torch.compiler.nested_compile_region(cls.forward,
                                                      max_reuse_entries=max_variants)
        none_by_default = {p.name for p in inspect.signature(cls.forward).parameters.values()
                           if p.default is None}

        def forward(self, *args, **kwargs):
            # A keyword argument left at its None default stays out of the region: it would
            # guard on pytree's registry, which a compiled graph cannot serialize (Mistral
            # layers get t_cond=None).
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in none_by_default}
            return region(self, *args, **kwargs)

        globals()[name] = type(name, (cls,), {"forward": forward, "__module__": __name__,
                                              "__qualname__": name})
    return globals()[name]

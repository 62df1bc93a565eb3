"""Emulated backend: a bucket's compiled program called straight, with the arguments it
was last given.

Calling an inductor graph goes through dynamo's bytecode (which gathers every weight,
buffer and KV cache off the model: ~340 tensors for a 30-layer model), AOT autograd's
runtime wrappers, and, for a C++-wrapper graph, a Python entry that turns each symbolic
size into a tensor. A bucket's graph is called with the same model, the same persistent
buffers and the same KV caches on every step, so all of that rebuilds the same argument
list every time: a visible share of a short decode step (measured: benchmarks/README.md,
"Design measurements").

`ProgramReplay` watches two calls of a bucket's graph. If each ran exactly one inductor
program, with the same tensor objects and the same sizes both times, and the graph
returned that program's outputs unchanged, later calls hand the recorded arguments to the
program directly. Anything else (a tensor built per call, a second program, an output the
wrappers rework) keeps the full path, so a replay can only ever do what the graph does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.output_code import CompiledFxGraph

_PROFILER_LABEL = "## Call CompiledFxGraph replayed ##"  # benchmarks/step_profile.py keys on it


class ProgramReplay:
    """Runs one bucket's graph: `graph_call()` until two calls proved it replayable, then
    its inductor program with the recorded arguments."""

    def __init__(self, sizes_as_tensors: bool):
        # A C++-wrapper program takes its symbolic sizes as tensors (and converts each one
        # on every call); a Python-wrapper program takes ints.
        self.sizes_as_tensors = sizes_as_tensors
        self.program: Callable[[list], Sequence[torch.Tensor]] | None = None
        self.args: list = []
        self._seen: list[Any] | None = None  # the first call's arguments
        self.watching = True  # False once the graph proved not replayable

    @property
    def replaying(self) -> bool:
        return self.program is not None

    def __call__(self, graph_call: Callable[[], tuple]) -> tuple:
        if self.program is not None:
            return self._replay()
        if not self.watching:
            return graph_call()
        calls, result = _watch(graph_call)
        self._learn(calls, result)
        return result

    def _replay(self) -> tuple:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(_PROFILER_LABEL):
                return tuple(self.program(list(self.args)))
        return tuple(self.program(list(self.args)))  # the program clears the list it gets

    def _learn(self, calls: list[tuple[CompiledFxGraph, list, Any]], result: tuple) -> None:
        if len(calls) != 1:
            self.watching = False
            return
        program, args, outputs = calls[0]
        if len(outputs) != len(result) or any(o is not r for o, r in zip(outputs, result)):
            self.watching = False
            return
        if self._seen is None:
            self._seen = args
            return
        if not _same_arguments(self._seen, args):
            self.watching = False
            return
        if self.sizes_as_tensors:
            args = [a if isinstance(a, torch.Tensor) else torch.tensor(a) for a in args]
        self.program, self.args, self._seen = program.current_callable, args, None
        _hold_cpp_references(self, [a for a in args if isinstance(a, torch.Tensor)])


def _hold_cpp_references(owner: object, tensors: list[torch.Tensor]) -> None:
    """One more C++ reference on each tensor while `owner` lives. A C++-wrapper program drops
    its handle on each input once done with it; a tensor whose C++ count falls back to one
    hands its Python object back, which takes the GIL the program released: ~400 times a
    step, a measurable share of a short one (benchmarks/README.md, "Design measurements")."""
    pins = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)
    weakref.finalize(owner, torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs, pins)


def _watch(graph_call: Callable[[], tuple]) -> tuple[list, tuple]:
    """Run `graph_call`, recording each inductor program it calls: (program, its
    arguments, its outputs)."""
    calls = []
    original = CompiledFxGraph.__call__

    def spy(program: CompiledFxGraph, inputs: Sequence[Any]) -> Any:
        args = list(inputs)  # the program clears its list
        outputs = original(program, inputs)
        calls.append((program, args, outputs))
        return outputs

    CompiledFxGraph.__call__ = spy
    try:
        result = graph_call()
    finally:
        CompiledFxGraph.__call__ = original
    return calls, result


def _same_arguments(first: list, second: list) -> bool:
    """The same tensor objects (a tensor made per call is a new object each time) and the
    same sizes."""
    if len(first) != len(second):
        return False
    for a, b in zip(first, second):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if a is not b:
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True

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

A C++-wrapper program's Python entry also makes a new handle per argument through Python
on every call; a replay calls its C++ entry from C++ instead (program_call.cpp), on copies
of handles it holds.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.output_code import CompiledFxGraph

from neuron_serve.device.emulated import extension

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
        self.native: NativeCall | None = None  # the C++ entry, where the program has one
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
                return self._call()
        return self._call()

    def _call(self) -> tuple:
        if self.native is not None:
            return self.native()
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
        held = _hold_cpp_references(self, [a for a in args if isinstance(a, torch.Tensor)])
        entry = _cpp_entry(self.program) if self.sizes_as_tensors else None
        if entry is not None and len(held) == len(args) and all(
                isinstance(o, torch.Tensor) for o in outputs):
            self.native = NativeCall(entry, held, len(outputs))


def _hold_cpp_references(owner: object, tensors: list[torch.Tensor]) -> list:
    """One more C++ reference on each tensor while `owner` lives; returns their handles. A
    C++-wrapper program drops its handle on each input once done with it; a tensor whose C++
    count falls back to one hands its Python object back, which takes the GIL the program
    released: ~400 times a step, a measurable share of a short one (benchmarks/README.md,
    "Design measurements")."""
    pins = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)
    weakref.finalize(owner, torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs, pins)
    return pins


# The C++ wrapper's entry, `void inductor_entry_impl(AtenTensorHandle*, AtenTensorHandle*)`
# (torch/_inductor/codegen/cpp_wrapper_cpu.py), by its C++ name in the graph's library.
_ENTRY_SYMBOL = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_"


def _cpp_entry(program: Callable) -> int | None:
    """The address of a C++-wrapper program's entry, or None if it cannot be found (the
    replay then calls the program's Python entry)."""
    module = getattr(getattr(program, "__globals__", {}).get("inductor_entry"), "__self__", None)
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    try:
        return ctypes.cast(ctypes.PyDLL(path)[_ENTRY_SYMBOL], ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class NativeCall:
    """A C++-wrapper program's entry called from C++ on copies of the replay's held handles
    (program_call.cpp): no Python list of new handles per call."""

    def __init__(self, entry: int, held: list, num_outputs: int):
        self.entry = entry
        self.held = (ctypes.c_void_p * len(held))(*(_capsule_pointer(h, None) for h in held))
        self.outputs = (ctypes.c_void_p * num_outputs)()
        self.error = ctypes.create_string_buffer(2048)
        self.call = extension.graph_caller()

    def __call__(self) -> tuple:
        if self.call(self.entry, self.held, len(self.held), self.outputs, self.error,
                     len(self.error)):
            raise RuntimeError(f"compiled graph failed: {self.error.value.decode(errors='replace')}")
        handles = [_new_capsule(h, None, None) for h in self.outputs]
        return tuple(torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(handles))


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

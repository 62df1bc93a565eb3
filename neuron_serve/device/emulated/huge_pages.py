"""Emulated backend: the decode kernel's packed weights in transparent huge pages.

A decode step streams every weight once, a layer at a time, in blocks of a few KB: in 4 KB
pages that is a page walk every 4 KB of every stream, and the walks go to memory as often
as the weights do. In 2 MB pages the same stream reads faster (measured:
benchmarks/memory_effects.py, benchmarks/README.md "Design measurements").

Linux gives huge pages to anonymous mappings advised with MADV_HUGEPAGE, whole 2 MB
extents only, so the packed weights are carved out of shared chunks of 64 MB rather than
mapped one small layer at a time. A chunk lives as long as a tensor in it. Where the kernel
has no huge pages to give (THP off, another OS), the mapping is plain memory and nothing
else changes. The KV cache maps its own (kv_memory.py).
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable

import torch

_CHUNK_BYTES = 64 << 20
_ALIGN = 64  # a cache line: the kernel streams whole lines


class HugePageArena:
    """Bump allocation of tensors from huge-page-advised anonymous mappings. Each tensor has
    a storage of its own (dynamo takes tensors that share one for aliases of each other)."""

    def __init__(self, chunk_bytes: int = _CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        # The mapping being filled, held weakly: once its tensors are gone it is unmapped,
        # not kept resident for the next model.
        self._chunk: Callable[[], mmap.mmap | None] = lambda: None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor, 64-byte aligned; one larger than a chunk
        gets a mapping of its own."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if nbytes > self.chunk_bytes:
            area, start = mapping(nbytes), 0
        else:
            area = self._chunk()
            if area is None or self._used + nbytes > self.chunk_bytes:
                area, self._used = mapping(self.chunk_bytes), 0
                self._chunk = weakref.ref(area)
            start = self._used
            self._used = -(-(start + nbytes) // _ALIGN) * _ALIGN
        # The tensor's storage holds the mapping (a buffer export) for as long as it lives.
        raw = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)
        return raw.view(dtype).view(shape)


def mapping(nbytes: int) -> mmap.mmap:
    """A new anonymous mapping of `nbytes` (zeros, unbacked until written), advised to use
    huge pages; plain pages where the kernel has no THP."""
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here
        area.madvise(mmap.MADV_HUGEPAGE)
    return area


_arena = HugePageArena()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor for packed weights, from this process's arena."""
    return _arena.empty(shape, dtype)

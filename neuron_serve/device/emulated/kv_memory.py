"""Emulated backend: the KV cache on transparent huge pages.

A decode step reads each sequence's KV blocks, which lie anywhere in the cache. On 4 KB
pages a SmolLM2 position (1.5 KB) crosses a page every 2-3 positions: a TLB miss each time,
and a fresh start for the hardware prefetcher. On 2 MB pages the same reads are faster
(measured: benchmarks/README.md, "Design measurements"). torch's own switch
(THP_MEM_ALLOC_ENABLE) is read once per process, at its first allocation, so the cache is
mapped and advised here instead.
"""

from __future__ import annotations

import contextlib
import mmap

import torch


def zeros(nbytes: int, committed: bool = True) -> torch.Tensor:
    """`nbytes` zero bytes (int8) on anonymous memory advised to use huge pages; plain pages
    where the kernel has no THP. Committed now, as torch.zeros would, unless `committed` is
    False: anonymous pages read as zero and stay unbacked until written."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here
        region.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(region, dtype=torch.int8, count=nbytes)  # keeps region alive
    return tensor.zero_() if committed else tensor

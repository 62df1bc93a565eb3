"""Emulated backend: the KV cache on transparent huge pages, committed in the background.

A decode step reads each sequence's KV blocks, which lie anywhere in the cache. On 4 KB
pages a SmolLM2 position (1.5 KB) crosses a page every 2-3 positions: a TLB miss each time,
and a fresh start for the hardware prefetcher. On 2 MB pages the same reads are faster
(measured: benchmarks/README.md, "Design measurements"). torch's own switch
(THP_MEM_ALLOC_ENABLE) is read once per process, at its first allocation, so the cache is
mapped and advised here instead.

Anonymous pages read as zero, so the cache needs no writing; committing it (faulting the
huge pages in) is what costs: seconds per GiB where the kernel must compact memory to find
huge pages. A thread does it with MADV_POPULATE_WRITE, which faults pages in without
touching their contents, so the engine serves meanwhile and a page it writes first is
simply already there.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import time

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module does not name it


def zeros(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (int8) on anonymous memory advised to use huge pages; plain pages
    where the kernel has no THP. Uncommitted: pages stay unbacked until written, or until
    `commit_in_background` faults them in."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.int8, count=nbytes)  # keeps region alive


def commit_in_background(tensor: torch.Tensor) -> threading.Thread:
    """Fault `tensor`'s pages in, writable, from a daemon thread (the call releases the
    GIL). Safe while the tensor is in use: no byte is written. Where the kernel lacks
    MADV_POPULATE_WRITE the pages stay lazy, committed as they are first written."""
    def populate() -> None:
        t0 = time.monotonic()
        nbytes = tensor.numel() * tensor.element_size()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes),
                        _MADV_POPULATE_WRITE) != 0:
            logger.info("KV cache left to commit on first write (madvise: errno %d)",
                        ctypes.get_errno())
            return
        logger.info("KV cache committed: %.2f GiB in %.1f s, in the background",
                    nbytes / 2**30, time.monotonic() - t0)

    thread = threading.Thread(target=populate, name="kv-cache-commit", daemon=True)
    thread.start()
    return thread

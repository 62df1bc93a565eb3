"""Emulated backend: the KV cache on transparent huge pages, committed as it is written.

A decode step reads each sequence's KV blocks, which lie anywhere in the cache. On 4 KB
pages a SmolLM2 position (1.5 KB) crosses a page every 2-3 positions: a TLB miss each time,
and a fresh start for the hardware prefetcher. On 2 MB pages the same reads are faster
(measured: benchmarks/README.md, "Design measurements"). torch's own switch
(THP_MEM_ALLOC_ENABLE) is read once per process, at its first allocation, so the cache is
mapped and advised here instead.

Anonymous pages read as zero, so the cache is not written at allocation: a page is
committed when a step first writes it. Writing a multi-GiB cache up front cost seconds of
every start (the kernel compacts memory to find huge pages), for blocks most workloads
never reach; faulting it in from a thread slowed the start further (benchmarks/README.md,
"Cold start"). A budget the host cannot hold shows at allocation under strict overcommit
accounting, else when the pages are written; it derives from the host's memory.
"""

from __future__ import annotations

import torch

from neuron_serve.device.emulated import huge_pages


def zeros(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (int8) on anonymous memory advised to use huge pages; plain pages
    where the kernel has no THP. Pages stay unbacked until written."""
    return torch.frombuffer(huge_pages.mapping(nbytes), dtype=torch.int8, count=nbytes)

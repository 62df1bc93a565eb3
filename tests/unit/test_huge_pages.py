"""Huge-page memory of the emulated backend: the KV cache (device/emulated/kv_memory.py),
zeroed, writable memory that lives as long as its tensor, and only vLLM's KV-cache
allocation redirected to it; the decode kernel's packed weights (huge_pages.py), carved out
of shared mappings without aliasing each other."""

import gc
from pathlib import Path

import pytest
import torch

from neuron_serve.device.emulated import huge_pages, kv_memory, setup, skinny_matmul

pytestmark = pytest.mark.emulated


def _smaps_kb(address: int, field: str) -> int:
    """AnonHugePages of the mapping that holds `address`. Not the process's total: other
    tests' memory in the same worker comes and goes (a total fell by 56 MB here once)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field:
            return int(line.split()[1])
    return 0


def test_zeros_are_zero_writable_and_outlive_their_mapping():
    buf = kv_memory.zeros((8 << 20) + 3)
    assert buf.dtype == torch.int8 and buf.numel() == (8 << 20) + 3
    assert not buf.any()
    gc.collect()  # the mapping object is referenced by the tensor alone
    view = buf[: 8 << 20].view(torch.float32).view(-1, 64)
    view[-1] = 1.5
    assert view.sum().item() == 1.5 * 64
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    buf[: 4 << 20].fill_(1)  # written: committed
    assert _smaps_kb(buf.data_ptr(), "AnonHugePages:") >= 2048  # at least one 2 MB page of the 8 MB


def test_pages_are_committed_as_they_are_written():
    buf = kv_memory.zeros(16 << 20)
    assert _smaps_kb(buf.data_ptr(), "Rss:") < (1 << 10)  # unbacked until written
    buf[: 4 << 20] = 7
    assert (4 << 10) <= _smaps_kb(buf.data_ptr(), "Rss:") < (12 << 10)
    assert buf.count_nonzero().item() == 4 << 20


def test_only_the_kv_cache_allocation_is_redirected():
    plain = torch.zeros
    with setup.kv_cache_allocation():
        kv = torch.zeros(1 << 20, dtype=torch.int8, device=torch.device("cpu"))
        other = torch.zeros(4, 4)
        ints = torch.zeros(16, dtype=torch.int8, requires_grad=False)
    assert torch.zeros is plain
    assert not kv.any() and kv.shape == (1 << 20,)
    assert not kv.untyped_storage().resizable()  # ours: a fixed mapping, not torch's allocator
    assert other.untyped_storage().resizable() and ints.untyped_storage().resizable()


def test_arena_tensors_are_aligned_apart_and_outlive_their_chunk():
    arena = huge_pages.HugePageArena(chunk_bytes=4 << 20)
    shapes = [((3, 100, 16), torch.float32), ((5, 7), torch.int8),
              ((2, 9, 16), torch.float8_e4m3fn), ((1020, 1024), torch.float32),  # a new chunk
              (((4 << 20) + 1,), torch.int8)]  # larger than a chunk: a mapping of its own
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    assert tensors[3].data_ptr() - tensors[0].data_ptr() not in range(4 << 20)
    for i, (t, (shape, dtype)) in enumerate(zip(tensors, shapes)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        t.view(torch.uint8).fill_(i + 1)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # Tensors sharing a storage would be aliases of each other to dynamo.
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    del arena
    gc.collect()  # the chunks are referenced by their tensors alone
    for i, t in enumerate(tensors):
        assert (t.view(torch.uint8) == i + 1).all()
    arena = huge_pages.HugePageArena(chunk_bytes=4 << 20)
    only = arena.empty((16,), torch.int8)
    assert arena._chunk() is not None
    del only
    gc.collect()  # the chunk goes with its last tensor, not kept mapped for a next model
    assert arena._chunk() is None
    none = huge_pages.HugePageArena().empty((0, 16), torch.float32)
    assert none.shape == (0, 16) and none.untyped_storage().resizable()  # torch's own


def test_packed_weights_are_on_huge_pages():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    blocks = skinny_matmul.pack_weight(torch.ones(4096, 1024))  # 16 MB of float32 blocks
    assert _smaps_kb(blocks.data_ptr(), "AnonHugePages:") >= 2048

"""The emulated KV cache on huge pages (device/emulated/kv_memory.py): zeroed, writable memory that lives as
long as its tensor, and only vLLM's KV-cache allocation is redirected to it."""

import gc
from pathlib import Path

import pytest
import torch

from neuron_serve.device.emulated import kv_memory, setup

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

"""The emulated backend's split of the host's cores (setup.share_cores): a model rank's
OpenMP threads and inductor's compile threads; background compile processes share the
compile threads, so that together they never start more compilers than there are cores."""

import os

import pytest
import torch
from torch._inductor import config as inductor_config

from neuron_serve.device.emulated import setup


@pytest.fixture
def restore_cores():
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    compile_threads = inductor_config.compile_threads
    yield sorted(affinity)
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)
    inductor_config.compile_threads = compile_threads


@pytest.mark.parametrize("siblings", [1, 2, 3, 64])
def test_compiling_processes_share_the_cores(restore_cores, siblings):
    cores = len(restore_cores)
    setup.share_cores(0, 1, compilers_on_host=siblings)
    assert torch.get_num_threads() == cores
    assert inductor_config.compile_threads == max(1, cores // siblings)
    assert inductor_config.compile_threads * min(siblings, cores) <= cores


def test_a_tensor_parallel_rank_compiles_on_its_own_cores(restore_cores):
    cores = restore_cores
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    setup.share_cores(1, 2)
    mine = sorted(os.sched_getaffinity(0))
    assert mine == cores[len(cores) // 2:len(cores) // 2 * 2]
    assert torch.get_num_threads() == inductor_config.compile_threads == len(mine)

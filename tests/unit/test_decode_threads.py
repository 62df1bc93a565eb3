"""Decode mode (emulated backend, csrc/step_threads.cpp): our kernels split a decode step on
helper threads instead of OpenMP's, and the helpers fetch the weights the step streams next.
The kernels' results must not change by a bit, OpenMP must run on one thread meanwhile and
get its threads back afterwards, and the helpers must actually take tasks and fetch ahead."""

import time

import pytest
import torch
from attention_cases import NEEDS_AVX2, make_case

from neuron_serve.device.emulated import EmulatedDevice, skinny_matmul
from neuron_serve.device.emulated import attention as cpu_kernels
from neuron_serve.device.emulated.quantized_linear import quantize_rows

pytestmark = [pytest.mark.emulated, NEEDS_AVX2]


@pytest.fixture(autouse=True)
def two_threads():
    skinny_matmul.load()
    cpu_kernels.kernel_set()
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a helper even on a one-core machine
    yield
    torch.ops.neuron_serve.set_decode_mode(False)
    torch.set_num_threads(before)


def stats() -> dict[str, int]:
    tasks, fetched, ring = torch.ops.neuron_serve.decode_thread_stats()
    return {"helper_tasks": tasks, "fetched_bytes": fetched, "ring_weights": ring}


def weights(shapes, dtype=torch.int8):
    torch.manual_seed(0)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k) / k ** 0.5
        if dtype == torch.float32:
            out.append((skinny_matmul.pack_weight(w), None, n, k))
        else:
            values, scale = quantize_rows(w, dtype)
            out.append((skinny_matmul.pack_weight(values), skinny_matmul.pack_scale(scale, dtype),
                        n, k))
    return out


def matmuls(layers, rows):
    xs = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) for *_, k in layers}
    return [skinny_matmul.skinny_matmul(xs[k], b, None, n, s) for b, s, n, k in layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matmuls_are_bit_for_bit_the_same_in_decode_mode(dtype, rows):
    layers = weights([(1536, 576), (200, 96), (37, 5)], dtype)
    expected = matmuls(layers, rows)
    torch.ops.neuron_serve.set_decode_mode(True)
    got = matmuls(layers, rows)
    torch.ops.neuron_serve.set_decode_mode(False)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seq_lens", [[200], [150, 70], [31]])
def test_decode_attention_is_bit_for_bit_the_same_in_decode_mode(seq_lens):
    query, kv_cache, table, req_of, pos_of, *_ = make_case(
        3, seq_lens, [1] * len(seq_lens), 6, 2, 64, 32, pad_tokens=0)

    def attend():
        return torch.ops.neuron_serve.paged_attention(query, kv_cache, table, req_of, pos_of,
                                                      0.125, 0, 0.0)
    expected = attend()
    torch.ops.neuron_serve.set_decode_mode(True)
    got = attend()
    torch.ops.neuron_serve.set_decode_mode(False)
    assert torch.equal(got, expected)


def test_openmp_runs_on_one_thread_in_decode_mode_and_gets_its_threads_back():
    device = EmulatedDevice()
    device.before_step(decode=True)
    assert torch.get_num_threads() == 1
    device.before_step(decode=True)
    assert torch.get_num_threads() == 1
    device.before_step(decode=False)
    assert torch.get_num_threads() == 2


def test_helpers_take_tasks_and_fetch_the_learned_weights_ahead():
    first = weights([(1536, 576), (576, 1536), (960, 576)])
    torch.ops.neuron_serve.set_decode_mode(True)
    # Learned once the step comes round; an earlier test's weights may have had these
    # addresses, so three rounds, and only then the counts.
    for _ in range(3):
        matmuls(first, 1)
    assert stats()["ring_weights"] == 3, "the step's three weights, learned in their order"
    before = stats()
    # On a busy machine the helper may wait a while for a core.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        matmuls(first, 1)
        now = stats()
        if (now["helper_tasks"] > before["helper_tasks"]
                and now["fetched_bytes"] > before["fetched_bytes"]):
            break
    assert now["ring_weights"] == 3
    assert now["helper_tasks"] > before["helper_tasks"], "the helper never took a task"
    assert now["fetched_bytes"] > before["fetched_bytes"], "the helper never fetched ahead"
    second = weights([(576, 576), (192, 576)])  # another model's weights: a new ring
    for _ in range(3):
        matmuls(second, 1)
    assert stats()["ring_weights"] == 2
    torch.ops.neuron_serve.set_decode_mode(False)

"""A decode graph built with the emulated device's options calls our kernels' C entries
(extension.c_shims) straight from inductor's C++ wrapper, and they compute what the ops
compute.

Oracles: the INT8 weight dequantized and multiplied in float64; the reference attention
kernel (attention/kernels.py), which gathers the whole block table naively.
"""

import pickle

import pytest
import torch

from neuron_serve.attention import kernels
from neuron_serve.device.emulated import EmulatedDevice, attention, extension, setup, skinny_matmul
from neuron_serve.device.emulated.quantized_linear import quantize_rows

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the kernels need AVX2")

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 6
OUT_FEATURES = 40  # not a whole number of 16-column blocks


def layer(x, weight_blocks, scale, query, kv_cache, block_table, token_req, token_pos):
    hidden = torch.ops.neuron_serve.skinny_matmul(x, weight_blocks, None, OUT_FEATURES, scale)
    attended = torch.ops.neuron_serve.paged_attention(query * hidden[:, :1, None], kv_cache,
                                                      block_table, token_req, token_pos,
                                                      HEAD_SIZE ** -0.5, 0, 0.0)
    return hidden + 1, attended


@pytest.fixture(scope="module")
def inputs():
    skinny_matmul.load()
    attention.kernel_set()  # the attention op's fake, for tracing
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, 96, generator=gen)
    values, scale = quantize_rows(weight, torch.int8)
    x = torch.randn(1, 96, generator=gen)
    query = torch.randn(1, HEADS, HEAD_SIZE, generator=gen)
    kv_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE, generator=gen)
    block_table = torch.tensor([[4, 1, 3]])
    token_req, token_pos = torch.tensor([0]), torch.tensor([40])
    args = (x, skinny_matmul.pack_weight(values), skinny_matmul.pack_scale(scale, torch.int8),
            query, kv_cache, block_table, token_req, token_pos)
    return args, values.double() * scale.double()[:, None]


def test_compiled_decode_graph_calls_the_c_entries(inputs):
    from torch._inductor.utils import run_and_get_cpp_code

    args, dequantized = inputs
    options = EmulatedDevice().graph_options(decode=True)
    assert options["cpp_wrapper"] and not options["size_asserts"]
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, options=options)
    (hidden, attended), code = run_and_get_cpp_code(compiled, *args)

    for entry in ("aoti_torch_cpu_skinny_matmul(", "aoti_torch_cpu_paged_attention("):
        assert code.count(entry) == 2, entry  # declared, then called
    assert "aoti_torch_call_dispatcher" not in code and "assert_size_stride(" not in code
    x, query, kv_cache, block_table, token_req, token_pos = args[0], *args[3:]
    want_hidden = x.double() @ dequantized.T
    torch.testing.assert_close(hidden.double(), want_hidden + 1, rtol=1e-5, atol=1e-4)
    want_attended = kernels.attend_each_token(query * hidden[:, :1, None].sub(1), kv_cache,
                                              block_table, token_req, token_pos,
                                              HEAD_SIZE ** -0.5, None, None)
    torch.testing.assert_close(attended, want_attended, rtol=1e-5, atol=1e-5)
    # The same inputs through the dispatcher, uncompiled: the same numbers.
    eager_hidden, eager_attended = layer(*args)
    torch.testing.assert_close(hidden, eager_hidden, rtol=0, atol=0)
    torch.testing.assert_close(attended, eager_attended, rtol=0, atol=0)


def test_decode_graph_options_pickle_alike_in_every_process():
    """AOT autograd's cache key pickles the compile options. Unpicklable, it falls back to
    a nonce from `random`, which vLLM seeds alike in every process, so one graph's entry
    was loaded for another's (seen: an FP8 model given the fp32 model's graph)."""
    setup.worker_process()
    options = EmulatedDevice().graph_options(decode=True)
    assert options["aot_inductor.custom_ops_to_c_shims"]
    assert pickle.loads(pickle.dumps(options)) == options  # the ops by name


def test_a_profiler_sees_the_c_entries_of_a_compiled_graph(inputs):
    """The C entries skip the dispatcher, which is what a profiler records: they record
    themselves, under the ops' names, so benchmarks/step_profile.py can split a step."""
    args, _ = inputs
    compiled = torch.compile(layer, fullgraph=True, dynamic=False,
                             options=EmulatedDevice().graph_options(decode=True))
    compiled(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*args)
    names = [event.name for event in prof.events()]
    assert names.count("neuron_serve::skinny_matmul") == 1
    assert names.count("neuron_serve::paged_attention") == 1


def test_decode_graph_kernels_open_no_openmp_region():
    """Decode steps run OpenMP on one thread (csrc/step_threads.cpp), so a decode graph's
    own kernels are built for one and open no parallel region; a mixed graph's use torch's
    threads."""
    from torch._inductor.utils import run_and_get_code

    def gated(a, b):
        return torch.nn.functional.silu(a) * b

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 1536, generator=gen), torch.randn(1, 1536, generator=gen)
    for decode in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(gated, fullgraph=True, dynamic=False,
                                 options=EmulatedDevice().graph_options(decode=decode))
        out, code = run_and_get_code(compiled, a, b)
        regions = sum(source.count("#pragma omp parallel") for source in code)
        if decode:
            assert regions == 0
        elif torch.get_num_threads() > 1:
            assert regions > 0
        torch.testing.assert_close(out, gated(a, b))

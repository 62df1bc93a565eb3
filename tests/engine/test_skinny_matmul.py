"""The decode matmul kernel (emulated backend, skinny_matmul.cpp) against `x @ W.T + b`:
every row-tile height of its AVX2 and its AVX-512 tiles (with and without prefetching), the
VNNI tile of one row of INT8 weights and how close its integer sums come to float64, the
BF16 tile of one row of e4m3 weights (every byte value, x unrounded),
widths that are not a multiple of its 16-column blocks (200 outputs: two threads take 7 and
6 blocks, each ending in a short panel), eager and compiled, and the errors it gives for
weights that do not fit."""

import os
import subprocess
import sys

import pytest
import torch

from neuron_serve.device.emulated import extension as cpu_extension
from neuron_serve.device.emulated import skinny_matmul

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(not cpu_extension.cpu_supported(), reason="needs AVX2")]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    skinny_matmul.load()


@pytest.fixture(params=["avx2", "avx512", "avx512-vnni"])
def isa(request):
    """Each set of tiles, whatever this CPU would pick: AVX-512 and VNNI where it has them."""
    if torch.ops.neuron_serve.skinny_matmul_isa(request.param) != request.param:
        torch.ops.neuron_serve.skinny_matmul_isa("avx512-vnni")
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    torch.ops.neuron_serve.skinny_matmul_isa("avx512-vnni")


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (200, 96), (37, 5), (17, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 24, 25, 32, 65, 128])
def test_matches_plain_matmul(rows, out_features, in_features, isa):
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    blocks = skinny_matmul.pack_weight(weight)
    torch.testing.assert_close(skinny_matmul.skinny_matmul(x, blocks, bias, out_features),
                               x @ weight.T + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny_matmul.skinny_matmul(x, blocks, None, out_features),
                               x @ weight.T, rtol=1e-5, atol=1e-5)


def quantized(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit copy of `weight` with a scale per output column, as quantized_linear stores it."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = weight.abs().amax(dim=1) / top
    values = weight / scale[:, None]
    return (values.round() if dtype == torch.int8 else values).to(dtype), scale


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (200, 96), (37, 5)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13, 32, 128, 300])  # 300: a prefill step
def test_8bit_weights_match_a_matmul_of_their_dequantized_values(rows, out_features,
                                                                  in_features, dtype, isa):
    """The oracle dequantizes first (values x scale, float32), then a plain matmul."""
    torch.manual_seed(rows * 1000 + out_features)
    weight, scale = quantized(torch.randn(out_features, in_features), dtype)
    weight[0, :4] = torch.tensor([0.001, -0.003, 0.01, -0.5]).to(dtype)  # e4m3 subnormals
    bias, x = torch.randn(out_features), torch.randn(rows, in_features)
    blocks = skinny_matmul.pack_weight(weight)
    packed_scale = skinny_matmul.pack_scale(scale, dtype)
    dequantized = weight.float() * scale[:, None]
    torch.testing.assert_close(
        skinny_matmul.skinny_matmul(x, blocks, bias, out_features, packed_scale),
        x @ dequantized.T + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        skinny_matmul.skinny_matmul(x, blocks, None, out_features, packed_scale),
        x @ dequantized.T, rtol=1e-5, atol=1e-5)


@pytest.fixture
def vnni():
    if torch.ops.neuron_serve.skinny_matmul_isa("avx512-vnni") != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI")


def int8_layer(out_features: int, in_features: int):
    weight, scale = quantized(torch.randn(out_features, in_features), torch.int8)
    return (weight, scale, skinny_matmul.pack_weight(weight),
            skinny_matmul.pack_scale(scale, torch.int8))


@pytest.mark.parametrize("out_features,in_features", [(200, 96), (1536, 576), (576, 1536)])
def test_int8_at_one_row_rounds_only_x_to_31_bits(out_features, in_features, vnni):
    """The VNNI tile's sums are exact: against float64, its error is x's fixed point (2^-31
    of max|x| per value) and the float32 roundings of the result, within one float32
    rounding of sum |x w| + |b|, a bound the float tiles' chains of FMAs exceed (checked
    for these shapes). An outlier 10^4 times the rest, as in the activations of large
    models, leaves the small values 2^-31 of it."""
    torch.manual_seed(out_features)
    weight, scale, blocks, packed_scale = int8_layer(out_features, in_features)
    dequantized = weight.double() * scale.double()[:, None]
    bias = torch.randn(out_features)
    for x in (torch.randn(1, in_features), torch.randn(1, in_features) * 1e-3):
        x[0, 7] = 10.0
        expected = x.double() @ dequantized.T + bias.double()
        out = skinny_matmul.skinny_matmul(x, blocks, bias, out_features, packed_scale)
        eps = torch.finfo(torch.float32).eps
        bound = (2.0 ** -31 * x.abs().max() * dequantized.abs().sum(1)
                 + eps * (x.double().abs() @ dequantized.abs().T + bias.abs()))
        assert ((out.double() - expected).abs() <= bound).all()


def test_int8_at_one_row_of_the_longest_vnni_row_at_its_extremes(vnni):
    """At the longest row the VNNI tile takes (K = 65,520), with every weight at -128 or
    127 and every value of x next to +max|x| (fixed-point bytes of 255 in the middle: a
    pass within 0.5 % of a 32-bit sum's range) or next to -max|x| (the signed top byte at
    its lowest), the sums stay exact: the error is x's 31-bit rounding and the result's
    float32 rounding."""
    in_features, out_features = 65520, 32
    weight = torch.where(torch.arange(out_features)[:, None] % 2 == 0, 127, -128)
    weight = weight.expand(out_features, in_features).to(torch.int8).clone()
    weight[1::4, ::3] = 127  # columns of mixed signs too
    scale = torch.full((out_features,), 1e-3)
    blocks, packed_scale = skinny_matmul.pack_weight(weight), skinny_matmul.pack_scale(scale, torch.int8)
    dequantized = weight.double() * scale.double()[:, None]
    below_max = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    for sign in (1.0, -1.0):
        x = torch.full((1, in_features), sign * below_max)
        x[0, 0] = sign
        out = skinny_matmul.skinny_matmul(x, blocks, None, out_features, packed_scale)
        expected = x.double() @ dequantized.T
        eps = torch.finfo(torch.float32).eps
        bound = 2.0 ** -31 * dequantized.abs().sum(1) + eps * (x.double().abs() @ dequantized.abs().T)
        assert ((out.double() - expected).abs() <= bound).all()


def test_int8_at_one_row_of_zeros_or_not_finite_values(vnni):
    """A row of zeros gives the bias; a NaN or an infinity reaches the outputs as a float
    matmul would carry it (such a row runs on the float tiles)."""
    weight, scale, blocks, packed_scale = int8_layer(48, 64)
    bias = torch.randn(48)
    zeros = torch.zeros(1, 64)
    assert torch.equal(skinny_matmul.skinny_matmul(zeros, blocks, bias, 48, packed_scale),
                       bias[None])
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 64)
        x[0, 3] = bad
        expected = x @ (weight.float() * scale[:, None]).T + bias
        out = skinny_matmul.skinny_matmul(x, blocks, bias, 48, packed_scale)
        torch.testing.assert_close(out, expected, equal_nan=True)


@pytest.fixture
def bf16(vnni):
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no AVX-512 BF16")


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.uint8).view(torch.float8_e4m3fn)


def test_e4m3_at_one_row_reads_every_byte_and_all_of_x(bf16):
    """The BF16 tile's lookup gives every e4m3 value but the NaN exactly (subnormals and
    signs too), and x reaches the products unrounded: column c holds byte c alone, so its
    output is one product, x's 24 significant bits times the byte's value, where x rounded
    to bfloat16 would be 2^-9 off."""
    torch.manual_seed(3)
    codes = torch.arange(256)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaNs
    weight = e4m3_bytes(torch.diag(codes))
    x = (1 + torch.rand(1, 256)) * torch.where(torch.rand(1, 256) < 0.5, -1.0, 1.0)
    scale = torch.ones(256)
    out = skinny_matmul.skinny_matmul(x, skinny_matmul.pack_weight(weight), None, 256,
                                      skinny_matmul.pack_scale(scale, torch.float8_e4m3fn))
    expected = x.double() * e4m3_bytes(codes).double()
    torch.testing.assert_close(out.double(), expected, rtol=2.0 ** -22, atol=0)


@pytest.mark.parametrize("out_features,in_features", [(200, 96), (1536, 576), (576, 1540)])
def test_e4m3_at_one_row_carries_only_float32_sums_roundings(out_features, in_features, bf16):
    """The BF16 tile against float64, with an outlier 10^4 times the rest in x, on whole rows
    and on one that is not a multiple of 16 long. Its products are exact (x in three exact
    bfloat16 pieces), so the error is its float32 sums': chains of K additions, within the
    textbook bound K u sum |x w| (u = 2^-24). x rounded to bfloat16 once would be ~2^-9 of
    that sum away, 2^15 u."""
    torch.manual_seed(out_features)
    weight, scale = quantized(torch.randn(out_features, in_features), torch.float8_e4m3fn)
    dequantized = weight.double() * scale.double()[:, None]
    bias = torch.randn(out_features)
    x = torch.randn(1, in_features)
    x[0, 7] = 1e4
    out = skinny_matmul.skinny_matmul(x, skinny_matmul.pack_weight(weight), bias, out_features,
                                      skinny_matmul.pack_scale(scale, torch.float8_e4m3fn))
    expected = x.double() @ dequantized.T + bias.double()
    bound = in_features * 2.0 ** -24 * (x.double().abs() @ dequantized.abs().T + bias.abs())
    assert ((out.double() - expected).abs() <= bound).all()


def test_e4m3_at_one_row_of_not_finite_values(bf16):
    """A NaN or an infinity in x reaches the outputs as a float matmul would carry it (such
    a row runs on the float tiles, as does one too large for bfloat16)."""
    weight, scale = quantized(torch.randn(48, 64), torch.float8_e4m3fn)
    blocks = skinny_matmul.pack_weight(weight)
    packed_scale = skinny_matmul.pack_scale(scale, torch.float8_e4m3fn)
    for bad in (float("nan"), float("inf"), 3.4e38):
        x = torch.randn(1, 64)
        x[0, 3] = bad
        expected = x @ (weight.float() * scale[:, None]).T
        out = skinny_matmul.skinny_matmul(x, blocks, None, 48, packed_scale)
        torch.testing.assert_close(out, expected, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_packed_8bit_layer_gives_one_product_with_or_without_the_kernel(dtype):
    """Without the kernel (no AVX2, or bf16 activations) a layer's blocks are dequantized
    for a plain matmul; both ways give the dequantized weight's product."""
    from torch import nn

    from neuron_serve.device.emulated import quantized_linear

    torch.manual_seed(1)
    weight, scale = quantized(torch.randn(40, 24), dtype)
    layer, bias, x = nn.Module(), torch.randn(40), torch.randn(3, 5, 24)
    quantized_linear.pack(layer, weight, scale)
    expected = x @ (weight.float() * scale[:, None]).T + bias
    for skinny in (True, False):
        method = quantized_linear.Packed8BitMethod(40, skinny)
        torch.testing.assert_close(method.apply(layer, x, bias), expected, rtol=1e-5, atol=1e-5)


def test_8bit_weights_need_their_scales_and_float_ones_none():
    x = torch.randn(2, 8)
    int8 = skinny_matmul.pack_weight(torch.ones(16, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="8-bit weights need a scale per column"):
        skinny_matmul.skinny_matmul(x, int8, None, 16)
    with pytest.raises(RuntimeError, match=r"scale must be float32 \[16\]"):
        skinny_matmul.skinny_matmul(x, int8, None, 16, torch.ones(8))
    fp32 = skinny_matmul.pack_weight(torch.ones(16, 8))
    with pytest.raises(RuntimeError, match="8-bit weights need a scale per column"):
        skinny_matmul.skinny_matmul(x, fp32, None, 16, torch.ones(16))


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 8])
def test_threads_take_equal_runs_of_blocks_ending_in_short_panels(threads, rows):
    """Two or three threads split 13 blocks (7 + 6, 5 + 5 + 3; 1024 inputs, so no grain
    merges them), most ranges ending in a panel shorter than 4 (1 row) or 3 (8 rows)."""
    torch.manual_seed(threads * 10 + rows)
    weight, bias, x = torch.randn(200, 1024), torch.randn(200), torch.randn(rows, 1024)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = skinny_matmul.skinny_matmul(x, skinny_matmul.pack_weight(weight), bias, 200)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, x @ weight.T + bias, rtol=1e-4, atol=1e-4)


def test_in_a_compiled_graph_and_on_strided_input():
    torch.manual_seed(0)
    weight, bias = torch.randn(50, 40), torch.randn(50)
    blocks = skinny_matmul.pack_weight(weight)
    x = torch.randn(40, 4).T  # [4, 40], not contiguous

    def step(x):
        return torch.relu(skinny_matmul.skinny_matmul(x * 2, blocks, bias, 50)) + 1

    expected = torch.relu((x * 2) @ weight.T + bias) + 1
    torch.testing.assert_close(step(x), expected, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_a_weight_that_does_not_fit_is_refused():
    blocks = skinny_matmul.pack_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="do not fit"):
        skinny_matmul.skinny_matmul(torch.randn(2, 9), blocks, None, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        skinny_matmul.skinny_matmul(torch.randn(2, 8), blocks, None, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        skinny_matmul.skinny_matmul(torch.randn(2, 8), blocks.double(), None, 32)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        skinny_matmul.skinny_matmul(torch.randn(2, 8), blocks, torch.randn(31), 32)
    with pytest.raises(RuntimeError, match="float32"):
        skinny_matmul.skinny_matmul(torch.randn(2, 8, dtype=torch.float64), blocks, None, 32)


def test_a_build_is_reused_and_never_half_written(tmp_path):
    """A fresh kernel directory gets one finished library and nothing else (the build ran
    in a private directory); a second process loads that file without building again."""
    code = ("from neuron_serve.device.emulated import extension as c; c.load(); "
            "print(c.library_path().name)")
    env = {**os.environ, "NEURON_SERVE_KERNEL_DIR": str(tmp_path)}

    def load_in_new_process() -> str:
        return subprocess.run([sys.executable, "-c", code], env=env, check=True,
                              capture_output=True, text=True).stdout.split()[-1]

    name = load_in_new_process()
    assert [p.name for p in tmp_path.iterdir()] == [name]
    built = (tmp_path / name).stat().st_mtime_ns
    assert load_in_new_process() == name
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert (tmp_path / name).stat().st_mtime_ns == built

// Emulated backend: `x @ W.T + bias` for the few rows of a decode step (AVX2 + FMA, and
// AVX-512 where the CPU has it, chosen at run time).
//
// A decode step's matmuls read every weight once for a handful of rows, so they are bound
// by how fast the weights stream from memory. The weight is stored as column blocks of 16
// outputs, each [in_features][16] and contiguous: a block streams front to back while the
// rows of x, broadcast one value at a time, stay in L1. Each block is a tile of
// accumulators per row (2 x 8 floats on AVX2, one 16-float register on AVX-512), written
// out once: no horizontal sums, no packing per call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <cstring>
#include <utility>
#include <optional>

namespace {

constexpr int64_t kBlock = 16;  // output columns per weight block: two 8-float registers
constexpr int kMaxTileRows = 6;  // 12 accumulators + 2 weight registers of AVX2's 16

// y[m, 0:16] = bias + sum_k x[m, k] * block[k, 0:16] for Rows rows of x. Every loop over
// rows is unrolled so the accumulators live in registers: a loop the compiler keeps
// (it kept the epilogue's) pins them to the stack, with a store per FMA pair.
template <int Rows>
void tile(const float* x, int64_t in_features, const float* block, const float* bias,
          float* y, int64_t ldy, int64_t columns) {
  __m256 lo[Rows], hi[Rows];
  const __m256 bias_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) lo[m] = bias_lo, hi[m] = bias_hi;
  int64_t k = 0;
  if constexpr (Rows <= 2) {
    // One or two rows leave the FMA units idle on a single chain: odd k on a second one.
    __m256 lo2[Rows], hi2[Rows];
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) lo2[m] = hi2[m] = _mm256_setzero_ps();
    for (; k + 1 < in_features; k += 2) {
      const float* w = block + k * kBlock;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      const __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
#pragma GCC unroll 8
      for (int m = 0; m < Rows; ++m) {
        const __m256 a = _mm256_broadcast_ss(x + m * in_features + k);
        const __m256 b = _mm256_broadcast_ss(x + m * in_features + k + 1);
        lo[m] = _mm256_fmadd_ps(w0, a, lo[m]);
        hi[m] = _mm256_fmadd_ps(w1, a, hi[m]);
        lo2[m] = _mm256_fmadd_ps(w2, b, lo2[m]);
        hi2[m] = _mm256_fmadd_ps(w3, b, hi2[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      lo[m] = _mm256_add_ps(lo[m], lo2[m]);
      hi[m] = _mm256_add_ps(hi[m], hi2[m]);
    }
  }
  for (; k < in_features; ++k) {
    const float* w = block + k * kBlock;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * in_features + k);
      lo[m] = _mm256_fmadd_ps(w0, a, lo[m]);
      hi[m] = _mm256_fmadd_ps(w1, a, hi[m]);
    }
  }
  if (columns == kBlock) {
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      _mm256_storeu_ps(y + m * ldy, lo[m]);
      _mm256_storeu_ps(y + m * ldy + 8, hi[m]);
    }
    return;
  }
  // The last block of a width that is not a multiple of 16.
  alignas(32) float out[Rows][kBlock];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
    _mm256_store_ps(out[m], lo[m]);
    _mm256_store_ps(out[m] + 8, hi[m]);
  }
  for (int m = 0; m < Rows; ++m) std::memcpy(y + m * ldy, out[m], columns * sizeof(float));
}

// The same tile on AVX-512: a block is one register, so 32 registers hold up to 24 rows
// and a block is streamed once for all of them, where AVX2 streams it once per 6 rows.
constexpr int kMaxTileRows512 = 24;

template <int Rows>
__attribute__((target("avx512f"))) void tile512(const float* x, int64_t in_features,
                                                 const float* block, const float* bias,
                                                 float* y, int64_t ldy, int64_t columns) {
  const __mmask16 valid = columns == kBlock ? 0xFFFF : (1u << columns) - 1;
  const __m512 start = bias ? _mm512_maskz_loadu_ps(valid, bias) : _mm512_setzero_ps();
  // Few rows are few FMA chains: two interleaved k halves keep both FMA units busy.
  constexpr int kChains = Rows <= 4 ? 2 : 1;
  __m512 acc[kChains][Rows];
#pragma GCC unroll 24
  for (int m = 0; m < Rows; ++m) {
    acc[0][m] = start;
    if constexpr (kChains == 2) acc[1][m] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + kChains <= in_features; k += kChains) {
#pragma GCC unroll 2
    for (int c = 0; c < kChains; ++c) {
      const __m512 w = _mm512_loadu_ps(block + (k + c) * kBlock);
#pragma GCC unroll 24
      for (int m = 0; m < Rows; ++m)
        acc[c][m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * in_features + k + c]), acc[c][m]);
    }
  }
  for (; k < in_features; ++k) {
    const __m512 w = _mm512_loadu_ps(block + k * kBlock);
#pragma GCC unroll 24
    for (int m = 0; m < Rows; ++m)
      acc[0][m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * in_features + k]), acc[0][m]);
  }
#pragma GCC unroll 24
  for (int m = 0; m < Rows; ++m) {
    if constexpr (kChains == 2) acc[0][m] = _mm512_add_ps(acc[0][m], acc[1][m]);
    _mm512_mask_storeu_ps(y + m * ldy, valid, acc[0][m]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t,
                        int64_t);

template <int... Rows>
constexpr std::array<TileFn, sizeof...(Rows) + 1> tiles512(std::integer_sequence<int, Rows...>) {
  return {nullptr, tile512<Rows + 1>...};
}

struct Kernel {
  const TileFn* tiles;  // tiles[h]: a tile of h rows
  int max_rows;
};

// Tests set this to run the AVX2 tiles on a CPU with AVX-512 too.
std::atomic<bool> avx2_only{false};

Kernel pick_kernel() {
  static constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                                      tile<4>, tile<5>, tile<6>};
  static constexpr auto kTiles512 = tiles512(std::make_integer_sequence<int, kMaxTileRows512>());
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512 && !avx2_only) return {kTiles512.data(), kMaxTileRows512};
  return {kTiles, kMaxTileRows};
}

// Which tiles run: "avx512" or "avx2"; `avx2_only` restricts them to AVX2.
std::string skinny_matmul_isa(bool avx2_only_) {
  avx2_only = avx2_only_;
  return pick_kernel().max_rows == kMaxTileRows512 ? "avx512" : "avx2";
}

// weight_blocks: [ceil(N / 16), K, 16], zero beyond column N (pack_weight in Python).
at::Tensor skinny_matmul(const at::Tensor& x_in, const at::Tensor& weight_blocks,
                         const std::optional<at::Tensor>& bias_in, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "skinny_matmul: x must be a 2-d float32 tensor, got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  TORCH_CHECK(weight_blocks.scalar_type() == at::kFloat && weight_blocks.is_contiguous() &&
                  weight_blocks.dim() == 3 &&
                  weight_blocks.size(0) == blocks && weight_blocks.size(1) == in_features &&
                  weight_blocks.size(2) == kBlock,
              "skinny_matmul: weight blocks ", weight_blocks.sizes(), " do not fit x ",
              x.sizes(), " and ", out_features, " outputs");
  at::Tensor bias_tensor;
  const float* bias = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == out_features &&
                    bias_in->scalar_type() == at::kFloat,
                "skinny_matmul: bias must be float32 [", out_features, "], got ",
                bias_in->sizes());
    bias_tensor = bias_in->contiguous();
    bias = bias_tensor.const_data_ptr<float>();
  }
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight_blocks.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const Kernel kernel = pick_kernel();
  // Row tiles of near-equal height: on AVX2 (at most 6) 8 rows run as 4 + 4, 16 as 6 + 5 + 5.
  const int64_t tiles = (rows + kernel.max_rows - 1) / kernel.max_rows;
  // A task streams at least ~64 KB of weights so small layers do not pay for the fork.
  const int64_t grain = std::max<int64_t>(1, 65536 / (in_features * kBlock * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t columns = std::min(kBlock, out_features - b * kBlock);
      const float* block = wp + b * in_features * kBlock;
      // The last block's bias, padded with zeros, so the tile reads 16 values everywhere.
      alignas(32) float bias_tail[kBlock] = {};
      const float* block_bias = bias ? bias + b * kBlock : nullptr;
      if (bias && columns < kBlock) {
        std::memcpy(bias_tail, block_bias, columns * sizeof(float));
        block_bias = bias_tail;
      }
      for (int64_t t = 0, row = 0; t < tiles; ++t) {
        const int64_t height = (rows - row) / (tiles - t);
        kernel.tiles[height](xp + row * in_features, in_features, block, block_bias,
                       yp + row * out_features + b * kBlock, out_features, columns);
        row += height;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_serve, m) {
  m.def("skinny_matmul(Tensor x, Tensor weight_blocks, Tensor? bias, int out_features) -> Tensor");
  m.def("skinny_matmul_isa(bool avx2_only) -> str", &skinny_matmul_isa);
}

TORCH_LIBRARY_IMPL(neuron_serve, CPU, m) { m.impl("skinny_matmul", &skinny_matmul); }

// Emulated backend: `x @ W.T + bias` for the rows of a decode step (AVX2 + FMA, and
// AVX-512 where the CPU has it, chosen at run time).
//
// A decode step's matmuls read every weight once for a few to a few dozen rows, so they are
// bound by how fast the weights stream from memory, and from ~16 rows on by the FMAs too.
// The weight is stored as column blocks of 16 outputs, each [in_features][16] and
// contiguous: a block streams front to back while the rows of x, broadcast one value at a
// time, stay in L1. A tile is a set of accumulators per row (2 x 8 floats per block on
// AVX2, one 16-float register per block on AVX-512), written out once: no horizontal sums,
// no packing per call.

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

// One call's work: `rows` rows of x times a panel of `blocks` adjacent weight blocks.
struct Panel {
  const float* x;
  int64_t in_features;
  const float* weight;  // the panel's first block
  const float* bias;    // blocks * 16 values, or null
  float* y;
  int64_t ldy;
  int64_t columns;      // valid output columns of the panel (its last block may be partial)
  const float* next;    // the next panel, fetched into L2 while this one computes, or null
  int64_t pass, passes; // this call is row tile `pass` of `passes` over the same panel
};

// y[m, 0:16] = bias + sum_k x[m, k] * block[k, 0:16] for Rows rows of x, one block. Every
// loop over rows is unrolled so the accumulators live in registers: a loop the compiler
// keeps (it kept the epilogue's) pins them to the stack, with a store per FMA pair.
template <int Rows>
void tile(const Panel& p) {
  const float* x = p.x;
  const int64_t in_features = p.in_features;
  __m256 lo[Rows], hi[Rows];
  const __m256 bias_lo = p.bias ? _mm256_loadu_ps(p.bias) : _mm256_setzero_ps();
  const __m256 bias_hi = p.bias ? _mm256_loadu_ps(p.bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) lo[m] = bias_lo, hi[m] = bias_hi;
  int64_t k = 0;
  if constexpr (Rows <= 2) {
    // One or two rows leave the FMA units idle on a single chain: odd k on a second one.
    __m256 lo2[Rows], hi2[Rows];
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) lo2[m] = hi2[m] = _mm256_setzero_ps();
    for (; k + 1 < in_features; k += 2) {
      const float* w = p.weight + k * kBlock;
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
    const float* w = p.weight + k * kBlock;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * in_features + k);
      lo[m] = _mm256_fmadd_ps(w0, a, lo[m]);
      hi[m] = _mm256_fmadd_ps(w1, a, hi[m]);
    }
  }
  if (p.columns == kBlock) {
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      _mm256_storeu_ps(p.y + m * p.ldy, lo[m]);
      _mm256_storeu_ps(p.y + m * p.ldy + 8, hi[m]);
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
  for (int m = 0; m < Rows; ++m) std::memcpy(p.y + m * p.ldy, out[m], p.columns * sizeof(float));
}

// AVX-512: a block is one register, so a tile is Rows rows x Blocks blocks (up to 8 x 3 or
// 6 x 4: 24 accumulators, one weight load per Rows FMAs). A single block per tile, one
// broadcast load per FMA, left the FMA units waiting on loads, slower than oneDNN from 2
// rows. From 7 rows the FMAs are busy enough to leave the memory idle, so the weights are
// prefetched: the panel's blocks 32 rows of k ahead into L1, and the next panel into L2,
// spread over this panel's row tiles so the memory is busy for all of them. Up to 6 rows
// the hardware prefetcher alone streams faster, close to a plain read's pace; at 8 rows
// prefetching still wins (measured: benchmarks/README.md, "Design measurements").
constexpr int kMaxTileRows512 = 8;
constexpr int kMaxBlocks512 = 4;
constexpr int kMinPrefetchRows = 7;
constexpr int64_t kPrefetchAhead = 32 * kBlock;

int blocks_per_panel512(int64_t tile_rows) { return tile_rows <= 6 ? 4 : 3; }

template <int Rows, int Blocks>
__attribute__((target("avx512f"))) void tile512(const Panel& p) {
  const int64_t stride = p.in_features * kBlock;  // from one block to the next
  __m512 acc[Rows][Blocks];
#pragma GCC unroll 4
  for (int b = 0; b < Blocks; ++b) {
    const __m512 start = p.bias ? _mm512_loadu_ps(p.bias + b * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) acc[m][b] = start;
  }
  int64_t next_k = p.pass * p.in_features / p.passes, phase = 0;
  for (int64_t k = 0; k < p.in_features; ++k) {
    __m512 w[Blocks];
#pragma GCC unroll 4
    for (int b = 0; b < Blocks; ++b) {
      const float* row = p.weight + b * stride + k * kBlock;
      w[b] = _mm512_loadu_ps(row);
      if constexpr (Rows >= kMinPrefetchRows)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchAhead), _MM_HINT_T0);
    }
    // One row of the next panel per `passes` rows.
    if (Rows >= kMinPrefetchRows && p.next && ++phase == p.passes) {
      phase = 0;
#pragma GCC unroll 4
      for (int b = 0; b < Blocks; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(p.next + b * stride + next_k * kBlock),
                     _MM_HINT_T1);
      ++next_k;
    }
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m512 a = _mm512_set1_ps(p.x[m * p.in_features + k]);
#pragma GCC unroll 4
      for (int b = 0; b < Blocks; ++b) acc[m][b] = _mm512_fmadd_ps(w[b], a, acc[m][b]);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < Blocks; ++b) {
    const int64_t valid = std::clamp<int64_t>(p.columns - b * kBlock, 0, kBlock);
    const __mmask16 mask = valid == kBlock ? 0xFFFF : (1u << valid) - 1;
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m)
      _mm512_mask_storeu_ps(p.y + m * p.ldy + b * kBlock, mask, acc[m][b]);
  }
}

using TileFn = void (*)(const Panel&);

template <int Rows>
constexpr std::array<TileFn, kMaxBlocks512 + 1> row_tiles512() {
  return {nullptr, tile512<Rows, 1>, tile512<Rows, 2>, tile512<Rows, 3>, tile512<Rows, 4>};
}

template <int... Rows>
constexpr std::array<std::array<TileFn, kMaxBlocks512 + 1>, sizeof...(Rows) + 1> tiles512(
    std::integer_sequence<int, Rows...>) {
  return {std::array<TileFn, kMaxBlocks512 + 1>{}, row_tiles512<Rows + 1>()...};
}

constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                             tile<4>, tile<5>, tile<6>};
constexpr auto kTiles512 = tiles512(std::make_integer_sequence<int, kMaxTileRows512>());

// The tiles a call runs: AVX-512's (panels of 3-4 blocks) or AVX2's (one block).
struct Kernel {
  bool avx512;

  int64_t max_tile_rows() const { return avx512 ? kMaxTileRows512 : kMaxTileRows; }
  int64_t blocks_per_panel(int64_t tile_rows) const {
    return avx512 ? blocks_per_panel512(tile_rows) : 1;
  }
  TileFn tile(int64_t rows, int64_t blocks) const {
    return avx512 ? kTiles512[rows][blocks] : kTiles[rows];
  }
};

// Tests set this to run the AVX2 tiles on a CPU with AVX-512 too.
std::atomic<bool> avx2_only{false};

Kernel pick_kernel() {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return {avx512 && !avx2_only};
}

// Which tiles run: "avx512" or "avx2"; `avx2_only` restricts them to AVX2.
std::string skinny_matmul_isa(bool avx2_only_) {
  avx2_only = avx2_only_;
  return pick_kernel().avx512 ? "avx512" : "avx2";
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
  const int64_t tiles = (rows + kernel.max_tile_rows() - 1) / kernel.max_tile_rows();
  const int64_t width = kernel.blocks_per_panel((rows + tiles - 1) / tiles);
  const int64_t block_floats = in_features * kBlock;
  // Threads take equal runs of blocks, not of panels: 36 blocks in panels of 4 would split
  // 5 + 4 panels. A task streams at least ~64 KB of weights so small layers skip the fork.
  const int64_t grain = std::max<int64_t>(1, 65536 / (block_floats * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; block += width) {
      const int64_t panel_blocks = std::min(width, last - block);
      const int64_t columns = std::min(panel_blocks * kBlock, out_features - block * kBlock);
      // The last panel's bias, padded with zeros, so a tile reads whole blocks everywhere.
      alignas(64) float bias_tail[kMaxBlocks512 * kBlock] = {};
      const float* panel_bias = bias ? bias + block * kBlock : nullptr;
      if (bias && columns < panel_blocks * kBlock) {
        std::memcpy(bias_tail, panel_bias, columns * sizeof(float));
        panel_bias = bias_tail;
      }
      const int64_t next = block + panel_blocks;
      Panel p{nullptr, in_features, wp + block * block_floats, panel_bias, nullptr,
              out_features, columns, next < last ? wp + next * block_floats : nullptr,
              0, tiles};
      for (int64_t row = 0; p.pass < tiles; ++p.pass) {
        const int64_t height = (rows - row) / (tiles - p.pass);
        p.x = xp + row * in_features;
        p.y = yp + row * out_features + block * kBlock;
        kernel.tile(height, panel_blocks)(p);
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

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
//
// 8-bit weights (int8, or float8 e4m3) keep the same layout, one byte per weight, with a
// scale per output column: a block's 16 weights are widened to floats as they are loaded,
// and the sums are scaled once at the end. The memory reads a quarter of float32's bytes.
// With many rows (a prefill) a panel is widened once into scratch for all its row tiles;
// at one row, INT8 runs as integer dot products where the CPU has AVX-512 VNNI (tile_vnni),
// e4m3 as bfloat16 dot products where it has AVX-512 BF16 (tile_bf16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "float8.h"
#include "step_threads.h"

#include <algorithm>
#include <cmath>
#include <array>
#include <atomic>
#include <string>
#include <cstring>
#include <utility>
#include <optional>
#include <vector>

namespace {

// How a weight block's 16 values load as floats (8 at a time on AVX2, 16 on AVX-512).
struct Float32 {
  using T = float;
  static constexpr bool kPairs = false;
  static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
  __attribute__((target("avx512f"))) static __m512 load16(const T* p) {
    return _mm512_loadu_ps(p);
  }
};

struct Int8 {
  using T = int8_t;
  static constexpr bool kPairs = false;
  static __m256 load8(const T* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  __attribute__((target("avx512f"))) static __m512 load16(const T* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// e4m3 through F16C, as halves of 2^-8 of their value (float8.h); the column scales undo
// the 2^-8.
struct E4M3 {
  using T = uint8_t;
  static __m256 load8(const T* p) {
    return _mm256_cvtph_ps(e4m3_halves(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  __attribute__((target("avx512f"))) static __m512 load16(const T* p) {
    return _mm512_cvtph_ps(e4m3_halves16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Two rows of k of a block (32 bytes) in 512-bit integer ops, half the instructions of
  // two load16s. Widening bounds the kernel at a few rows, so this is what an e4m3 weight
  // streams at.
  static constexpr bool kPairs = true;
  __attribute__((target("avx512f,avx512bw"))) static void load16x2(const T* p, __m512& a,
                                                                   __m512& b) {
    const __m512i h = e4m3_halves32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
};

constexpr int64_t kBlock = 16;  // output columns per weight block: two 8-float registers
// How far ahead weights are prefetched where the hardware prefetcher alone falls behind
// (see tile512): 32 rows of k of a float32 block, 128 of an 8-bit one.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int kMaxTileRows = 6;  // 12 accumulators + 2 weight registers of AVX2's 16

// One call's work: `rows` rows of x times a panel of `blocks` adjacent weight blocks.
struct Panel {
  const float* x;
  int64_t in_features;
  const void* weight;   // the panel's first block
  const float* bias;    // blocks * 16 values, or null
  const float* scale;   // 8-bit weights: blocks * 16 column scales; float32: null
  float* y;
  int64_t ldy;
  int64_t columns;      // valid output columns of the panel (its last block may be partial)
  const void* next;     // the next panel, fetched into L2 while this one computes, or null
  int64_t pass, passes; // this call is row tile `pass` of `passes` over the same panel
  const uint32_t* digits = nullptr;  // int8 VNNI tile: x's fixed-point digits (XDigits)
  const uint32_t* x_pairs = nullptr; // e4m3 BF16 tile: x's bfloat16 pieces (XPieces)
  double step = 0;                   // and the value of one unit of that fixed point
  int64_t top_bias = 0;              // and what its top digit's pass adds to each column
};

// acc * scale + bias of 8 columns (an unscaled tile started from the bias).
inline __m256 finish8(__m256 acc, const Panel& p, int64_t column) {
  if (!p.scale) return acc;
  const __m256 bias = p.bias ? _mm256_loadu_ps(p.bias + column) : _mm256_setzero_ps();
  return _mm256_fmadd_ps(acc, _mm256_loadu_ps(p.scale + column), bias);
}

// An 8-bit block's cache line 2 KB ahead, at the first of the 4 rows of k a line holds:
// widening keeps the core busy long enough between loads that, left to the hardware
// prefetcher, the memory and the widening take turns (see tile512).
template <typename T>
inline void prefetch_8bit(const T* row, int64_t k) {
  if constexpr (sizeof(T) == 1)
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
}

// y[m, 0:16] = bias + sum_k x[m, k] * block[k, 0:16] for Rows rows of x, one block. Every
// loop over rows is unrolled so the accumulators live in registers: a loop the compiler
// keeps (it kept the epilogue's) pins them to the stack, with a store per FMA pair.
template <int Rows, typename W>
void tile(const Panel& p) {
  const float* x = p.x;
  const typename W::T* weight = static_cast<const typename W::T*>(p.weight);
  const int64_t in_features = p.in_features;
  __m256 lo[Rows], hi[Rows];
  const bool start_at_bias = p.bias && !p.scale;
  const __m256 bias_lo = start_at_bias ? _mm256_loadu_ps(p.bias) : _mm256_setzero_ps();
  const __m256 bias_hi = start_at_bias ? _mm256_loadu_ps(p.bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) lo[m] = bias_lo, hi[m] = bias_hi;
  int64_t k = 0;
  if constexpr (Rows <= 2) {
    // One or two rows leave the FMA units idle on a single chain: odd k on a second one.
    __m256 lo2[Rows], hi2[Rows];
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) lo2[m] = hi2[m] = _mm256_setzero_ps();
    for (; k + 1 < in_features; k += 2) {
      const typename W::T* w = weight + k * kBlock;
      prefetch_8bit(w, k);
      const __m256 w0 = W::load8(w), w1 = W::load8(w + 8);
      const __m256 w2 = W::load8(w + 16), w3 = W::load8(w + 24);
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
    const typename W::T* w = weight + k * kBlock;
    prefetch_8bit(w, k);
    const __m256 w0 = W::load8(w), w1 = W::load8(w + 8);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m256 a = _mm256_broadcast_ss(x + m * in_features + k);
      lo[m] = _mm256_fmadd_ps(w0, a, lo[m]);
      hi[m] = _mm256_fmadd_ps(w1, a, hi[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) lo[m] = finish8(lo[m], p, 0), hi[m] = finish8(hi[m], p, 8);
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
// prefetched: the panel's blocks 2 KB ahead into L1, and the next panel into L2, spread over
// this panel's row tiles so the memory is busy for all of them. Up to 6 rows float32 weights
// stream faster on the hardware prefetcher alone, close to a plain read's pace; at 8 rows
// prefetching still wins (measured: benchmarks/README.md, "Design measurements"). 8-bit
// weights are prefetched at every row count: widening them keeps the core busy long enough
// between loads that, left to the hardware, the memory and the widening took turns.
constexpr int kMaxTileRows512 = 8;
constexpr int kMaxBlocks512 = 4;
constexpr int kMinPrefetchRows = 7;

int blocks_per_panel512(int64_t tile_rows) { return tile_rows <= 6 ? 4 : 3; }

template <int Rows, int Blocks, typename W>
__attribute__((target("avx512f,avx512bw"))) void tile512(const Panel& p) {
  using T = typename W::T;
  const T* weight = static_cast<const T*>(p.weight);
  const T* next = static_cast<const T*>(p.next);
  const int64_t stride = p.in_features * kBlock;  // from one block to the next
  constexpr bool prefetch = Rows >= kMinPrefetchRows || sizeof(T) == 1;
  constexpr int64_t line_steps = 64 / (kBlock * sizeof(T));  // rows of k per cache line
  __m512 acc[Rows][Blocks];
#pragma GCC unroll 4
  for (int b = 0; b < Blocks; ++b) {
    const __m512 start = p.bias && !p.scale ? _mm512_loadu_ps(p.bias + b * kBlock)
                                            : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) acc[m][b] = start;
  }
  int64_t next_k = p.pass * p.in_features / p.passes, phase = 0;
  // At the first row of k of each cache line: the line 2 KB ahead of each block, and one
  // line of the next panel per `passes` lines.
  auto prefetch_at = [&](int64_t k) {
    if (!prefetch || k % line_steps) return;
#pragma GCC unroll 4
    for (int b = 0; b < Blocks; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(weight + b * stride + k * kBlock) +
                   kPrefetchBytes, _MM_HINT_T0);
    if (next && ++phase == p.passes) {
      phase = 0;
#pragma GCC unroll 4
      for (int b = 0; b < Blocks; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(next + b * stride + next_k * kBlock),
                     _MM_HINT_T1);
      next_k += line_steps;
    }
  };
  int64_t k = 0;
  if constexpr (W::kPairs && Rows < kMinPrefetchRows) {  // room for 2 x Blocks weights
    for (; k + 1 < p.in_features; k += 2) {
      __m512 w0[Blocks], w1[Blocks];
#pragma GCC unroll 4
      for (int b = 0; b < Blocks; ++b) W::load16x2(weight + b * stride + k * kBlock, w0[b], w1[b]);
      prefetch_at(k);
#pragma GCC unroll 8
      for (int m = 0; m < Rows; ++m) {
        const __m512 a0 = _mm512_set1_ps(p.x[m * p.in_features + k]);
        const __m512 a1 = _mm512_set1_ps(p.x[m * p.in_features + k + 1]);
#pragma GCC unroll 4
        for (int b = 0; b < Blocks; ++b)
          acc[m][b] = _mm512_fmadd_ps(w1[b], a1, _mm512_fmadd_ps(w0[b], a0, acc[m][b]));
      }
    }
  }
  for (; k < p.in_features; ++k) {
    __m512 w[Blocks];
#pragma GCC unroll 4
    for (int b = 0; b < Blocks; ++b) w[b] = W::load16(weight + b * stride + k * kBlock);
    prefetch_at(k);
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
    if (p.scale) {  // acc * scale + bias
      const __m512 scale = _mm512_loadu_ps(p.scale + b * kBlock);
      const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + b * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int m = 0; m < Rows; ++m) acc[m][b] = _mm512_fmadd_ps(acc[m][b], scale, bias);
    }
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m)
      _mm512_mask_storeu_ps(p.y + m * p.ldy + b * kBlock, mask, acc[m][b]);
  }
}

using TileFn = void (*)(const Panel&);

template <typename W, int Rows>
constexpr std::array<TileFn, kMaxBlocks512 + 1> row_tiles512() {
  return {nullptr, tile512<Rows, 1, W>, tile512<Rows, 2, W>, tile512<Rows, 3, W>,
          tile512<Rows, 4, W>};
}

template <typename W, int... Rows>
constexpr std::array<std::array<TileFn, kMaxBlocks512 + 1>, sizeof...(Rows) + 1> tiles512(
    std::integer_sequence<int, Rows...>) {
  return {std::array<TileFn, kMaxBlocks512 + 1>{}, row_tiles512<W, Rows + 1>()...};
}

// The tiles of one weight format: AVX2's [rows], AVX-512's [rows][blocks].
template <typename W>
struct Tiles {
  static constexpr TileFn avx2[kMaxTileRows + 1] = {nullptr, tile<1, W>, tile<2, W>, tile<3, W>,
                                                    tile<4, W>, tile<5, W>, tile<6, W>};
  static constexpr auto avx512 =
      tiles512<W>(std::make_integer_sequence<int, kMaxTileRows512>());
};

// INT8 weights at one row, on AVX-512 VNNI: integer dot products instead of widening.
//
// Widening each weight to a float takes two instructions beside its FMA, so at one row the
// float tiles widen no faster than a few memory channels deliver bytes (on AMD Zen 4, which
// runs 512-bit operations in two halves, one thread's pace is near its share of the
// memory's). VPDPBUSD multiplies 64 unsigned bytes by 64 signed ones and adds each group of
// 4 products into a 32-bit sum: an integer copy of x does the work in 6 instructions per 64
// weights (a permute, an XOR, 4 digit passes), where widening takes 12.
//
// x is not rounded to 8 bits. Its row is written as 32-bit signed fixed point (x / max|x| *
// 2^30, rounded: at most 2^-31 max|x| away from x), whose four bytes are one VPDPBUSD pass
// over the weights each. The three low bytes are unsigned, as VPDPBUSD wants of its first
// operand; the top byte is signed, so its pass swaps the operands and reads each weight
// plus 128 (the XOR) as the unsigned one, which adds 128 * (the top bytes' sum) to every
// column, taken back out at the end. Each pass's sum is exact in 32 bits (255 * 128 * K <
// 2^31 for K < 65536), and the passes add up exactly in 64 bits. So the only rounding
// before the scale is x's to 31 bits, and the result is closer to x . w than a chain of
// float32 FMAs (tests/engine/test_skinny_matmul.py). A fifth pass for the weights' column
// sums, which an unsigned top byte (x offset by 2^31) needed instead, cost 5-26 % more
// time on weights in cache (benchmarks/README.md, "Design measurements").
constexpr int kDigits = 4;
constexpr int64_t kMaxVnniIn = 65535;  // longer rows could overflow a 32-bit sum
// Besides the next blocks (as tile512), each line 16 KB ahead is fetched into L2 too: from
// memory the step's matmuls ran 3-11 % faster so (benchmarks/README.md). Near a panel's end
// those lines are the blocks that follow it, near a call's end whatever memory follows the
// weight (often the next layer's; a prefetch never faults).
constexpr int64_t kL2Ahead = 16384;

// The one-row dot-product tiles' prefetches at a weight cache line they load: the line
// 2 KB ahead into L1, 16 KB ahead into L2, and `next_line` (the next blocks', or null).
inline void prefetch_around(const char* line, const char* next_line) {
  _mm_prefetch(line + kPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(line + kL2Ahead, _MM_HINT_T1);
  if (next_line) _mm_prefetch(next_line, _MM_HINT_T1);
}

// VPERMB indices that transpose 64 bytes held as `rows` rows: byte c * rows + r of the
// result is byte r * (64 / rows) + c of the source.
constexpr std::array<uint8_t, 64> byte_transpose(int rows) {
  std::array<uint8_t, 64> index{};
  for (int i = 0; i < 64; ++i) index[i] = static_cast<uint8_t>(i % rows * (64 / rows) + i / rows);
  return index;
}

// 8 values of x as 32-bit signed fixed point: x * unit, rounded.
__attribute__((target("avx512f,avx512dq"))) inline __m256i fixed8(const float* x, __m512d unit) {
  const __m512d scaled = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x)), unit);
  return _mm512_cvtepi64_epi32(_mm512_cvtpd_epi64(scaled));
}

// x's row as the VNNI tile reads it: digit d of 4 consecutive k in one 32-bit word,
// words[d * K / 4 + k / 4], and the value of the fixed point's unit.
struct XDigits {
  std::vector<uint32_t> words;
  double step = 0;
  int64_t top_bias = 0;

  // False where the tile cannot run (the float tiles do): a row that is not finite, or K
  // not a multiple of 16.
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi"))) bool make(
      const float* x, int64_t in_features) {
    if (in_features % 16 || in_features > kMaxVnniIn) return false;
    __m512 top = _mm512_setzero_ps();
    __mmask16 nan = 0;  // max drops a NaN
    for (int64_t k = 0; k < in_features; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      top = _mm512_max_ps(top, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float max_abs = _mm512_reduce_max_ps(top);
    if (nan || !std::isfinite(max_abs)) return false;
    step = max_abs > 0 ? max_abs / 1073741824.0 : 0;
    const __m512d unit = _mm512_set1_pd(max_abs > 0 ? 1073741824.0 / max_abs : 0);  // 2^30/max
    // 16 words of 4 bytes to 4 lanes of 16: each 128-bit lane one digit of 4 quads.
    alignas(64) static constexpr auto kDigitMajor = byte_transpose(16);
    const __m512i digit_major = _mm512_load_si512(kDigitMajor.data());
    const int64_t quads = in_features / 4;
    words.resize(kDigits * quads);
    __m512i top_sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < in_features; k += 16) {
      const __m512i fixed = _mm512_inserti64x4(
          _mm512_castsi256_si512(fixed8(x + k, unit)), fixed8(x + k + 8, unit), 1);
      top_sum = _mm512_add_epi32(top_sum, _mm512_srai_epi32(fixed, 24));
      const __m512i digits = _mm512_permutexvar_epi8(digit_major, fixed);
      uint32_t* out = words.data() + k / 4;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_extracti32x4_epi32(digits, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + quads), _mm512_extracti32x4_epi32(digits, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * quads),
                       _mm512_extracti32x4_epi32(digits, 2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 3 * quads),
                       _mm512_extracti32x4_epi32(digits, 3));
    }
    top_bias = 128 * static_cast<int64_t>(_mm512_reduce_add_epi32(top_sum));
    return true;
  }
};

// Half `h` of 16 32-bit sums as 8 64-bit ones.
__attribute__((target("avx512f"))) inline __m512i widen_half(__m512i v, int h) {
  return _mm512_cvtepi32_epi64(h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
}

// y[0, :] of one row for `Blocks` blocks from block `first` of the panel (see above). Two
// blocks at a time keep the sums in registers: 10 of them, where a panel's 4 blocks spilled.
template <int Blocks>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,avx512vbmi"))) void vnni_blocks(
    const Panel& p, int first) {
  const int64_t stride = p.in_features * kBlock;
  const int8_t* weight = static_cast<const int8_t*>(p.weight) + first * stride;
  // Two blocks fetched into L2 alongside, as tile512 fetches the next panel: the panel's
  // next two blocks, or after its last ones the next panel's first two.
  const int panel_blocks = static_cast<int>((p.columns + kBlock - 1) / kBlock);
  const char* next = first + 2 < panel_blocks
                         ? reinterpret_cast<const char*>(weight + 2 * stride)
                         : static_cast<const char*>(p.next);
  const int64_t quads = p.in_features / 4;
  // A block's cache line holds 4 rows of k of 16 columns; VPDPBUSD wants each column's 4
  // bytes together.
  alignas(64) static constexpr auto kTranspose = byte_transpose(4);
  const __m512i transpose = _mm512_load_si512(kTranspose.data());
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[Blocks][kDigits];
#pragma GCC unroll 2
  for (int b = 0; b < Blocks; ++b) {
#pragma GCC unroll 4
    for (int d = 0; d < kDigits; ++d) acc[b][d] = _mm512_setzero_si512();
  }
  for (int64_t q = 0; q < quads; ++q) {
    __m512i w[Blocks];
#pragma GCC unroll 2
    for (int b = 0; b < Blocks; ++b) {
      const int8_t* line = weight + b * stride + q * 64;
      prefetch_around(reinterpret_cast<const char*>(line),
                      next ? next + b * stride + q * 64 : nullptr);
      w[b] = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(line));
    }
#pragma GCC unroll 3
    for (int d = 0; d < kDigits - 1; ++d) {
      const __m512i digit = _mm512_set1_epi32(static_cast<int>(p.digits[d * quads + q]));
#pragma GCC unroll 2
      for (int b = 0; b < Blocks; ++b) acc[b][d] = _mm512_dpbusd_epi32(acc[b][d], digit, w[b]);
    }
    const __m512i top = _mm512_set1_epi32(static_cast<int>(p.digits[(kDigits - 1) * quads + q]));
#pragma GCC unroll 2
    for (int b = 0; b < Blocks; ++b) {
      const __m512i unsigned_w = _mm512_xor_si512(w[b], flip);  // w + 128
      acc[b][kDigits - 1] = _mm512_dpbusd_epi32(acc[b][kDigits - 1], unsigned_w, top);
    }
  }
  const __m512d step = _mm512_set1_pd(p.step);
  // The top digit's pass read each weight plus 128: 128 * sum(top digits) too much, in
  // every column, at the top digit's place.
  const __m512i top_bias = _mm512_set1_epi64(p.top_bias << (8 * (kDigits - 1)));
#pragma GCC unroll 2
  for (int b = 0; b < Blocks; ++b) {
    const int64_t column = (first + b) * kBlock;
    // sum_d 2^(8d) acc[d] - 2^24 top_bias, 8 columns at a time in 64 bits, then scaled.
    __m256 half[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512i total = _mm512_sub_epi64(widen_half(acc[b][0], h), top_bias);
#pragma GCC unroll 3
      for (int d = 1; d < kDigits; ++d)
        total = _mm512_add_epi64(total, _mm512_slli_epi64(widen_half(acc[b][d], h), 8 * d));
      half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi64_pd(total), step));
    }
    __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + column) : _mm512_setzero_ps();
    out = _mm512_fmadd_ps(out, _mm512_loadu_ps(p.scale + column), bias);
    const int64_t valid = std::clamp<int64_t>(p.columns - column, 0, kBlock);
    _mm512_mask_storeu_ps(p.y + column, valid == kBlock ? 0xFFFF : (1u << valid) - 1, out);
  }
}

template <int Blocks>
void tile_vnni(const Panel& p) {
  if constexpr (Blocks >= 2) vnni_blocks<2>(p, 0);
  if constexpr (Blocks == 4) vnni_blocks<2>(p, 2);
  if constexpr (Blocks % 2) vnni_blocks<1>(p, Blocks - 1);
}

constexpr TileFn kVnniTiles[kMaxBlocks512 + 1] = {nullptr, tile_vnni<1>, tile_vnni<2>,
                                                  tile_vnni<3>, tile_vnni<4>};

// e4m3 weights at one row, on AVX-512 BF16: float dot products of pairs instead of widening.
//
// The float tiles widen e4m3 to floats in five instructions per 32 weights before their
// FMAs; at one row that bounds them below the memory's pace, as widening bounded INT8
// before VNNI. VDPBF16PS multiplies 32 pairs of bfloat16s and adds each pair's two products
// to a float32 sum: 16 columns times two rows of k per instruction. A weight byte becomes
// its bfloat16 by two table lookups (VPERMI2B: the half's low and high bytes, by the byte's
// 7 magnitude bits; the sign is OR-ed in), subnormals included, so 64 weights cost a
// permute, two lookups, a logic op and two unpacks.
//
// x is not rounded to bfloat16: its row is written as three bfloat16 pieces that add up to
// it exactly (8 + 8 + 8 significant bits), one pass over the weights each. The products are
// exact in float32, so the sums carry only float32's roundings, as the float tiles' FMAs do.
constexpr int kPieces = 3;

// e4m3 magnitude `m` (7 bits) times 2^-8 as a bfloat16: the float tiles' reading
// (float8.h), so the same column scales apply; the NaN reads 480 as there.
constexpr uint16_t e4m3_bf16(int m) {
  if (m == 0x7F) return (127 << 7) | 0x70;                    // 480 * 2^-8 = 1.875
  const int exponent = m >> 3, mantissa = m & 7;
  if (exponent) return static_cast<uint16_t>(((exponent + 112) << 7) | (mantissa << 4));
  if (!mantissa) return 0;
  const int top = mantissa >= 4 ? 2 : mantissa >= 2 ? 1 : 0;  // mantissa * 2^-17
  return static_cast<uint16_t>(((110 + top) << 7) | ((mantissa - (1 << top)) << (7 - top)));
}

// The lookup tables: byte `half` (0 low, 1 high) of each magnitude's bfloat16.
constexpr std::array<uint8_t, 128> e4m3_bf16_bytes(int half) {
  std::array<uint8_t, 128> bytes{};
  for (int m = 0; m < 128; ++m) bytes[m] = static_cast<uint8_t>(e4m3_bf16(m) >> (8 * half));
  return bytes;
}

// VPERMB indices that order a block's 4 rows of k (64 bytes) for the unpacks: after them,
// 32-bit lane c of the first register holds column c's weights at k and k + 1, of the
// second at k + 2 and k + 3. Unpacking interleaves the low (high) 8 bytes of each 128-bit
// lane, so source byte 16 (e / 8) + e % 8 (+ 8) becomes pair element e.
constexpr std::array<uint8_t, 64> bf16_pair_order() {
  std::array<uint8_t, 64> index{};
  for (int e = 0; e < 32; ++e) {
    index[16 * (e / 8) + e % 8] = static_cast<uint8_t>(e % 2 * 16 + e / 2);
    index[16 * (e / 8) + 8 + e % 8] = static_cast<uint8_t>((2 + e % 2) * 16 + e / 2);
  }
  return index;
}

// x's row as the BF16 tile reads it: piece p of k and k + 1 in one 32-bit word,
// words[p * K / 2 + k / 2].
struct XPieces {
  std::vector<uint32_t> words;

  // False where the tile cannot run (the float tiles do): a value that is not finite or
  // out of bfloat16's range, or K not a multiple of 4.
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) bool make(
      const float* x, int64_t in_features) {
    if (in_features % 4) return false;
    const int64_t pairs = in_features / 2;
    words.resize(kPieces * pairs);
    __mmask16 bad = 0;
    for (int64_t k = 0; k < in_features; k += 16) {
      const __mmask16 valid = in_features - k >= 16 ? 0xFFFF : (1u << (in_features - k)) - 1;
      __m512 rest = _mm512_maskz_loadu_ps(valid, x + k);
      for (int piece = 0; piece < kPieces; ++piece) {
        const __m256bh half = _mm512_cvtneps_pbh(rest);
        const __m512 value = _mm512_cvtpbh_ps(half);
        if (piece == 0) bad |= _mm512_fpclass_ps_mask(value, 0x99);  // NaN or infinity
        rest = _mm512_sub_ps(rest, value);
        _mm256_mask_storeu_epi16(words.data() + piece * pairs + k / 2, valid,
                                 reinterpret_cast<__m256i>(half));
      }
    }
    return !bad;
  }
};

// y[0, :] of one row for a panel's `Blocks` e4m3 blocks (see above).
template <int Blocks>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16"))) void tile_bf16(
    const Panel& p) {
  const int64_t stride = p.in_features * kBlock;
  const uint8_t* weight = static_cast<const uint8_t*>(p.weight);
  const char* next = static_cast<const char*>(p.next);
  alignas(64) static constexpr auto kLow = e4m3_bf16_bytes(0), kHigh = e4m3_bf16_bytes(1);
  alignas(64) static constexpr auto kOrder = bf16_pair_order();
  const __m512i low0 = _mm512_load_si512(kLow.data()), low1 = _mm512_load_si512(kLow.data() + 64);
  const __m512i high0 = _mm512_load_si512(kHigh.data());
  const __m512i high1 = _mm512_load_si512(kHigh.data() + 64);
  const __m512i order = _mm512_load_si512(kOrder.data());
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t pairs = p.in_features / 2;
  __m512 acc[Blocks][kPieces];
#pragma GCC unroll 4
  for (int b = 0; b < Blocks; ++b) {
#pragma GCC unroll 3
    for (int piece = 0; piece < kPieces; ++piece) acc[b][piece] = _mm512_setzero_ps();
  }
  for (int64_t q = 0; q < p.in_features / 4; ++q) {
    __m512bh w01[Blocks], w23[Blocks];  // rows k, k + 1 and k + 2, k + 3 of each column
#pragma GCC unroll 4
    for (int b = 0; b < Blocks; ++b) {
      const uint8_t* line = weight + b * stride + q * 64;
      prefetch_around(reinterpret_cast<const char*>(line),
                      next ? next + b * stride + q * 64 : nullptr);
      const __m512i bytes = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(line));
      const __m512i low = _mm512_permutex2var_epi8(low0, bytes, low1);
      const __m512i high = _mm512_ternarylogic_epi32(  // table | (byte & 0x80)
          _mm512_permutex2var_epi8(high0, bytes, high1), bytes, sign, 0xF8);
      w01[b] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(low, high));
      w23[b] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(low, high));
    }
#pragma GCC unroll 3
    for (int piece = 0; piece < kPieces; ++piece) {
      const uint32_t* x = p.x_pairs + piece * pairs + 2 * q;
      const __m512bh x01 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[0])));
      const __m512bh x23 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[1])));
#pragma GCC unroll 4
      for (int b = 0; b < Blocks; ++b)
        acc[b][piece] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[b][piece], w01[b], x01), w23[b], x23);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < Blocks; ++b) {
    const int64_t column = b * kBlock;
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]), acc[b][2]);
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + column) : _mm512_setzero_ps();
    const __m512 out = _mm512_fmadd_ps(sum, _mm512_loadu_ps(p.scale + column), bias);
    const int64_t valid = std::clamp<int64_t>(p.columns - column, 0, kBlock);
    _mm512_mask_storeu_ps(p.y + column, valid == kBlock ? 0xFFFF : (1u << valid) - 1, out);
  }
}

constexpr TileFn kBf16Tiles[kMaxBlocks512 + 1] = {nullptr, tile_bf16<1>, tile_bf16<2>,
                                                  tile_bf16<3>, tile_bf16<4>};

enum class Format { kFloat32, kInt8, kE4M3 };

// The tiles a call runs: AVX-512's (panels of 3-4 blocks) or AVX2's (one block), and at one
// row the dot-product tiles where the CPU has them: VNNI for INT8, BF16 for e4m3.
struct Kernel {
  bool avx512;
  bool vnni;
  bool bf16;
  Format format = Format::kFloat32;

  int64_t max_tile_rows() const { return avx512 ? kMaxTileRows512 : kMaxTileRows; }
  int64_t blocks_per_panel(int64_t tile_rows) const {
    return avx512 ? blocks_per_panel512(tile_rows) : 1;
  }
  TileFn tile(int64_t rows, int64_t blocks) const {
    switch (format) {
      case Format::kInt8: return pick<Int8>(rows, blocks);
      case Format::kE4M3: return pick<E4M3>(rows, blocks);
      default: return pick<Float32>(rows, blocks);
    }
  }
  template <typename W>
  TileFn pick(int64_t rows, int64_t blocks) const {
    return avx512 ? Tiles<W>::avx512[rows][blocks] : Tiles<W>::avx2[rows];
  }
};

// An 8-bit panel read by this many row tiles or more is widened to floats once, not by
// every tile: widening takes the ports the FMAs need, and a prefill's rows make them busy.
constexpr int64_t kWidenFromTiles = 4;

// `count` 8-bit weights (a whole number of blocks) as floats, in this thread's scratch.
const float* widened_panel(Format format, const void* weights, int64_t count) {
  thread_local std::vector<float> scratch;
  scratch.resize(count);
  float* out = scratch.data();
  if (format == Format::kInt8) {
    const auto* in = static_cast<const Int8::T*>(weights);
    for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(out + i, Int8::load8(in + i));
  } else {
    const auto* in = static_cast<const E4M3::T*>(weights);
    for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(out + i, E4M3::load8(in + i));
  }
  return out;
}

// A call's blocks as one run per thread, each a sequence of panels `width` blocks wide. Its
// owner takes a run's panels front to back; a thread done with its own run takes the
// others' from their back ends. On two cores a thread that starts late, or loses its core
// for a while (to vLLM's front end, say), does not hold the other at the join.
class PanelRuns {
 public:
  PanelRuns(int64_t blocks, int64_t grain, int64_t width)
      : blocks_(blocks), width_(width),
        count_(std::clamp<int64_t>((blocks + grain - 1) / grain, 1,
                                   neuron_serve::step_thread_count())),
        chunk_((blocks + count_ - 1) / count_), ends_(count_) {
    for (int64_t run = 0; run < count_; ++run) {
      const int64_t panels = (last(run) - first(run) + width_ - 1) / width_;
      ends_[run].packed.store(static_cast<uint64_t>(std::max<int64_t>(panels, 0)) << 32);
    }
  }
  int64_t count() const { return count_; }
  int64_t first(int64_t run) const { return std::min(blocks_, run * chunk_); }
  int64_t last(int64_t run) const { return std::min(blocks_, (run + 1) * chunk_); }

  // Claims the run's first (or last) panel not yet taken; false once none is left.
  bool take(int64_t run, bool front, int64_t& block) const {
    std::atomic<uint64_t>& ends = ends_[run].packed;  // front panel | back panel << 32
    uint64_t now = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = now & 0xFFFFFFFFu, hi = now >> 32;
      if (lo >= hi) return false;
      const uint64_t claimed = front ? now + 1 : now - (uint64_t{1} << 32);
      if (ends.compare_exchange_weak(now, claimed, std::memory_order_relaxed)) {
        block = first(run) + static_cast<int64_t>(front ? lo : hi - 1) * width_;
        return true;
      }
    }
  }

 private:
  struct alignas(64) Ends {  // a cache line of its own per run
    std::atomic<uint64_t> packed{0};
  };
  int64_t blocks_, width_, count_, chunk_;
  mutable std::vector<Ends> ends_;
};

// The most the kernel may use: 0 AVX2, 1 AVX-512, 2 AVX-512 VNNI. Tests and benchmarks lower
// it to run a CPU's other tiles too.
std::atomic<int> isa_limit{2};

Kernel pick_kernel() {
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  static const bool vnni = avx512 && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512vnni") &&
                           __builtin_cpu_supports("avx512vbmi");
  static const bool bf16 = avx512 && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512bf16") &&
                           __builtin_cpu_supports("avx512vbmi");
  return {avx512 && isa_limit >= 1, vnni && isa_limit >= 2, bf16 && isa_limit >= 2};
}

// Which tiles run, at most `limit` ("avx2", "avx512" or "avx512-vnni"): the one this CPU has.
// "avx512-vnni" is AVX-512 with its dot-product tiles (VNNI, and BF16 where the CPU has it).
std::string skinny_matmul_isa(const std::string& limit) {
  static const std::array<std::string, 3> names = {"avx2", "avx512", "avx512-vnni"};
  const auto named = std::find(names.begin(), names.end(), limit);
  TORCH_CHECK(named != names.end(), "skinny_matmul_isa: unknown ISA ", limit,
              " (avx2, avx512 or avx512-vnni)");
  isa_limit = static_cast<int>(named - names.begin());
  const Kernel kernel = pick_kernel();
  return names[kernel.vnni ? 2 : kernel.avx512 ? 1 : 0];
}

// weight_blocks: [ceil(N / 16), K, 16], zero beyond column N (pack_weight in Python):
// float32, or int8 / float8_e4m3fn with `scale`, float32 [ceil(N / 16) * 16] per column.
at::Tensor skinny_matmul(const at::Tensor& x_in, const at::Tensor& weight_blocks,
                         const std::optional<at::Tensor>& bias_in, int64_t out_features,
                         const std::optional<at::Tensor>& scale_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "skinny_matmul: x must be a 2-d float32 tensor, got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const auto dtype = weight_blocks.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kChar || dtype == at::kFloat8_e4m3fn) &&
                  weight_blocks.is_contiguous() && weight_blocks.dim() == 3 &&
                  weight_blocks.size(0) == blocks && weight_blocks.size(1) == in_features &&
                  weight_blocks.size(2) == kBlock,
              "skinny_matmul: weight blocks ", weight_blocks.sizes(), " ", dtype,
              " do not fit x ", x.sizes(), " and ", out_features, " outputs (float32, int8 or "
              "float8_e4m3fn)");
  const bool scaled = dtype != at::kFloat;
  TORCH_CHECK(scaled == (scale_in.has_value() && scale_in->defined()),
              "skinny_matmul: 8-bit weights need a scale per column, float32 ones none");
  at::Tensor scale_tensor;
  const float* scale = nullptr;
  if (scaled) {
    TORCH_CHECK(scale_in->scalar_type() == at::kFloat && scale_in->numel() == blocks * kBlock,
                "skinny_matmul: scale must be float32 [", blocks * kBlock, "], got ",
                scale_in->sizes());
    scale_tensor = scale_in->contiguous();
    scale = scale_tensor.const_data_ptr<float>();
  }
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
  const char* wp = static_cast<const char*>(weight_blocks.const_data_ptr());
  float* yp = y.mutable_data_ptr<float>();
  Kernel kernel = pick_kernel();
  kernel.format = dtype == at::kChar ? Format::kInt8
                  : dtype == at::kFloat8_e4m3fn ? Format::kE4M3 : Format::kFloat32;
  // Row tiles of near-equal height: on AVX2 (at most 6) 8 rows run as 4 + 4, 16 as 6 + 5 + 5.
  const int64_t tiles = (rows + kernel.max_tile_rows() - 1) / kernel.max_tile_rows();
  const int64_t width = kernel.blocks_per_panel((rows + tiles - 1) / tiles);
  const int64_t block_bytes = in_features * kBlock * weight_blocks.element_size();
  // Threads take equal runs of blocks, not of panels: 36 blocks in panels of 4 would split
  // 5 + 4 panels. A task streams at least ~64 KB of weights so small layers skip the fork.
  const int64_t grain = std::max<int64_t>(1, 65536 / block_bytes);
  const PanelRuns runs(blocks, grain, width);
  const bool widen = kernel.format != Format::kFloat32 && tiles >= kWidenFromTiles;
  thread_local XDigits digits;  // this (the calling) thread's; the tiles get its pointer
  const bool vnni = kernel.vnni && kernel.format == Format::kInt8 && rows == 1 &&
                    digits.make(xp, in_features);
  thread_local XPieces pieces;
  const bool bf16 = kernel.bf16 && kernel.format == Format::kE4M3 && rows == 1 &&
                    pieces.make(xp, in_features);
  const uint32_t* digit_words = digits.words.data();
  const uint32_t* piece_words = pieces.words.data();
  const double digit_step = digits.step;
  const int64_t digit_top_bias = digits.top_bias;
  // The panel at `block` of a run ending at `last`; `ahead`: the run's next panel is fetched
  // while it computes.
  auto compute = [&](int64_t block, int64_t last, bool ahead) {
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
    Panel p{nullptr, in_features, wp + block * block_bytes, panel_bias,
            scale ? scale + block * kBlock : nullptr, nullptr, out_features, columns,
            ahead && next < last ? wp + next * block_bytes : nullptr, 0, tiles};
    Kernel panel_kernel = kernel;
    if (widen) {  // the tiles read the panel as floats from this thread's scratch
      p.weight = widened_panel(kernel.format, p.weight, panel_blocks * in_features * kBlock);
      p.next = nullptr;
      panel_kernel.format = Format::kFloat32;
    }
    if (vnni) {
      p.x = xp, p.y = yp + block * kBlock;
      p.digits = digit_words, p.step = digit_step, p.top_bias = digit_top_bias;
      return kVnniTiles[panel_blocks](p);
    }
    if (bf16) {
      p.x_pairs = piece_words, p.y = yp + block * kBlock;
      return kBf16Tiles[panel_blocks](p);
    }
    for (int64_t row = 0; p.pass < tiles; ++p.pass) {
      const int64_t height = (rows - row) / (tiles - p.pass);
      p.x = xp + row * in_features;
      p.y = yp + row * out_features + block * kBlock;
      panel_kernel.tile(height, panel_blocks)(p);
      row += height;
    }
  };
  neuron_serve::note_weight_stream(wp, blocks * block_bytes);
  neuron_serve::step_parallel_for(runs.count(), [&](int64_t begin, int64_t end) {
    int64_t block;
    for (int64_t run = begin; run < end; ++run)
      while (runs.take(run, /*front=*/true, block)) compute(block, runs.last(run), true);
    for (int64_t i = 1; i < runs.count(); ++i) {  // then the others' last panels
      const int64_t run = (end - 1 + i) % runs.count();
      while (runs.take(run, /*front=*/false, block)) compute(block, runs.last(run), false);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_serve, m) {
  m.def("skinny_matmul(Tensor x, Tensor weight_blocks, Tensor? bias, int out_features, "
        "Tensor? scale=None) -> Tensor");
  m.def("skinny_matmul_isa(str limit) -> str", &skinny_matmul_isa);
}

TORCH_LIBRARY_IMPL(neuron_serve, CPU, m) { m.impl("skinny_matmul", &skinny_matmul); }

// The op's C entry for inductor's C++ wrapper (aot_inductor.custom_ops_to_c_shims): a
// compiled graph calls it directly instead of boxing its arguments through the dispatcher
// on every one of a decode step's ~120 matmuls. It records itself as the dispatcher would,
// so a profiler (benchmarks/step_profile.py) still sees the matmuls of a compiled step.
extern "C" AOTITorchError aoti_torch_cpu_skinny_matmul(
    AtenTensorHandle x, AtenTensorHandle weight_blocks, AtenTensorHandle* bias,
    int64_t out_features, AtenTensorHandle* scale, AtenTensorHandle* out) {
  using namespace torch::aot_inductor;
  RECORD_FUNCTION("neuron_serve::skinny_matmul", c10::ArrayRef<const c10::IValue>{});
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(skinny_matmul(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight_blocks),
        pointer_to_optional<at::Tensor>(bias), out_features,
        pointer_to_optional<at::Tensor>(scale)));
  });
}

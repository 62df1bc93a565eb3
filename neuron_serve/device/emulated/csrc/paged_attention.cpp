// Emulated backend: paged attention over the KV cache (AVX2 + FMA), reading only the
// positions each query token sees: `paged_attention` for tokens that attend on their own
// (decodes), `paged_attention_tiles` for query tiles (prefill chunks, below).
//
// The reference kernel traced by inductor (attention/kernels.py) reads every position of
// the step's padded block table, visible or not, once per query head. Here each (token, KV head)
// reads its visible keys and values once, for all the query heads that share them:
// their scores, a softmax, then the values weighted by it (a decode token: chunk by chunk,
// with a running softmax; with fewer tokens than threads, in parts merged at the end).
//
// KV cache: [num_blocks, block_size, num_kv_heads, 2 * head_size], key then value: float32,
// or 8 bits (float8 e4m3 / e5m2, per-tensor scales). An 8-bit cache's positions are
// dequantized as they are read (a decode token's chunk, a tile's context), into per-thread
// scratch that the float32 code then reads from L1 / L2: memory sees one byte per element.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/record_function.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include "float8.h"
#include "step_threads.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

// e^x for x <= 0, 8 lanes (below -87: ~0): x = n ln2 + r, e^r by Cephes expf's polynomial,
// 2^n through the exponent bits. Relative error about 2e-7, like std::exp's float.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane j: the sum of the 8 lanes of a[j].
inline __m256 sum_each(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

float max_of(const float* p, int64_t n) {
  __m256 max8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(p + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, max8);
  float max = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) max = std::max(max, p[i]);
  return max;
}

// p[0:n] = e^(p - max) in place; returns their sum.
float exp_shifted(float* p, int64_t n, float max) {
  const __m256 shift = _mm256_set1_ps(max);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
    _mm256_storeu_ps(p + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float lane : lanes) total += lane;
  for (; i < n; ++i) total += p[i] = std::exp(p[i] - max);
  return total;
}

struct Shapes {
  int64_t heads, kv_heads, block_size, blocks_per_req;
};

enum class Format { kFloat32, kE4M3, kE5M2 };

// 8 float8 values as floats, through F16C: an e5m2 byte is a half's top byte; e4m3 bytes
// read their value times 2^-8 (float8.h), which the scale undoes (KvCache). The e4m3 NaN
// reads 480: the writer saturates, so the cache holds none.
inline __m256 fp8x8(const uint8_t* p, Format format) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (format == Format::kE5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  return _mm256_cvtph_ps(e4m3_halves(bytes));
}

// The KV cache as the kernels read it.
struct KvCache {
  const char* data;
  Format format;
  int64_t row_elems;       // one position of a block: kv_heads * 2 * head_size
  float k_scale, v_scale;  // an 8-bit cache's, times 2^8 for e4m3 (fp8x8)

  bool quantized() const { return format != Format::kFloat32; }
  const char* row(const int64_t* blocks, int64_t pos, int64_t block_size) const {
    const int64_t slot = blocks[pos / block_size] * block_size + pos % block_size;
    return data + slot * row_elems * (quantized() ? 1 : sizeof(float));
  }
  // Elements [begin, begin + 2 * D) of an 8-bit row (one KV head's key and value) into dst.
  void dequantize(const char* row, int64_t begin, int64_t head_size, float* dst) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(row) + begin;
    const __m256 ks = _mm256_set1_ps(k_scale), vs = _mm256_set1_ps(v_scale);
    for (int64_t d = 0; d < head_size; d += 8) {
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(fp8x8(src + d, format), ks));
      _mm256_storeu_ps(dst + head_size + d,
                       _mm256_mul_ps(fp8x8(src + head_size + d, format), vs));
    }
  }
};

constexpr int64_t kMaxHeads = 256;  // query heads
constexpr int64_t kMaxParts = 64;   // parts one token's positions are split into (threads)

struct Scratch {  // per thread, reused across tokens
  std::vector<float> probs;
  std::vector<const float*> rows;
  std::vector<float> dequantized;  // a chunk's rows of an 8-bit cache
};

// out[g] = keep[g] * out[g] + sum_i probs[g][i] * value_i for G query heads sharing a KV
// head (probs rows `stride` apart; out is not read where keep[g] is 0), C vectors of 8 at a
// time: G x C accumulators stay in registers.
template <int D, int G, int C>
void weigh_values(const float* const* rows, int64_t n, int64_t value_offset,
                  const float* probs, int64_t stride, const float* keep, float* out) {
  for (int c0 = 0; c0 < D / 8; c0 += C) {
    __m256 acc[G][C];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[g][c] = keep[g] == 0 ? _mm256_setzero_ps()
                                 : _mm256_mul_ps(_mm256_loadu_ps(out + g * D + (c0 + c) * 8),
                                                 _mm256_set1_ps(keep[g]));
    for (int64_t i = 0; i < n; ++i) {
      const float* values = rows[i] + value_offset + c0 * 8;
      __m256 v[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) v[c] = _mm256_loadu_ps(values + c * 8);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m256 weight = _mm256_set1_ps(probs[g * stride + i]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(weight, v[c], acc[g][c]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm256_storeu_ps(out + g * D + (c0 + c) * 8, acc[g][c]);
  }
}

// weigh_values for the `group` query heads of one KV head (outputs D apart): each value is
// read once for all of them.
template <int D>
void weigh_group_avx2(const float* const* rows, int64_t n, int64_t value_offset, const float* probs,
                 int64_t stride, int64_t group, const float* keep, float* out) {
  switch (group) {
    case 1: weigh_values<D, 1, 8>(rows, n, value_offset, probs, stride, keep, out); break;
    case 2: weigh_values<D, 2, 4>(rows, n, value_offset, probs, stride, keep, out); break;
    case 3: weigh_values<D, 3, 2>(rows, n, value_offset, probs, stride, keep, out); break;
    case 4: weigh_values<D, 4, 2>(rows, n, value_offset, probs, stride, keep, out); break;
    default:
      for (int64_t g = 0; g < group; ++g)
        weigh_values<D, 1, 8>(rows, n, value_offset, probs + g * stride, stride, keep + g,
                              out + g * D);
  }
}

// ---- AVX-512 versions, chosen at run time (use_avx512) -------------------------------------
// 16 lanes and 32 registers: a score pass shares each key load among 3 query heads, and a
// query head's whole output (64 floats: 4 registers) stays in registers over the values.

#define AVX512 __attribute__((target("avx512f")))

// Lane j: the sum of the 16 lanes of a[j].
AVX512 inline __m256 sum_each512(const __m512 a[8]) {
  __m256 halves[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    halves[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm256_castpd_ps(
                                  _mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  return sum_each(halves);
}

// Scores of 8 positions (rows) for G query heads of one KV head (q: G heads, D apart):
// each key vector is loaded once for the G heads. probs[g * stride + j] for j < count.
template <int D, int G>
AVX512 void score8_512(const float* const* rows, int64_t key_offset, const float* q, float scale,
                       float* probs, int64_t stride, int64_t count) {
  __m512 acc[G][8];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < D / 16; ++c) {
    __m512 qc[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) qc[g] = _mm512_loadu_ps(q + g * D + c * 16);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 key = _mm512_loadu_ps(rows[j] + key_offset + c * 16);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(qc[g], key, acc[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    alignas(32) float scores[8];
    _mm256_store_ps(scores, _mm256_mul_ps(sum_each512(acc[g]), _mm256_set1_ps(scale)));
    for (int64_t j = 0; j < count; ++j) probs[g * stride + j] = scores[j];
  }
}

// Scores of 8 positions for every query head of a KV head, 3 heads at a time (3 x 8
// accumulators; 4 would spill).
template <int D>
AVX512 void score8_group512(const float* const* rows, int64_t key_offset, const float* q,
                            int64_t group, float scale, float* probs, int64_t stride,
                            int64_t count) {
  for (int64_t g = 0; g < group; g += 3) {
    const float* qg = q + g * D;
    float* pg = probs + g * stride;
    switch (std::min<int64_t>(3, group - g)) {
      case 1: score8_512<D, 1>(rows, key_offset, qg, scale, pg, stride, count); break;
      case 2: score8_512<D, 2>(rows, key_offset, qg, scale, pg, stride, count); break;
      default: score8_512<D, 3>(rows, key_offset, qg, scale, pg, stride, count);
    }
  }
}

template <int D, int G, int C>
AVX512 void weigh_values512(const float* const* rows, int64_t n, int64_t value_offset,
                            const float* probs, int64_t stride, const float* keep, float* out) {
  for (int c0 = 0; c0 < D / 16; c0 += C) {
    __m512 acc[G][C];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[g][c] = keep[g] == 0 ? _mm512_setzero_ps()
                                 : _mm512_mul_ps(_mm512_loadu_ps(out + g * D + (c0 + c) * 16),
                                                 _mm512_set1_ps(keep[g]));
    for (int64_t i = 0; i < n; ++i) {
      const float* values = rows[i] + value_offset + c0 * 16;
      __m512 v[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(values + c * 16);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m512 weight = _mm512_set1_ps(probs[g * stride + i]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(weight, v[c], acc[g][c]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(out + g * D + (c0 + c) * 16, acc[g][c]);
  }
}

template <int D>
AVX512 void weigh_group512(const float* const* rows, int64_t n, int64_t value_offset,
                           const float* probs, int64_t stride, int64_t group, const float* keep,
                           float* out) {
  constexpr int kVectors = D / 16;  // 4 or 8; at most 16 accumulators
  switch (group) {
    case 1: weigh_values512<D, 1, kVectors>(rows, n, value_offset, probs, stride, keep, out); break;
    case 2: weigh_values512<D, 2, kVectors>(rows, n, value_offset, probs, stride, keep, out); break;
    case 3: weigh_values512<D, 3, 4>(rows, n, value_offset, probs, stride, keep, out); break;
    case 4: weigh_values512<D, 4, 4>(rows, n, value_offset, probs, stride, keep, out); break;
    default:
      for (int64_t g = 0; g < group; ++g)
        weigh_values512<D, 1, kVectors>(rows, n, value_offset, probs + g * stride, stride,
                                        keep + g, out + g * D);
  }
}

// Tests set this to run the AVX2 code on a CPU with AVX-512 too.
std::atomic<bool> avx2_only{false};

bool use_avx512() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported && !avx2_only;
}

template <int D>
void weigh_group(const float* const* rows, int64_t n, int64_t value_offset, const float* probs,
                 int64_t stride, int64_t group, const float* keep, float* out) {
  if (use_avx512())
    weigh_group512<D>(rows, n, value_offset, probs, stride, group, keep, out);
  else
    weigh_group_avx2<D>(rows, n, value_offset, probs, stride, group, keep, out);
}

// Scores of positions 0..count of `rows` (count <= kChunk; rows readable 8 past it) for
// every head: probs[h * stride + j]. 8 positions at a time per query head, one accumulator
// per position, summed across lanes once.
template <int D>
void score_positions(const float* const* rows, int64_t count, const float* q, const Shapes& s,
                     float scale, float* probs, int64_t stride) {
  const int64_t group = s.heads / s.kv_heads;
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < count; i += 8) {
    const float* const* at = rows + i;
    const int64_t n = std::min<int64_t>(8, count - i);
    if (use_avx512()) {
      for (int64_t kv_head = 0; kv_head < s.kv_heads; ++kv_head)
        score8_group512<D>(at, kv_head * 2 * D, q + kv_head * group * D, group, scale,
                           probs + kv_head * group * stride + i, stride, n);
      continue;
    }
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t key_offset = (h / group) * 2 * D;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < D / 8; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + h * D + c * 8);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(at[j] + key_offset + c * 8), acc[j]);
      }
      alignas(32) float scores[8];
      _mm256_store_ps(scores, _mm256_mul_ps(sum_each(acc), scale8));
      for (int64_t j = 0; j < n; ++j) probs[h * stride + i + j] = scores[j];
    }
  }
}

// Reads every cache line of rows[0..count) front to back, so they are in the caches when
// the scores and values need them. The hardware prefetchers follow a plain front-to-back
// read; they did not follow the scoring's (the keys of 8 rows at a time, a few lines of
// each), nor did software prefetches of the same lines help.
void load_rows(const float* const* rows, int64_t count, int64_t row_floats) {
  __m256 sink = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; ++i)
    for (int64_t f = 0; f < row_floats; f += 16)  // one load per 64-byte line
      sink = _mm256_or_ps(sink, _mm256_loadu_ps(rows[i] + f));
  asm volatile("" : : "x"(sink));  // keeps the loads
}

// Positions a decode token handles at a time: read in (load_rows), then scored and their
// values weighed while in L1 / L2, so each is read from memory once however long the
// context. This is markedly faster than scoring all positions first, with software
// prefetches, then weighing the values, and not far from a plain read of the same rows
// (measured: benchmarks/README.md, "Design measurements").
constexpr int64_t kChunk = 32;

// One token over positions first..last of its request, every head, for head size D, in
// chunks with a running softmax: per chunk the scores, the new running maximum, and the
// values weighed into the output, whose sum so far is rescaled by how far the maximum rose.
// A position's keys and values of all KV heads are one contiguous row of its block, so a
// block streams front to back. Leaves out unnormalized: per head h, the sum of
// e^(score - max[h]) * value, with sum[h] the sum of those weights (merge_parts divides).
template <int D>
void attend(const float* q, const KvCache& cache, const int64_t* blocks, int64_t first,
            int64_t last, const Shapes& s, float scale, float soft_cap,
            Scratch& scratch, float* out, float* max, float* sum) {
  const int64_t n = last - first + 1, group = s.heads / s.kv_heads;
  const int64_t row_floats = s.kv_heads * 2 * D;  // one position of a block
  // The i-th visible position's row, then the last one 8 times (score_positions reads
  // 8 at a time); for an 8-bit cache, the current chunk's dequantized rows.
  std::vector<const float*>& row_at = scratch.rows;
  row_at.resize(cache.quantized() ? kChunk + 8 : n + 8);
  if (cache.quantized())
    scratch.dequantized.resize(kChunk * row_floats);
  else
    for (int64_t i = 0; i < n + 8; ++i)
      row_at[i] = reinterpret_cast<const float*>(
          cache.row(blocks, first + std::min(i, n - 1), s.block_size));
  std::vector<float>& probs = scratch.probs;
  probs.resize(s.heads * kChunk);
  float keep[kMaxHeads];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t count = std::min(kChunk, n - c0);
    const float* const* rows = row_at.data() + c0;
    if (cache.quantized()) {
      for (int64_t i = 0; i < count; ++i) {
        float* dst = scratch.dequantized.data() + i * row_floats;
        const char* row = cache.row(blocks, first + c0 + i, s.block_size);
        for (int64_t h = 0; h < s.kv_heads; ++h) cache.dequantize(row, h * 2 * D, D, dst + h * 2 * D);
        row_at[i] = dst;
      }
      std::fill(row_at.begin() + count, row_at.begin() + count + 8, row_at[count - 1]);
      rows = row_at.data();
    } else {
      load_rows(rows, count, row_floats);
    }
    score_positions<D>(rows, count, q, s, scale, probs.data(), kChunk);
    for (int64_t h = 0; h < s.heads; ++h) {
      float* p = probs.data() + h * kChunk;
      if (soft_cap > 0)
        for (int64_t i = 0; i < count; ++i) p[i] = soft_cap * std::tanh(p[i] / soft_cap);
      const float top = c0 == 0 ? max_of(p, count) : std::max(max[h], max_of(p, count));
      keep[h] = c0 == 0 ? 0.0f : std::exp(max[h] - top);
      sum[h] = keep[h] * (c0 == 0 ? 0.0f : sum[h]) + exp_shifted(p, count, top);
      max[h] = top;
    }
    for (int64_t kv_head = 0; kv_head < s.kv_heads; ++kv_head) {
      const int64_t h = kv_head * group;
      weigh_group<D>(rows, count, kv_head * 2 * D + D, probs.data() + h * kChunk, kChunk,
                     group, keep + h, out + h * D);
    }
  }
}

// One token's output from `parts` attends over consecutive ranges of its positions (outs:
// [parts][heads][head_size], in place when there is one part): each part's weights are
// rescaled to the largest maximum, then the weighed values summed and divided by the weights.
void merge_parts(const float* outs, const float* max, const float* sum, int64_t parts,
                 int64_t heads, int64_t head_size, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    float top = max[h], total = 0.0f, weight[kMaxParts];
    for (int64_t p = 1; p < parts; ++p) top = std::max(top, max[p * heads + h]);
    for (int64_t p = 0; p < parts; ++p) {
      weight[p] = std::exp(max[p * heads + h] - top);
      total += weight[p] * sum[p * heads + h];
    }
    for (int64_t p = 0; p < parts; ++p) weight[p] /= total;
    for (int64_t d = 0; d < head_size; ++d) {
      float value = 0.0f;
      for (int64_t p = 0; p < parts; ++p) value += weight[p] * outs[(p * heads + h) * head_size + d];
      out[h * head_size + d] = value;
    }
  }
}

// The checks both ops make of their arguments; returns the shapes.
Shapes check_inputs(const char* op, const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& block_table) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, op,
              ": query must be float32 [tokens, heads, head_size], got ", query.sizes(), " ",
              query.scalar_type());
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() &&
                  kv_cache.size(3) == 2 * query.size(2) &&
                  (dtype == at::kFloat || dtype == at::kFloat8_e4m3fn ||
                   dtype == at::kFloat8_e5m2),
              op, ": kv_cache must be a contiguous float32 or float8 (e4m3fn, e5m2) [blocks, "
              "block_size, kv_heads, 2 * head_size], got ", kv_cache.sizes(), " ", dtype);
  const Shapes s{query.size(1), kv_cache.size(2), kv_cache.size(1), block_table.size(1)};
  const int64_t head_size = query.size(2);
  TORCH_CHECK((head_size == 64 || head_size == 128) && s.heads % s.kv_heads == 0 &&
                  s.heads <= kMaxHeads,
              op, ": head_size must be 64 or 128 and heads (at most ", kMaxHeads,
              ") a multiple of kv_heads, got ", head_size, " and ", s.heads, "/", s.kv_heads);
  return s;
}

// The cache and, for an 8-bit one, its scales (0-d float32 tensors).
KvCache cache_of(const char* op, const at::Tensor& kv_cache,
                 const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& v_scale) {
  const auto dtype = kv_cache.scalar_type();
  KvCache cache{static_cast<const char*>(kv_cache.const_data_ptr()),
                dtype == at::kFloat8_e4m3fn ? Format::kE4M3
                : dtype == at::kFloat8_e5m2 ? Format::kE5M2 : Format::kFloat32,
                kv_cache.size(2) * kv_cache.size(3), 1.0f, 1.0f};
  if (!cache.quantized()) return cache;
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->numel() == 1 &&
                  v_scale->numel() == 1,
              op, ": an 8-bit kv_cache needs k_scale and v_scale, one value each");
  const float unit = cache.format == Format::kE4M3 ? 256.0f : 1.0f;  // fp8x8
  cache.k_scale = k_scale->item<float>() * unit;
  cache.v_scale = v_scale->item<float>() * unit;
  return cache;
}

// A token of request `req` at `pos` reads blocks 0..pos / block_size of its row of the block
// table: check they lie inside the table and the cache instead of reading out of bounds.
void check_context(const char* op, const at::Tensor& block_table, int64_t num_blocks,
                   const Shapes& s, int64_t token, int64_t req, int64_t pos) {
  TORCH_CHECK(req >= 0 && req < block_table.size(0) && pos >= 0 &&
                  pos < s.blocks_per_req * s.block_size,
              op, ": token ", token, " at position ", pos, " of request ", req,
              " lies outside the block table ", block_table.sizes());
  const int64_t* row = block_table.const_data_ptr<int64_t>() + req * s.blocks_per_req;
  for (int64_t b = 0; b <= pos / s.block_size; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, op, ": block id ", row[b], " of request ",
                req, " is outside the KV cache's ", num_blocks);
}

at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& kv_cache,
                           const at::Tensor& block_table_in, const at::Tensor& token_req_in,
                           const at::Tensor& token_pos_in, double scale, int64_t sliding_window,
                           double soft_cap, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  const at::Tensor query = query_in.contiguous();
  const at::Tensor block_table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor token_req = token_req_in.to(at::kLong).contiguous();
  const at::Tensor token_pos = token_pos_in.to(at::kLong).contiguous();
  const Shapes s = check_inputs("paged_attention", query, kv_cache, block_table);
  const KvCache cache = cache_of("paged_attention", kv_cache, k_scale, v_scale);
  const int64_t head_size = query.size(2), tokens = query.size(0);
  const auto attend_token = head_size == 64 ? attend<64> : attend<128>;
  TORCH_CHECK(token_req.numel() == tokens && token_pos.numel() == tokens,
              "paged_attention: token_req and token_pos need one entry per token");
  const int64_t* req = token_req.const_data_ptr<int64_t>();
  const int64_t* pos = token_pos.const_data_ptr<int64_t>();
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    check_context("paged_attention", block_table, kv_cache.size(0), s, t, req[t], pos[t]);
  at::Tensor out = at::empty_like(query);
  const float* q = query.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  // Fewer tokens than threads (a decode of one or a few sequences): each token's positions
  // are split into `parts` ranges of at least a chunk, attended by different threads, then
  // merged; otherwise one part per token, attended in place. On two threads a lone token
  // takes little more than half its one-thread time (measured: benchmarks/README.md,
  // "Design measurements").
  const int64_t threads = neuron_serve::step_thread_count();
  const int64_t parts = std::clamp<int64_t>(0 < tokens && tokens < threads ? threads / tokens : 1, 1,
                                             kMaxParts);
  const int64_t head_floats = s.heads * head_size;
  std::vector<float> partial(parts > 1 ? tokens * parts * head_floats : 0);
  std::vector<float> maxes(tokens * parts * s.heads), sums(tokens * parts * s.heads);
  auto first_of = [&](int64_t t) {
    return sliding_window > 0 ? std::max<int64_t>(0, pos[t] - sliding_window + 1) : 0;
  };
  auto parts_of = [&](int64_t t) {
    return std::clamp<int64_t>((pos[t] - first_of(t) + 1) / kChunk, 1, parts);
  };
  neuron_serve::step_parallel_for(tokens * parts, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / parts, part = item % parts, n_parts = parts_of(t);
      if (part >= n_parts) continue;
      const int64_t first = first_of(t), n = pos[t] - first + 1;
      float* dest = parts > 1 ? partial.data() + item * head_floats : o + t * head_floats;
      attend_token(q + t * head_floats, cache, table + req[t] * s.blocks_per_req,
                   first + part * n / n_parts, first + (part + 1) * n / n_parts - 1, s,
                   static_cast<float>(scale), static_cast<float>(soft_cap), scratch, dest,
                   maxes.data() + item * s.heads, sums.data() + item * s.heads);
      if (parts == 1)
        merge_parts(dest, maxes.data() + t * s.heads, sums.data() + t * s.heads, 1, s.heads,
                    head_size, dest);
    }
  });
  if (parts > 1)
    for (int64_t t = 0; t < tokens; ++t)
      merge_parts(partial.data() + t * parts * head_floats, maxes.data() + t * parts * s.heads,
                  sums.data() + t * parts * s.heads, parts_of(t), s.heads, head_size,
                  o + t * head_floats);
  return out;
}

// ---- Query tiles: consecutive tokens of one request (a prefill chunk) attend together ----
//
// Per (tile, KV head) the visible keys are transposed once into panels of 8 positions,
// [panel][D][8], so the scores of a block of query rows are a small matrix product: per
// element of the head, two panel loads feed 2 x kRowBlock FMAs, one broadcast of the query
// per two of them. (The decode layout re-reads each key once per query row, from L1: 96
// rows per tile for SmolLM2.) Then a softmax per query row over the positions it sees, and
// its values weighed per token as in the decode kernel.

constexpr int kRowBlock = 6;  // 6 rows x 2 panels = 12 accumulators, 2 panels, 1 broadcast

struct TileScratch {  // per thread, reused across work items
  std::vector<float> keys;                // [panels][D][8]
  std::vector<float> scores;              // [tile rows x group][panels x 8]
  std::vector<const float*> rows, query;  // context rows; each query row's head vector
  std::vector<float> dequantized;         // [positions][2D]: one KV head of an 8-bit cache
};

// scores[r][8p .. 8p+8) = scale * q[r] . key for R query rows and P consecutive panels.
template <int D, int R, int P>
void score_block(const float* const* q, const float* panels, float scale, float* scores,
                 int64_t stride) {
  __m256 acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 key[P];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) key[p] = _mm256_loadu_ps(panels + p * D * 8 + d * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q[r] + d);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[r][p] = _mm256_fmadd_ps(qd, key[p], acc[r][p]);
    }
  }
  const __m256 scale8 = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
      _mm256_storeu_ps(scores + r * stride + p * 8, _mm256_mul_ps(acc[r][p], scale8));
}

template <int D, int P>
void score_rows(int rows, const float* const* q, const float* panels, float scale,
                float* scores, int64_t stride) {
  switch (rows) {
    case 1: score_block<D, 1, P>(q, panels, scale, scores, stride); break;
    case 2: score_block<D, 2, P>(q, panels, scale, scores, stride); break;
    case 3: score_block<D, 3, P>(q, panels, scale, scores, stride); break;
    case 4: score_block<D, 4, P>(q, panels, scale, scores, stride); break;
    case 5: score_block<D, 5, P>(q, panels, scale, scores, stride); break;
    default: score_block<D, kRowBlock, P>(q, panels, scale, scores, stride);
  }
}

// Positions first[r]..last[r] of tile row r (a token), for the query heads of one KV head;
// out: the tile's [rows, heads, D] output.
template <int D>
void attend_tile(const float* query, const KvCache& cache, const int64_t* blocks,
                 const int64_t* tokens, const int64_t* first, const int64_t* last,
                 int64_t rows, int64_t kv_head, const Shapes& s, float scale, float soft_cap,
                 TileScratch& scratch, float* out) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t lo = *std::min_element(first, first + rows);
  const int64_t n = *std::max_element(last, last + rows) - lo + 1;
  const int64_t panels = (n + 7) / 8, width = panels * 8;
  // Each position's row and where this KV head's key starts in it: an 8-bit cache's
  // rows are this head's key and value alone, dequantized.
  std::vector<const float*>& row_at = scratch.rows;
  row_at.resize(n);
  int64_t key_at = kv_head * 2 * D;
  if (cache.quantized()) scratch.dequantized.resize(n * 2 * D);
  for (int64_t i = 0; i < n; ++i) {
    const char* row = cache.row(blocks, lo + i, s.block_size);
    if (cache.quantized()) {
      float* dst = scratch.dequantized.data() + i * 2 * D;
      cache.dequantize(row, key_at, D, dst);
      row_at[i] = dst;
    } else {
      row_at[i] = reinterpret_cast<const float*>(row);
    }
  }
  if (cache.quantized()) key_at = 0;
  scratch.keys.resize(panels * D * 8);
  float* keys = scratch.keys.data();
  std::fill(keys + (panels - 1) * D * 8, keys + panels * D * 8, 0.0f);  // past the last position
  for (int64_t i = 0; i < n; ++i) {
    const float* key = row_at[i] + key_at;
    float* column = keys + (i / 8) * D * 8 + i % 8;
    for (int d = 0; d < D; ++d) column[d * 8] = key[d];
  }
  const int64_t query_rows = rows * group;  // row m: tile row m / group, head m % group
  scratch.query.resize(query_rows);
  for (int64_t m = 0; m < query_rows; ++m)
    scratch.query[m] = query + (tokens[m / group] * s.heads + kv_head * group + m % group) * D;
  scratch.scores.resize(query_rows * width);
  float* scores = scratch.scores.data();
  for (int64_t m0 = 0; m0 < query_rows; m0 += kRowBlock) {
    const int block = static_cast<int>(std::min<int64_t>(kRowBlock, query_rows - m0));
    const int64_t r0 = m0 / group, r1 = (m0 + block - 1) / group + 1;  // tile rows
    const int64_t begin = (*std::min_element(first + r0, first + r1) - lo) / 8;
    const int64_t end = (*std::max_element(last + r0, last + r1) - lo) / 8 + 1;
    for (int64_t p = begin; p < end; p += 2) {
      const float* panel = keys + p * D * 8;
      float* at = scores + m0 * width + p * 8;
      if (p + 1 < end)
        score_rows<D, 2>(block, scratch.query.data() + m0, panel, scale, at, width);
      else
        score_rows<D, 1>(block, scratch.query.data() + m0, panel, scale, at, width);
    }
  }
  const float fresh[kMaxHeads] = {};  // weigh_group's keep: the output starts from zero
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t offset = first[r] - lo, count = last[r] - first[r] + 1;
    float* row_scores = scores + r * group * width + offset;
    for (int64_t g = 0; g < group; ++g) {
      float* p = row_scores + g * width;
      if (soft_cap > 0)
        for (int64_t i = 0; i < count; ++i) p[i] = soft_cap * std::tanh(p[i] / soft_cap);
      const float norm = 1.0f / exp_shifted(p, count, max_of(p, count));
      for (int64_t i = 0; i < count; ++i) p[i] *= norm;
    }
    weigh_group<D>(row_at.data() + offset, count, key_at + D, row_scores, width, group, fresh,
                   out + (r * s.heads + kv_head * group) * D);
  }
}

// Attention of query tiles: tile i is tokens tile_token[i][0..q) of request tile_req[i],
// consecutive; a row whose token does not follow the one before is padding (left zero),
// as is all of a tile but its first row when its tokens are all 0. Returns [tiles * q,
// heads, head_size], tile-major.
at::Tensor paged_attention_tiles(const at::Tensor& query_in, const at::Tensor& kv_cache,
                                 const at::Tensor& block_table_in,
                                 const at::Tensor& tile_token_in, const at::Tensor& tile_req_in,
                                 const at::Tensor& token_pos_in, double scale,
                                 int64_t sliding_window, double soft_cap,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_tiles";
  const at::Tensor query = query_in.contiguous();
  const at::Tensor block_table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor tile_token = tile_token_in.to(at::kLong).contiguous();
  const at::Tensor tile_req = tile_req_in.to(at::kLong).contiguous();
  const at::Tensor token_pos = token_pos_in.to(at::kLong).contiguous();
  const Shapes s = check_inputs(op, query, kv_cache, block_table);
  const KvCache cache = cache_of(op, kv_cache, k_scale, v_scale);
  TORCH_CHECK(tile_token.dim() == 2 && tile_req.numel() == tile_token.size(0) &&
                  token_pos.numel() == query.size(0),
              op, ": need tile_token [tiles, q], tile_req [tiles] and token_pos [tokens], got ",
              tile_token.sizes(), ", ", tile_req.sizes(), ", ", token_pos.sizes());
  const int64_t num_tiles = tile_token.size(0), q = tile_token.size(1);
  const int64_t head_size = query.size(2);
  const int64_t* tok = tile_token.const_data_ptr<int64_t>();
  const int64_t* req = tile_req.const_data_ptr<int64_t>();
  const int64_t* pos = token_pos.const_data_ptr<int64_t>();
  // Each tile's real rows, and each row's visible positions first..last.
  std::vector<int64_t> rows(num_tiles), first(num_tiles * q), last(num_tiles * q);
  for (int64_t i = 0; i < num_tiles; ++i) {
    int64_t r = 0;
    while (r < q && (r == 0 || tok[i * q + r] == tok[i * q + r - 1] + 1)) {
      const int64_t t = tok[i * q + r];
      TORCH_CHECK(t >= 0 && t < query.size(0), op, ": tile ", i, " row ", r, " is token ", t,
                  " of ", query.size(0));
      check_context(op, block_table, kv_cache.size(0), s, t, req[i], pos[t]);
      last[i * q + r] = pos[t];
      first[i * q + r] = sliding_window > 0 ? std::max<int64_t>(0, pos[t] - sliding_window + 1) : 0;
      ++r;
    }
    rows[i] = r;
  }
  // Work items (tile, KV head), longest first, dealt round-robin to the threads: a chunk's
  // later tiles see more context, and contiguous ranges would give one thread all of them.
  std::vector<int64_t> items(num_tiles * s.kv_heads);
  for (int64_t w = 0; w < static_cast<int64_t>(items.size()); ++w) items[w] = w;
  auto cost = [&](int64_t w) {
    const int64_t i = w / s.kv_heads, r = rows[i] - 1;
    return rows[i] * (last[i * q + r] - first[i * q] + 1);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  at::Tensor out = at::zeros({num_tiles * q, s.heads, head_size}, query.options());
  const auto attend = head_size == 64 ? attend_tile<64> : attend_tile<128>;
  const float* qp = query.const_data_ptr<float>();
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t threads = neuron_serve::step_thread_count();
  neuron_serve::step_parallel_for(threads, [&](int64_t begin, int64_t end) {
    TileScratch scratch;
    for (int64_t thread = begin; thread < end; ++thread)
      for (size_t k = thread; k < items.size(); k += threads) {
        const int64_t i = items[k] / s.kv_heads, kv_head = items[k] % s.kv_heads;
        attend(qp, cache, table + req[i] * s.blocks_per_req, tok + i * q, first.data() + i * q,
               last.data() + i * q, rows[i], kv_head, s, static_cast<float>(scale),
               static_cast<float>(soft_cap), scratch, o + i * q * s.heads * head_size);
      }
  });
  return out;
}

// Which code runs: "avx512" or "avx2"; `avx2_only_` restricts it to AVX2 (tests).
std::string paged_attention_isa(bool avx2_only_) {
  avx2_only = avx2_only_;
  return use_avx512() ? "avx512" : "avx2";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_serve, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor token_req, "
        "Tensor token_pos, float scale, int sliding_window, float soft_cap, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("paged_attention_tiles(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor tile_token, Tensor tile_req, Tensor token_pos, float scale, int sliding_window, "
        "float soft_cap, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("paged_attention_isa(bool avx2_only) -> str", &paged_attention_isa);
}

TORCH_LIBRARY_IMPL(neuron_serve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_tiles", &paged_attention_tiles);
}

// The decode op's C entry for inductor's C++ wrapper (see skinny_matmul's): no boxing
// through the dispatcher on each layer's call; recorded for a profiler as skinny_matmul's is.
extern "C" AOTITorchError aoti_torch_cpu_paged_attention(
    AtenTensorHandle query, AtenTensorHandle kv_cache, AtenTensorHandle block_table,
    AtenTensorHandle token_req, AtenTensorHandle token_pos, double scale, int64_t sliding_window,
    double soft_cap, AtenTensorHandle* k_scale, AtenTensorHandle* v_scale, AtenTensorHandle* out) {
  using namespace torch::aot_inductor;
  RECORD_FUNCTION("neuron_serve::paged_attention", c10::ArrayRef<const c10::IValue>{});
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(paged_attention(
        *tensor_handle_to_tensor_pointer(query), *tensor_handle_to_tensor_pointer(kv_cache),
        *tensor_handle_to_tensor_pointer(block_table),
        *tensor_handle_to_tensor_pointer(token_req),
        *tensor_handle_to_tensor_pointer(token_pos), scale, sliding_window, soft_cap,
        pointer_to_optional<at::Tensor>(k_scale), pointer_to_optional<at::Tensor>(v_scale)));
  });
}

// Emulated backend: attention of query tokens that attend on their own (decodes) over the
// paged KV cache (AVX2 + FMA), reading only the positions each token sees.
//
// The reference kernel traced by inductor (kernels.py) reads every position of the step's
// padded block table, visible or not, once per query head. Here each (token, KV head)
// reads its visible keys and values once, for all the query heads that share them:
// scores for every position, a softmax, then the values weighted by it.
//
// KV cache: [num_blocks, block_size, num_kv_heads, 2 * head_size], key then value.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

constexpr int64_t kMaxHeads = 256;  // query heads

struct Scratch {  // per thread, reused across tokens
  std::vector<float> probs;
  std::vector<const float*> rows;
};

// out[g] = norm[g] * sum_i probs[g][i] * value_i for G query heads sharing a KV head
// (probs rows n apart), C vectors of 8 at a time: G x C accumulators stay in registers.
template <int D, int G, int C>
void weigh_values(const float* const* rows, int64_t n, int64_t value_offset,
                  const float* probs, const float* norm, float* out) {
  for (int c0 = 0; c0 < D / 8; c0 += C) {
    __m256 acc[G][C];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const float* values = rows[i] + value_offset + c0 * 8;
      __m256 v[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) v[c] = _mm256_loadu_ps(values + c * 8);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const __m256 weight = _mm256_set1_ps(probs[g * n + i]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(weight, v[c], acc[g][c]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm256_storeu_ps(out + g * D + (c0 + c) * 8,
                         _mm256_mul_ps(acc[g][c], _mm256_set1_ps(norm[g])));
  }
}

// One token over positions first..last of its request, every head, for head size D.
// A position's keys and values of all KV heads are one contiguous row of its block, so a
// block streams front to back. Scores: 8 positions at a time per query head, one
// accumulator per position, summed across lanes once. Output: a query head's D values in
// registers (in chunks of 64) while the positions stream by.
template <int D>
void attend(const float* q, const float* kv, const int64_t* blocks, int64_t first,
            int64_t last, const Shapes& s, float scale, float soft_cap,
            Scratch& scratch, float* out) {
  constexpr int kVectors = D / 8;
  const int64_t n = last - first + 1, group = s.heads / s.kv_heads;
  const int64_t row_floats = s.kv_heads * 2 * D;  // one position of a block
  std::vector<float>& probs = scratch.probs;
  std::vector<const float*>& row_at = scratch.rows;  // i-th visible position; then the last
  probs.resize(s.heads * n);
  row_at.resize(n + 16);
  for (int64_t i = 0; i < n + 16; ++i) {
    const int64_t pos = first + std::min(i, n - 1);
    row_at[i] = kv + (blocks[pos / s.block_size] * s.block_size + pos % s.block_size) * row_floats;
  }
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) {
    const float* const* rows = row_at.data() + i;
    // The next 8 rows: blocks lie anywhere, and a row (1.5 KB for SmolLM2) spans pages
    // faster than the hardware prefetchers pick a stream up (10 -> 12-14 GB/s from memory,
    // 60 layers' worth of cache, 8-32 sequences at 192 positions).
    for (int j = 8; j < 16 && i + j < n; ++j)
      for (int64_t byte = 0; byte < row_floats * 4; byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + byte, _MM_HINT_T0);
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t key_offset = (h / group) * 2 * D;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < kVectors; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + h * D + c * 8);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + key_offset + c * 8), acc[j]);
      }
      alignas(32) float scores[8];
      _mm256_store_ps(scores, _mm256_mul_ps(sum_each(acc), scale8));
      for (int64_t j = 0; j < std::min<int64_t>(8, n - i); ++j)
        probs[h * n + i + j] =
            soft_cap > 0 ? soft_cap * std::tanh(scores[j] / soft_cap) : scores[j];
    }
  }
  float norm[kMaxHeads];
  for (int64_t h = 0; h < s.heads; ++h) {
    float* p = probs.data() + h * n;
    norm[h] = 1.0f / exp_shifted(p, n, max_of(p, n));
  }
  for (int64_t kv_head = 0; kv_head < s.kv_heads; ++kv_head) {
    const int64_t h = kv_head * group, offset = kv_head * 2 * D + D;
    const float* p = probs.data() + h * n;
    switch (group) {  // the query heads of a KV head together, so each value is read once
      case 1: weigh_values<D, 1, 8>(row_at.data(), n, offset, p, norm + h, out + h * D); break;
      case 2: weigh_values<D, 2, 4>(row_at.data(), n, offset, p, norm + h, out + h * D); break;
      case 3: weigh_values<D, 3, 2>(row_at.data(), n, offset, p, norm + h, out + h * D); break;
      case 4: weigh_values<D, 4, 2>(row_at.data(), n, offset, p, norm + h, out + h * D); break;
      default:
        for (int64_t g = 0; g < group; ++g)
          weigh_values<D, 1, 8>(row_at.data(), n, offset, p + g * n, norm + h + g,
                                out + (h + g) * D);
    }
  }
}

at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& kv_cache,
                           const at::Tensor& block_table_in, const at::Tensor& token_req_in,
                           const at::Tensor& token_pos_in, double scale, int64_t sliding_window,
                           double soft_cap) {
  TORCH_CHECK(query_in.dim() == 3 && query_in.scalar_type() == at::kFloat,
              "paged_attention: query must be float32 [tokens, heads, head_size], got ",
              query_in.sizes(), " ", query_in.scalar_type());
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.scalar_type() == at::kFloat &&
                  kv_cache.is_contiguous() && kv_cache.size(3) == 2 * query_in.size(2),
              "paged_attention: kv_cache must be a contiguous float32 [blocks, block_size, "
              "kv_heads, 2 * head_size], got ", kv_cache.sizes());
  const at::Tensor query = query_in.contiguous();
  const at::Tensor block_table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor token_req = token_req_in.to(at::kLong).contiguous();
  const at::Tensor token_pos = token_pos_in.to(at::kLong).contiguous();
  const Shapes s{query.size(1), kv_cache.size(2), kv_cache.size(1), block_table.size(1)};
  const int64_t head_size = query.size(2), tokens = query.size(0);
  TORCH_CHECK((head_size == 64 || head_size == 128) && s.heads % s.kv_heads == 0 &&
                  s.heads <= kMaxHeads,
              "paged_attention: head_size must be 64 or 128 and heads (at most ", kMaxHeads,
              ") a multiple of kv_heads, got ", head_size, " and ", s.heads, "/", s.kv_heads);
  const auto attend_token = head_size == 64 ? attend<64> : attend<128>;
  TORCH_CHECK(token_req.numel() == tokens && token_pos.numel() == tokens,
              "paged_attention: token_req and token_pos need one entry per token");
  const int64_t* req = token_req.const_data_ptr<int64_t>();
  const int64_t* pos = token_pos.const_data_ptr<int64_t>();
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(req[t] >= 0 && req[t] < block_table.size(0) && pos[t] >= 0 &&
                    pos[t] < s.blocks_per_req * s.block_size,
                "paged_attention: token ", t, " at position ", pos[t], " of request ", req[t],
                " lies outside the block table ", block_table.sizes());
    for (int64_t b = 0; b <= pos[t] / s.block_size; ++b) {
      const int64_t block = table[req[t] * s.blocks_per_req + b];
      TORCH_CHECK(block >= 0 && block < kv_cache.size(0), "paged_attention: block id ", block,
                  " of request ", req[t], " is outside the KV cache's ", kv_cache.size(0));
    }
  }
  at::Tensor out = at::empty_like(query);
  const float* q = query.const_data_ptr<float>();
  const float* kv = kv_cache.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first =
          sliding_window > 0 ? std::max<int64_t>(0, pos[t] - sliding_window + 1) : 0;
      const int64_t offset = t * s.heads * head_size;
      attend_token(q + offset, kv, table + req[t] * s.blocks_per_req, first, pos[t], s,
             static_cast<float>(scale), static_cast<float>(soft_cap), scratch, o + offset);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_serve, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor token_req, "
        "Tensor token_pos, float scale, int sliding_window, float soft_cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(neuron_serve, CPU, m) { m.impl("paged_attention", &paged_attention); }

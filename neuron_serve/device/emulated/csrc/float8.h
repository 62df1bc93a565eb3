// Emulated backend: float8 e4m3 bytes as halves, which F16C widens to floats. Shared by the
// skinny matmul (8-bit weights) and the paged attention (an FP8 KV cache).
//
// A byte sign-extended to 16 bits and shifted left by 7 has its exponent and mantissa where
// a half's go, its sign where a half's goes, and a copy of the sign on the exponent's top
// bit, which the mask clears. The half reads the value times 2^-8 (exponent bias 7 against
// 15), subnormals included; the caller's scale undoes the 2^-8. The e4m3 NaN reads 480.
#pragma once

#include <immintrin.h>

constexpr short kE4M3HalfMask = static_cast<short>(0xBFFF);

// The 8 bytes in the low half of `bytes` as 8 halves.
inline __m128i e4m3_halves(__m128i bytes) {
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16(kE4M3HalfMask));
}

// 16 bytes as 16 halves (AVX2).
inline __m256i e4m3_halves16(__m128i bytes) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                          _mm256_set1_epi16(kE4M3HalfMask));
}

// 32 bytes as 32 halves (AVX512BW).
__attribute__((target("avx512f,avx512bw"))) inline __m512i e4m3_halves32(__m256i bytes) {
  return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                          _mm512_set1_epi16(kE4M3HalfMask));
}

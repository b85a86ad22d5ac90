// The small-rows GEMM's inner loop in AVX-512: four weight rows at once, each dotted with up to four rows of x.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CONVEYOR_AVX512_DOTS 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "float_types.h"

#include <cstdint>
#include <type_traits>

namespace conveyor::avx512 {

// 16 values from `p` as floats: a whole vector (the kernels' loads; the decode attention, attention_simd.h, reads
// through these too), or with `mask` the first lanes only (a row's tail: masked loads cost whole vectors a fifth of
// the bandwidth, see dot_block).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const int8_t* p) {  // an 8-bit KV row's values
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// sums[j * kOut + r] = x_j . w_r for the kRows rows x_j of x (float, [kRows, in]) and the kOut weight rows
// w_r = w + r * in: kRows * kOut independent accumulators, so the FMAs do not wait on each other, and each
// weight vector is widened once for every row of x.
template <int kRows, int kOut, typename weight_t>
inline void dot_block(const float* x, int64_t in, const weight_t* w, float* sums) {
  __m512 acc[kRows][kOut];
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto whole, __mmask16 mask) {
    const auto load = [&](const auto* p) {
      if constexpr (decltype(whole)::value) {
        return load16(p);
      } else {
        return load16(p, mask);
      }
    };
    __m512 wv[kOut];
    for (int r = 0; r < kOut; ++r) {
      conveyor::prefetch_weight(w + r * in + k);
      wv[r] = load(w + r * in + k);
    }
    for (int j = 0; j < kRows; ++j) {
      const __m512 xv = load(x + j * in + k);
      for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_fmadd_ps(xv, wv[r], acc[j][r]);
    }
  };
  // Whole vectors with plain loads, then the tail with masked ones: masked loads throughout cost float32 rows a
  // fifth of the bandwidth (SmolLM2's shapes at one row on an AMD EPYC Zen 5: 32-35 GB/s against 42-44 without).
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) step(k, std::true_type{}, __mmask16{0});
  if (k < in) step(k, std::false_type{}, static_cast<__mmask16>((1u << (in - k)) - 1));
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) sums[j * kOut + r] = _mm512_reduce_add_ps(acc[j][r]);
}

#if defined(__AVX512BF16__)
#define CONVEYOR_AVX512_BF16_DOTS 1
// The same for bfloat16 x and weights with the CPU's bfloat16 dot product (vdpbf16ps): 32 weights a load and one
// instruction, where widening them takes a shuffle and a shift per 16 and left a decode step's bfloat16 layers
// bound by those rather than by memory. Each product of two bfloat16 values is exact in float; pairs of them are
// summed in float (a different order than the widening path's, and subnormal inputs count as zero).
template <int kRows, int kOut>
inline void dot_block_bf16(const c10::BFloat16* x, int64_t in, const c10::BFloat16* w, float* sums) {
  __m512 acc[kRows][kOut];
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_setzero_ps();
  const auto load = [](const c10::BFloat16* p, auto whole, __mmask32 mask) {
    if constexpr (decltype(whole)::value) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  };
  const auto step = [&](int64_t k, auto whole, __mmask32 mask) {
    __m512bh wv[kOut];
    for (int r = 0; r < kOut; ++r) {
      conveyor::prefetch_weight(w + r * in + k);
      wv[r] = load(w + r * in + k, whole, mask);
    }
    for (int j = 0; j < kRows; ++j) {
      const __m512bh xv = load(x + j * in + k, whole, mask);
      for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], xv, wv[r]);
    }
  };
  int64_t k = 0;  // whole vectors with plain loads, then the tail, as above
  for (; k + 32 <= in; k += 32) step(k, std::true_type{}, __mmask32{0});
  if (k < in) step(k, std::false_type{}, static_cast<__mmask32>((1u << (in - k)) - 1));
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) sums[j * kOut + r] = _mm512_reduce_add_ps(acc[j][r]);
}
#endif

}  // namespace conveyor::avx512
#endif

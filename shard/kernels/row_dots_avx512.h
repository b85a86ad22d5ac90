// The small-rows GEMM's inner loop in AVX-512: four weight rows at once, each dotted with up to six rows of x.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CONVEYOR_AVX512_DOTS 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "float_types.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

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

// The four sums of a, b, c and d in one vector: their lanes added pairwise in a transposed tree (13 instructions
// where four whole reductions take 32), which at SmolLM2's 576 inputs was a sixth of a 5-row block's work.
inline __m128 reduce_add4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// sums[j * kOut + r] = the sum of acc[j][r]'s lanes.
template <int kRows, int kOut>
inline void reduce_sums(const __m512 (&acc)[kRows][kOut], float* sums) {
  for (int j = 0; j < kRows; ++j) {
    if constexpr (kOut == 4) {
      _mm_storeu_ps(sums + j * 4, reduce_add4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
    } else {
      for (int r = 0; r < kOut; ++r) sums[j * kOut + r] = _mm512_reduce_add_ps(acc[j][r]);
    }
  }
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
  reduce_sums<kRows, kOut>(acc, sums);
}

// bfloat16 weights widened without a shuffle: a load of 32 values holds 16 even ones in the low halves of its 32-bit
// lanes and 16 odd ones in the high halves, so a shift and a mask make two vectors of floats, where load16 takes a
// shuffle (port 5, which the FMAs share) and a shift per 16. x comes split to match (split_pairs: each whole block
// of 32 as its 16 even values, then its 16 odd ones); a tail under 32 stays in order and is widened as load16 does.
// The products are dot_block's; each lane sums them in another order.
template <int kRows, int kOut>
inline void dot_block_split(const float* x, int64_t in, const c10::BFloat16* w, float* sums) {
  __m512 acc[kRows][kOut];
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m512 even[kOut], odd[kOut];
    for (int r = 0; r < kOut; ++r) {
      conveyor::prefetch_weight(w + r * in + k);
      const __m512i pairs = _mm512_loadu_si512(w + r * in + k);
      even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      odd[r] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
    }
    for (int j = 0; j < kRows; ++j) {
      const __m512 xe = _mm512_loadu_ps(x + j * in + k), xo = _mm512_loadu_ps(x + j * in + k + 16);
      for (int r = 0; r < kOut; ++r) {
        acc[j][r] = _mm512_fmadd_ps(xe, even[r], acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(xo, odd[r], acc[j][r]);
      }
    }
  }
  for (; k < in; k += 16) {
    const __mmask16 mask = in - k >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (in - k)) - 1);
    __m512 wv[kOut];
    for (int r = 0; r < kOut; ++r) wv[r] = load16(w + r * in + k, mask);
    for (int j = 0; j < kRows; ++j) {
      const __m512 xv = load16(x + j * in + k, mask);
      for (int r = 0; r < kOut; ++r) acc[j][r] = _mm512_fmadd_ps(xv, wv[r], acc[j][r]);
    }
  }
  reduce_sums<kRows, kOut>(acc, sums);
}

// x's rows as dot_block_split reads them.
inline void split_pairs(std::vector<float>& x, int64_t in) {
  float block[32];
  for (size_t row = 0; row < x.size() / in; ++row)
    for (int64_t k = 0; k + 32 <= in; k += 32) {
      float* p = x.data() + row * in + k;
      for (int i = 0; i < 16; ++i) block[i] = p[2 * i], block[16 + i] = p[2 * i + 1];
      std::copy(block, block + 32, p);
    }
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
  reduce_sums<kRows, kOut>(acc, sums);
}
#endif

}  // namespace conveyor::avx512
#endif

// The paged decode attention's work for one (sequence, KV head) in AVX-512, for head sizes of 64 and 128.
//
// The portable loops (paged_attention.cpp) compiled to a scalar reduction for every q.k dot product and a scalar
// softmax (GCC vectorized neither its max nor its exp), and reloaded and stored the output sums for every
// context token: at batch 32 the kernel took a third of a decode step of SmolLM2-135M in float32, far from the
// memory bound of reading its K/V. Here sixteen tokens' dot products are summed across lanes together (one
// transpose-and-add tree instead of sixteen reductions), the softmax's exp is vectorized, and the output sums
// stay in registers while the context's values stream by.
#pragma once

#include "row_dots_avx512.h"

#ifdef CONVEYOR_AVX512_DOTS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace conveyor::avx512 {

// Lane i of the result is the sum of v[i]'s sixteen lanes.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's share of four vectors' sums
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  __m512 halves[2];
  for (int i = 0; i < 2; ++i)  // lanes 0-1 and 2-3 of eight vectors' shares, summed in pairs
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// exp(x) for x <= 0, the portable kernel's Cephes polynomial sixteen at a time (2^n applied by vscalefps).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, x), x, x), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// Softmax of `count` scores in place.
inline void softmax16(float* s, int64_t count) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = first_lanes(count - t);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, s + t));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = first_lanes(count - t);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), peak));
    _mm512_mask_storeu_ps(s + t, mask, e);
    total = _mm512_mask_add_ps(total, mask, total, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = first_lanes(count - t);
    _mm512_mask_storeu_ps(s + t, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + t), inverse));
  }
}

// scores[g * count + t] = q_g . k_t for the `group` query rows q (float, scaled, [group, kDim]) and the rows
// k_t = keys + slots[t] * stride, sixteen tokens at a time.
template <typename scalar_t, int kDim>
inline void score(const float* q, int64_t group, const scalar_t* keys, const int64_t* slots, int64_t stride,
                  int64_t count, float* scores) {
  constexpr int kVecs = kDim / 16;
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - t0);
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[kVecs];
      for (int j = 0; j < kVecs; ++j) qv[j] = _mm512_loadu_ps(q + g * kDim + 16 * j);
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i >= n) continue;
        const scalar_t* k = keys + slots[t0 + i] * stride;
        for (int j = 0; j < kVecs; ++j) acc[i] = _mm512_fmadd_ps(qv[j], load16(k + 16 * j, 0xFFFF), acc[i]);
      }
      _mm512_mask_storeu_ps(scores + g * count + t0, first_lanes(n), sum_lanes16(acc));
    }
  }
}

// out[g] = sum_t weights[g * count + t] * v_t, the rows v_t = values + slots[t] * stride; the sums of a few
// query rows at a time stay in registers (sixteen vectors of them) while the values stream by.
template <typename scalar_t, int kDim>
inline void weigh(const float* weights, int64_t group, const scalar_t* values, const int64_t* slots, int64_t stride,
                  int64_t count, float* out) {
  constexpr int kVecs = kDim / 16, kRows = std::max(1, 16 / kVecs);
  for (int64_t g0 = 0; g0 < group; g0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, group - g0));
    __m512 acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
      const scalar_t* v = values + slots[t] * stride;
      __m512 vv[kVecs];
      for (int j = 0; j < kVecs; ++j) vv[j] = load16(v + 16 * j, 0xFFFF);
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        const __m512 w = _mm512_set1_ps(weights[(g0 + r) * count + t]);
        for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_fmadd_ps(w, vv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(out + (g0 + r) * kDim + 16 * j, acc[r][j]);
  }
}

}  // namespace conveyor::avx512

#endif

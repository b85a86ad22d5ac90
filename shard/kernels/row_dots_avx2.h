// The small-rows GEMM's inner loop in AVX2 and FMA, for the CPUs without AVX-512: a few weight rows at once, each
// dotted with up to four rows of x. Every x vector is loaded once for all those weight rows and every weight vector
// once for all x rows, so at 3 and 4 rows of x the loop stays bound by reading the weight where the portable one
// (a weight row at a time, x reloaded for each) is bound by its loads.
#pragma once

#include "attention_simd.h"

#ifdef CONVEYOR_SIMD_ATTENTION
#define CONVEYOR_AVX2_DOTS 1

#include <cstdint>

namespace conveyor::avx2 {

// Weight rows per block: with kRows rows of x, kRows * kOut accumulators, kOut weight vectors and one x vector
// must fit AVX2's 16 registers.
template <int kRows>
constexpr int kOutFor = kRows <= 2 ? 4 : 2;

// sums[j * kOut + r] = x_j . w_r for the kRows rows x_j of x (float, [kRows, in]) and the kOut weight rows
// w_r = w + r * in (float or bfloat16, widened as read).
template <int kRows, int kOut, typename weight_t>
inline void dot_block(const float* x, int64_t in, const weight_t* w, float* sums) {
  using V = conveyor::simd::Avx2;
  __m256 acc[kRows][kOut];
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) acc[j][r] = V::zero();
  constexpr int64_t kPerLine = 64 / sizeof(weight_t);  // one prefetch per cache line of each weight row
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    __m256 wv[kOut];
    for (int r = 0; r < kOut; ++r) {
      if (k % kPerLine == 0) conveyor::prefetch_weight(w + r * in + k);
      wv[r] = V::load(w + r * in + k);
    }
    for (int j = 0; j < kRows; ++j) {
      const __m256 xv = V::load(x + j * in + k);
      for (int r = 0; r < kOut; ++r) acc[j][r] = V::fma(xv, wv[r], acc[j][r]);
    }
  }
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) sums[j * kOut + r] = V::reduce_add(acc[j][r]);
  for (; k < in; ++k)  // the row's tail past the last whole vector
    for (int r = 0; r < kOut; ++r) {
      const float wk = widen(w[r * in + k]);
      for (int j = 0; j < kRows; ++j) sums[j * kOut + r] += x[j * in + k] * wk;
    }
}

}  // namespace conveyor::avx2

#endif

// What the GEMM kernels for a few rows share: one weight row dotted with up to four rows of x at once, and the
// walk over x's rows in chunks of four that picks the unrolled dot for each chunk.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float_types.h"

namespace conveyor {

inline float widen(int8_t x) { return static_cast<float>(x); }

constexpr int64_t kRowsAtOnce = 4;

// sums[j] = x_j . w for the kRows rows x_j of x (float, [kRows, in]); each element of w is widened once and used
// for every row, four partial sums side by side.
template <int kRows, typename weight_t>
inline void dot_rows(const float* x, int64_t in, const weight_t* w, float* sums) {
  const float* x0 = x;
  const float* x1 = x + (kRows > 1 ? in : 0);
  const float* x2 = x + (kRows > 2 ? 2 * in : 0);
  const float* x3 = x + (kRows > 3 ? 3 * in : 0);
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t k = 0; k < in; ++k) {
    const float wk = widen(w[k]);
    s0 += x0[k] * wk;
    if constexpr (kRows > 1) s1 += x1[k] * wk;
    if constexpr (kRows > 2) s2 += x2[k] * wk;
    if constexpr (kRows > 3) s3 += x3[k] * wk;
  }
  sums[0] = s0;
  if constexpr (kRows > 1) sums[1] = s1;
  if constexpr (kRows > 2) sums[2] = s2;
  if constexpr (kRows > 3) sums[3] = s3;
}

// Calls chunk(std::integral_constant<int, k>{}, m) for x's rows m..m+k-1, in chunks of up to kRowsAtOnce.
template <typename Chunk>
inline void for_row_chunks(int64_t count, Chunk chunk) {
  for (int64_t m = 0; m < count; m += kRowsAtOnce) {
    switch (std::min(kRowsAtOnce, count - m)) {
      case 1: chunk(std::integral_constant<int, 1>{}, m); break;
      case 2: chunk(std::integral_constant<int, 2>{}, m); break;
      case 3: chunk(std::integral_constant<int, 3>{}, m); break;
      default: chunk(std::integral_constant<int, 4>{}, m); break;
    }
  }
}

}  // namespace conveyor

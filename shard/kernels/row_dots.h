// What the GEMM kernels for a few rows share: one weight row dotted with up to four rows of x at once, and the
// walk over x's rows in chunks of four that picks the unrolled dot for each chunk.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float_types.h"
#include "row_dots_avx512.h"

namespace conveyor {

// The quantized GEMMs' loops, by the widest SIMD each uses, and the widest one this library was built for (what
// int8_gemm and int4_gemm run; the others stay callable by name, so the tests hold each to the reference).
enum class Loop { kPortable, kAvx2, kAvx512 };

constexpr Loop kBestLoop =
#if defined(CONVEYOR_AVX512_DOTS)
    Loop::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
    Loop::kAvx2;
#else
    Loop::kPortable;
#endif

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

// Rows of x the quantized kernels' AVX2 loops take in one chunk past kRowsAtOnce: they widen each block of weights
// once per chunk, so a step verifying up to seven drafts (k + 1 rows of one sequence) widens it once, where chunks
// of four would widen it twice (issue 66's k-row cost: the widening, not the read, bounds those loops on AVX2).
constexpr int64_t kWideRows = 8;

// Rows of x the AVX-512 loops take in one chunk against four weight rows past kRowsAtOnce: 24 sums, the weight
// vectors and one of x fill AVX-512's 32 registers (a step verifying four or five drafts).
constexpr int64_t kAvx512ChunkRows = 6;

// out[m + j, o + r] = sums[j * kOut + r] + bias[o + r] for kRows rows of x and kOut weight rows: how every GEMM
// kernel for a few rows writes its sums.
template <int kRows, int kOut, typename scalar_t>
inline void store(const float* sums, const scalar_t* bias, scalar_t* out, int64_t out_features, int64_t m,
                  int64_t o) {
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) {
      const float b = bias ? widen(bias[o + r]) : 0.f;
      out[(m + j) * out_features + o + r] = static_cast<scalar_t>(sums[j * kOut + r] + b);
    }
}

// f(std::integral_constant<int, n>{}) for a run-time n in [1, kMost].
template <int kMost, typename F>
inline void with_rows(int n, F f) {
  if constexpr (kMost > 1) {
    if (n < kMost) return with_rows<kMost - 1>(n, f);
  }
  f(std::integral_constant<int, kMost>{});
}

// Calls chunk(std::integral_constant<int, k>{}, m) for x's rows m..m+k-1, in chunks of up to kMost.
template <int kMost = kRowsAtOnce, typename Chunk>
inline void for_row_chunks(int64_t count, Chunk chunk) {
  for (int64_t m = 0; m < count; m += kMost) {
    with_rows<kMost>(static_cast<int>(std::min<int64_t>(kMost, count - m)), [&](auto rows) { chunk(rows, m); });
  }
}

}  // namespace conveyor

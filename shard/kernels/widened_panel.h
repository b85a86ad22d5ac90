// Many rows of x (a decode batch, a prompt) against quantized weights on AVX-512: what the int8 and int4 GEMMs share
// past kWideRows rows of x (fewer rows run faster through their register loops). A panel of kPanel weight rows is widened once into a float buffer, each GEMM writing the same
// values its few-rows loop makes in registers, then every chunk of kChunk rows of x (kept in L1) is dotted with the
// panel's rows kOut at a time. Widening in registers for every chunk of rows had cost more than the FMAs, and walking
// all of x for each few weight rows re-read x from L2 for every group, which bounded the loops at 32 rows. Each sum
// runs 16 inputs at a time in input order, as the few-rows loops' do, so a row's output does not depend on the rows
// that share its call.
#pragma once

#include "row_dots.h"
#include "row_dots_avx512.h"

#if defined(CONVEYOR_AVX512_DOTS)
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace conveyor::panel {

constexpr int kChunk = 6, kOut = 4;  // 24 accumulators, 4 weight vectors and x's in 32 registers
constexpr int64_t kPanel = 16;       // weight rows widened together: every chunk of x's rows meets all of them in turn

// sums[m * kWidth + r] = x_m . widened_r over the first `span` inputs (a multiple of 16), for kRows rows of x.
template <int kRows, int kWidth>
inline void dots(const float* x, int64_t in, int64_t span, const float* widened, float* sums) {
  __m512 acc[kRows][kWidth];
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kWidth; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < span; k += 16) {
    __m512 wv[kWidth];
    for (int r = 0; r < kWidth; ++r) wv[r] = _mm512_loadu_ps(widened + r * span + k);
    for (int m = 0; m < kRows; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * in + k);
      for (int r = 0; r < kWidth; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kWidth; ++r) sums[m * kWidth + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// out[m, o] for o in [begin, end) and every row m of x (float [count, in]). `widen(o, n, buffer)` writes weight rows
// [o, o + n) as floats over their first `span` inputs into buffer [n, span]; `finish(sum, m, o)` returns the sum with
// whatever lies past `span` added (int8's last short block), the way the GEMM's few-rows loop adds it.
template <typename scalar_t, typename Widen, typename Finish>
void rows(const float* x, int64_t count, const scalar_t* bias, scalar_t* out, int64_t in, int64_t span,
          int64_t out_features, int64_t begin, int64_t end, Widen widen, Finish finish) {
  std::vector<float> widened(kPanel * span);
  for (int64_t o = begin; o < end; o += kPanel) {
    const int64_t n = std::min(kPanel, end - o);
    widen(o, n, widened.data());
    conveyor::for_row_chunks<kChunk>(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      const auto group = [&](auto width, int64_t g) {
        constexpr int kWidth = decltype(width)::value;
        float sums[kRows * kWidth];
        dots<kRows, kWidth>(x + m * in, in, span, widened.data() + g * span, sums);
        for (int j = 0; j < kRows; ++j)
          for (int r = 0; r < kWidth; ++r) sums[j * kWidth + r] = finish(sums[j * kWidth + r], m + j, o + g + r);
        conveyor::store<kRows, kWidth>(sums, bias, out, out_features, m, o + g);
      };
      int64_t g = 0;
      for (; g + kOut <= n; g += kOut) group(std::integral_constant<int, kOut>{}, g);
      for (; g < n; ++g) group(std::integral_constant<int, 1>{}, g);
    });
  }
}

}  // namespace conveyor::panel
#endif

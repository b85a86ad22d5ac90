// What the integer kernels share: x's rows rounded to int8 as each call comes in, a float scale per block of 32
// inputs (as llama.cpp's q8_0), each kernel placing the bytes in the order its weights are stored in.
//
// Why blocks, not a scale per row: a real model's activations have a few outlier channels (hundreds of times the
// rest), and one scale per row spends the 8 bits on them, leaving the other inputs a handful of levels. On
// SmolLM2-135M-Instruct with int8 weights, a scale per 32 inputs (with the weights' scales per 32 as well) moved
// the output distribution from float32's far less than a scale per row did (mean KL: `python -m
// benchmarks.accuracy --quantize int8`); an outlier now coarsens only its own block.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "float_types.h"
#include "row_dots_avx512.h"

// Where the library's CPU kind has them (conveyor.cpu.KINDS): AVX-512 VNNI for vpdpbusd, BW and VL for the byte and
// half-width masked loads. Elsewhere their ops exist but refuse, and `int8_vnni_available` says no.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define CONVEYOR_VNNI 1
#endif

namespace conveyor {

// Up to kStreamRows rows of x, the integer kernels read the weights once, as they come (a decode step with few
// sequences is reading the weights); more go several weight rows side by side, over tiles of kTileRows rows of x
// that stay in cache while every weight row passes.
constexpr int64_t kStreamRows = 4, kTileRows = 64;

constexpr int64_t kBlock = 32;  // inputs per activation scale

// q = round(x * (1 / s)) for the block's n values (the rest of q zeros: a row's last block, cut short), s = max|x|
// / 127 (1 for a block of zeros), as the tests' torch reference computes it; returns s.
template <typename scalar_t>
inline float quantize_block(const scalar_t* x, int64_t n, int8_t q[kBlock]) {
  float v[kBlock] = {};
  for (int64_t j = 0; j < n; ++j) v[j] = widen(x[j]);
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f, inverse = 1.f / scale;
  for (int64_t j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
  return scale;
}

#ifdef CONVEYOR_VNNI
using avx512::load16;  // 16 values of x widened to float (row_dots_avx512.h: a VNNI kind has AVX-512 F/BW/VL)

// A whole block: the same rounding in a few vector instructions (vcvtps2dq rounds to nearest even, as nearbyint).
template <typename scalar_t>
inline float quantize_whole_block(const scalar_t* x, int8_t q[kBlock]) {
  const __m512 low = load16(x), high = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 inverse = _mm512_set1_ps(1.f / scale);
  const __m128i q_low = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(low, inverse)));
  const __m128i q_high = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(high, inverse)));
  // One store of the 32 bytes: the placement's loads of q then forward from it (two halves stored apart would
  // stall every load that spans both).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_inserti128_si256(_mm256_castsi128_si256(q_low), q_high, 1));
  return scale;
}

// Calls place(m, b, q, scale) for every row m of x [count, in] and block b of it (`blocks` of them, the last ones
// past `in` all zeros), rows in parallel (a prompt's thousands of rows); each kernel stores q where its weights'
// order wants it.
template <typename scalar_t, typename Place>
void for_quantized_blocks(const at::Tensor& x, int64_t blocks, Place place) {
  const int64_t count = x.size(0), in = x.size(1), whole = std::min(blocks, in / kBlock);
  const scalar_t* values = x.data_ptr<scalar_t>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    int8_t q[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      const scalar_t* row = values + m * in;
      for (int64_t b = 0; b < whole; ++b) place(m, b, q, quantize_whole_block(row + b * kBlock, q));
      for (int64_t b = whole; b < blocks; ++b) {
        const int64_t n = std::clamp<int64_t>(in - b * kBlock, 0, kBlock);
        place(m, b, q, quantize_block(row + b * kBlock, n, q));
      }
    }
  });
}
#endif  // CONVEYOR_VNNI

}  // namespace conveyor

// What the integer kernels share: x's rows rounded to int8, a scale each, as each call comes in.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "float_types.h"

// Where the integer kernels are compiled (-march=native decides): AVX-512 VNNI for vpdpbusd, BW and VL for the byte
// and half-width masked loads. Elsewhere their ops exist but refuse, and `int8_vnni_available` says no.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define CONVEYOR_VNNI 1
#endif

namespace conveyor {

// Up to kStreamRows rows of x, the integer kernels read each weight row as one stream (a decode step with few
// sequences is reading the weights); more go several weight rows side by side, over tiles of kTileRows rows of x
// that stay in cache while every weight row passes.
constexpr int64_t kStreamRows = 4, kTileRows = 64;

// x's rows as uint8 (q + 128), each padded with zeros (128) to a multiple of `pad` bytes, with a scale a row.
struct QuantizedRows {
  std::vector<uint8_t> values;
  std::vector<float> scales;
  int64_t stride = 0;
};

// q = round(x * (1 / s)), s = max|x| / 127 (1 for a row of zeros), as the tests' torch reference computes it;
// rows in parallel (a prompt's thousands of rows), each a vectorized pass for the maximum and one for the rounding.
template <typename scalar_t>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t pad) {
  const int64_t count = x.size(0), in = x.size(1);
  QuantizedRows q;
  q.stride = (in + pad - 1) / pad * pad;
  q.values.assign(count * q.stride, 128);
  q.scales.resize(count);
  const scalar_t* values = x.data_ptr<scalar_t>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const scalar_t* row = values + m * in;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < in; ++k) amax = std::max(amax, std::fabs(widen(row[k])));
      const float scale = amax > 0.f ? amax / 127.f : 1.f, inverse = 1.f / scale;
      uint8_t* to = q.values.data() + m * q.stride;
#pragma omp simd
      for (int64_t k = 0; k < in; ++k)
        to[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(widen(row[k]) * inverse)) + 128);
      q.scales[m] = scale;
    }
  });
  return q;
}

}  // namespace conveyor

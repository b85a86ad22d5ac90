// x @ dequant(W).T (+ b) for int8 weights with a float16 scale per block of 32 inputs (`--quantize int8`, llama.cpp's
// q8_0 weights), on every CPU kind: x stays in float.
//
// Why x is not rounded to int8 too (as q8_0 x q8_0 and VNNI's vpdpbusd would have it): on SmolLM2-135M-Instruct that
// rounding alone, a scale per 32 inputs, turned float32's greedy answer to "What is the capital of France?" into
// "L'Etoile, la Cite, ..." (the first token is a near tie; a torch emulation of the integer kernel on an AVX2 machine
// gave the same answer as AVX-512 VNNI machines), while these same weights against float x answer as float32 does on
// every chat question of tests/unit/test_real_model_accuracy.py. Answers then do not depend on the CPU kind.
// Why a scale per block and not per row: an outlier weight coarsens only its block (a scale per row changed the
// answer to "Translate 'hello' into Spanish" from float32's, and measures a larger KL: benchmarks/accuracy.py).
//
// Each block of 32 weights is widened and scaled once, into float, then multiplied into up to four rows of x at
// once: the weight row is read from memory once per call whatever the row count (a quarter of float32's bytes,
// half of bf16's, which is what decides a decode step with few rows), and the products are float FMAs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_simd.h"
#include "float_types.h"
#include "row_dots.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int8_gemm_kernel {

using conveyor::kRowsAtOnce;
using conveyor::widen;

constexpr int64_t kBlock = 32, kLanes = 16;  // inputs per scale; float partial sums per row of x

// sums[m] = x_m . dequant(row) for kRows rows of x (float, [kRows, in]), each block's weights widened and scaled
// once for all of them. A last block cut short (in % 32) runs element by element.
template <int kRows>
inline void dots(const float* x, int64_t in, const int8_t* w, const c10::Half* scales, float* sums) {
  float acc[kRowsAtOnce][kLanes] = {};
  const int64_t whole = in / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    const float scale = widen(scales[b]);
    const int8_t* wb = w + b * kBlock;
    float ws[kBlock];
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) ws[j] = scale * static_cast<float>(wb[j]);
    for (int m = 0; m < kRows; ++m) {
      const float* xb = x + m * in + b * kBlock;
      float* a = acc[m];
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) a[j] += xb[j] * ws[j] + xb[j + kLanes] * ws[j + kLanes];
    }
  }
  for (int m = 0; m < kRows; ++m) {
    float sum = 0.f;
    for (int64_t j = 0; j < kLanes; ++j) sum += acc[m][j];
    if (whole * kBlock < in) {
      const float scale = widen(scales[whole]);
      for (int64_t k = whole * kBlock; k < in; ++k) sum += x[m * in + k] * (scale * static_cast<float>(w[k]));
    }
    sums[m] = sum;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The same in AVX2, kOut weight rows at once: each block's 32 weights loaded in one go, widened and scaled into four
// vectors, and each row of x's vectors used for every weight row, so that kRows * kOut accumulators run side by side.
// The loop above, left to the compiler, waited on its one accumulator chain and its stack round trip: on an AVX2 EPYC
// (Zen 3, 2 threads) a decode step's int8 layers read their weights at about a third of a plain read.
inline __m256 widened8(__m128i bytes, __m256 scale) {  // the low 8 int8 of `bytes`, as floats times the scale
  return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

template <int kRows, int kOut>
inline void dots_avx2(const float* x, int64_t in, const int8_t* w, const c10::Half* scales, int64_t blocks,
                      float* sums) {
  __m256 acc[kRows][kOut];
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t whole = in / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    __m256 ws[kOut][4];
    for (int r = 0; r < kOut; ++r) {
      const int8_t* wb = w + r * in + b * kBlock;
      conveyor::prefetch_weight(wb);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
      const __m256 scale = _mm256_set1_ps(widen(scales[r * blocks + b]));
      const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
      ws[r][0] = widened8(low, scale);
      ws[r][1] = widened8(_mm_srli_si128(low, 8), scale);
      ws[r][2] = widened8(high, scale);
      ws[r][3] = widened8(_mm_srli_si128(high, 8), scale);
    }
    for (int m = 0; m < kRows; ++m)
      for (int q = 0; q < 4; ++q) {
        const __m256 xv = _mm256_loadu_ps(x + m * in + b * kBlock + q * 8);
        for (int r = 0; r < kOut; ++r) acc[m][r] = _mm256_fmadd_ps(xv, ws[r][q], acc[m][r]);
      }
  }
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) {
      float sum = conveyor::simd::Avx2::reduce_add(acc[m][r]);
      if (whole * kBlock < in) {
        const float scale = widen(scales[r * blocks + whole]);
        for (int64_t k = whole * kBlock; k < in; ++k) sum += x[m * in + k] * (scale * static_cast<float>(w[r * in + k]));
      }
      sums[m * kOut + r] = sum;
    }
}

template <int kOut, int kMost, typename scalar_t>
void rows_avx2_block(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
                     scalar_t* out, int64_t in, int64_t out_features, int64_t o) {
  float sums[kMost * kOut];
  const int64_t blocks = (in + kBlock - 1) / kBlock;
  conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
    constexpr int kRows = decltype(chunk)::value;
    dots_avx2<kRows, kOut>(x + m * in, in, w + o * in, scales + o * blocks, blocks, sums);
    for (int j = 0; j < kRows; ++j)
      for (int r = 0; r < kOut; ++r) {
        const float b = bias ? widen(bias[o + r]) : 0.f;
        out[(m + j) * out_features + o + r] = static_cast<scalar_t>(sums[j * kOut + r] + b);
      }
  });
}

template <typename scalar_t>
void rows_avx2(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
               scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  int64_t o = begin;
  if (count > kRowsAtOnce) {  // one weight row at a time, up to kWideRows rows of x in registers
    for (; o < end; ++o) rows_avx2_block<1, conveyor::kWideRows>(x, count, w, scales, bias, out, in, out_features, o);
    return;
  }
  for (; o + 2 <= end; o += 2) rows_avx2_block<2, kRowsAtOnce>(x, count, w, scales, bias, out, in, out_features, o);
  for (; o < end; ++o) rows_avx2_block<1, kRowsAtOnce>(x, count, w, scales, bias, out, in, out_features, o);
}
#endif

// out[m, o] for o in [begin, end) and every m; x is float [count, in].
template <typename scalar_t>
void rows(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
          scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  float sums[kRowsAtOnce];
  const int64_t blocks = (in + kBlock - 1) / kBlock;
  for (int64_t o = begin; o < end; ++o) {
    const float b = bias ? widen(bias[o]) : 0.f;
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      dots<kRows>(x + m * in, in, w + o * in, scales + o * blocks, sums);
      for (int j = 0; j < kRows; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] + b);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out, bool avx2) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
    if (avx2)
      return rows_avx2<scalar_t>(xf.data(), count, weight.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(), b,
                                 out.data_ptr<scalar_t>(), in, out_features, begin, end);
#endif
    rows<scalar_t>(xf.data(), count, weight.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(), b,
                   out.data_ptr<scalar_t>(), in, out_features, begin, end);
  });
}

// x [M, in] (float32, bf16 or fp16), weight int8 [out, in], scales float16 [out, ceil(in / 32)], bias [out] in x's
// dtype or none.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias, bool avx2) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, in] and weight [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "an int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                  scales.size(1) == (weight.size(1) + kBlock - 1) / kBlock,
              "float16 scales [out, ceil(in / 32)]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  conveyor::for_float_dtype(x.scalar_type(), "int8_gemm",
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out, avx2); });
  return out;
}

// The AVX2 loop where the library is AVX2's; an AVX-512 build keeps the plain loop, which its compiler vectorizes
// 16 wide (the AVX2 loop was measured on an AVX2 CPU only).
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  return gemm(x, weight, scales, bias, true);
#else
  return gemm(x, weight, scales, bias, false);
#endif
}

// Each loop by name, the AVX2 one in every build: the tests hold both to the same reference on any machine.
at::Tensor int8_gemm_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, false);
}

at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, true);
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_gemm", c10::DispatchKey::CPU, &int8_gemm);
  m.def("int8_gemm_portable(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_gemm_portable", c10::DispatchKey::CPU, &int8_gemm_portable);
  m.def("int8_gemm_avx2(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_gemm_avx2", c10::DispatchKey::CPU, &int8_gemm_avx2);
}

}  // namespace conveyor::int8_gemm_kernel

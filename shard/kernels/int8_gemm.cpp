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
// half of bf16's, which is what decides a decode step with few rows), and the products are float FMAs. On AVX-512,
// more than eight rows (a decode batch, a prompt) widen a panel of weight rows once into a buffer and dot every chunk
// of x's rows with it, in the same order, so that a row's output does not depend on the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_simd.h"
#include "float_types.h"
#include "row_dots.h"
#include "row_dots_avx512.h"
#include "widened_panel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int8_gemm_kernel {

using conveyor::kRowsAtOnce;
using conveyor::widen;

constexpr int64_t kBlock = 32, kLanes = 16;  // inputs per scale; float partial sums per row of x

// `sum` plus x . dequant(w) over a last block cut short, inputs [from, in), element by element after the whole
// blocks' sum: every loop adds it the same way, so a row's output has the same bits on each of them.
inline float add_tail(float sum, const float* x, const int8_t* w, int64_t from, int64_t in, c10::Half scale) {
  const float s = widen(scale);
  for (int64_t k = from; k < in; ++k) sum += x[k] * (s * static_cast<float>(w[k]));
  return sum;
}

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
    if (whole * kBlock < in) sum = add_tail(sum, x + m * in, w, whole * kBlock, in, scales[whole]);
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
      if (whole * kBlock < in)
        sum = add_tail(sum, x + m * in, w + r * in, whole * kBlock, in, scales[r * blocks + whole]);
      sums[m * kOut + r] = sum;
    }
}

#endif

using conveyor::store;

#if defined(CONVEYOR_AVX512_DOTS)
// 16 weights from `p` widened and scaled: the one way both AVX-512 paths make them, so they dot the same values.
inline __m512 scaled16(const int8_t* p, __m512 scale) { return _mm512_mul_ps(scale, conveyor::avx512::load16(p)); }

// The AVX2 loop's scheme 16 lanes wide, for up to four rows of x: a block's 32 weights in two vectors, kOut = 4
// weight rows at once. Left to the compiler, the plain loop ran a decode step's int8 layers at a third of this
// loop's speed on an Intel Xeon (Ice Lake).
template <int kRows, int kOut>
inline void dots_avx512(const float* x, int64_t in, const int8_t* w, const c10::Half* scales, int64_t blocks,
                        float* sums) {
  __m512 acc[kRows][kOut];
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t whole = in / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    __m512 ws[kOut][2];
    for (int r = 0; r < kOut; ++r) {
      const int8_t* wb = w + r * in + b * kBlock;
      conveyor::prefetch_weight(wb);
      const __m512 scale = _mm512_set1_ps(widen(scales[r * blocks + b]));
      ws[r][0] = scaled16(wb, scale);
      ws[r][1] = scaled16(wb + 16, scale);
    }
    for (int m = 0; m < kRows; ++m)
      for (int q = 0; q < 2; ++q) {
        const __m512 xv = _mm512_loadu_ps(x + m * in + b * kBlock + q * 16);
        for (int r = 0; r < kOut; ++r) acc[m][r] = _mm512_fmadd_ps(xv, ws[r][q], acc[m][r]);
      }
  }
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) {
      float sum = _mm512_reduce_add_ps(acc[m][r]);
      if (whole * kBlock < in)
        sum = add_tail(sum, x + m * in, w + r * in, whole * kBlock, in, scales[r * blocks + whole]);
      sums[m * kOut + r] = sum;
    }
}

// Past kWideRows rows of x, the panel (widened_panel.h): each block's 32 weights widened by scaled16, as dots_avx512
// makes them, and a last short block added after the whole blocks' sum, as there.
template <typename scalar_t>
void rows_widened(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
                  scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t blocks = (in + kBlock - 1) / kBlock, whole = in / kBlock, span = whole * kBlock;
  const auto widen_rows = [&](int64_t o, int64_t n, float* widened) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < whole; ++b) {
        const __m512 scale = _mm512_set1_ps(widen(scales[(o + r) * blocks + b]));
        const int8_t* wb = w + (o + r) * in + b * kBlock;
        _mm512_storeu_ps(widened + r * span + b * kBlock, scaled16(wb, scale));
        _mm512_storeu_ps(widened + r * span + b * kBlock + 16, scaled16(wb + 16, scale));
      }
  };
  const auto finish = [&](float sum, int64_t m, int64_t o) {
    return span < in ? add_tail(sum, x + m * in, w + o * in, span, in, scales[o * blocks + whole]) : sum;
  };
  conveyor::panel::rows<scalar_t>(x, count, bias, out, in, span, out_features, begin, end, widen_rows, finish);
}
#endif

using conveyor::Loop;

template <Loop kLoop, int kOut, int kMost, typename scalar_t>
void rows_simd_block(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
                     scalar_t* out, int64_t in, int64_t out_features, int64_t o) {
  float sums[kMost * kOut];
  const int64_t blocks = (in + kBlock - 1) / kBlock;
  conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
    constexpr int kRows = decltype(chunk)::value;
#if defined(CONVEYOR_AVX512_DOTS)
    if constexpr (kLoop == Loop::kAvx512)
      dots_avx512<kRows, kOut>(x + m * in, in, w + o * in, scales + o * blocks, blocks, sums);
    else
#endif
      dots_avx2<kRows, kOut>(x + m * in, in, w + o * in, scales + o * blocks, blocks, sums);
    store<kRows, kOut>(sums, bias, out, out_features, m, o);
  });
}

// Weight rows [begin, end) against every row of x: kFew weight rows at once for up to four rows of x (AVX-512: up to
// six, a 4- or 5-draft verify, whose x vectors are then loaded once per four weight rows: SmolLM2-135M-Instruct's
// layers at five rows 12.1-13.8 -> 11.0-13.0 ms on an Intel Xeon, 2 threads); past those, one weight row at a time
// against up to kWideRows rows (past those, AVX-512 widens a panel instead, rows_widened).
template <Loop kLoop, int kFew, typename scalar_t>
void rows_simd(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
               scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  int64_t o = begin;
  if constexpr (kFew == 4) {  // AVX-512's 32 registers hold four weight rows' sums for kAvx512ChunkRows rows of x
    constexpr int64_t kChunk = conveyor::kAvx512ChunkRows;
    if (count > kRowsAtOnce && count <= kChunk) {
      for (; o + 4 <= end; o += 4) rows_simd_block<kLoop, 4, kChunk>(x, count, w, scales, bias, out, in, out_features, o);
    }
  }
  if (count > kRowsAtOnce) {
    for (; o < end; ++o)
      rows_simd_block<kLoop, 1, conveyor::kWideRows>(x, count, w, scales, bias, out, in, out_features, o);
    return;
  }
  for (; o + kFew <= end; o += kFew)
    rows_simd_block<kLoop, kFew, kRowsAtOnce>(x, count, w, scales, bias, out, in, out_features, o);
  for (; o < end; ++o) rows_simd_block<kLoop, 1, kRowsAtOnce>(x, count, w, scales, bias, out, in, out_features, o);
}

// out[m, o] for o in [begin, end) and every m; x is float [count, in].
template <typename scalar_t>
void rows(const float* x, int64_t count, const int8_t* w, const c10::Half* scales, const scalar_t* bias,
          scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  float sums[kRowsAtOnce];
  const int64_t blocks = (in + kBlock - 1) / kBlock;
  for (int64_t o = begin; o < end; ++o) {
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      dots<kRows>(x + m * in, in, w + o * in, scales + o * blocks, sums);
      store<kRows, 1>(sums, bias, out, out_features, m, o);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out, Loop loop) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const int8_t* w = weight.data_ptr<int8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
#if defined(CONVEYOR_AVX512_DOTS)
    if (loop == Loop::kAvx512 && count > conveyor::kWideRows)
      return rows_widened<scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
    if (loop == Loop::kAvx512)
      return rows_simd<Loop::kAvx512, 4, scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (loop == Loop::kAvx2)
      return rows_simd<Loop::kAvx2, 2, scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
#endif
    rows<scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
  });
}

// x [M, in] (float32, bf16 or fp16), weight int8 [out, in], scales float16 [out, ceil(in / 32)], bias [out] in x's
// dtype or none.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias, Loop loop) {
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
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out, loop); });
  return out;
}

// The widest loop the library was built for.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, conveyor::kBestLoop);
}

// Each loop by name, the AVX2 one in every build: the tests hold both to the same reference on any machine.
at::Tensor int8_gemm_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, Loop::kPortable);
}

at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, Loop::kAvx2);
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

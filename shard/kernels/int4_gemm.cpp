// x @ dequant(W).T (+ b) for weights quantized to 4 bits in groups of 32 along the input (`--quantize int4`).
//
// A group is 16 bytes: byte j holds element j in its low nibble and element j + 16 in its high one, each stored
// as q + 8 for q in [-8, 7], and the group has one float16 scale (as llama.cpp's q4_0). Splitting a group in halves
// rather than pairing neighbours keeps both halves' x contiguous, so the unpacking vectorizes. Each weight row is
// read from memory once per call whatever the row count; the scale multiplies each group's 16 lanes, and the
// lanes are summed once per row, not once per group.
//
// x stays in float on every CPU kind, as in int8_gemm.cpp. It was once rounded to int8 too on CPUs with AVX-512
// VNNI (llama.cpp's q4_0 against q8_0, integer vpdpbusd products). Rounding x is a step function, so the float
// noise of a CPU kind's own summation order (1e-6 of a layer's output) moves values across rounding edges and
// grows through the layers: on SmolLM2-135M-Instruct the same rounded-x scheme computed two ways (this loop fed
// rounded x, and torch) differed by 0.14 nats in the first token's lead on "Translate 'hello' into Spanish." and
// parted on its answer, where float x computed those two ways gave the same answers and KL to five digits. Both
// schemes measure the same KL from float32 (int4's error is its weights': 0.248 float x, 0.250 rounded x, on an
// AVX2 EPYC), so float x it is, and int4 answers do not depend on the CPU.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention_simd.h"
#include "float_types.h"
#include "row_dots.h"
#include "row_dots_avx512.h"
#include "widened_panel.h"

#include <algorithm>
#include <cstdint>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int4_gemm_kernel {

using conveyor::widen;

using conveyor::kRowsAtOnce;

constexpr int64_t kGroup = 32, kHalf = kGroup / 2;

// sums[m] = x_m . dequant(row) for kRows rows of x, the row's groups unpacked once for all of them.
template <int kRows>
void dots(const float* x, int64_t in, const uint8_t* packed, const c10::Half* scales, float* sums) {
  float acc[kRowsAtOnce][kHalf] = {};
  for (int64_t g = 0; g < in / kGroup; ++g) {
    const uint8_t* bytes = packed + g * kHalf;
    const float scale = widen(scales[g]);
    for (int m = 0; m < kRows; ++m) {
      const float* xg = x + m * in + g * kGroup;
      float* a = acc[m];
#pragma omp simd
      for (int64_t j = 0; j < kHalf; ++j) {
        const float low = static_cast<float>(static_cast<int>(bytes[j] & 15) - 8);
        const float high = static_cast<float>(static_cast<int>(bytes[j] >> 4) - 8);
        a[j] += scale * (xg[j] * low + xg[j + kHalf] * high);
      }
    }
  }
  for (int m = 0; m < kRows; ++m) {
    float sum = 0.f;
    for (int64_t j = 0; j < kHalf; ++j) sum += acc[m][j];
    sums[m] = sum;
  }
}

#ifdef CONVEYOR_SIMD_ATTENTION
// The same in AVX2 and FMA: a group's 32 nibbles widened to float once, in four vectors, then dotted with each row
// of x, and the group's scale applied once to each row's group sum. The plain loop above unpacks the group again
// for every row of x and lane by lane, which left one row bound by that work rather than by reading the weight
// (SmolLM2-135M-Instruct's int4 layers on an AMD EPYC Zen 3: a 1-row decode step of 17 ms for 60 MB of weights).
template <int kRows>
void dots_avx2(const float* x, int64_t in, const uint8_t* packed, const c10::Half* scales, float* sums) {
  using V = conveyor::simd::Avx2;
  __m256 acc[kRows];
  for (int m = 0; m < kRows; ++m) acc[m] = V::zero();
  const __m128i nibble = _mm_set1_epi8(15);
  const __m256 eight = V::set1(8.f);
  const auto widened = [&](__m128i bytes) { return V::sub(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), eight); };
  for (int64_t g = 0; g < in / kGroup; ++g) {
    if (g % 4 == 0) conveyor::prefetch_weight(packed + g * kHalf);  // a cache line is four groups
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + g * kHalf));
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m256 w0 = widened(low), w1 = widened(_mm_srli_si128(low, 8));
    const __m256 w2 = widened(high), w3 = widened(_mm_srli_si128(high, 8));
    const __m256 scale = V::set1(widen(scales[g]));
    for (int m = 0; m < kRows; ++m) {
      const float* xg = x + m * in + g * kGroup;
      __m256 t = V::mul(V::load(xg), w0);
      t = V::fma(V::load(xg + 8), w1, t);
      t = V::fma(V::load(xg + kHalf), w2, t);
      t = V::fma(V::load(xg + kHalf + 8), w3, t);
      acc[m] = V::fma(t, scale, acc[m]);
    }
  }
  for (int m = 0; m < kRows; ++m) sums[m] = V::reduce_add(acc[m]);
}
#endif

#if defined(CONVEYOR_AVX512_DOTS)
// The same on AVX-512, kOut weight rows at once, with no integer-to-float conversion: a group's 16 bytes are
// zero-extended into 16 lanes and each nibble picks its weight from a 16-entry table, (q - 8) times the group's
// scale, by one permute (vpermps reads an index's low 4 bits, so the low nibble needs no mask and the high one a
// shift). That is the dequantized weight the reference computes, rounded once, then one FMA per 16 weights and row
// of x. The AVX2 loop's conversions and its per-group product left 1-row int4 steps compute-bound on AVX-512 CPUs:
// on an Intel Xeon (AVX-512 and VNNI, 2 vCPUs) a 1B Llama's int4 bare decode step took 79 ms through it, more than
// int8's 62 ms for twice the bytes, and 48 ms through this loop (SmolLM2-135M-Instruct: 12.3 ms -> 8.4-10.5 ms).
inline __m512 nibble_values() {
  return _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
}

// A group's 32 weights, dequantized: elements 0-15 into `low`, 16-31 into `high`. The one way both AVX-512 paths
// make them, so that they dot the same values.
inline void group_weights(const uint8_t* bytes, c10::Half scale, __m512 values, __m512& low, __m512& high) {
  const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(widen(scale)));
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  low = _mm512_permutexvar_ps(lanes, table);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);
}

template <int kRows, int kOut>
void dots_avx512(const float* x, int64_t in, const uint8_t* packed, const c10::Half* scales, float* sums) {
  const int64_t groups = in / kGroup;
  const __m512 values = nibble_values();
  __m512 acc[kRows][kOut];
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 low[kOut], high[kOut];
    for (int r = 0; r < kOut; ++r) {
      const uint8_t* bytes = packed + r * (in / 2) + g * kHalf;
      if (g % 4 == 0) conveyor::prefetch_weight(bytes);  // a cache line is four groups
      group_weights(bytes, scales[r * groups + g], values, low[r], high[r]);
    }
    for (int m = 0; m < kRows; ++m) {
      const __m512 x_low = _mm512_loadu_ps(x + m * in + g * kGroup);
      const __m512 x_high = _mm512_loadu_ps(x + m * in + g * kGroup + kHalf);
      for (int r = 0; r < kOut; ++r) {
        acc[m][r] = _mm512_fmadd_ps(x_low, low[r], acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(x_high, high[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int r = 0; r < kOut; ++r) sums[m * kOut + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// Past kWideRows rows of x, the panel (widened_panel.h), each group dequantized by group_weights in the order
// dots_avx512 dots it: elements 0-15, then 16-31. A prompt's int4 layers took 2.3x float32's F.linear through
// dots_avx512 in chunks of eight rows (345 rows of SmolLM2's 1536 x 576 on an Intel Xeon with AVX-512).
template <typename scalar_t>
void rows_widened(const float* x, int64_t count, const uint8_t* w, const c10::Half* scales, const scalar_t* bias,
                  scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t groups = in / kGroup;
  const __m512 values = nibble_values();
  const auto widen_rows = [&](int64_t o, int64_t n, float* widened) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        __m512 low, high;
        group_weights(w + (o + r) * (in / 2) + g * kHalf, scales[(o + r) * groups + g], values, low, high);
        _mm512_storeu_ps(widened + r * in + g * kGroup, low);
        _mm512_storeu_ps(widened + r * in + g * kGroup + kHalf, high);
      }
  };
  const auto whole = [](float sum, int64_t, int64_t) { return sum; };  // in is a multiple of the group
  conveyor::panel::rows<scalar_t>(x, count, bias, out, in, in, out_features, begin, end, widen_rows, whole);
}
#endif

using conveyor::Loop;

// kOut weight rows from o against every row of x, in chunks of up to kMost rows of x.
template <Loop kLoop, int kOut, int kMost, typename scalar_t>
void rows_block(const float* x, int64_t count, const uint8_t* w, const c10::Half* scales, const scalar_t* bias,
                scalar_t* out, int64_t in, int64_t out_features, int64_t o) {
  const int64_t groups = in / kGroup;
  const uint8_t* row = w + o * (in / 2);
  const c10::Half* row_scales = scales + o * groups;
  float sums[kMost * kOut];
  conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
    constexpr int kRows = decltype(chunk)::value;
#if defined(CONVEYOR_AVX512_DOTS)
    if constexpr (kLoop == Loop::kAvx512) dots_avx512<kRows, kOut>(x + m * in, in, row, row_scales, sums);
#endif
#ifdef CONVEYOR_SIMD_ATTENTION
    if constexpr (kLoop == Loop::kAvx2) dots_avx2<kRows>(x + m * in, in, row, row_scales, sums);
#endif
    if constexpr (kLoop == Loop::kPortable) dots<kRows>(x + m * in, in, row, row_scales, sums);
    conveyor::store<kRows, kOut>(sums, bias, out, out_features, m, o);
  });
}

// Weight rows [begin, end) against every row of x. The AVX2 loop unpacks each group once for up to kWideRows rows
// of x; the AVX-512 one takes four weight rows at once for up to five rows of x (a 4-draft verify: 20 sums, 8
// weight vectors and x's two fill 31 registers; SmolLM2-135M-Instruct's layers at five rows 11.3-12.8 -> 10.5-11.8
// ms on an Intel Xeon, 2 threads), two for up to kWideRows, and a widened panel for more.
template <Loop kLoop, typename scalar_t>
void rows(const float* x, int64_t count, const uint8_t* w, const c10::Half* scales, const scalar_t* bias,
          scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  int64_t o = begin;
#if defined(CONVEYOR_AVX512_DOTS)
  if constexpr (kLoop == Loop::kAvx512) {
    if (count > conveyor::kWideRows)
      return rows_widened<scalar_t>(x, count, w, scales, bias, out, in, out_features, begin, end);
    if (count == kRowsAtOnce + 1) {
      for (; o + 4 <= end; o += 4)
        rows_block<kLoop, 4, kRowsAtOnce + 1>(x, count, w, scales, bias, out, in, out_features, o);
    } else if (count > kRowsAtOnce) {
      for (; o + 2 <= end; o += 2)
        rows_block<kLoop, 2, conveyor::kWideRows>(x, count, w, scales, bias, out, in, out_features, o);
    } else {
      for (; o + 4 <= end; o += 4) rows_block<kLoop, 4, kRowsAtOnce>(x, count, w, scales, bias, out, in, out_features, o);
    }
  }
#endif
  constexpr int kMost = kLoop == Loop::kPortable ? kRowsAtOnce : conveyor::kWideRows;
  for (; o < end; ++o) rows_block<kLoop, 1, kMost>(x, count, w, scales, bias, out, in, out_features, o);
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out, Loop loop) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const auto* w = weight.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const c10::Half*>(scales.data_ptr());
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
#if defined(CONVEYOR_AVX512_DOTS)
    if (loop == Loop::kAvx512) return rows<Loop::kAvx512, scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
#endif
#ifdef CONVEYOR_SIMD_ATTENTION
    if (loop == Loop::kAvx2) return rows<Loop::kAvx2, scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
#endif
    rows<Loop::kPortable, scalar_t>(xf.data(), count, w, s, b, o, in, out_features, begin, end);
  });
}

// x [M, in] (float32, bf16 or fp16), weight uint8 [out, in / 2], scales float16 [out, in / 32], bias [out] or none.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias, Loop loop) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int4_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == 2 * weight.size(1), "x [M, in], weight [out, in/2]");
  TORCH_CHECK(x.size(1) % kGroup == 0, "int4_gemm: the input size must be a multiple of 32");
  TORCH_CHECK(weight.scalar_type() == at::kByte, "a uint8 weight of packed nibbles");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == weight.size(0) * (x.size(1) / kGroup),
              "float16 scales [out, in / 32]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  conveyor::for_float_dtype(x.scalar_type(), "int4_gemm",
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out, loop); });
  return out;
}

// The widest loop the library was built for.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, conveyor::kBestLoop);
}

// Each loop by name, the AVX2 one in every build that has AVX2: the tests hold both to one reference anywhere.
at::Tensor int4_gemm_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, Loop::kPortable);
}

at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
#ifdef CONVEYOR_SIMD_ATTENTION
  return gemm(x, weight, scales, bias, Loop::kAvx2);
#else
  return gemm(x, weight, scales, bias, Loop::kPortable);
#endif
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, &int4_gemm);
  m.def("int4_gemm_portable(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int4_gemm_portable", c10::DispatchKey::CPU, &int4_gemm_portable);
  m.def("int4_gemm_avx2(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int4_gemm_avx2", c10::DispatchKey::CPU, &int4_gemm_avx2);
}

}  // namespace conveyor::int4_gemm_kernel

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

template <typename scalar_t>
void rows(const float* x, int64_t count, const uint8_t* w, const c10::Half* scales, const scalar_t* bias,
          scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end, bool avx2) {
  float sums[conveyor::kWideRows];
  const int64_t groups = in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = w + o * (in / 2);
    const c10::Half* row_scales = scales + o * groups;
    const float b = bias ? widen(bias[o]) : 0.f;
    const auto store = [&](int64_t m, int rows) {
      for (int j = 0; j < rows; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] + b);
    };
#ifdef CONVEYOR_SIMD_ATTENTION
    if (avx2) {  // each group unpacked once for up to kWideRows rows of x
      conveyor::for_row_chunks<conveyor::kWideRows>(count, [&](auto chunk, int64_t m) {
        dots_avx2<decltype(chunk)::value>(x + m * in, in, row, row_scales, sums);
        store(m, decltype(chunk)::value);
      });
      continue;
    }
#endif
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      dots<decltype(chunk)::value>(x + m * in, in, row, row_scales, sums);
      store(m, decltype(chunk)::value);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out, bool avx2) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const auto* w = weight.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const c10::Half*>(scales.data_ptr());
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    rows<scalar_t>(xf.data(), count, w, s, b, out.data_ptr<scalar_t>(), in, out_features, begin, end, avx2);
  });
}

// x [M, in] (float32, bf16 or fp16), weight uint8 [out, in / 2], scales float16 [out, in / 32], bias [out] or none.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias, bool avx2) {
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
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out, avx2); });
  return out;
}

// The AVX2 loop wherever the library has AVX2, AVX-512 builds included: the plain loop, left to their compiler, took
// SmolLM2-135M-Instruct's int4 bare decode step 17.8 ms at one row and 283 ms at 32 on an Intel Xeon with AVX-512
// and VNNI (2 vCPUs), where the AVX2 library on the same CPU took 12.3 and 139.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
#if defined(CONVEYOR_SIMD_ATTENTION)
  return gemm(x, weight, scales, bias, true);
#else
  return gemm(x, weight, scales, bias, false);
#endif
}

// Each loop by name, the AVX2 one in every build that has AVX2: the tests hold both to one reference anywhere.
at::Tensor int4_gemm_portable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, false);
}

at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, scales, bias, true);
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

// x @ dequant(W).T (+ b) for weights quantized to 4 bits in groups of 32 along the input (`--quantize int4`).
//
// A group is 16 bytes: byte j holds element j in its low nibble and element j + 16 in its high one, each stored
// as q + 8 for q in [-8, 7], and the group has one float16 scale (as llama.cpp's q4_0). Splitting a group in halves
// rather than pairing neighbours keeps both halves' x contiguous, so the unpacking vectorizes. Each weight row is
// read from memory once per call whatever the row count; the scale multiplies each group's 16 lanes, and the
// lanes are summed once per row, not once per group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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

template <typename scalar_t>
void rows(const float* x, int64_t count, const uint8_t* w, const c10::Half* scales, const scalar_t* bias,
          scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  float sums[kRowsAtOnce];
  const int64_t groups = in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = w + o * (in / 2);
    const c10::Half* row_scales = scales + o * groups;
    const float b = bias ? widen(bias[o]) : 0.f;
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      dots<kRows>(x + m * in, in, row, row_scales, sums);
      for (int j = 0; j < kRows; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] + b);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const auto* w = weight.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const c10::Half*>(scales.data_ptr());
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    rows<scalar_t>(xf.data(), count, w, s, b, out.data_ptr<scalar_t>(), in, out_features, begin, end);
  });
}

// x [M, in] (float32, bf16 or fp16), weight uint8 [out, in / 2], scales float16 [out, in / 32], bias [out] or none.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
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
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, &int4_gemm);
}

}  // namespace conveyor::int4_gemm_kernel

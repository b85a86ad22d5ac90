// x @ dequant(W).T (+ b) for weights quantized to int8 per output channel (`--quantize int8`).
//
// A weight row is int8 [in] with one float scale, factored out of the dot product: each int8 is widened to float
// as it is read and multiplied into four rows of x at once, and the scale multiplies each sum once. The weight row
// is read from memory once per call whatever the row count (from L1 for the next four rows): a quarter of
// float32's bytes, half of bf16's, which is what decides a decode step with few rows. With many rows the work is
// the dot products, in float, with no register blocking across weight rows: oneDNN's packed float kernels are
// several times faster there; the README says by how much.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using conveyor::widen;

constexpr int64_t kRowsAtOnce = 4;  // rows of x dotted together while one weight row is read

// sum_k x_j[k] * q[k] for the kRows rows x_j, the int8 row widened once per k for all of them.
template <int kRows>
inline void dots(const float* x, int64_t in, const int8_t* q, float* sums) {
  const float* x0 = x;
  const float* x1 = x + (kRows > 1 ? in : 0);
  const float* x2 = x + (kRows > 2 ? 2 * in : 0);
  const float* x3 = x + (kRows > 3 ? 3 * in : 0);
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t k = 0; k < in; ++k) {
    const float w = static_cast<float>(q[k]);
    s0 += x0[k] * w;
    if constexpr (kRows > 1) s1 += x1[k] * w;
    if constexpr (kRows > 2) s2 += x2[k] * w;
    if constexpr (kRows > 3) s3 += x3[k] * w;
  }
  sums[0] = s0;
  if constexpr (kRows > 1) sums[1] = s1;
  if constexpr (kRows > 2) sums[2] = s2;
  if constexpr (kRows > 3) sums[3] = s3;
}

// out[m, o] for o in [begin, end) and every m; x is float [count, in]. The row's scale multiplies each sum once.
template <typename scalar_t>
void rows(const float* x, int64_t count, const int8_t* w, const float* scales, const scalar_t* bias, scalar_t* out,
          int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  float sums[kRowsAtOnce];
  for (int64_t o = begin; o < end; ++o) {
    const int8_t* q = w + o * in;
    const float scale = scales[o], b = bias ? widen(bias[o]) : 0.f;
    for (int64_t m = 0; m < count; m += kRowsAtOnce) {
      const int64_t here = std::min(kRowsAtOnce, count - m);
      switch (here) {
        case 1: dots<1>(x + m * in, in, q, sums); break;
        case 2: dots<2>(x + m * in, in, q, sums); break;
        case 3: dots<3>(x + m * in, in, q, sums); break;
        default: dots<4>(x + m * in, in, q, sums); break;
      }
      for (int64_t j = 0; j < here; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] * scale + b);
    }
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = bias && bias->defined() ? bias->data_ptr<scalar_t>() : nullptr;
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    rows<scalar_t>(xf.data(), count, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), b,
                   out.data_ptr<scalar_t>(), in, out_features, begin, end);
  });
}

// x [M, in] (float32, bf16 or fp16), weight int8 [out, in], scales float32 [out], bias [out] in x's dtype or none.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, in] and weight [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "an int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "float32 scales [out]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == weight.size(0), "bias [out]");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias shares x's dtype");
  }
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  conveyor::for_float_dtype(x.scalar_type(), "int8_gemm", [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_gemm", c10::DispatchKey::CPU, &int8_gemm);
}

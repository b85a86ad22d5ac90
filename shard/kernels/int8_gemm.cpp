// x @ dequant(W).T (+ b) for weights quantized to int8 per output channel (`--quantize int8`).
//
// A weight row is int8 [in] with one float scale, factored out of the dot product: each int8 is widened to float
// as it is read and multiplied into four rows of x at once, and the scale multiplies each sum once. The weight row
// is read from memory once per call whatever the row count (from L1 for the next four rows): a quarter of
// float32's bytes, half of bf16's, which is what decides a decode step with few rows. With many rows the work is
// the dot products, in float, with no register blocking across weight rows: oneDNN's packed float kernels are
// faster there (demo small's layers at 32 rows, AMD EPYC Zen 4; no benchmark times the kernel alone, `make bench
// ARGS="--quantized int8"` on a CPU without VNNI measures a whole int8 deployment on it). CPUs with AVX-512 VNNI
// take int8_vnni_gemm.cpp instead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"
#include "row_dots.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int8_gemm_kernel {

using conveyor::widen;

// out[m, o] for o in [begin, end) and every m; x is float [count, in]. The row's scale multiplies each sum once.
template <typename scalar_t>
void rows(const float* x, int64_t count, const int8_t* w, const float* scales, const scalar_t* bias, scalar_t* out,
          int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  float sums[conveyor::kRowsAtOnce];
  for (int64_t o = begin; o < end; ++o) {
    const float scale = scales[o], b = bias ? widen(bias[o]) : 0.f;
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      conveyor::dot_rows<kRows>(x + m * in, in, w + o * in, sums);
      for (int j = 0; j < kRows; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] * scale + b);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const std::vector<float> xf = conveyor::widened<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
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
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  conveyor::for_float_dtype(x.scalar_type(), "int8_gemm", [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_gemm", c10::DispatchKey::CPU, &int8_gemm);
}

}  // namespace conveyor::int8_gemm_kernel

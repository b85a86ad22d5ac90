// RMSNorm over the last dimension, in float whatever x's dtype, in one pass per row instead of torch's seven ops
// (pow, mean, add, rsqrt, mul, the cast back, the weight's mul), each a dispatch and an allocation, which weigh
// most at batch 1, where a decode step runs 25 norms on the demo model. The bare forward's decode step
// (benchmarks/bare.py) with `CONVEYOR_ATTENTION=torch` against `auto` measures what the kernels save.
//
// `add_rms_norm_` also adds the residual branch's output into the hidden state first (in place, rounded to x's
// dtype as torch's add rounds it) and normalises the sum: the residual add and the next norm in one pass.
//
// Two roundings, as the checkpoints' own code does them: Llama's family rounds the normalised x to x's dtype and
// then multiplies by the weight in that dtype (`w * normed.to(dtype)`); Gemma's multiplies by (1 + w) in float and
// rounds once (`scale` is then 1 + w, as float32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "float_types.h"

#include <cmath>
#include <cstdint>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::rms_norm_kernel {

template <typename scalar_t, typename weight_t>
void rows(const scalar_t* x, const weight_t* weight, scalar_t* out, int64_t size, double eps, bool gemma,
          int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    const scalar_t* row = x + m * size;
    scalar_t* to = out + m * size;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < size; ++k) squares += conveyor::widen(row[k]) * conveyor::widen(row[k]);
    const float r = 1.f / std::sqrt(squares / static_cast<float>(size) + static_cast<float>(eps));
    if (gemma) {
#pragma omp simd
      for (int64_t k = 0; k < size; ++k)
        to[k] = conveyor::narrow<scalar_t>(conveyor::widen(row[k]) * r * conveyor::widen(weight[k]));
    } else {
#pragma omp simd
      for (int64_t k = 0; k < size; ++k) {
        const float normed = conveyor::widen(conveyor::narrow<scalar_t>(conveyor::widen(row[k]) * r));
        to[k] = conveyor::narrow<scalar_t>(conveyor::widen(weight[k]) * normed);
      }
    }
  }
}

// x [..., size] contiguous (float32, bf16 or fp16); weight [size] in x's dtype, or float32 (1 + w) for Gemma.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on CPU");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight [size] for x [..., size]");
  TORCH_CHECK(gemma ? weight.scalar_type() == at::kFloat : weight.scalar_type() == x.scalar_type(),
              "weight in x's dtype (Gemma: float32 1 + w)");
  auto out = at::empty_like(x);
  const int64_t size = x.size(-1), count = size ? x.numel() / size : 0;
  conveyor::for_float_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* values = x.data_ptr<scalar_t>();
    scalar_t* to = out.data_ptr<scalar_t>();
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      if (gemma)
        rows(values, weight.data_ptr<float>(), to, size, eps, true, begin, end);
      else
        rows(values, weight.data_ptr<scalar_t>(), to, size, eps, false, begin, end);
    });
  });
  return out;
}

template <typename scalar_t>
void add_rows(scalar_t* x, const scalar_t* delta, int64_t size, int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    scalar_t* row = x + m * size;
    const scalar_t* add = delta + m * size;
#pragma omp simd
    for (int64_t k = 0; k < size; ++k) row[k] = conveyor::narrow<scalar_t>(conveyor::widen(row[k]) + conveyor::widen(add[k]));
  }
}

// x += delta (in place), then rms_norm(x): x and delta [..., size], contiguous, one dtype.
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(delta.device().is_cpu() && delta.is_contiguous(), "delta contiguous, on CPU");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "delta shaped as x, x's dtype");
  TORCH_CHECK(x.is_contiguous(), "contiguous inputs");
  const int64_t size = x.size(-1), count = size ? x.numel() / size : 0;
  conveyor::for_float_dtype(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* values = x.data_ptr<scalar_t>();
    const scalar_t* add = delta.data_ptr<scalar_t>();
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) { add_rows(values, add, size, begin, end); });
  });
  return rms_norm(x, weight, eps, gemma);
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps, bool gemma) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
}

}  // namespace conveyor::rms_norm_kernel

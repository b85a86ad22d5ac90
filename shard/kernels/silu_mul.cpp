// SwiGLU's gate: silu(gate) * up from the fused gate/up projection's output [..., 2 * size], in one pass instead
// of torch's chunk, silu and mul (three dispatches and two allocations a layer). Rounded as torch rounds them:
// silu in float (torch's formula and exp), rounded to x's dtype, then the product in float, rounded again.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_types.h"

#if defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::silu_mul_kernel {

// exp(-g) for a block of kLanes floats, by the function torch's own vectorized silu calls on this CPU (SLEEF's
// expf to 1 ulp, exported by libtorch_cpu for its kernels, its header shipped with torch), so that silu is torch's
// to the bit in float32 too, and vectorized: glibc's scalar expf kept SwiGLU several times slower.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline void exp_negated(const float* g, float* out) {
  _mm512_storeu_ps(out, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(g))));
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
inline void exp_negated(const float* g, float* out) {
  _mm256_storeu_ps(out, Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g))));
}
#else
constexpr int64_t kLanes = 8;
inline void exp_negated(const float* g, float* out) {
  for (int64_t i = 0; i < kLanes; ++i) out[i] = std::exp(-g[i]);
}
#endif

// Up to kLanes elements of one row: a short block is padded with zeros, as torch pads its last vector.
template <typename scalar_t>
void block(const scalar_t* gate, const scalar_t* up, scalar_t* to, int64_t count) {
  alignas(64) float g[kLanes] = {}, e[kLanes];
  for (int64_t i = 0; i < count; ++i) g[i] = conveyor::widen(gate[i]);
  exp_negated(g, e);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float silu = conveyor::widen(conveyor::narrow<scalar_t>(g[i] / (1.f + e[i])));
    to[i] = conveyor::narrow<scalar_t>(silu * conveyor::widen(up[i]));
  }
}

template <typename scalar_t>
void rows(const scalar_t* gate_up, scalar_t* out, int64_t size, int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    const scalar_t* gate = gate_up + m * 2 * size;
    const scalar_t* up = gate + size;
    scalar_t* to = out + m * size;
    for (int64_t k = 0; k < size; k += kLanes) block(gate + k, up + k, to + k, std::min(kLanes, size - k));
  }
}

// gate_up [..., 2 * size] contiguous (float32, bf16 or fp16); returns [..., size].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous(), "silu_mul: contiguous, on CPU");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: an even last dimension");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  const int64_t size = shape.back() / 2;
  shape.back() = size;
  auto out = at::empty(shape, gate_up.options());
  const int64_t count = size ? out.numel() / size : 0;
  conveyor::for_float_dtype(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* values = gate_up.data_ptr<scalar_t>();
    scalar_t* to = out.data_ptr<scalar_t>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) { rows(values, to, size, begin, end); });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}

}  // namespace conveyor::silu_mul_kernel

// SwiGLU's gate: silu(gate) * up from the fused gate/up projection's output [..., 2 * size], in one pass instead
// of torch's chunk, silu and mul (three dispatches and two allocations a layer). Rounded as torch rounds them:
// silu in float, rounded to x's dtype, then the product in float, rounded again.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_types.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename scalar_t>
void rows(const scalar_t* gate_up, scalar_t* out, int64_t size, int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    const scalar_t* gate = gate_up + m * 2 * size;
    const scalar_t* up = gate + size;
    scalar_t* to = out + m * size;
#pragma omp simd
    for (int64_t k = 0; k < size; ++k) {
      const float g = conveyor::widen(gate[k]);
      const float silu = conveyor::widen(static_cast<scalar_t>(g / (1.f + std::exp(-g))));
      to[k] = static_cast<scalar_t>(silu * conveyor::widen(up[k]));
    }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}

// What Conveyor's CPU kernels share: reading an element of any float dtype as float, and calling a kernel
// instantiated for a tensor's dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace conveyor {

// How far ahead of its loads a GEMM kernel prefetches the weight it streams, in bytes: a decode step with a few rows
// reads every weight once, and the hardware prefetcher alone kept those reads well below the memory bandwidth.
constexpr int64_t kPrefetchBytes = 8192;

#if defined(__SSE__)
// Whether those prefetches fill L2 rather than L1. On an AMD EPYC Zen 4 (2 vCPUs, SmolLM2-135M's layer shapes
// streamed at one row, 2 threads) L2 let the small-rows GEMM read 20-35 GB/s where L1 read 15-25, the bf16 layers
// of a decode step taking 9.4-11.4 ms instead of 14.0-15.4 (float32: 17.1-20.2 instead of 21.8-23.5). L1 is what
// was measured on Intel's Xeon (Emerald Rapids), and it stays there.
inline const bool kPrefetchToL2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") > 0;
}();

// Asks for the weight bytes kPrefetchBytes past `p`, which the kernel reads next.
inline void prefetch_weight(const void* p) {
  const char* ahead = static_cast<const char*>(p) + kPrefetchBytes;
  if (kPrefetchToL2) {
    _mm_prefetch(ahead, _MM_HINT_T1);
  } else {
    _mm_prefetch(ahead, _MM_HINT_T0);
  }
}
#endif

inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {  // the top half of a float: a shift the compiler vectorizes
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// A float rounded to `scalar_t` as torch rounds it (to nearest, ties to even; a NaN stays a NaN). For bfloat16 this
// is c10's own rule written without its branch, so that a loop of them vectorizes: c10's conversion kept the
// half-type norms and SwiGLU several times slower than their float32 form.
template <typename scalar_t>
inline scalar_t narrow(float x) {
  return static_cast<scalar_t>(x);
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t top = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return c10::BFloat16(top, c10::BFloat16::from_bits());
}

// A small activation matrix (a few rows of x) widened once into float, for kernels that read it again for every
// weight row.
template <typename scalar_t>
std::vector<float> widened(const at::Tensor& x) {
  const scalar_t* values = x.data_ptr<scalar_t>();
  std::vector<float> out(x.numel());
  for (size_t i = 0; i < out.size(); ++i) out[i] = widen(values[i]);
  return out;
}

// A GEMM's optional bias: [out_features], contiguous, in the inputs' `dtype` (refused otherwise).
inline void check_bias(const c10::optional<at::Tensor>& bias, int64_t out_features, at::ScalarType dtype) {
  if (!bias || !bias->defined()) return;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features, "bias [out]");
  TORCH_CHECK(bias->scalar_type() == dtype, "bias shares the inputs' dtype");
}

// The bias's values, or nullptr for none.
template <typename scalar_t>
const scalar_t* bias_data(const c10::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? bias->data_ptr<scalar_t>() : nullptr;
}

// Calls `kernel(scalar_t{})` with scalar_t the C++ type of `dtype` (float32, bfloat16 or float16); any other
// dtype is the caller's error, named after `op`.
template <typename Kernel>
void for_float_dtype(at::ScalarType dtype, const char* op, Kernel kernel) {
  switch (dtype) {
    case at::kFloat:
      return kernel(float{});
    case at::kBFloat16:
      return kernel(c10::BFloat16{});
    case at::kHalf:
      return kernel(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace conveyor

// Rotary position embedding applied in place to x [T, heads, head_dim] (q and k side by side) with each token's
// cos and sin [T, 1, rotary_dim] (half-split convention; a rotary_dim below head_dim turns only the head's first
// part), in one pass instead of torch's slices, neg, cat, two muls and an add per layer. Rounded as torch rounds
// `x * cos + rotate_half(x) * sin` in x's dtype: each product, then the sum.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "float_types.h"

#include <algorithm>
#include <cstdint>
#include <vector>

// Each product is rounded before the sum, as torch's two muls and an add are: no fused multiply-add here, so that
// float32 gives torch's bits exactly. Pushed and popped: kernels.cpp compiles every kernel in one translation unit,
// and the kernels after this one (the small-rows GEMM: 1.6x longer at 4 rows) must keep their contractions.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::rotary_kernel {

template <typename scalar_t>
inline float rounded(float value) {
  return conveyor::widen(conveyor::narrow<scalar_t>(value));
}

// One head of one token: out[i] = x[i] cos[i] - x[i + half] sin[i], out[i + half] = x[i + half] cos[i + half]
// + x[i] sin[i + half] (the two halves of cos/sin are equal in Llama's layout, but they are read as given).
template <typename scalar_t>
void rotate(scalar_t* head, const scalar_t* cos, const scalar_t* sin, int64_t half, float* scratch) {
  for (int64_t i = 0; i < 2 * half; ++i) scratch[i] = conveyor::widen(head[i]);
  for (int64_t i = 0; i < half; ++i) {
    const float a = scratch[i], b = scratch[i + half];
    const float c0 = conveyor::widen(cos[i]), s0 = conveyor::widen(sin[i]);
    const float c1 = conveyor::widen(cos[i + half]), s1 = conveyor::widen(sin[i + half]);
    head[i] = conveyor::narrow<scalar_t>(rounded<scalar_t>(a * c0) + rounded<scalar_t>(rounded<scalar_t>(-b) * s0));
    head[i + half] = conveyor::narrow<scalar_t>(rounded<scalar_t>(b * c1) + rounded<scalar_t>(a * s1));
  }
}

// What both ops need of x (the tensor turned in place, on CPU, contiguous) and of each token's angles: cos and sin
// contiguous [tokens, 1, rotary_dim] in x's dtype, with an even rotary_dim within the head.
void check_angles(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t tokens,
                  int64_t head_dim) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x contiguous, on CPU");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos and sin alike");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == tokens && cos.size(1) == 1, "cos [T, 1, rotary_dim]");
  TORCH_CHECK(cos.size(2) % 2 == 0 && cos.size(2) <= head_dim, "an even rotary_dim within the head");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "cos/sin in x's dtype");
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, "rotary_: x [T, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), turning = cos.size(-1);
  check_angles(x, cos, sin, tokens, head_dim);
  conveyor::for_float_dtype(x.scalar_type(), "rotary_", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* values = x.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(turning);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t token = index / heads;
        rotate(values + index * head_dim, c + token * turning, s + token * turning, turning / 2, scratch.data());
      }
    });
  });
}

// The attention's whole prologue for the fused projection's output qkv [T, (heads + 2 kv_heads) * head_dim]: q and
// k rotated in place, then each token's k and v copied to its slot of the paged caches [blocks, block_size,
// kv_heads, head_dim] (slots [T], as `index_copy_` would), one pass instead of splits, views and two copies.
void rotary_kv_(at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slots) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "caches [blocks, size, heads, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  const int64_t head_dim = key_cache.size(3), tokens = qkv.size(0), turning = cos.size(-1);
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == kv_heads, "the caches hold kv_heads heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim,
              "qkv [T, (heads + 2 kv_heads) * head_dim]");
  check_angles(qkv, cos, sin, tokens, head_dim);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "slots [T] int64");
  TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type() && value_cache.scalar_type() == qkv.scalar_type(),
              "the caches in qkv's dtype");
  const int64_t* where = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(where[t] >= 0 && where[t] < capacity, "a slot beyond the caches");
  const int64_t kv_width = kv_heads * head_dim, row_width = qkv.size(1);
  conveyor::for_float_dtype(qkv.scalar_type(), "rotary_kv_", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* values = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* keys = key_cache.data_ptr<scalar_t>();
    scalar_t* vals = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(turning);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = values + t * row_width;
        for (int64_t h = 0; h < heads + kv_heads; ++h)
          rotate(row + h * head_dim, c + t * turning, s + t * turning, turning / 2, scratch.data());
        const scalar_t* k = row + heads * head_dim;
        std::copy(k, k + kv_width, keys + where[t] * kv_width);
        std::copy(k + kv_width, k + 2 * kv_width, vals + where[t] * kv_width);
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
  m.def(
      "rotary_kv_(Tensor(a!) qkv, int heads, int kv_heads, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor slots) -> ()");
  m.impl("rotary_kv_", c10::DispatchKey::CPU, &rotary_kv_);
}

}  // namespace conveyor::rotary_kernel

#pragma GCC pop_options

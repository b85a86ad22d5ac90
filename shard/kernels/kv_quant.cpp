// Writes a step's new K or V rows into an 8-bit KV pool, and gathers a context back as floats (shard/layers/
// kv_quant.py holds the format and the torch references, `quantize` and `dequantize`): each group of kKvGroup values
// rounded against its own float16 scale, absmax / 127.
//
// The torch reference is eight small ops a side and a layer; a decode step at short contexts paid more for them than
// the 8-bit cache saved its attention (SmolLM2-135M f32, 4 rows of 300 tokens, AMD EPYC Zen 5: 17.7 ms a step with a
// float cache, 19.4 with an int8 one written in torch). The same bits, in one pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_simd.h"
#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::kv_quant_kernel {

using conveyor::kKvGroup;
using conveyor::kv_row_bytes;
using conveyor::widen;

constexpr float kSmallestScale = 5.9604644775390625e-08f;  // 2^-24: float16's smallest subnormal

// One row of `head_dim` values as int8 values and their float16 scales at `out` (kv_quant.quantize's order of
// operations: absmax / 127 in float, clamped, rounded to float16; each value / that scale, rounded half to even).
template <typename scalar_t>
void quantize_row(const scalar_t* row, int64_t head_dim, int8_t* out) {
  for (int64_t g = 0; g < head_dim; g += kKvGroup) {
    float top = 0.f;
    for (int64_t i = g; i < g + kKvGroup; ++i) top = std::max(top, std::fabs(widen(row[i])));
    const c10::Half scale(std::max(top / 127.0f, kSmallestScale));
    const float step = static_cast<float>(scale);
    for (int64_t i = g; i < g + kKvGroup; ++i) {
      const float q = std::nearbyint(widen(row[i]) / step);
      out[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
    }
    std::memcpy(out + conveyor::kv_scale_offset(head_dim, g), &scale, sizeof scale);
  }
}

// `slots` as a contiguous int64 tensor [count], each checked to lie in a pool of `capacity` slots.
at::Tensor checked_slots(const at::Tensor& slots, int64_t count, int64_t capacity) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == count, "slots [", count, "]");
  at::Tensor where = slots.contiguous();
  const int64_t* slot = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot out of the pool");
  return where;
}

// rows [T, Hkv, D] (float32, bf16 or fp16) into cache [N, block, Hkv, D * 9 / 8] int8 at slots [T] (int64).
void write(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kChar && cache.dim() == 4, "an int8 pool");
  TORCH_CHECK(rows.dim() == 3 && rows.is_contiguous() && cache.is_contiguous(), "rows [T, Hkv, D], contiguous");
  const int64_t tokens = rows.size(0), heads = rows.size(1), head_dim = rows.size(2);
  TORCH_CHECK(head_dim % kKvGroup == 0, "whole groups of ", kKvGroup);
  const int64_t width = kv_row_bytes(head_dim);
  TORCH_CHECK(cache.size(2) == heads && cache.size(3) == width, "the pool's rows fit these");
  const at::Tensor where = checked_slots(slots, tokens, cache.size(0) * cache.size(1));
  const int64_t* slot = where.data_ptr<int64_t>();
  int8_t* pool = cache.data_ptr<int8_t>();
  conveyor::for_float_dtype(rows.scalar_type(), "kv_quant_write_", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = rows.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / heads, h = r % heads;
        quantize_row(in + r * head_dim, head_dim, pool + (slot[t] * heads + h) * width);
      }
    });
  });
}

// The rows of `slots` from a flattened int8 pool [S_pool, Hkv, D * 9 / 8], widened to `dtype` as
// [S, Hkv, D]: a prompt chunk's context for the prefill paths, in one pass (the torch reference, kv_quant.gather,
// is eight ops over the whole context for every chunk and layer).
template <typename scalar_t>
void widen_rows(const int8_t* pool, const int64_t* slot, int64_t count, int64_t heads, int64_t head_dim,
                scalar_t* out) {
  const int64_t width = kv_row_bytes(head_dim);
  at::parallel_for(0, count * heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* row = pool + (slot[r / heads] * heads + r % heads) * width;
      scalar_t* dst = out + r * head_dim;
      for (int64_t g = 0; g < head_dim; g += kKvGroup) {
        const float scale = conveyor::kv_scale(row, head_dim, g);
        for (int64_t i = g; i < g + kKvGroup; ++i) dst[i] = static_cast<scalar_t>(static_cast<float>(row[i]) * scale);
      }
    }
  });
}

at::Tensor gather(const at::Tensor& flat, const at::Tensor& slots, at::ScalarType dtype) {
  TORCH_CHECK(flat.device().is_cpu() && flat.scalar_type() == at::kChar && flat.dim() == 3, "a flat int8 pool");
  TORCH_CHECK(flat.is_contiguous() && slots.dim() == 1, "a contiguous pool, slots [S]");
  const int64_t heads = flat.size(1), width = flat.size(2), head_dim = width * kKvGroup / (kKvGroup + 2);
  TORCH_CHECK(head_dim % kKvGroup == 0 && kv_row_bytes(head_dim) == width, "8-bit rows");
  const int64_t count = slots.size(0);
  const at::Tensor where = checked_slots(slots, count, flat.size(0));
  const int64_t* slot = where.data_ptr<int64_t>();
  auto out = at::empty({count, heads, head_dim}, flat.options().dtype(dtype));
  conveyor::for_float_dtype(dtype, "kv_quant_gather", [&](auto tag) {
    using scalar_t = decltype(tag);
    widen_rows(flat.data_ptr<int8_t>(), slot, count, heads, head_dim, out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor write_(at::Tensor cache, const at::Tensor& slots, const at::Tensor& rows) {
  write(cache, slots, rows);
  return cache;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("kv_quant_write_(Tensor(a!) cache, Tensor slots, Tensor rows) -> Tensor(a!)");
  m.impl("kv_quant_write_", c10::DispatchKey::CPU, &write_);
  m.def("kv_quant_gather(Tensor flat, Tensor slots, ScalarType dtype) -> Tensor");
  m.impl("kv_quant_gather", c10::DispatchKey::CPU, &gather);
}

}  // namespace conveyor::kv_quant_kernel

// Decode attention that reads each sequence's K/V where it lies in the paged pool, through its block table.
//
// The torch path (shard/layers/attention.py) gathers every sequence's context into a padded copy and runs SDPA
// with a mask; at batch 32 that copy and the masked kernel were a large share of a decode step on CPU (the bare
// forward's decode step, benchmarks/bare.py, with `CONVEYOR_ATTENTION=torch` against `auto`, measures it). Here one
// task per (sequence, KV head) scores its context once for all the query heads that share that KV head (GQA),
// softmaxes in float32 and sums the values, reading the pool in place: in SIMD registers for heads of 64 and 128
// (attention_simd.h), in portable loops otherwise. The torch path stays the reference: the tests hold this kernel,
// each of its loops, to it on random block tables, in float32 and bfloat16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_simd.h"
#include "float_types.h"
#include "row_dots.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::paged_attention_kernel {

using conveyor::Avx2Loops;
using conveyor::exp_nonpositive;
using conveyor::Portable;
using conveyor::Widest;
using conveyor::widen;

// q . row, the row widened to float as it is read (no copy through a buffer).
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* row, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += q[i] * widen(row[i]);
  return sum;
}

// The same for an 8-bit row (shard/layers/kv_quant.py): each group of kKvGroup values' sum times its scale.
inline float dot(const float* q, const int8_t* row, int64_t n) {
  float sum = 0.f;
  for (int64_t g = 0; g < n; g += conveyor::kKvGroup) {
    float part = 0.f;
#pragma omp simd reduction(+ : part)
    for (int64_t i = g; i < g + conveyor::kKvGroup; ++i) part += q[i] * widen(row[i]);
    sum += part * conveyor::kv_scale(row, n, g);
  }
  return sum;
}

// acc += w * row, widened likewise.
template <typename scalar_t>
inline void add_scaled(float* acc, float w, const scalar_t* row, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += w * widen(row[i]);
}

inline void add_scaled(float* acc, float w, const int8_t* row, int64_t n) {
  for (int64_t g = 0; g < n; g += conveyor::kKvGroup) {
    const float step = w * conveyor::kv_scale(row, n, g);
#pragma omp simd
    for (int64_t i = g; i < g + conveyor::kKvGroup; ++i) acc[i] += step * widen(row[i]);
  }
}

// Calls visit(t, slot) for the context's positions first..length-1 (t counted from 0), a block at a time.
template <typename Visit>
inline void for_each_slot(const int32_t* table, int64_t block_size, int64_t first, int64_t length, Visit visit) {
  for (int64_t block = first / block_size; block * block_size < length; ++block) {
    const int64_t begin = std::max(first, block * block_size), end = std::min(length, (block + 1) * block_size);
    const int64_t base = static_cast<int64_t>(table[block]) * block_size - block * block_size;
    for (int64_t p = begin; p < end; ++p) visit(p - first, base + p);
  }
}

// Softmax of each of `group` rows of `count` scores, in place.
inline void softmax(float* scores, int64_t group, int64_t count) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * count;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < count; ++t) top = std::max(top, s[t]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < count; ++t) {
      s[t] = exp_nonpositive(s[t] - top);
      total += s[t];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < count; ++t) s[t] *= inverse;
  }
}

// The portable loops for one (sequence, KV head): each dot product reduced on its own, the output sums in memory.
template <typename scalar_t>
void score_portable(const float* q, int64_t group, int64_t head_dim, const scalar_t* keys, const int64_t* slots,
                    int64_t stride, int64_t count, float* scores) {
  for (int64_t t = 0; t < count; ++t) {
    const scalar_t* k = keys + slots[t] * stride;
    for (int64_t g = 0; g < group; ++g) scores[g * count + t] = dot(q + g * head_dim, k, head_dim);
  }
}

template <typename scalar_t>
void weigh_portable(const float* weights, int64_t group, int64_t head_dim, const scalar_t* values,
                    const int64_t* slots, int64_t stride, int64_t count, float* out) {
  std::fill(out, out + group * head_dim, 0.f);
  for (int64_t t = 0; t < count; ++t) {
    const scalar_t* v = values + slots[t] * stride;
    for (int64_t g = 0; g < group; ++g) add_scaled(out + g * head_dim, weights[g * count + t], v, head_dim);
  }
}

// kDim: the head size when the compiler knows it (64, 128: its loops unroll, and a dot product's reduction is
// no longer a loop with a remainder), 0 for any other size, read at run time. Loops: `Portable`, or a SIMD
// width of attention_simd.h (which needs kDim).
// cache_t: the pool's element type, the query's (scalar_t) or int8_t for 8-bit rows with their scales.
template <typename scalar_t, typename cache_t, int64_t kDim, typename Loops>
void decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
            double softcap, at::Tensor& out) {
  constexpr bool kPortable = std::is_same_v<Loops, Portable>;
  const int64_t batch = query.size(0), q_heads = query.size(1), head_dim = kDim ? kDim : query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2), row = key_cache.size(3);
  const int64_t group = q_heads / kv_heads, table_width = block_tables.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* keys = key_cache.data_ptr<cache_t>();
  const cache_t* values = value_cache.data_ptr<cache_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t token_stride = kv_heads * row;  // between neighbouring slots of the pool
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t length = lengths[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t count = length - first;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qg = q + (b * q_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = widen(qg[d]) * scale_f;
      }
      slots.resize(count);
      const int32_t* table = tables + b * table_width;
      for_each_slot(table, block_size, first, length, [&](int64_t t, int64_t slot) { slots[t] = slot; });
      scores.resize(group * count);
      const cache_t *k_head = keys + h * row, *v_head = values + h * row;
      if constexpr (kPortable)
        score_portable(qf.data(), group, head_dim, k_head, slots.data(), token_stride, count, scores.data());
#ifdef CONVEYOR_SIMD_ATTENTION
      else
        conveyor::simd::score<Loops, cache_t, kDim>(qf.data(), group, k_head, slots.data(), token_stride, count,
                                                    scores.data());
#endif
      if (softcap > 0) {  // Gemma 2: scores squashed into (-cap, cap) before the softmax
        const float cap = static_cast<float>(softcap);
        for (float& s : scores) s = cap * std::tanh(s / cap);
      }
      if constexpr (kPortable) {
        softmax(scores.data(), group, count);
      }
#ifdef CONVEYOR_SIMD_ATTENTION
      else {
        for (int64_t g = 0; g < group; ++g) conveyor::simd::softmax<Loops>(scores.data() + g * count, count);
      }
#endif
      if constexpr (kPortable) {
        weigh_portable(scores.data(), group, head_dim, v_head, slots.data(), token_stride, count, acc.data());
      }
#ifdef CONVEYOR_SIMD_ATTENTION
      else {
        conveyor::simd::weigh<Loops, cache_t, kDim>(scores.data(), group, v_head, slots.data(), token_stride, count,
                                                    acc.data());
      }
#endif
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o + (b * q_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

template <typename scalar_t, typename cache_t, typename Loops>
void by_head_size(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                  double softcap, at::Tensor& out) {
  // The SIMD loops read float32, bfloat16 and int8 rows; a float16 cache takes the portable ones.
  using Chosen = std::conditional_t<std::is_same_v<cache_t, c10::Half>, Portable, Loops>;
  switch (query.size(2)) {
    case 64:
      return decode<scalar_t, cache_t, 64, Chosen>(query, key_cache, value_cache, block_tables, context_lens, scale,
                                                   window, softcap, out);
    case 128:
      return decode<scalar_t, cache_t, 128, Chosen>(query, key_cache, value_cache, block_tables, context_lens, scale,
                                                    window, softcap, out);
    default:
      return decode<scalar_t, cache_t, 0, Portable>(query, key_cache, value_cache, block_tables, context_lens, scale,
                                                    window, softcap, out);
  }
}

// query [B, Hq, D]; key_cache/value_cache [blocks, block_size, Hkv, D] in the query's dtype, or int8
// [blocks, block_size, Hkv, D * 9 / 8] (8-bit rows, shard/layers/kv_quant.py); block_tables [B, W] int32;
// context_lens [B] int32 (tokens in the cache, the new one included); window 0 for none; softcap 0 for none.
// Returns [B, Hq, D].
template <typename Loops>
at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                  double softcap) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention runs on CPU");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, Hq, D] and a cache [N, block, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous tables");
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || query.scalar_type() == key_cache.scalar_type(), "the cache is int8 or the query's dtype");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "keys and values share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads are a multiple of KV heads");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(!int8 || head_dim % conveyor::kKvGroup == 0, "an 8-bit cache needs whole groups of ", conveyor::kKvGroup);
  const int64_t row = int8 ? conveyor::kv_row_bytes(head_dim) : head_dim;
  TORCH_CHECK(key_cache.size(3) == row, "query and cache share a head size");
  auto out = at::empty_like(query);
  conveyor::for_float_dtype(query.scalar_type(), "paged_decode_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    if (int8)
      by_head_size<scalar_t, int8_t, Loops>(query, key_cache, value_cache, block_tables, context_lens, scale, window,
                                            softcap, out);
    else
      by_head_size<scalar_t, scalar_t, Loops>(query, key_cache, value_cache, block_tables, context_lens, scale,
                                              window, softcap, out);
  });
  return out;
}

TORCH_LIBRARY(conveyor, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &attend<Widest>);
  // The narrower loops alone, where wider ones would serve: the tests hold each to the torch path.
  m.def(
      "paged_decode_attention_avx2(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode_attention_avx2", c10::DispatchKey::CPU, &attend<Avx2Loops>);
  m.def(
      "paged_decode_attention_portable(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode_attention_portable", c10::DispatchKey::CPU, &attend<Portable>);
}

}  // namespace conveyor::paged_attention_kernel

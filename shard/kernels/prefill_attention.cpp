// Causal attention of one sequence's prompt chunk over its whole context, in float32, flash-style: the scores are
// computed a tile at a time and never stored whole, and every GEMM goes through oneDNN's brgemm.
//
// Why not SDPA: torch's CPU flash kernel does the same tiling but its GEMMs call MKL's sgemm, which on AMD CPUs
// takes an AVX2 path: ~70 GFLOP/s a core on a Zen 5 where brgemm reaches ~240 (same shapes, one thread). A
// 2,300-token prompt of SmolLM2-135M spent half its prefill (1.2 of 2.4 s) in SDPA. Three more things SDPA cannot
// do here: the query heads that share a KV head (GQA) are one tile's rows, so a key tile is read once for all of
// them; a chunk after a cached prefix is causal at its offset (SDPA's is_causal is top-left aligned, so the torch
// path builds a mask and computes every score block); and the tasks' order pairs heavy and light tiles, so that
// the causal triangle splits evenly across threads.
//
// One task is (KV head g, block of query positions): its M = rep * block rows are the rep query heads of g over
// those positions (zero rows pad a short last block: brgemm then keeps one shape). For each key tile up to the
// last position any of its queries sees: S = Q K^T (brgemm), an online softmax on S (running max and sum per row,
// the output rescaled when the max moves), O += P V (brgemm). The keys are transposed and the values laid out by
// head once per call, both zero-padded to whole tiles, so that every task reads its tiles in place and the GEMM
// shapes never change within a call (brgemm's JIT kernels are made once per shape). The paged entry point lays
// them out straight from the KV pool's rows, so the context is never gathered into a copy first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace conveyor::prefill_attention_kernel {

using conveyor::Avx2Loops;
using conveyor::Widest;

#ifdef CONVEYOR_SIMD_ATTENTION

constexpr int64_t kKeyTile = 128;  // keys per tile: small enough that the causal diagonal wastes little
constexpr int64_t kRows = 192;     // a task's rows (query heads x positions): brgemm's M

struct Shape {
  int64_t queries, context, heads, kv_heads, dim;
  int64_t padded() const { return (context + kKeyTile - 1) / kKeyTile * kKeyTile; }  // whole key tiles
  int64_t rep() const { return heads / kv_heads; }
  int64_t positions() const { return std::max<int64_t>(1, kRows / rep()); }  // query positions per task
  int64_t blocks() const { return (queries + positions() - 1) / positions(); }
  int64_t offset() const { return context - queries; }  // query i sits at position offset + i
};

// The task order: query blocks alternate from both ends (0, n-1, 1, n-2, ...), so that each thread's contiguous
// share of tasks mixes the short rows at the top of the causal triangle with the long ones at the bottom.
inline int64_t block_of(int64_t index, int64_t blocks) {
  return index % 2 == 0 ? index / 2 : blocks - 1 - index / 2;
}

template <typename V>
struct Task {
  const Shape& s;
  const float* q;   // [Q, Hq, D]
  const float* kt;  // [Hkv, D, padded]: the keys transposed
  const float* v;   // [Hkv, padded, D]
  float* out;       // [Q, Hq, D]
  float scale;
  int64_t positions;
  std::vector<float> a, scores, o, top, total;

  Task(const Shape& shape, const float* q_, const float* kt_, const float* v_, float* out_, float scale_)
      : s(shape), q(q_), kt(kt_), v(v_), out(out_), scale(scale_), positions(shape.positions()),
        a(rows() * shape.dim), scores(rows() * kKeyTile), o(rows() * shape.dim), top(rows()), total(rows()) {}

  int64_t rows() const { return s.rep() * positions; }

  void run(int64_t g, int64_t block) {
    const int64_t first = block * positions, count = std::min(positions, s.queries - first);
    load_queries(g, first, count);
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
    std::fill(total.begin(), total.end(), 0.f);
    const int64_t last_key = s.offset() + first + count - 1;  // the last position this block's queries see
    for (int64_t key0 = 0; key0 <= last_key; key0 += kKeyTile) {
      const int64_t keys = std::min(kKeyTile, s.context - key0);
      const float* tile_keys = kt + g * s.dim * s.padded() + key0;  // [D, tile] with rows `padded` apart
      at::native::cpublas::brgemm(rows(), kKeyTile, s.dim, s.dim, s.padded(), kKeyTile, false, a.data(), tile_keys,
                                  scores.data(), false);
      for (int64_t r = 0; r < rows(); ++r) {
        const int64_t position = s.offset() + first + r % positions;
        softmax_row(r, std::min(keys, position - key0 + 1));
      }
      const float* tile_values = v + (g * s.padded() + key0) * s.dim;
      at::native::cpublas::brgemm(rows(), s.dim, kKeyTile, kKeyTile, s.dim, s.dim, true, scores.data(), tile_values,
                                  o.data(), false);
    }
    store(g, first, count);
  }

  // Rows h * positions + i: query head g * rep + h at position first + i, scaled; zeros past the last query.
  void load_queries(int64_t g, int64_t first, int64_t count) {
    std::fill(a.begin(), a.end(), 0.f);
    for (int64_t h = 0; h < s.rep(); ++h)
      for (int64_t i = 0; i < count; ++i) {
        const float* src = q + ((first + i) * s.heads + g * s.rep() + h) * s.dim;
        float* dst = a.data() + (h * positions + i) * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) dst[d] = src[d] * scale;
      }
  }

  // The row's scores over the tile's first `seen` keys become their weights against the running max; the rest 0.
  // The row's output so far and its sum are rescaled when the max moves.
  void softmax_row(int64_t r, int64_t seen) {
    constexpr int L = V::kLanes;
    float* s_row = scores.data() + r * kKeyTile;
    if (seen <= 0) {
      std::fill(s_row, s_row + kKeyTile, 0.f);
      return;
    }
    auto peak = V::set1(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < seen; t += L) peak = V::max_first(peak, s_row + t, seen - t);
    const float previous = top[r], now = std::max(previous, V::reduce_max(peak));
    const auto shift = V::set1(now);
    auto sum = V::zero();
    for (int64_t t = 0; t < seen; t += L) {
      V::store_first(s_row + t, simd::exp_nonpositive<V>(V::sub(V::load_first(s_row + t, seen - t), shift)), seen - t);
      sum = V::add(sum, V::load_first(s_row + t, seen - t));
    }
    std::fill(s_row + seen, s_row + kKeyTile, 0.f);
    const float alpha = conveyor::exp_nonpositive(previous - now);  // 0 on the first tile (previous is -inf)
    if (alpha != 1.f) {
      float* o_row = o.data() + r * s.dim;
      for (int64_t d = 0; d < s.dim; ++d) o_row[d] *= alpha;
    }
    total[r] = total[r] * alpha + V::reduce_add(sum);
    top[r] = now;
  }

  void store(int64_t g, int64_t first, int64_t count) {
    for (int64_t h = 0; h < s.rep(); ++h)
      for (int64_t i = 0; i < count; ++i) {
        const int64_t r = h * positions + i;
        const float inverse = 1.f / total[r];
        float* dst = out + ((first + i) * s.heads + g * s.rep() + h) * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) dst[d] = o[r * s.dim + d] * inverse;
      }
  }
};

// The context's keys transposed, [Hkv, D, padded], and its values by head, [Hkv, padded, D], zero past the context.
// Context row c is row rows[c] of keys/values ([N, Hkv, D], contiguous; rows null: row c), so that a pool's rows
// are read where they lie rather than gathered into a copy first. Tasks are (KV head, run of kLayOutRows rows).
struct LaidOut {
  at::Tensor kt, vh;
};

constexpr int64_t kLayOutRows = 256;

inline LaidOut lay_out(const Shape& s, const float* keys, const float* values, const int64_t* rows,
                       const at::TensorOptions& options) {
  const int64_t padded = s.padded(), width = s.kv_heads * s.dim, runs = (padded + kLayOutRows - 1) / kLayOutRows;
  auto kt = at::empty({s.kv_heads, s.dim, padded}, options);
  auto vh = at::empty({s.kv_heads, padded, s.dim}, options);
  float* const k_out = kt.data_ptr<float>();
  float* const v_out = vh.data_ptr<float>();
  at::parallel_for(0, s.kv_heads * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / runs, first = t % runs * kLayOutRows, last = std::min(padded, first + kLayOutRows);
      float* kg = k_out + g * s.dim * padded;
      float* vg = v_out + g * padded * s.dim;
      const int64_t filled = std::min(last, s.context);
      for (int64_t c0 = first; c0 < filled; c0 += 8) {  // 8 rows at a time: each of kt's rows gets a run of 8
        const int64_t n = std::min<int64_t>(8, filled - c0);
        const float* k[8];
        for (int64_t j = 0; j < n; ++j) {
          const int64_t r = rows ? rows[c0 + j] : c0 + j;
          k[j] = keys + r * width + g * s.dim;
          std::memcpy(vg + (c0 + j) * s.dim, values + r * width + g * s.dim, s.dim * sizeof(float));
        }
        for (int64_t d = 0; d < s.dim; ++d)
          for (int64_t j = 0; j < n; ++j) kg[d * padded + c0 + j] = k[j][d];
      }
      if (last > filled) {  // the last tile's padding: zeros, so padded keys score 0 and padded values add 0
        const int64_t from = std::max(first, filled);
        for (int64_t d = 0; d < s.dim; ++d) std::fill(kg + d * padded + from, kg + d * padded + last, 0.f);
        std::fill(vg + from * s.dim, vg + last * s.dim, 0.f);
      }
    }
  });
  return {kt, vh};
}

template <typename V>
at::Tensor attend(const Shape& shape, const at::Tensor& query, const LaidOut& laid, double scale) {
  auto q = query.contiguous();
  auto out = at::empty(query.sizes(), query.options());
  const int64_t blocks = shape.blocks(), tasks = blocks * shape.kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Task<V> task(shape, q.data_ptr<float>(), laid.kt.data_ptr<float>(), laid.vh.data_ptr<float>(),
                 out.data_ptr<float>(), static_cast<float>(scale));
    for (int64_t t = begin; t < end; ++t) task.run(t % shape.kv_heads, block_of(t / shape.kv_heads, blocks));
    at::native::cpublas::brgemm_release(false);
  });
  return out;
}

inline void check_query(const at::Tensor& query) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat, "prefill_attention: float32 on CPU");
  TORCH_CHECK(query.dim() == 3, "the query is [Q, Hq, D]");
}

// query [Q, Hq, D], keys/values [C, Hkv, D] (the sequence's whole context, the chunk's own tokens last), all
// float32; query i attends to keys 0..C-Q+i. Returns [Q, Hq, D].
template <typename V>
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, double scale) {
  check_query(query);
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "float32 keys and values");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(), "[Q, Hq, D] and [C, Hkv, D]");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0 && query.size(2) == keys.size(2), "GQA heads and one head size");
  TORCH_CHECK(keys.size(0) >= query.size(0), "the context holds the chunk");
  const Shape shape{query.size(0), keys.size(0), query.size(1), keys.size(1), query.size(2)};
  auto k = keys.contiguous(), v = values.contiguous();
  return attend<V>(shape, query, lay_out(shape, k.data_ptr<float>(), v.data_ptr<float>(), nullptr, query.options()),
                   scale);
}

// The same over a KV pool: key_pool/value_pool [N, Hkv, D] (the flat float32 pool), slots [C] the context's rows
// in order. Reads the rows in place: no gathered copy of the context per layer.
template <typename V>
at::Tensor prefill_attention_paged(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                                   const at::Tensor& slots, double scale) {
  check_query(query);
  TORCH_CHECK(key_pool.scalar_type() == at::kFloat && value_pool.scalar_type() == at::kFloat, "float32 pools");
  TORCH_CHECK(key_pool.dim() == 3 && key_pool.sizes() == value_pool.sizes(), "pools are [N, Hkv, D]");
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), "contiguous pools");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: [C] int64");
  TORCH_CHECK(query.size(1) % key_pool.size(1) == 0 && query.size(2) == key_pool.size(2), "GQA heads, one head size");
  TORCH_CHECK(slots.size(0) >= query.size(0), "the context holds the chunk");
  const int64_t* rows = slots.data_ptr<int64_t>();
  const int64_t pool_rows = key_pool.size(0);
  TORCH_CHECK(std::all_of(rows, rows + slots.size(0), [&](int64_t r) { return r >= 0 && r < pool_rows; }),
              "slots within the pool");
  const Shape shape{query.size(0), slots.size(0), query.size(1), key_pool.size(1), query.size(2)};
  const auto laid = lay_out(shape, key_pool.data_ptr<float>(), value_pool.data_ptr<float>(), rows, query.options());
  return attend<V>(shape, query, laid, scale);
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("prefill_attention(Tensor query, Tensor keys, Tensor values, float scale) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &prefill_attention<Widest>);
  m.def("prefill_attention_avx2(Tensor query, Tensor keys, Tensor values, float scale) -> Tensor");
  m.impl("prefill_attention_avx2", c10::DispatchKey::CPU, &prefill_attention<Avx2Loops>);
  m.def("prefill_attention_paged(Tensor query, Tensor key_pool, Tensor value_pool, Tensor slots, float scale) -> Tensor");
  m.impl("prefill_attention_paged", c10::DispatchKey::CPU, &prefill_attention_paged<Widest>);
  m.def(
      "prefill_attention_paged_avx2(Tensor query, Tensor key_pool, Tensor value_pool, Tensor slots, float scale) -> "
      "Tensor");
  m.impl("prefill_attention_paged_avx2", c10::DispatchKey::CPU, &prefill_attention_paged<Avx2Loops>);
}

#endif  // CONVEYOR_SIMD_ATTENTION

}  // namespace conveyor::prefill_attention_kernel

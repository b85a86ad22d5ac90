// x @ dequant(W).T (+ b) for int8 weights with a float16 scale per block of 32 inputs, x rounded to int8 with a
// float scale per block of 32 as it comes in (quantized_rows.h): `--quantize int8` on a CPU with AVX-512 VNNI, as
// llama.cpp's q8_0 weights against q8_0 activations. Each block's dot product is integer, then scaled by both
// blocks' scales and summed in float. (A scale per row for each, as before, moved the output much further from
// float32's on a real model: `python -m benchmarks.accuracy --quantize int8` measures the mean KL.)
//
// The weights' order keeps the scaling off the integer loop (`Int8BlockWeight`, shard/layers/quantize.py): blocks
// go in groups of 16, a group's 64-byte vector k holding bytes 4k..4k+3 of each of its blocks, so that one vpdpbusd
// adds four products of every block into that block's own int32 lane. Eight of them finish the group's 16 block
// sums in one register, which then takes its 16 pairs of scales: three float instructions per eight integer ones,
// where a block per vector would take them per one. A row's last blocks (fewer than 16) go in groups of 8, 4, 2 and
// 1 packed the same way, lane l holding block l % size: every group but one of a single block fills whole vectors.
//
// vpdpbusd multiplies unsigned bytes by signed ones: the weights are stored as q + 128, and each block's first lane
// starts from -128 * (x's sum over the block), computed once per call, which takes the offset back out exactly.
//
// Up to kStreamRows rows of x (decode with few sequences) the weights are read once, a few rows side by side; with
// more, the arithmetic decides, and several weight rows side by side let each vector of x loaded serve several
// products, over tiles of x's rows that stay in cache while every weight row passes. Against the kernel with a
// scale per row (Intel Xeon Emerald Rapids, one thread, SmolLM2-135M's layers and head), this one was a little
// faster at one row (four weight rows reduce together) and slower at many (the three float instructions per eight
// vpdpbusd share their ports; a scale per row of the weights would take one of them away, for a larger KL from
// float32). No benchmark times the kernel alone: `make bench ARGS="--quantized int8"` measures a whole int8
// deployment, and `python -m benchmarks.accuracy --quantize int8` its KL.
//
// Compiled where quantized_rows.h says (AVX-512 VNNI, BW and VL); elsewhere the op exists, says so through
// `int8_vnni_available`, and the widening kernel (int8_gemm.cpp) serves instead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_types.h"
#include "quantized_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int8_vnni_gemm_kernel {

using conveyor::kBlock;
constexpr int64_t kGroupBlocks = 16;  // blocks per full group: one int32 lane each

// The group of blocks that block b belongs to in a row of `blocks`: its first block and size. Full groups of 16,
// then the rest in groups of 8, 4, 2 and 1 blocks as its binary digits say (18 blocks: 16 and 2), so that every
// group but one of a single block fills whole vectors.
struct Group {
  int64_t first, size;
};

inline Group group_of(int64_t blocks, int64_t b) {
  const int64_t full = blocks / kGroupBlocks * kGroupBlocks;
  if (b < full) return {b / kGroupBlocks * kGroupBlocks, kGroupBlocks};
  int64_t first = full;
  for (int64_t size = kGroupBlocks / 2;; size /= 2) {
    if (((blocks - full) & size) == 0) continue;
    if (b < first + size) return {first, size};
    first += size;
  }
}

// Where element j of block b goes in a row stored in groups: four bytes of each of the group's blocks in turn, so
// that lane l of each vector holds bytes of block first + l % size.
inline int64_t grouped(const Group& g, int64_t b, int64_t j) {
  return g.first * kBlock + (j / 4 * g.size + (b - g.first)) * 4 + j % 4;
}

#ifdef CONVEYOR_VNNI

using conveyor::kStreamRows;
using conveyor::kTileRows;

// x's rows for this kernel: int8 in the weights' grouped order, each block's scale, and each block's -128 * sum.
struct GroupedRows {
  std::vector<int8_t> values;    // [count, blocks * 32]
  std::vector<float> scales;     // [count, blocks]
  std::vector<int32_t> offsets;  // [count, blocks]
  int64_t blocks = 0;
};

// The sum of a block's 32 values: as unsigned bytes (q + 128), summed eight at a time by vpsadbw.
inline int32_t block_sum(const int8_t* q) {
  const __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i bytes = _mm256_xor_si256(values, _mm256_set1_epi8(-128));
  const __m256i sums = _mm256_sad_epu8(bytes, _mm256_setzero_si256());
  const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  return static_cast<int32_t>(_mm_cvtsi128_si64(half) + _mm_extract_epi64(half, 1)) - kBlock * 128;
}

template <typename scalar_t>
GroupedRows group_rows(const at::Tensor& x, int64_t blocks) {
  const int64_t count = x.size(0);
  GroupedRows g;
  g.blocks = blocks;
  g.values.resize(count * blocks * kBlock);
  g.scales.resize(count * blocks);
  g.offsets.resize(count * blocks);
  conveyor::for_quantized_blocks<scalar_t>(x, blocks, [&](int64_t m, int64_t b, const int8_t* q, float scale) {
    int8_t* row = g.values.data() + m * blocks * kBlock;
    const Group group = group_of(blocks, b);
    for (int64_t j = 0; j < kBlock; j += 4) std::memcpy(row + grouped(group, b, j), q + j, 4);  // a dword apart
    g.scales[m * blocks + b] = scale;
    g.offsets[m * blocks + b] = -128 * block_sum(q);
  });
  return g;
}

// 64 bytes at p, or the bytes of `mask` alone where the vector is not whole.
template <bool kWhole>
inline __m512i load_bytes(const void* p, __mmask64 mask) {
  if constexpr (kWhole) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8(mask, p);
}

// A group's `size` per-block values spread over the 16 lanes, lane l taking block l % size's.
inline __m512 spread(__m512 values, int64_t size) {
  if (size == kGroupBlocks) return values;
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_permutexvar_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(static_cast<int>(size - 1))), values);
}

// acc[r][j] += the group's share of x row m + r . dequant(weight row j): its blocks' integer sums, lane by lane
// (each block's offset in its first lane), times both blocks' scales. kVectors: the group's 64-byte vectors (a
// constant, so that the loop unrolls and its sums stay in registers). kWhole: every vector is whole (all but a lone
// last block), read with plain loads: masked loads throughout left a decode step's int8 layers further from the
// memory bandwidth (AMD EPYC Zen 5).
template <int kRows, int kWeights, int kVectors, bool kWhole = true>
inline void dot_group(const GroupedRows& x, int64_t m, const uint8_t* const w[kWeights],
                      const c10::Half* const scales[kWeights], const Group& g, __m512 acc[kRows][kWeights]) {
  const int64_t blocks = x.blocks, stride = blocks * kBlock, base = g.first * kBlock;
  const __mmask16 lanes = static_cast<__mmask16>((1u << g.size) - 1);
  const __mmask64 bytes = g.size == 1 ? (__mmask64{1} << kBlock) - 1 : ~__mmask64{0};
  __m512 weight_scales[kWeights];
  for (int j = 0; j < kWeights; ++j)
    weight_scales[j] = spread(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales[j] + g.first)), g.size);
  __m512i dots[kRows][kWeights];
  for (int r = 0; r < kRows; ++r) {
    const __m512i offset = _mm512_maskz_loadu_epi32(lanes, x.offsets.data() + (m + r) * blocks + g.first);
    for (int j = 0; j < kWeights; ++j) dots[r][j] = offset;
  }
#pragma GCC unroll 8
  for (int v = 0; v < kVectors; ++v) {
    __m512i wv[kWeights];
    for (int j = 0; j < kWeights; ++j) {
      conveyor::prefetch_weight(w[j] + base + v * 64);
      wv[j] = load_bytes<kWhole>(w[j] + base + v * 64, bytes);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512i xv = load_bytes<kWhole>(x.values.data() + (m + r) * stride + base + v * 64, bytes);
      for (int j = 0; j < kWeights; ++j) dots[r][j] = _mm512_dpbusd_epi32(dots[r][j], wv[j], xv);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 x_scales =
        spread(_mm512_maskz_loadu_ps(lanes, x.scales.data() + (m + r) * blocks + g.first), g.size);
    for (int j = 0; j < kWeights; ++j) {
      const __m512 scale = _mm512_mul_ps(x_scales, weight_scales[j]);
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][j]), scale, acc[r][j]);
    }
  }
}

// The four lane sums of a0..a3, in that order (one transposing reduction for four weight rows). Every path reduces
// through it, whatever its number of weight rows, so that a row's output is the same bits whatever the batch.
inline __m128 sum_lanes(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  const __m512 t =
      _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// sums[r][j] = x row m + r . dequant(weight row j), for kRows rows of x and kWeights weight rows side by side.
template <int kRows, int kWeights>
inline void dot_groups(const GroupedRows& x, int64_t m, const uint8_t* const w[kWeights],
                       const c10::Half* const scales[kWeights], float sums[kRows][kWeights]) {
  __m512 acc[kRows][kWeights];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kWeights; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks;) {
    const Group g = group_of(x.blocks, b);
    switch (g.size) {
      case 16: dot_group<kRows, kWeights, 8>(x, m, w, scales, g, acc); break;
      case 8: dot_group<kRows, kWeights, 4>(x, m, w, scales, g, acc); break;
      case 4: dot_group<kRows, kWeights, 2>(x, m, w, scales, g, acc); break;
      case 2: dot_group<kRows, kWeights, 1>(x, m, w, scales, g, acc); break;
      default: dot_group<kRows, kWeights, 1, false>(x, m, w, scales, g, acc); break;  // 1 block: half a vector
    }
    b += g.size;
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    alignas(16) float four[4];
    const __m512 a1 = kWeights > 1 ? acc[r][1 % kWeights] : zero, a2 = kWeights > 2 ? acc[r][2 % kWeights] : zero;
    _mm_store_ps(four, sum_lanes(acc[r][0], a1, a2, kWeights > 3 ? acc[r][3 % kWeights] : zero));
    for (int j = 0; j < kWeights; ++j) sums[r][j] = four[j];
  }
}

// Calls chunk(std::integral_constant<int, k>{}, m) for x's rows m..m+k-1, in chunks of up to kMost (the register
// blocking of dot_groups for a given number of weight rows).
template <int kMost, typename Chunk>
inline void for_chunks(int64_t count, Chunk chunk) {
  for (int64_t m = 0; m < count; m += kMost) {
    switch (std::min<int64_t>(kMost, count - m)) {
      case 1: chunk(std::integral_constant<int, 1>{}, m); break;
      case 2: if constexpr (kMost >= 2) chunk(std::integral_constant<int, 2>{}, m); break;
      case 3: if constexpr (kMost >= 3) chunk(std::integral_constant<int, 3>{}, m); break;
      default: if constexpr (kMost >= 4) chunk(std::integral_constant<int, 4>{}, m); break;
    }
  }
}

// out[m, o..o+kWeights) for x's rows m in [first, first + count); weight rows past the end repeat the last one.
template <int kWeights, int kMostRows, typename scalar_t>
void weight_rows(const GroupedRows& x, int64_t first, int64_t count, const uint8_t* weight, const c10::Half* scales,
                 const scalar_t* bias, scalar_t* out, int64_t out_features, int64_t o) {
  const int rows = static_cast<int>(std::min<int64_t>(kWeights, out_features - o));
  const uint8_t* w[kWeights];
  const c10::Half* row_scales[kWeights];
  float b[kWeights];
  for (int j = 0; j < kWeights; ++j) {
    const int64_t row = o + std::min(j, rows - 1);
    w[j] = weight + row * x.blocks * kBlock;
    row_scales[j] = scales + row * x.blocks;
    b[j] = bias ? conveyor::widen(bias[row]) : 0.f;
  }
  for_chunks<kMostRows>(count, [&](auto chunk, int64_t chunk_start) {
    constexpr int kRows = decltype(chunk)::value;
    const int64_t m = first + chunk_start;
    float sums[kRows][kWeights];
    dot_groups<kRows, kWeights>(x, m, w, row_scales, sums);
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < rows; ++j) out[(m + r) * out_features + o + j] = static_cast<scalar_t>(sums[r][j] + b[j]);
  });
}

// Weight rows side by side, and x's rows dotted with them at once (the register block): one row of x takes four
// weight rows (their sums reduce together), two to four rows take two, and more take four weight rows by three rows
// of x (measured on an Intel Xeon, Emerald Rapids: 4 x 3 ahead of 4 x 2 and 4 x 4, whose accumulators spill).
constexpr int kOneRowWeights = 4, kFewRowsWeights = 2, kManyRowsWeights = 4, kManyRowsRows = 3;

// out for every row of x, weight rows [begin, end) kWeights at a time, x's rows kMostRows at a time.
template <int kWeights, int kMostRows, typename scalar_t>
void rows_of(const GroupedRows& x, int64_t count, const uint8_t* w, const c10::Half* s, const scalar_t* b,
             scalar_t* o, int64_t out_features, int64_t begin, int64_t end) {
  for (int64_t first = 0; first < count; first += kTileRows)
    for (int64_t row = begin; row < end; row += kWeights)
      weight_rows<kWeights, kMostRows>(x, first, std::min(kTileRows, count - first), w, s, b, o, out_features, row);
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
         const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t count = x.size(0), out_features = weight.size(0), blocks = scales.size(1);
  const GroupedRows g = group_rows<scalar_t>(x, blocks);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t unit = count == 1 ? kOneRowWeights : count <= kStreamRows ? kFewRowsWeights : kManyRowsWeights;
  at::parallel_for(0, (out_features + unit - 1) / unit, 16 / unit, [&](int64_t begin, int64_t end) {
    const int64_t from = begin * unit, to = std::min(end * unit, out_features);
    if (count == 1)
      rows_of<kOneRowWeights, 1>(g, count, w, s, b, o, out_features, from, to);
    else if (count <= kStreamRows)
      rows_of<kFewRowsWeights, kStreamRows>(g, count, w, s, b, o, out_features, from, to);
    else
      rows_of<kManyRowsWeights, kManyRowsRows>(g, count, w, s, b, o, out_features, from, to);
  });
}

#endif  // CONVEYOR_VNNI

bool int8_vnni_available() {
#ifdef CONVEYOR_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, in] (float32, bf16 or fp16); weight uint8 [out, blocks * 32], q + 128 in grouped order; scales float16
// [out, blocks] with blocks = ceil(in / 32) (a last block past `in` holds zeros); bias [out] in x's dtype or none.
at::Tensor int8_vnni_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(int8_vnni_available(), "int8_vnni_gemm needs AVX-512 VNNI, which this build's CPU lacks");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_vnni_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scales.dim() == 2, "x [M, in], weight and scales 2-d");
  const int64_t blocks = (x.size(1) + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(1) == blocks * kBlock,
              "uint8 weight [out, blocks * 32]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.size(0) == weight.size(0) && scales.size(1) == blocks,
              "float16 scales [out, blocks]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
#ifdef CONVEYOR_VNNI
  conveyor::for_float_dtype(x.scalar_type(), "int8_vnni_gemm",
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out); });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_vnni_available() -> bool");
  m.impl("int8_vnni_available", c10::DispatchKey::CatchAll, &int8_vnni_available);
  m.def("int8_vnni_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_vnni_gemm", c10::DispatchKey::CPU, &int8_vnni_gemm);
}

}  // namespace conveyor::int8_vnni_gemm_kernel

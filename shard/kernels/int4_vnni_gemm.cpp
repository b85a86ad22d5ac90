// x @ dequant(W).T (+ b) for 4-bit weights (`--quantize int4`, groups of 32 with a float16 scale, the layout of
// int4_gemm.cpp) with x rounded to int8 with a float scale per group of 32 as well (quantized_rows.h), on a CPU with
// AVX-512 VNNI: llama.cpp's q4_0 against q8_0.
//
// 64 packed bytes are four groups: their low nibbles are elements 0-15 of each group, their high ones elements
// 16-31, each stored as q + 8 in [0, 15]. Masked, they are the unsigned side of vpdpbusd as they are, against x's
// signed bytes rearranged once per call into the same order (each 128 inputs: the four low halves, then the four
// high halves). Each int32 lane then sums four bytes of one group: lanes 4g..4g+3 are group g. The +8 comes back
// out as 8 * (x's sum over the lane's bytes), computed once per call and subtracted by starting each lane from it;
// the lanes, as floats, take the product of their group's two scales (the weight's and x's) in one multiply-add.
// x's scale per group rather than per row costs that multiply, one float instruction per two vpdpbusd: on an Intel
// Xeon (Emerald Rapids, one thread) over SmolLM2-135M's layers and head, a decode step's GEMMs took the same time at
// one row and a little longer at many. It buys little accuracy there (int4's error is its weights': the mean KL
// from float32 is about the same either way, `python -m benchmarks.accuracy --quantize int4`), but keeps
// an outlier channel of x from costing the whole row. No benchmark times the kernel alone; `make bench
// ARGS="--quantized int4"` measures a whole int4 deployment.
//
// Compiled where quantized_rows.h says (AVX-512 VNNI, BW and VL); elsewhere the op exists but refuses,
// `int8_vnni_available` says no, and int4_gemm.cpp serves.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_types.h"
#include "quantized_rows.h"
#include "row_dots.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::int4_vnni_gemm_kernel {

constexpr int64_t kGroup = 32;

#ifdef CONVEYOR_VNNI

constexpr int64_t kChunk = 128, kChunkBytes = 64, kLanes = 16;
using conveyor::kStreamRows;
using conveyor::kTileRows;

// x's rows for the int4 kernel: signed bytes in the packed weights' order, each lane's 8 * sum, negated, and each
// group's scale (zeros past the input: a last chunk cut short).
struct ArrangedRows {
  std::vector<int8_t> values;     // [count, chunks * 128]
  std::vector<int32_t> offsets;   // [count, chunks * 16]
  std::vector<float> scales;      // [count, chunks * 16]: each group's scale in its four lanes
  int64_t chunks = 0;
};

template <typename scalar_t>
ArrangedRows arrange_rows(const at::Tensor& x) {
  const int64_t count = x.size(0), groups = x.size(1) / kGroup;
  ArrangedRows a;
  a.chunks = (groups + 3) / 4;
  a.values.assign(count * a.chunks * kChunk, 0);
  a.offsets.assign(count * a.chunks * kLanes, 0);
  a.scales.assign(count * a.chunks * kLanes, 0.f);
  conveyor::for_quantized_blocks<scalar_t>(x, groups, [&](int64_t m, int64_t group, const int8_t* q, float scale) {
    const int64_t c = group / 4, g = group % 4;
    int8_t* to = a.values.data() + (m * a.chunks + c) * kChunk;
    int32_t* offsets = a.offsets.data() + (m * a.chunks + c) * kLanes;
    std::memcpy(to + g * 16, q, 16);  // elements 0-15 among the low nibbles' bytes, 16-31 among the high ones'
    std::memcpy(to + kChunkBytes + g * 16, q + 16, 16);
    // Each lane's four bytes of both halves, summed by multiplying with ones: bytes to pairs, pairs to fours.
    const __m128i ones = _mm_set1_epi8(1), low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    const __m128i pairs = _mm_add_epi16(_mm_maddubs_epi16(ones, low), _mm_maddubs_epi16(ones, high));
    const __m128i fours = _mm_madd_epi16(pairs, _mm_set1_epi16(-8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(offsets + g * 4), fours);
    std::fill_n(a.scales.data() + m * a.chunks * kLanes + group * 4, 4, scale);
  });
  return a;
}

// sums[r][j] = x row m + r . dequant(weight row j), for kRows rows of x and kWeights weight rows side by side: one
// weight row streams (few rows of x), four share each vector of x loaded (many rows).
template <int kRows, int kWeights>
inline void dot_rows(const ArrangedRows& x, int64_t m, const uint8_t* const packed[kWeights],
                     const c10::Half* const scales[kWeights], int64_t in, float sums[kRows][kWeights]) {
  const int64_t bytes = in / 2, groups = in / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[kRows][kWeights];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kWeights; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t stride = x.chunks * kChunk;
  const auto chunk = [&](int64_t c, auto whole) {
    const int64_t left = bytes - c * kChunkBytes, groups_left = groups - c * 4;
    const __mmask64 mask = left >= kChunkBytes ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    const __mmask8 scale_mask = groups_left >= 4 ? 0x0F : static_cast<__mmask8>((1u << groups_left) - 1);
    __m512i low[kWeights], high[kWeights];
    __m512 s[kWeights];
    for (int j = 0; j < kWeights; ++j) {
      conveyor::prefetch_weight(packed[j] + c * kChunkBytes);
      __m512i w;
      __m128 s4;
      if constexpr (decltype(whole)::value) {
        w = _mm512_loadu_si512(packed[j] + c * kChunkBytes);
        s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales[j] + c * 4)));
      } else {
        w = _mm512_maskz_loadu_epi8(mask, packed[j] + c * kChunkBytes);
        s4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(scale_mask, scales[j] + c * 4));
      }
      low[j] = _mm512_and_si512(w, nibble);
      high[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
      s[j] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
    }
    for (int r = 0; r < kRows; ++r) {
      const int8_t* xr = x.values.data() + (m + r) * stride + c * kChunk;
      const __m512i offset = _mm512_loadu_si512(x.offsets.data() + ((m + r) * x.chunks + c) * kLanes);
      const __m512i x_low = _mm512_loadu_si512(xr), x_high = _mm512_loadu_si512(xr + kChunkBytes);
      const __m512 x_scales = _mm512_loadu_ps(x.scales.data() + ((m + r) * x.chunks + c) * kLanes);
      for (int j = 0; j < kWeights; ++j) {
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(offset, low[j], x_low), high[j], x_high);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(s[j], x_scales), acc[r][j]);
      }
    }
  };
  // Whole chunks with plain loads, then a part chunk with masked ones (as the float rows do, row_dots_avx512.h).
  const int64_t whole = bytes / kChunkBytes;
  for (int64_t c = 0; c < whole; ++c) chunk(c, std::true_type{});
  for (int64_t c = whole; c < x.chunks; ++c) chunk(c, std::false_type{});
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kWeights; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

// out[m, o..o+kWeights) for x's rows m in [first, first + count); weight rows past the end repeat the last one.
template <int kWeights, typename scalar_t>
void weight_rows(const ArrangedRows& x, int64_t first, int64_t count, const uint8_t* weight, const c10::Half* scales,
                 const scalar_t* bias, scalar_t* out, int64_t in, int64_t out_features, int64_t o) {
  const int rows = static_cast<int>(std::min<int64_t>(kWeights, out_features - o));
  const uint8_t* packed[kWeights];
  const c10::Half* row_scales[kWeights];
  float b[kWeights];
  for (int j = 0; j < kWeights; ++j) {
    const int64_t row = o + std::min(j, rows - 1);
    packed[j] = weight + row * (in / 2);
    row_scales[j] = scales + row * (in / kGroup);
    b[j] = bias ? conveyor::widen(bias[row]) : 0.f;
  }
  conveyor::for_row_chunks(count, [&](auto chunk, int64_t chunk_start) {
    constexpr int kRows = decltype(chunk)::value;
    const int64_t m = first + chunk_start;
    float sums[kRows][kWeights];
    dot_rows<kRows, kWeights>(x, m, packed, row_scales, in, sums);
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < rows; ++j)
        out[(m + r) * out_features + o + j] = static_cast<scalar_t>(sums[r][j] + b[j]);
  });
}

// Up to kStreamRows rows of x, each weight row streams on its own; more go four weight rows at a time, over tiles
// of x that stay in cache while every weight row passes.
template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
         const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const ArrangedRows a = arrange_rows<scalar_t>(x);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  const uint8_t* packed = weight.data_ptr<uint8_t>();
  const c10::Half* s = scales.data_ptr<c10::Half>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int weights = count > kStreamRows ? 4 : 1;
  const int64_t blocks = (out_features + weights - 1) / weights;
  at::parallel_for(0, blocks, 16 / weights, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < count; first += kTileRows) {
      const int64_t tile = std::min(kTileRows, count - first);
      for (int64_t block = begin; block < end; ++block) {
        if (weights == 4)
          weight_rows<4>(a, first, tile, packed, s, b, o, in, out_features, block * 4);
        else
          weight_rows<1>(a, first, tile, packed, s, b, o, in, out_features, block);
      }
    }
  });
}

#endif  // CONVEYOR_VNNI

// Whether this library's CPU kind has the integer kernel (shard/layers/gemm.py's `vnni`).
bool int8_vnni_available() {
#ifdef CONVEYOR_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, in] (float32, bf16 or fp16), packed uint8 [out, in / 2], scales float16 [out, in / 32], bias or none.
at::Tensor int4_vnni_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias) {
#ifndef CONVEYOR_VNNI
  TORCH_CHECK(false, "int4_vnni_gemm needs AVX-512 VNNI, which this build's CPU lacks");
#endif
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int4_vnni_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == 2 * weight.size(1), "x [M, in], packed [out, in/2]");
  TORCH_CHECK(x.size(1) % kGroup == 0, "int4 needs in divisible by ", kGroup);
  TORCH_CHECK(weight.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf, "uint8 packed, float16 scales");
  TORCH_CHECK(scales.size(0) == weight.size(0) && scales.size(1) == x.size(1) / kGroup, "scales [out, in / 32]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
#ifdef CONVEYOR_VNNI
  conveyor::for_float_dtype(x.scalar_type(), "int4_vnni_gemm",
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, bias, out); });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_vnni_available() -> bool");
  m.impl("int8_vnni_available", c10::DispatchKey::CatchAll, &int8_vnni_available);
  m.def("int4_vnni_gemm(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int4_vnni_gemm", c10::DispatchKey::CPU, &int4_vnni_gemm);
}

}  // namespace conveyor::int4_vnni_gemm_kernel

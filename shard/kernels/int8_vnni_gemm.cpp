// x @ dequant(W).T (+ b) for int8 weights with x rounded to int8 as well, a scale per row, as it comes in
// (`--quantize int8` on a CPU with AVX-512 VNNI, as llama.cpp's q8_0 does). The dot products are then integer: one
// vpdpbusd multiplies 64 byte pairs and adds them four at a time into 16 int32 lanes, where the widening kernel
// (int8_gemm.cpp) does 16 float multiply-adds after widening each weight.
//
// vpdpbusd multiplies unsigned bytes by signed ones. x's int8 values go in offset by 128, and the offset's share
// comes back out with the weight row's sum: sum((q + 128) * w) - 128 * sum(w) = sum(q * w), exact in int32 for
// rows shorter than 2^31 / (255 * 127), about 66,000 inputs.
//
// Two loops, measured on an AMD EPYC Zen 4 (demo small model's layers): up to kStreamRows rows of x (decode with
// few sequences), each weight row is read as one stream, which reads the weights from memory at ~37 GB/s against
// ~18 for reading four rows side by side (and the widening kernel's ~18). With more rows the arithmetic decides,
// and four weight rows side by side let each vector loaded serve four products (32 rows: 2.0 -> 1.5 ms), over
// tiles of x's rows that stay in cache while every weight row passes (a prompt's thousands of rows would not).
//
// Compiled where quantized_rows.h says (AVX-512 VNNI, BW and VL); elsewhere the op exists, says so through
// `int8_vnni_available`, and the widening kernel serves instead.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "float_types.h"
#include "quantized_rows.h"
#include "row_dots.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using conveyor::kStreamRows;
using conveyor::kTileRows;
using conveyor::QuantizedRows;
using conveyor::quantize_rows;

constexpr int64_t kBytes = 64;  // one 512-bit register
constexpr int64_t kMaxIn = 66000;

#ifdef CONVEYOR_VNNI

// sums[r] = x row r (of kRows, `stride` apart) . w, over one weight row, read as one stream four vectors at a
// time into independent accumulators (short dependency chains).
template <int kRows>
inline void dot_row(const uint8_t* x, int64_t stride, const int8_t* w, int64_t in, int32_t sums[kRows]) {
  constexpr int kUnroll = 4;
  __m512i acc[kRows][kUnroll];
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < kUnroll; ++u) acc[r][u] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + kUnroll * kBytes <= in; k += kUnroll * kBytes) {
    for (int u = 0; u < kUnroll; ++u) {
      const __m512i wv = _mm512_loadu_si512(w + k + u * kBytes);
      for (int r = 0; r < kRows; ++r)
        acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], _mm512_loadu_si512(x + r * stride + k + u * kBytes), wv);
    }
  }
  for (; k < in; k += kBytes) {  // x is padded to whole vectors; the weight's tail is loaded under a mask, as 0
    const __mmask64 mask = in - k >= kBytes ? ~__mmask64{0} : (__mmask64{1} << (in - k)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + k);
    for (int r = 0; r < kRows; ++r)
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_loadu_si512(x + r * stride + k), wv);
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512i a = _mm512_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), _mm512_add_epi32(acc[r][2], acc[r][3]));
    sums[r] = _mm512_reduce_add_epi32(a);
  }
}

// The four int32 lane sums of a0..a3, in that order.
inline __m128i sum_lanes(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

constexpr int kBlockRows = 4;  // weight rows read side by side when x has many rows

// sums[r] = the dot products of x row r (of kRows) with the four weight rows w[0..3]: each vector loaded serves
// four products, which is what many rows need (the arithmetic, not the weights' bytes, decides there).
template <int kRows>
inline void dot_block(const uint8_t* x, int64_t stride, const int8_t* const w[kBlockRows], int64_t in,
                      __m128i sums[kRows]) {
  __m512i acc[kRows][kBlockRows];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kBlockRows; ++j) acc[r][j] = _mm512_setzero_si512();
  const auto step = [&](int64_t k, __mmask64 mask) {
    __m512i wv[kBlockRows];
    for (int j = 0; j < kBlockRows; ++j) wv[j] = _mm512_maskz_loadu_epi8(mask, w[j] + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512i xv = _mm512_loadu_si512(x + r * stride + k);
      for (int j = 0; j < kBlockRows; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
    }
  };
  int64_t k = 0;
  for (; k + kBytes <= in; k += kBytes) step(k, ~__mmask64{0});
  if (k < in) step(k, (__mmask64{1} << (in - k)) - 1);  // the weight's tail as 0 (x is padded)
  for (int r = 0; r < kRows; ++r) sums[r] = sum_lanes(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// out[m, o..o+3] for x's rows m in [first, first + count); a last block with fewer than four weight rows repeats
// its last one.
template <typename scalar_t>
void block_rows(const QuantizedRows& x, int64_t first, int64_t count, const int8_t* weight, const float* scales,
                const int32_t* weight_sums, const scalar_t* bias, scalar_t* out, int64_t in, int64_t out_features,
                int64_t o) {
  const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, out_features - o));
  const int8_t* w[kBlockRows];
  float scale[kBlockRows], b[kBlockRows], offset[kBlockRows];
  for (int j = 0; j < kBlockRows; ++j) {
    const int64_t row = o + std::min(j, rows - 1);
    w[j] = weight + row * in;
    scale[j] = scales[row];
    b[j] = bias ? conveyor::widen(bias[row]) : 0.f;
    offset[j] = 128.f * static_cast<float>(weight_sums[row]);
  }
  conveyor::for_row_chunks(count, [&](auto chunk, int64_t chunk_start) {
    constexpr int kRows = decltype(chunk)::value;
    const int64_t m = first + chunk_start;
    __m128i sums[kRows];
    dot_block<kRows>(x.values.data() + m * x.stride, x.stride, w, in, sums);
    for (int r = 0; r < kRows; ++r) {
      alignas(16) int32_t s[kBlockRows];
      _mm_store_si128(reinterpret_cast<__m128i*>(s), sums[r]);
      scalar_t* to = out + (m + r) * out_features + o;
      for (int j = 0; j < rows; ++j)
        to[j] = static_cast<scalar_t>((static_cast<float>(s[j]) - offset[j]) * x.scales[m + r] * scale[j] + b[j]);
    }
  });
}

// out[m, o] for o in [begin, end) and every row m of x.
template <typename scalar_t>
void rows(const QuantizedRows& x, int64_t count, const int8_t* weight, const float* scales,
          const int32_t* weight_sums, const scalar_t* bias, scalar_t* out, int64_t in, int64_t out_features,
          int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o) {
    const float scale = scales[o], b = bias ? conveyor::widen(bias[o]) : 0.f;
    const float offset = 128.f * static_cast<float>(weight_sums[o]);
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      int32_t sums[kRows];
      dot_row<kRows>(x.values.data() + m * x.stride, x.stride, weight + o * in, in, sums);
      for (int r = 0; r < kRows; ++r)
        out[(m + r) * out_features + o] =
            static_cast<scalar_t>((static_cast<float>(sums[r]) - offset) * x.scales[m + r] * scale + b);
    });
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& weight_sums,
         const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  const QuantizedRows q = quantize_rows<scalar_t>(x, kBytes);
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  if (count > kStreamRows) {
    at::parallel_for(0, (out_features + kBlockRows - 1) / kBlockRows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t first = 0; first < count; first += kTileRows)
        for (int64_t block = begin; block < end; ++block)
          block_rows<scalar_t>(q, first, std::min(kTileRows, count - first), weight.data_ptr<int8_t>(),
                               scales.data_ptr<float>(), weight_sums.data_ptr<int32_t>(), b, out.data_ptr<scalar_t>(),
                               in, out_features, block * kBlockRows);
    });
    return;
  }
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    rows<scalar_t>(q, count, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), weight_sums.data_ptr<int32_t>(), b,
                   out.data_ptr<scalar_t>(), in, out_features, begin, end);
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

// x [M, in] (float32, bf16 or fp16), weight int8 [out, in], scales float32 [out], weight_sums int32 [out] (each
// row's sum), bias [out] in x's dtype or none.
at::Tensor int8_vnni_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const at::Tensor& weight_sums, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(int8_vnni_available(), "int8_vnni_gemm needs AVX-512 VNNI, which this build's CPU lacks");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_vnni_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, in] and weight [out, in]");
  TORCH_CHECK(x.size(1) <= kMaxIn, "int8_vnni_gemm sums exactly up to ", kMaxIn, " inputs");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "an int8 weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "float32 scales [out]");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.numel() == weight.size(0), "int32 sums [out]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scales.is_contiguous() && weight_sums.is_contiguous(),
              "contiguous inputs");
  conveyor::check_bias(bias, weight.size(0), x.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
#ifdef CONVEYOR_VNNI
  conveyor::for_float_dtype(x.scalar_type(), "int8_vnni_gemm",
                            [&](auto tag) { run<decltype(tag)>(x, weight, scales, weight_sums, bias, out); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("int8_vnni_available() -> bool");
  m.impl("int8_vnni_available", c10::DispatchKey::CatchAll, &int8_vnni_available);
  m.def("int8_vnni_gemm(Tensor x, Tensor weight, Tensor scales, Tensor weight_sums, Tensor? bias) -> Tensor");
  m.impl("int8_vnni_gemm", c10::DispatchKey::CPU, &int8_vnni_gemm);
}

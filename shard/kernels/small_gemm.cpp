// x @ W.T (+ b) for a few rows of x: the shape of every linear layer in a decode step with one or two requests.
//
// At one row a linear layer is a matrix-vector product, bound by reading the weight once from memory. oneDNN's
// kernels for a packed weight are built for many rows; at one row they read the weights well below the memory
// bandwidth a plain sum over the same bytes reaches (on an AMD EPYC Zen 4). Here each task streams whole
// rows of the plain [out, in] weight, widened to float as they are read, and dots them with every row of x while
// the weight row is still in L1: the weight is read from memory once whatever the row count, and the work per
// weight row grows with it, so this wins only for the first few rows (the caller picks the limit by measurement:
// `SMALL_ROWS` in shard/layers/gemm.py, from the bare forward's decode step, benchmarks/bare.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_types.h"
#include "row_dots.h"
#include "row_dots_avx2.h"
#include "row_dots_avx512.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Named rather than anonymous: kernels.cpp compiles every kernel in one translation unit.
namespace conveyor::small_gemm_kernel {

using conveyor::widen;

// The most rows of x one pass over the weight takes (a verifying step of one sequence with 4 drafts is 5, and a few
// such at once more); a call with more makes a pass for each kMostRows of them (gemm below).
constexpr int64_t kMostRows = 8;

// Whether this build dots bfloat16 as it is (vdpbf16ps, row_dots_avx512.h) rather than widening it.
#ifdef CONVEYOR_AVX512_BF16_DOTS
constexpr bool kNativeBf16Dots = true;
#else
constexpr bool kNativeBf16Dots = false;
#endif

// out[m, o] = x[m, :] . w[o, :] (+ bias[o]) for o in [begin, end) and every row m of x (float, [count, in]).
template <typename scalar_t>
void rows(const float* x, int64_t count, const scalar_t* w, const scalar_t* bias, scalar_t* out, int64_t in,
          int64_t out_features, int64_t begin, int64_t end) {
  float sums[conveyor::kRowsAtOnce];
  for (int64_t o = begin; o < end; ++o) {
    const float b = bias ? widen(bias[o]) : 0.f;
    conveyor::for_row_chunks(count, [&](auto chunk, int64_t m) {
      constexpr int kRows = decltype(chunk)::value;
      conveyor::dot_rows<kRows>(x + m * in, in, w + o * in, sums);
      for (int j = 0; j < kRows; ++j) out[(m + j) * out_features + o] = static_cast<scalar_t>(sums[j] + b);
    });
  }
}

#ifdef CONVEYOR_AVX512_DOTS
// The same in AVX-512, four weight rows at a time: the portable loop above keeps one accumulator chain per weight
// row and waits on it, which bfloat16 weights (half the bytes to wait for) feel most: on SmolLM2's layer shapes
// (one thread, one row, Intel Xeon Emerald Rapids) bfloat16 gained clearly and float32 stayed level. No benchmark
// times this kernel alone; the bare forward's decode step at batch 1 (benchmarks/bare.py) shows it.
template <int kOut, int kMost, typename scalar_t>
void rows_avx512_block(const float* x, const scalar_t* x_raw, int64_t count, const scalar_t* w, const scalar_t* bias,
                       scalar_t* out, int64_t in, int64_t out_features, int64_t o, bool native) {
  float sums[kMost * kOut];
  conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
    constexpr int kRows = decltype(chunk)::value;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (native) {
#ifdef CONVEYOR_AVX512_BF16_DOTS
        conveyor::avx512::dot_block_bf16<kRows, kOut>(x_raw + m * in, in, w + o * in, sums);
#endif
      } else {
        conveyor::avx512::dot_block_split<kRows, kOut>(x + m * in, in, w + o * in, sums);
      }
    } else {
      conveyor::avx512::dot_block<kRows, kOut>(x + m * in, in, w + o * in, sums);
    }
    for (int j = 0; j < kRows; ++j)
      for (int r = 0; r < kOut; ++r) {
        const float b = bias ? widen(bias[o + r]) : 0.f;
        out[(m + j) * out_features + o + r] = static_cast<scalar_t>(sums[j * kOut + r] + b);
      }
  });
}

// Five or six rows of x (a step verifying four or five drafts) take one chunk: four weight rows' sums for six rows
// fill 24 of AVX-512's 32 registers, and each weight vector is then widened once, and each x vector loaded once per
// four weight rows, where chunks of four and one did both twice. SmolLM2-135M-Instruct's layers at five rows
// (Intel Xeon, AVX-512 without avx512_bf16, 2 threads, weights streamed from memory): bfloat16 16.0-16.4 ms ->
// 14.7-15.0 with dot_block_split, against 11.0-11.4 at one row. Seven or eight rows measured no better in one
// chunk of three weight rows.
template <typename scalar_t>
void rows_avx512(const float* x, const scalar_t* x_raw, int64_t count, const scalar_t* w, const scalar_t* bias,
                 scalar_t* out, int64_t in, int64_t out_features, int64_t begin, int64_t end, bool native) {
  constexpr int64_t kFour = conveyor::kRowsAtOnce, kChunk = conveyor::kAvx512ChunkRows;
  int64_t o = begin;
  if (count > kFour && count <= kChunk) {
    for (; o + 4 <= end; o += 4) rows_avx512_block<4, kChunk>(x, x_raw, count, w, bias, out, in, out_features, o, native);
  } else {
    for (; o + 4 <= end; o += 4) rows_avx512_block<4, kFour>(x, x_raw, count, w, bias, out, in, out_features, o, native);
  }
  for (; o < end; ++o) rows_avx512_block<1, kMostRows>(x, x_raw, count, w, bias, out, in, out_features, o, native);
}
#endif

#ifdef CONVEYOR_AVX2_DOTS
// The same blocks in AVX2 (row_dots_avx2.h): what a CPU without AVX-512 runs, float32 and bfloat16 widened.
template <int kRows, int kOut, typename scalar_t>
void rows_avx2_block(const float* x, const scalar_t* w, const scalar_t* bias, scalar_t* out, int64_t in,
                     int64_t out_features, int64_t m, int64_t o) {
  float sums[kRows * kOut];
  conveyor::avx2::dot_block<kRows, kOut>(x + m * in, in, w + o * in, sums);
  for (int j = 0; j < kRows; ++j)
    for (int r = 0; r < kOut; ++r) {
      const float b = bias ? widen(bias[o + r]) : 0.f;
      out[(m + j) * out_features + o + r] = static_cast<scalar_t>(sums[j * kOut + r] + b);
    }
}

// Each block of weight rows is read from memory once and dotted with every row of x, kMost rows at a time, while
// it is still in L1.
template <int kOut, int kMost, typename scalar_t>
void rows_avx2_blocks(const float* x, int64_t count, const scalar_t* w, const scalar_t* bias, scalar_t* out,
                      int64_t in, int64_t out_features, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kOut <= end; o += kOut)
    conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
      rows_avx2_block<decltype(chunk)::value, kOut>(x, w, bias, out, in, out_features, m, o);
    });
  for (; o < end; ++o)
    conveyor::for_row_chunks<kMost>(count, [&](auto chunk, int64_t m) {
      rows_avx2_block<decltype(chunk)::value, 1>(x, w, bias, out, in, out_features, m, o);
    });
}

// Past four rows of x (a step verifying drafts), one weight row at a time against up to kWideRows rows of x, so
// that each weight vector is loaded and widened once for all of them rather than once per four.
template <typename scalar_t>
void rows_avx2(const float* x, int64_t count, const scalar_t* w, const scalar_t* bias, scalar_t* out, int64_t in,
               int64_t out_features, int64_t begin, int64_t end) {
  using conveyor::avx2::kOutFor;
  constexpr int kFour = conveyor::kRowsAtOnce;
  if (count <= 2) return rows_avx2_blocks<kOutFor<2>, kFour>(x, count, w, bias, out, in, out_features, begin, end);
  if (count <= kFour) return rows_avx2_blocks<kOutFor<4>, kFour>(x, count, w, bias, out, in, out_features, begin, end);
  rows_avx2_blocks<1, conveyor::kWideRows>(x, count, w, bias, out, in, out_features, begin, end);
}
#endif

// Whether this build has a vector path for the weight's dtype (float and bfloat16 with AVX-512).
template <typename scalar_t>
constexpr bool vectorized() {
#ifdef CONVEYOR_AVX512_DOTS
  return std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#else
  return false;
#endif
}

// Which loop a call takes: the fastest this build has, the plain C++ loop, the AVX-512 loop that widens bfloat16
// weights to float (what a CPU without the bfloat16 dot product runs), or the AVX2 loop (what a CPU without AVX-512
// runs). The tests call each on any machine that has it.
enum class Path { kBest, kPortable, kWidening, kAvx2 };

template <typename scalar_t>
constexpr bool avx2_vectorized() {
#ifdef CONVEYOR_AVX2_DOTS
  return std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#else
  return false;
#endif
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& out,
         Path path) {
  const int64_t count = x.size(0), in = x.size(1), out_features = weight.size(0);
  std::vector<float> xf = conveyor::widened<scalar_t>(x);
#ifdef CONVEYOR_AVX512_DOTS
  // The one choice of the AVX-512 loop's bfloat16 path: the CPU's own bfloat16 dot product, reading x as it is, where
  // the build has it and the call asks for the best loop; else weights widened, reading x split into pairs' halves
  // (dot_block_split).
  const bool avx512 = path == Path::kBest || path == Path::kWidening;
  const bool native = kNativeBf16Dots && path == Path::kBest;
  if (std::is_same_v<scalar_t, c10::BFloat16> && avx512 && !native) conveyor::avx512::split_pairs(xf, in);
#endif
  const scalar_t* x_raw = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  const scalar_t* b = conveyor::bias_data<scalar_t>(bias);
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
#ifdef CONVEYOR_AVX512_DOTS
    if constexpr (vectorized<scalar_t>()) {
      if (avx512) return rows_avx512<scalar_t>(xf.data(), x_raw, count, w, b, o, in, out_features, begin, end, native);
    }
    constexpr bool avx2_best = false;
#else
    constexpr bool avx2_best = true;
#endif
#ifdef CONVEYOR_AVX2_DOTS
    if constexpr (avx2_vectorized<scalar_t>()) {
      if (path == Path::kAvx2 || (avx2_best && path == Path::kBest))
        return rows_avx2<scalar_t>(xf.data(), count, w, b, o, in, out_features, begin, end);
    }
#endif
    rows<scalar_t>(xf.data(), count, w, b, o, in, out_features, begin, end);
  });
}

// x [M, in] with M >= 1, weight [out, in], bias [out] or none, all one dtype and contiguous. Returns [M, out]. Past
// kMostRows rows, x is taken kMostRows rows at a time, a pass over the weight each: a row's sums are those it gets
// in any other batch, and a bf16 layer that keeps no float32 copy reads its weight a few times rather than fall to
// torch's bf16 matmul on a CPU without avx512_bf16 (shard/layers/gemm.py says when).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, Path path) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_gemm runs on CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, in] and weight [out, in]");
  TORCH_CHECK(x.size(0) >= 1, "small_gemm takes at least one row");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight share a dtype");
  conveyor::check_bias(bias, weight.size(0), weight.scalar_type());
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  for (int64_t m = 0; m < x.size(0); m += kMostRows) {
    const int64_t rows = std::min(kMostRows, x.size(0) - m);
    auto part = out.narrow(0, m, rows);  // rows of a contiguous [M, out]: contiguous too
    conveyor::for_float_dtype(x.scalar_type(), "small_gemm",
                              [&](auto tag) { run<decltype(tag)>(x.narrow(0, m, rows), weight, bias, part, path); });
  }
  return out;
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, bias, Path::kBest);
}

at::Tensor small_gemm_portable(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, bias, Path::kPortable);
}

at::Tensor small_gemm_widening(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, bias, Path::kWidening);
}

at::Tensor small_gemm_avx2(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return gemm(x, weight, bias, Path::kAvx2);
}

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("small_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_gemm", c10::DispatchKey::CPU, &small_gemm);
  m.def("small_gemm_portable(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_gemm_portable", c10::DispatchKey::CPU, &small_gemm_portable);
  m.def("small_gemm_widening(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_gemm_widening", c10::DispatchKey::CPU, &small_gemm_widening);
  m.def("small_gemm_avx2(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_gemm_avx2", c10::DispatchKey::CPU, &small_gemm_avx2);
}

}  // namespace conveyor::small_gemm_kernel

// The paged decode attention's work for one (sequence, KV head) in SIMD registers, for head sizes of 64 and 128:
// the same loops over AVX-512's sixteen lanes (`Avx512`) and AVX2's eight (`Avx2`, which every CPU this runs on
// has, so its loops are tested on any machine).
//
// The portable loops (paged_attention.cpp) compiled to a scalar reduction for every q.k dot product and a scalar
// softmax (GCC vectorized neither its max nor its exp), and reloaded and stored the output sums for every
// context token: at batch 32 the kernel took a third of a decode step of SmolLM2-135M in float32, far from the
// memory bound of reading its K/V. Here a vector's worth of tokens' dot products are summed across lanes
// together (one transpose-and-add tree instead of one reduction each), the softmax's exp is vectorized, and the
// output sums stay in registers while the context's values stream by.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/Half.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "row_dots_avx512.h"

namespace conveyor {

// exp(x) for x <= 0 as Cephes computes expf: x = n ln 2 + r, a degree-6 polynomial on r, times 2^n (~1 ulp). The
// portable kernel's scalar exp and the SIMD one below read these.
struct CephesExp {
  static constexpr float kLowest = -87.f;  // below, 2^n leaves the normal floats; exp is < 1.7e-38 there anyway
  static constexpr float kLog2e = 1.44269504088896341f;
  static constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts, for r
  static constexpr float kPolynomial[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

// CephesExp's exp, one float at a time (the portable loops and the SIMD loops' remainders): libm's expf is a call
// per element, and was the portable attention kernel's largest cost.
inline float exp_nonpositive(float x) {
  using E = CephesExp;
  x = std::max(x, E::kLowest);
  const float n = std::floor(x * E::kLog2e + 0.5f);
  x = x - n * E::kLn2High - n * E::kLn2Low;
  float y = E::kPolynomial[0];
  for (int i = 1; i < 6; ++i) y = y * x + E::kPolynomial[i];
  y = y * x * x + x + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// An 8-bit KV row (shard/layers/kv_quant.py): `head_dim` int8 values, then a float16 scale for each group of
// kKvGroup of them.
constexpr int64_t kKvGroup = 16;

// A row's bytes, and the offset in it of the scale of the group holding value i.
constexpr int64_t kv_row_bytes(int64_t head_dim) { return head_dim + head_dim / kKvGroup * 2; }
constexpr int64_t kv_scale_offset(int64_t head_dim, int64_t i) { return head_dim + i / kKvGroup * 2; }

// The scale of the group holding value i of a row.
inline float kv_scale(const int8_t* row, int64_t head_dim, int64_t i) {
#if defined(__F16C__)
  uint16_t bits;  // the CPU's own conversion where the build has it (every x86 kind here): one instruction
  std::memcpy(&bits, row + kv_scale_offset(head_dim, i), sizeof bits);
  return _cvtsh_ss(bits);
#else
  c10::Half scale;
  std::memcpy(&scale, row + kv_scale_offset(head_dim, i), sizeof scale);
  return static_cast<float>(scale);
#endif
}

}  // namespace conveyor

#if defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_SIMD_ATTENTION 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <limits>

namespace conveyor::simd {

#ifdef CONVEYOR_AVX512_DOTS
struct Avx512 {
  using R = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kSumRegisters = 16;  // of 32: the output sums a `weigh` keeps
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R zero() { return _mm512_setzero_ps(); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fnma(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static R maximum(R a, R b) { return _mm512_max_ps(a, b); }
  static R floor(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static R times_pow2(R y, R n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n a whole number
  template <typename scalar_t>
  static R load(const scalar_t* p) {  // sixteen floats, or bfloat16s or int8s widened (row_dots_avx512.h)
    return conveyor::avx512::load16(p);
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
  static R load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_first(float* p, R v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static R max_first(R top, const float* p, int64_t n) {  // lanes past n keep top
    return _mm512_mask_max_ps(top, first(n), top, load_first(p, n));
  }
  static unsigned equal(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // bit i: lane i equal
  static float reduce_add(R v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(R v) { return _mm512_reduce_max_ps(v); }
  // Lane i of the result is the sum of v[i]'s lanes.
  static R sum_lanes(const R* v) {
    R pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      pairs[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's share of four vectors' sums
      quads[i] = add(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                     _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // lanes 0-1 and 2-3 of eight vectors' shares, summed in pairs
      halves[i] = add(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                      _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return add(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88), _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
  }
};
#endif

struct Avx2 {
  using R = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kSumRegisters = 8;  // of 16
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R zero() { return _mm256_setzero_ps(); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fnma(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  static R maximum(R a, R b) { return _mm256_max_ps(a, b); }
  static R floor(R x) { return _mm256_floor_ps(x); }
  static R times_pow2(R y, R n) {  // y * 2^n for whole n >= -126: n's bits put in a float's exponent
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return mul(y, _mm256_castsi256_ps(bits));
  }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R load(const c10::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static R load(const int8_t* p) {  // an 8-bit KV row's values
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256i first(int64_t n) {  // all ones in the lanes below n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static R load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_first(float* p, R v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }
  static R max_first(R top, const float* p, int64_t n) {
    return _mm256_blendv_ps(top, _mm256_max_ps(top, load_first(p, n)), _mm256_castsi256_ps(first(n)));
  }
  static unsigned equal(R a, R b) {
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
  }
  static float reduce_add(R v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(R v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static R sum_lanes(const R* v) {
    R quads[2];
    for (int i = 0; i < 2; ++i)  // per 128-bit lane: that lane's share of four vectors' sums
      quads[i] = _mm256_hadd_ps(_mm256_hadd_ps(v[4 * i], v[4 * i + 1]), _mm256_hadd_ps(v[4 * i + 2], v[4 * i + 3]));
    return add(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
};

// CephesExp's exp, a vector at a time.
template <typename V>
inline typename V::R exp_nonpositive(typename V::R x) {
  using E = CephesExp;
  x = V::maximum(x, V::set1(E::kLowest));
  const auto n = V::floor(V::fma(x, V::set1(E::kLog2e), V::set1(0.5f)));
  x = V::fnma(n, V::set1(E::kLn2Low), V::fnma(n, V::set1(E::kLn2High), x));
  auto y = V::set1(E::kPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = V::fma(y, x, V::set1(E::kPolynomial[i]));
  return V::times_pow2(V::add(V::fma(V::mul(y, x), x, x), V::set1(1.f)), n);
}

// Softmax of `count` scores in place.
template <typename V>
inline void softmax(float* s, int64_t count) {
  constexpr int L = V::kLanes;
  auto top = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < count; t += L) top = V::max_first(top, s + t, count - t);
  const auto peak = V::set1(V::reduce_max(top));
  auto total = V::zero();
  for (int64_t t = 0; t < count; t += L) {  // the exps are summed as stored: lanes past the count read back 0
    V::store_first(s + t, exp_nonpositive<V>(V::sub(V::load_first(s + t, count - t), peak)), count - t);
    total = V::add(total, V::load_first(s + t, count - t));
  }
  const auto inverse = V::set1(1.f / V::reduce_add(total));
  for (int64_t t = 0; t < count; t += L)
    V::store_first(s + t, V::mul(V::load_first(s + t, count - t), inverse), count - t);
}

// How many context tokens ahead of its reads a loop asks for a token's row. A head's rows lie a pool slot apart
// (every KV head's row between them) and blocks anywhere in the pool, which the hardware prefetcher follows
// poorly: a decode step's context is read once, from memory. AMD EPYC Zen 5, 2 vCPUs, SmolLM2's heads in float32,
// cold caches: 4 sequences of 2,300 tokens read 20-22 GB/s without these, 29-35 with 32 rows ahead (16: 32-33).
constexpr int64_t kRowsAhead = 32;

// Asks for the row of kDim elements at `row` (into L1: it is read within the next few dozen tokens), with an 8-bit
// row's scales after it.
template <typename scalar_t, int kDim>
inline void prefetch_row(const scalar_t* row) {
  constexpr int64_t kBytes = kDim * static_cast<int64_t>(sizeof(scalar_t)) + (sizeof(scalar_t) == 1 ? kDim / 8 : 0);
  for (int64_t b = 0; b < kBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// L values of a K or V row from `offset` as floats: as they are, or an 8-bit row's widened and times their group's
// scale (a vector never straddles two groups: L is 8 or 16).
template <typename V, typename scalar_t, int kDim>
inline typename V::R load_row(const scalar_t* row, int offset) {
  if constexpr (std::is_same_v<scalar_t, int8_t>) {
    return V::mul(V::load(row + offset), V::set1(conveyor::kv_scale(row, kDim, offset)));
  } else {
    return V::load(row + offset);
  }
}

// scores[g * count + t] = q_g . k_t for the `group` query rows q (float, scaled, [group, kDim]) and the rows
// k_t = keys + slots[t] * stride, a vector's worth of tokens at a time.
template <typename V, typename scalar_t, int kDim>
inline void score(const float* q, int64_t group, const scalar_t* keys, const int64_t* slots, int64_t stride,
                  int64_t count, float* scores) {
  constexpr int L = V::kLanes, kVecs = kDim / L;
  for (int64_t t0 = 0; t0 < count; t0 += L) {
    const int64_t n = std::min<int64_t>(L, count - t0);
    for (int64_t t = t0 + kRowsAhead; t < std::min(count, t0 + kRowsAhead + L); ++t)
      prefetch_row<scalar_t, kDim>(keys + slots[t] * stride);
    for (int64_t g = 0; g < group; ++g) {
      typename V::R qv[kVecs], acc[L];
      for (int j = 0; j < kVecs; ++j) qv[j] = V::load(q + g * kDim + L * j);
      for (int i = 0; i < L; ++i) {
        acc[i] = V::zero();
        if (i >= n) continue;
        const scalar_t* k = keys + slots[t0 + i] * stride;
        for (int j = 0; j < kVecs; ++j) acc[i] = V::fma(qv[j], load_row<V, scalar_t, kDim>(k, L * j), acc[i]);
      }
      V::store_first(scores + g * count + t0, V::sum_lanes(acc), n);
    }
  }
}

// out[g] = sum_t weights[g * count + t] * v_t, the rows v_t = values + slots[t] * stride; the sums of a few
// query rows at a time stay in registers (half of them hold sums) while the values stream by.
template <typename V, typename scalar_t, int kDim>
inline void weigh(const float* weights, int64_t group, const scalar_t* values, const int64_t* slots, int64_t stride,
                  int64_t count, float* out) {
  constexpr int L = V::kLanes, kVecs = kDim / L, kRows = std::max(1, V::kSumRegisters / kVecs);
  for (int64_t g0 = 0; g0 < group; g0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, group - g0));
    typename V::R acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kVecs; ++j) acc[r][j] = V::zero();
    for (int64_t t = 0; t < count; ++t) {
      if (g0 == 0 && t + kRowsAhead < count) prefetch_row<scalar_t, kDim>(values + slots[t + kRowsAhead] * stride);
      const scalar_t* v = values + slots[t] * stride;
      typename V::R vv[kVecs];
      for (int j = 0; j < kVecs; ++j) vv[j] = load_row<V, scalar_t, kDim>(v, L * j);
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        const auto w = V::set1(weights[(g0 + r) * count + t]);
        for (int j = 0; j < kVecs; ++j) acc[r][j] = V::fma(w, vv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < kVecs; ++j) V::store(out + (g0 + r) * kDim + L * j, acc[r][j]);
  }
}

}  // namespace conveyor::simd

#endif

namespace conveyor {

// The loops a kernel instance runs: the portable ones, or the SIMD traits above over one of their lane widths.
// The decode attention and the greedy sampler (greedy.cpp) each register an op for the widest and, by name, for
// the narrower ones, so that the tests hold every width to torch on any machine here.
struct Portable {};
#if defined(CONVEYOR_SIMD_ATTENTION) && defined(CONVEYOR_AVX512_DOTS)
using Widest = simd::Avx512;
#elif defined(CONVEYOR_SIMD_ATTENTION)
using Widest = simd::Avx2;
#else
using Widest = Portable;
#endif
#ifdef CONVEYOR_SIMD_ATTENTION
using Avx2Loops = simd::Avx2;
#else
using Avx2Loops = Portable;
#endif

}  // namespace conveyor

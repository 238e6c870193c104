// fp32 vector helpers of the paged decode attention kernel (paged_attention.cpp), on top of
// bf16_vec.h's 16-lane types: 32-element blocks as two fp32 vectors in each type's own lane
// order, a 16-row horizontal sum with hsum's bits, tile max / sum, and exp for x <= 0.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_vec.h"
#include "cephes_exp.h"

namespace pdserve {
namespace vec {

// ---- 32-element blocks as two fp32 vectors ------------------------------------
//
// load32 turns 32 consecutive elements into two fp32 vectors, and store32 undoes
// it. The lane order is the type's own: bf16 splits even and odd elements (one
// shift or mask per vector instead of a widening shuffle), the others keep the
// natural order. q, K and V go through the same load32, so dot products are
// unaffected, and the fp32 accumulators keep that order until store32.

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline void load32(const float* p, f32x16& lo, f32x16& hi) {
  lo = load16(p);
  hi = load16(p + kLanes);
}

inline void store32(float* p, f32x16 lo, f32x16 hi) {
  store16(p, lo);
  store16(p + kLanes, hi);
}

// lo = elements 0, 2, .., 30 and hi = 1, 3, .., 31: a bf16 is the top half of an fp32.
inline void load32(const c10::BFloat16* p, f32x16& lo, f32x16& hi) {
  u32x16 pairs;  // element 2l in the low half of lane l, 2l + 1 in the high half
  std::memcpy(&pairs, p, sizeof pairs);
  const u32x16 even = pairs << 16, odd = pairs & 0xFFFF0000u;
  std::memcpy(&lo, &even, sizeof lo);
  std::memcpy(&hi, &odd, sizeof hi);
}

// Rounded in integer arithmetic (round_bf16_bits), not by the AVX512-BF16 instruction.
inline void store32(c10::BFloat16* p, f32x16 lo, f32x16 hi) {
  const u32x16 pairs = (round_bf16_bits(lo) >> 16) | round_bf16_bits(hi);
  std::memcpy(p, &pairs, sizeof pairs);
}

inline void load32(const c10::Half* p, f32x16& lo, f32x16& hi) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kLanes)));
  std::memcpy(&lo, &a, sizeof lo);
  std::memcpy(&hi, &b, sizeof hi);
#elif defined(__F16C__)
  __m256 parts[4];
  for (int64_t j = 0; j < 4; ++j) {
    parts[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j)));
  }
  std::memcpy(&lo, parts, sizeof lo);
  std::memcpy(&hi, parts + 2, sizeof hi);
#else
  for (int64_t l = 0; l < kLanes; ++l) {
    lo[l] = static_cast<float>(p[l]);
    hi[l] = static_cast<float>(p[kLanes + l]);
  }
#endif
}

inline void store32(c10::Half* p, f32x16 lo, f32x16 hi) {
  for (int64_t l = 0; l < kLanes; ++l) {
    p[l] = static_cast<c10::Half>(lo[l]);  // round to nearest even
    p[kLanes + l] = static_cast<c10::Half>(hi[l]);
  }
}

// ---- math --------------------------------------------------------------------

// reduce16's first level for rows a, b: lanes 0-7 a[j] + a[j + 8], lanes 8-15 b[j] + b[j + 8].
inline f32x16 pair_rows(f32x16 a, f32x16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// reduce16's levels after the first, from x[k] = pair_rows(row 2k, row 2k + 1).
inline f32x16 reduce16_rest(const f32x16* x) {
  f32x16 y[4], z[2];
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: row 4k + L's a[j] + a[j + 4]
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // lane L: (b0 + b2, b1 + b3) of row 8k + L, then of row 8k + 4 + L
    z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(y[2 * k], y[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // lane L, element j: row L + 4 j
  const f32x16 r = __builtin_shufflevector(z[0], z[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
                   __builtin_shufflevector(z[0], z[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  return __builtin_shufflevector(r, r, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// Lane t of the result = hsum(row t) of p [16, 16] (bf16_vec.h), with hsum's additions in its order (so
// the same bits): rows are paired at each level so that one vector add serves 2, 4, 8 rows.
inline f32x16 reduce16(const float* p) {
  f32x16 x[8];
  for (int k = 0; k < 8; ++k) x[k] = pair_rows(load16(p + 32 * k), load16(p + 32 * k + 16));
  return reduce16_rest(x);
}

// reduce16 from its first level's 8 vectors x [8, 16] (x[k] = pair_rows(row 2k, row 2k + 1)),
// computed by the caller: the same bits as reduce16 of the 16 rows.
inline f32x16 reduce16_pairs(const float* p) {
  f32x16 x[8];
  for (int k = 0; k < 8; ++k) x[k] = load16(p + 16 * k);
  return reduce16_rest(x);
}

// max / sum of x[0, N), in 16 lanes folded at the end. A plain `s += x[i]`
// loop does not vectorize without -ffast-math, and gcc ends `omp simd reduction`
// with 16 dependent scalar adds.
template <int64_t N>
inline float max_of(const float* __restrict x) {
  f32x16 m = load16(x);
  for (int64_t i = kLanes; i < N; i += kLanes) {
    const f32x16 v = load16(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int64_t l = 1; l < kLanes; ++l) r = std::max(r, m[l]);
  return r;
}

template <int64_t N>
inline float sum_of(const float* __restrict x) {
  f32x16 s = load16(x);
  for (int64_t i = kLanes; i < N; i += kLanes) s += load16(x + i);
  return hsum(s);
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp). Inputs below -87 give ~1e-38 instead of 0, which no softmax notices.
inline float exp_nonpos(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = std::max(x, -87.f);
  // n = round(x / ln 2); std::floor would not vectorize without -fno-trapping-math.
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace vec
}  // namespace pdserve

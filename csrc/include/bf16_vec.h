// 16-lane fp32 vectors over bf16 data (GCC/Clang vector extensions, lowered to what
// -march allows; AVX512-BF16 rounding where present). Natural element order.
// Shared by activation.cpp and rms_norm.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors in inlined internal functions

namespace pdserve {
namespace vec {

constexpr int64_t kLanes = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

inline f32x16 splat(float x) { return f32x16{} + x; }

// bf16 -> fp32 (exact) and back, for vectors of 16 (F f32x16, U u32x16, H u16x16) or 8 lanes.
template <class F, class U, class H>
inline F widen_bf16(const c10::BFloat16* p) {
  H h;
  std::memcpy(&h, p, sizeof h);
  const U bits = __builtin_convertvector(h, U) << 16;
  F v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// 16 bf16. With AVX-512 one widening load and a shift: GCC lowers the generic form for 512-bit
// vectors as two 8-lane widenings and an insert where -march's tuning prefers 256-bit vectors
// (as for this VM's CPU model), which made RMSNorm and rotary ~1.7x slower.
inline f32x16 load_bf16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<f32x16>(w);
#else
  return widen_bf16<f32x16, u32x16, u16x16>(p);
#endif
}
inline f32x8 load_bf16x8(const c10::BFloat16* p) { return widen_bf16<f32x8, u32x8, u16x8>(p); }  // 8 bf16

// fp32 bits rounded to the nearest even bf16 in the top half (NaN stays NaN, quiet), in plain
// integer arithmetic: denormals kept, whatever the CPU.
template <class U, class F>
inline U round_bits(F v) {
  U bits;
  std::memcpy(&bits, &v, sizeof bits);
  const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const U nan = (bits | 0x00400000u) & 0xFFFF0000u;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

inline u32x16 round_bf16_bits(f32x16 v) { return round_bits<u32x16>(v); }
inline u32x8 round_bf16_bits(f32x8 v) { return round_bits<u32x8>(v); }

// fp32 rounded to the nearest even bf16 (NaN stays NaN), still as fp32 values.
inline f32x16 round_bf16(f32x16 v) {
#if defined(__AVX512BF16__)
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  return reinterpret_cast<f32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
#else
  const u32x16 bits = round_bf16_bits(v);
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

inline void store_bf16(c10::BFloat16* p, f32x16 rounded) {  // rounded: a round_bf16 result
  u32x16 bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  const u16x16 h = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}

// store_bf16(p, round_bf16(v)), the same bits; with AVX512-BF16 in one conversion (no widening
// and narrowing again: a third of the ops of a bf16 elementwise kernel like RMSNorm's).
inline void store_round_bf16(c10::BFloat16* p, f32x16 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
#else
  store_bf16(p, round_bf16(v));
#endif
}

// store_round_bf16(p, v), returning round_bf16(v).
inline f32x16 round_store_bf16(c10::BFloat16* p, f32x16 v) {
#if defined(__AVX512BF16__)
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  return reinterpret_cast<f32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  const f32x16 r = round_bf16(v);
  store_bf16(p, r);
  return r;
#endif
}

inline void store_bf16x8(c10::BFloat16* p, f32x8 v) {  // rounded to nearest even (round_bf16_bits)
  const u16x8 h = __builtin_convertvector(round_bf16_bits(v) >> 16, u16x8);
  std::memcpy(p, &h, sizeof h);
}

inline float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane r of the result = hsum(v[r]) for 8 vectors, with hsum's additions in its order (so the
// same bits); each level pairs rows so that one vector add serves two of them.
inline f32x8 hsum8(const f32x16 (&v)[8]) {
  f32x16 x[4], y[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-7: a of row 2i (v[j] + v[j + 8]); 8-15: a of row 2i + 1
    x[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)  // lanes 4g..4g+3: b of row 4j + g (a[t] + a[t + 4])
    y[j] = __builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * j], x[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // lanes 2r, 2r + 1: (b0 + b2, b1 + b3) of row r
  const f32x16 z = __builtin_shufflevector(y[0], y[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(y[0], y[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(z, z, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(z, z, 1, 3, 5, 7, 9, 11, 13, 15);
}

}  // namespace vec
}  // namespace pdserve

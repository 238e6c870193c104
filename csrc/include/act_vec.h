// The gated MLP activations over 16 fp32 lanes, shared by activation.cpp (act_and_mul) and
// small_linear.cpp (the gate|up projection with the activation in its epilogue), so both give
// the same bits. GCC/Clang vector extensions (bf16_vec.h).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>

#include "bf16_vec.h"
#include "cephes_exp.h"

namespace pdserve {
namespace act {

using vec::f32x16;
using vec::i32x16;
using vec::splat;

// exp(x) (Cephes expf: range reduction by ln 2, degree-6 polynomial p, times 2^n), x clamped to
// [-87, 88.8]: +inf from 88.72 like expf, ~1e-38 instead of 0 below -87. p * 2^n is rounded once
// (AVX-512's scalef, else two exact power-of-two steps), so a result near the top of the range is
// finite where expf's is.
inline f32x16 exp16(f32x16 x) {
  const f32x16 kRound = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.8f) ? splat(88.8f) : x;
  const f32x16 n = (x * 1.44269504088896341f + kRound) - kRound;  // in [-126, 128]
  const f32x16 p = exp_reduced(x, n);
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const i32x16 k = __builtin_convertvector(n, i32x16), h = k >> 1;  // 2^n = 2^h 2^(n - h), both normal
  const i32x16 b1 = (h + 127) << 23, b2 = (k - h + 127) << 23;
  f32x16 s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  return p * s1 * s2;
#endif
}

inline f32x16 silu16(f32x16 g) { return g / (1.f + exp16(-g)); }

// 0.5 * g * (1 + tanh(y)) == g / (1 + exp(-2y)): no cancellation in 1 + tanh(y) for y << 0.
inline f32x16 gelu_tanh16(f32x16 g) {
  const f32x16 y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.f + exp16(-2.f * y));
}

// Scalar forms for the last I % 16 columns: the same formulas as the vector ones.
inline float silu1(float g) { return g / (1.f + std::exp(-g)); }

inline float gelu_tanh1(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.f + std::exp(-2.f * y));
}

// act(g) * u for 16 lanes of bf16 values held as fp32 (g and u already rounded to bf16), stored
// as 16 bf16 at p: the activation rounded to bf16, then the product rounded again (torch's
// `act(gate) * up` in bf16).
template <bool kGelu>
inline void store_gated16(c10::BFloat16* p, f32x16 g, f32x16 u) {
  vec::store_round_bf16(p, vec::round_bf16(kGelu ? gelu_tanh16(g) : silu16(g)) * u);
}

}  // namespace act
}  // namespace pdserve

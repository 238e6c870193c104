// The gated MLP activations over 16 fp32 lanes, shared by activation.cpp (act_and_mul) and
// small_linear.cpp (the gate|up projection with the activation in its epilogue), so both give
// the same bits. GCC/Clang vector extensions (bf16_vec.h).
#pragma once

#include <cmath>
#include <cstring>

#include "bf16_vec.h"
#include "cephes_exp.h"

namespace pdserve {
namespace act {

using vec::f32x16;
using vec::i32x16;
using vec::splat;

// exp(x) (Cephes expf: range reduction by ln 2, degree-6 polynomial); +inf above
// 88.7 like expf, ~1e-38 instead of 0 below -87.
inline f32x16 exp16(f32x16 x) {
  const f32x16 kRound = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const auto overflow = x > splat(88.7f);
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = overflow ? splat(88.f) : x;
  const f32x16 n = (x * 1.44269504088896341f + kRound) - kRound;
  const f32x16 p = exp_reduced(x, n);
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2^n, n in [-126, 127]
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f32x16 inf = splat(__builtin_inff());
  return overflow ? inf : p * scale;
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

// act(g) * u for 16 lanes of bf16 values held as fp32 (g and u already rounded to bf16): the
// activation rounded to bf16, then the product rounded again (torch's `act(gate) * up` in bf16).
template <bool kGelu>
inline f32x16 gated16(f32x16 g, f32x16 u) {
  const f32x16 a = vec::round_bf16(kGelu ? gelu_tanh16(g) : silu16(g));
  return vec::round_bf16(a * u);
}

}  // namespace act
}  // namespace pdserve

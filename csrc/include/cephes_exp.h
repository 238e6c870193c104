// The core of Cephes' expf, shared by the scalar (auto-vectorised) and the 16-lane
// exp in the CPU kernels: with n = round(x / ln 2), returns exp(x - n ln 2) (~1 ulp),
// which the caller scales by 2^n. V is float or a GCC vector of floats.
#pragma once

namespace pdserve {

template <typename V>
inline V exp_reduced(V x, V n) {
  V r = x - n * 0.693359375f;  // ln 2 in two parts, so r keeps its low bits
  r = r - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

}  // namespace pdserve

// GGUF's 32-weight block forms found from fp32 weights (exactly: the values these blocks
// dequantize to), shared by the quant copies of csrc/linear/amx_rows.cpp (AMX tiles) and
// csrc/linear/packed_quant.cpp (AVX512-BF16 panels): Q4_1 (w = fma(d, q, m), q in 0..15) and Q8_0
// (w = d q, q in -128..127).
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pdserve {
namespace quant {

// One 32-weight block in Q4_1's or Q8_0's form, found from its fp32 values (exactly: the values
// these blocks dequantize to); false where none reproduces all 32.
inline bool q4_fits(const float* v, float lo, float dc, uint8_t* q) {
  for (int i = 0; i < 32; ++i) {
    const float qf = dc == 0.0f ? 0.0f : std::nearbyint((v[i] - lo) / dc);
    if (!(qf >= 0.0f && qf <= 15.0f && std::fma(dc, qf, lo) == v[i])) return false;
    q[i] = static_cast<uint8_t>(qf);
  }
  return true;
}

inline bool find_q4(const float* v, float* d, float* m, uint8_t* q) {
  // m is the block's least value (its q is 0); d is (max - m) / q_max, q_max 15 in a GGUF block
  // (the quantizer maps the block's range onto 0..15) but tried down to 1, with d as computed and
  // rounded to fp16 (how GGUF stores it)
  float lo = v[0], hi = v[0];
  for (int i = 1; i < 32; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  for (int qmax = 15; qmax >= 1; --qmax) {
    const float c0 = (hi - lo) / static_cast<float>(qmax);
    for (float dc : {c0, static_cast<float>(c10::Half(c0))}) {
      if (q4_fits(v, lo, dc, q)) {
        *d = dc;
        *m = lo;
        return true;
      }
    }
    if (hi == lo) break;
  }
  return false;
}

inline bool find_q8(const float* v, float* d, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!std::isfinite(amax)) return false;
  const float c0 = amax / 127.0f;
  const float cands[2] = {c0, static_cast<float>(c10::Half(c0))};
  for (float dc : cands) {
    bool ok = true;
    for (int i = 0; i < 32 && ok; ++i) {
      const float qf = dc == 0.0f ? 0.0f : std::nearbyint(v[i] / dc);
      ok = qf >= -128.0f && qf <= 127.0f && dc * qf == v[i];
      q[i] = static_cast<int8_t>(qf);
    }
    if (ok) {
      *d = dc;
      return true;
    }
  }
  return false;
}

}  // namespace quant
}  // namespace pdserve

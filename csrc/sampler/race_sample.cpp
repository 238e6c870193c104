// Temperature sampling by the exponential race in one pass per row, registered as
// torch.ops.pdserve.race_sample (loader: engine/race_sample_op.py).
//
//   logits    [B, V]  fp32 or bf16, contiguous
//   inv_temp  [B]     fp32, 1 / temperature (> 0)
//   seeds     [B]     int64, a 64-bit key per row (its bits, sign ignored)
//   out       [B]     int64: argmax_i exp((x_i - max x) * inv_temp) / q_i
//
// q_i ~ Exp(1) is -log(u_i) with u_i = (2 k + 1) / 2^25, k the top 24 bits of a counter hash
// of (row key, i): the same 24-bit uniform grid as torch.rand's float32, never 0 or 1. The
// winner of the race is distributed as softmax(x * inv_temp); argmax(p / q) needs no
// normalisation, so no softmax, no [B, V] noise tensor and no division pass is made.
//
// Why: the torch version (rand, log, neg, clamp, divide, softmax, divide, argmax) made eight
// passes over [B, V] and took ~8 ms a step for 16 rows of SmolLM2's 49k vocabulary on one
// core, ~11% of a 16-row decode step; this is one pass for the max and one for the race.
// A row's token depends only on its logits, its temperature and its key (never on the
// batch, the thread count or the row's position).
//
// Vector code uses the GCC/Clang vector extensions (lowered to whatever -march allows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bf16_vec.h"
#include "cephes_exp.h"

namespace pdserve {
namespace {

using namespace vec;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const c10::BFloat16* p) { return load_bf16(p); }

// Wellons' lowbias32: a bijective 32-bit mixer (bias ~0.17).
inline u32x16 mix32(u32x16 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline f32x16 as_float(u32x16 b) {
  f32x16 v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}
inline u32x16 as_bits(f32x16 v) {
  u32x16 b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// -log(u) for u in (0, 1) (Cephes logf: u = 2^e m with m in [sqrt(1/2), sqrt(2)), degree-8
// polynomial in m - 1; ~1 ulp).
inline f32x16 neg_log(f32x16 u) {
  const u32x16 bits = as_bits(u);
  i32x16 e = (i32x16)(bits >> 23) - 127;
  f32x16 m = as_float((bits & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  const auto big = m > splat(1.41421356f);
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const f32x16 x = m - 1.f, z = x * x, ef = __builtin_convertvector(e, f32x16);
  f32x16 p = x * 7.0376836292e-2f - 1.1514610310e-1f;
  p = p * x + 1.1676998740e-1f;
  p = p * x - 1.2420140846e-1f;
  p = p * x + 1.4249322787e-1f;
  p = p * x - 1.6668057665e-1f;
  p = p * x + 2.0000714765e-1f;
  p = p * x - 2.4999993993e-1f;
  p = p * x + 3.3333331174e-1f;
  f32x16 y = x * z * p + ef * -2.12194440e-4f - z * 0.5f;
  return -(x + y + ef * 0.693359375f);
}

// exp(x) for x <= 0 (as paged_attention.cpp); ~1e-38 below -87 (and for -inf or NaN).
inline f32x16 exp_nonpos(f32x16 x) {
  x = x > splat(-87.f) ? x : splat(-87.f);
  const f32x16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const f32x16 p = exp_reduced(x, n);
  const u32x16 scale = (u32x16)((__builtin_convertvector(n, i32x16) + 127) << 23);
  return p * as_float(scale);
}

// The lanes' running maxima folded: the largest value (top) and the smallest index holding it.
inline int64_t first_max(f32x16 best, i32x16 best_i, float& top) {
  int64_t tok = best_i[0];
  top = best[0];
  for (int64_t l = 1; l < kLanes; ++l)
    if (best[l] > top || (best[l] == top && best_i[l] < tok)) {
      top = best[l];
      tok = best_i[l];
    }
  return tok;
}

template <typename T>
int64_t race_row(const T* x, int64_t V, float inv_temp, uint64_t key) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full = V / kLanes * kLanes;
  alignas(64) T tail[kLanes];  // the last partial vector, padded with -inf
  for (int64_t i = 0; i < kLanes; ++i) tail[i] = full + i < V ? x[full + i] : static_cast<T>(kNegInf);
  auto at = [&](int64_t i) { return i < full ? load16(x + i) : load16(tail); };
  const int64_t end = (V + kLanes - 1) / kLanes * kLanes;

  f32x16 mx = splat(kNegInf);
  for (int64_t i = 0; i < end; i += kLanes) {
    const f32x16 v = at(i);
    mx = v > mx ? v : mx;
  }
  float m = mx[0];
  for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, mx[l]);
  if (m == kNegInf) return 0;  // nothing to sample from (or all NaN): token 0, like argmax

  const uint32_t k1 = static_cast<uint32_t>(key), k2 = static_cast<uint32_t>(key >> 32);
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f32x16 best = splat(-1.f);
  i32x16 best_i = lane;
  for (int64_t i = 0; i < end; i += kLanes) {
    const i32x16 idx = lane + static_cast<int32_t>(i);
    const u32x16 h = mix32(mix32((u32x16)idx + k1) ^ k2);
    const f32x16 u = __builtin_convertvector((h >> 8) * 2u + 1u, f32x16) * (1.f / 33554432.f);  // (2k+1) / 2^25
    f32x16 score = exp_nonpos((at(i) - m) * inv_temp) / neg_log(u);
    score = idx < static_cast<int32_t>(V) ? score : splat(-1.f);
    const auto better = score > best;  // strict: a lane keeps its first maximum
    best = better ? score : best;
    best_i = better ? idx : best_i;
  }
  float top;
  return first_max(best, best_i, top);
}

// torch.argmax of a row: the first index of its maximum, or of its first NaN (torch ranks NaN
// above every number). One pass, a running maximum and its first index per lane.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  const int64_t full = V / kLanes * kLanes;
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f32x16 best = splat(-std::numeric_limits<float>::infinity());
  i32x16 best_i = lane;
  i32x16 nan = lane * 0;
  for (int64_t i = 0; i < full; i += kLanes) {
    const f32x16 v = load16(x + i);
    const auto better = v > best;  // strict: a lane keeps its first maximum
    best = better ? v : best;
    best_i = better ? lane + static_cast<int32_t>(i) : best_i;
    nan |= v != v;
  }
  bool any_nan = false;
  for (int64_t l = 0; l < kLanes; ++l) any_nan |= nan[l] != 0;
  if (any_nan) {
    for (int64_t i = 0; i < full; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  float top;
  int64_t tok = first_max(best, best_i, top);
  for (int64_t i = full; i < V; ++i) {  // the tail, after every full vector's index
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > top) {
      top = v;
      tok = i;
    }
  }
  return tok;
}

// Both ops' logits: contiguous fp32 or bf16 [B, V] on the CPU, 0 < V < 2^31.
void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(), op,
              ": logits must be a contiguous [B, V] CPU tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
              ": logits must be float32 or bfloat16; got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31), op, ": vocabulary size out of range: ",
              logits.size(1));
}

// Greedy sampling's argmax over the vocabulary (torch.argmax(logits, -1), the same indices):
// torch's reduction took ~75 us a row of SmolLM2's 49k logits here (1.2 ms of a 16-row decode
// step), this ~5.
at::Tensor argmax_rows_cpu(const at::Tensor& logits) {
  check_logits(logits, "argmax_rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      op[b] = logits.scalar_type() == at::kFloat ? argmax_row(logits.const_data_ptr<float>() + b * V, V)
                                                 : argmax_row(logits.const_data_ptr<c10::BFloat16>() + b * V, V);
  });
  return out;
}

at::Tensor race_sample_cpu(const at::Tensor& logits, const at::Tensor& inv_temp, const at::Tensor& seeds) {
  check_logits(logits, "race_sample");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(inv_temp.scalar_type() == at::kFloat && inv_temp.dim() == 1 && inv_temp.size(0) == B,
              "race_sample: inv_temp must be float32 [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1 && seeds.size(0) == B,
              "race_sample: seeds must be int64 [B]");
  const at::Tensor it = inv_temp.contiguous(), sd = seeds.contiguous();
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* itp = it.const_data_ptr<float>();
  const int64_t* sp = sd.const_data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t key = static_cast<uint64_t>(sp[b]);
      op[b] = logits.scalar_type() == at::kFloat
                  ? race_row(logits.const_data_ptr<float>() + b * V, V, itp[b], key)
                  : race_row(logits.const_data_ptr<c10::BFloat16>() + b * V, V, itp[b], key);
    }
  });
  return out;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("race_sample(Tensor logits, Tensor inv_temp, Tensor seeds) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("race_sample", &pdserve::race_sample_cpu);
  m.impl("argmax_rows", &pdserve::argmax_rows_cpu);
}

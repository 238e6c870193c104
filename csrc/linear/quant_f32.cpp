// float32 linear for decode batches on AVX2 (+FMA) CPUs, reading a block-quantized copy of the
// weight: torch.ops.pdserve.quant_linear_f32 and pack_quant_f32 (wrapper: native/quant_linear.py,
// layer: engine/layers/linear.py).
//
// Why: where a CPU has no AVX512-BF16 (AMD Zen 3, the bf16 kernels do not run) `--dtype auto`
// computes in float32, and a decode step streams every fp32 weight once (540 MB for SmolLM2-135M).
// torch's linear (oneDNN) reads them at memory speed for one row but slows down for a few rows
// (Zen 3, one thread, all of SmolLM2's linears: 35 ms at 1 row, 68 at 4, 80 at 8, 103 at 16).
// Where the model is a GGUF's dequantized values, every 32-weight block of a weight is exactly
// Q4_1's fma(d, q, m) or Q8_0's d q (csrc/include/quant_blocks.h finds them, checked weight for
// weight); this copy holds them in 6 (Q4_1) or 9 (Q8_0) bits a weight, and the kernel sums each
// block as d (x . q) + m (sum of x) (one FMA a weight; rebuilding w = fma(d, q, m) first took two:
// one row 1.4-1.6x faster, four rows 1.05x, Zen 3, docs/kernels.md).
//
// Layout (after a 64-byte header: int32 kind, N, K): units of 8 output columns, then the K / 32
// blocks of each; a block is d[8] (and m[8] for Q4) as fp32, then for each of its 16 k pairs
// (2 j, 2 j + 1): Q4: 8 bytes, byte c = q[c][2 j] | q[c][2 j + 1] << 4; Q8: 16 bytes, q[c][2 j]
// for c < 8 then q[c][2 j + 1].
//
// Numerics: for each output n and block, (x . q) in two fp32 sums over the even and the odd k in
// order, added; then the output's sum takes d times that and m times the block's sum of x, block
// after block (then the bias): an order fixed by K alone, never by M, the batch position, how many
// units or rows one pass takes, or the thread count, so a row's result does not depend on the
// batch it ran in. It is not torch's order: results differ from F.linear in the last bits (max
// error against a float64 product 1.6-4.1e-7 of the largest output, where rebuilding w gave
// 3.5-8.9e-7).
//
// Without AVX2 and FMA at compile time quant_f32_supported() is false and callers use torch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_QF32 1
#endif

namespace pdserve {
namespace qf32 {

constexpr int kQ4 = 1, kQ8 = 2;
constexpr int64_t kHeader = 64;
constexpr int64_t kUnit = 8;  // output columns per unit
constexpr int kMaxRows = 4;  // x rows per pass over a unit's blocks

constexpr int64_t block_bytes(int kind) { return kind == kQ4 ? 64 + 128 : 32 + 256; }

struct Header {
  int32_t kind, n, k;
};

Header header_of(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 1 && q.is_contiguous() && q.numel() >= kHeader,
              "quant_linear_f32: not a pack_quant_f32 copy");
  Header h;
  std::memcpy(&h, q.data_ptr<uint8_t>(), sizeof h);
  TORCH_CHECK((h.kind == kQ4 || h.kind == kQ8) && h.n > 0 && h.n % kUnit == 0 && h.k > 0 && h.k % 32 == 0 &&
                  q.numel() == kHeader + (h.n / kUnit) * (h.k / 32) * block_bytes(h.kind),
              "quant_linear_f32: not a pack_quant_f32 copy");
  return h;
}

// The copy of w32 [N, K] (fp32, contiguous) where every block fits one form; empty otherwise.
at::Tensor pack(const at::Tensor& w32) {
  TORCH_CHECK(w32.scalar_type() == at::kFloat && w32.dim() == 2 && w32.device().is_cpu(),
              "pack_quant_f32: w32 must be a 2-D fp32 CPU tensor");
  const at::Tensor w = w32.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  if (N == 0 || N % kUnit || K == 0 || K % 32) return at::empty({0}, at::kByte);
  const float* src = w.data_ptr<float>();
  const int64_t units = N / kUnit, blocks = K / 32;
  for (int kind : {kQ4, kQ8}) {
    at::Tensor out = at::empty({kHeader + units * blocks * block_bytes(kind)}, at::kByte);
    uint8_t* base = out.data_ptr<uint8_t>();
    std::memset(base, 0, kHeader);
    const Header h{kind, static_cast<int32_t>(N), static_cast<int32_t>(K)};
    std::memcpy(base, &h, sizeof h);
    std::atomic<bool> ok{true};
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      uint8_t q4[32];
      int8_t q8[32];
      for (int64_t u = u0; u < u1 && ok.load(std::memory_order_relaxed); ++u) {
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* blk = base + kHeader + (u * blocks + b) * block_bytes(kind);
          float* d = reinterpret_cast<float*>(blk);
          uint8_t* body = blk + (kind == kQ4 ? 64 : 32);
          for (int c = 0; c < kUnit; ++c) {
            const float* v = src + (u * kUnit + c) * K + 32 * b;
            if (kind == kQ4) {
              float dd, mm;
              if (!quant::find_q4(v, &dd, &mm, q4)) {
                ok = false;
                return;
              }
              d[c] = dd;
              d[8 + c] = mm;
              for (int j = 0; j < 16; ++j) body[8 * j + c] = static_cast<uint8_t>(q4[2 * j] | (q4[2 * j + 1] << 4));
            } else {
              float dd;
              if (!quant::find_q8(v, &dd, q8)) {
                ok = false;
                return;
              }
              d[c] = dd;
              for (int j = 0; j < 16; ++j) {
                body[16 * j + c] = static_cast<uint8_t>(q8[2 * j]);
                body[16 * j + 8 + c] = static_cast<uint8_t>(q8[2 * j + 1]);
              }
            }
          }
        }
      }
    });
    if (ok) return out;
  }
  return at::empty({0}, at::kByte);
}

#ifdef PDSERVE_QF32

// Rows [0, MR) of x against NV consecutive units starting at unit u: out[r][8 (u + v) + c].
// A block's weights are w = d q + m (Q4_1) or d q (Q8_0), so its share of a row's sum is
// d (x . q) + m S, with S the row's sum over the block (`xs`, made once a call): the kernel
// converts each q to fp32 and multiplies it by x (one FMA a weight, where rebuilding w first
// took two), then scales the block's dot by d and adds m S. (x . q): two fp32 chains, over the
// even and the odd k in order, added at the block's end.
// Every loop over the accumulator arrays carries `#pragma GCC unroll`: without it GCC 12 kept them
// in memory, a store per FMA (SmolLM2's linears at 4 rows 35.6 -> 20.3 ms with it).
template <int Kind, int MR, int NV>
void pass(const float* x, int64_t ldx, const float* xs, int64_t ldxs, const uint8_t* q, int64_t blocks,
          const float* bias, float* out, int64_t ldo, int64_t u) {
  __m256 acc[MR * NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR * NV; ++i) acc[i] = _mm256_setzero_ps();
  constexpr int64_t bb = block_bytes(Kind);
  const uint8_t* ub[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) ub[v] = q + (u + v) * blocks * bb;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 even[MR * NV], odd[MR * NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR * NV; ++i) even[i] = odd[i] = _mm256_setzero_ps();
    const uint8_t* body[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) body[v] = ub[v] + b * bb + (Kind == kQ4 ? 64 : 32);
    const float* xb = x + 32 * b;
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        __m256 qe, qo;
        if constexpr (Kind == kQ4) {
          const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(body[v] + 8 * j)));
          qe = _mm256_cvtepi32_ps(_mm256_and_si256(t, _mm256_set1_epi32(15)));
          qo = _mm256_cvtepi32_ps(_mm256_srli_epi32(t, 4));
        } else {
          const uint8_t* p = body[v] + 16 * j;
          qe = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
          qo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          even[r * NV + v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * ldx + 2 * j), qe, even[r * NV + v]);
          odd[r * NV + v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * ldx + 2 * j + 1), qo, odd[r * NV + v]);
        }
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const float* h = reinterpret_cast<const float*>(ub[v] + b * bb);
      const __m256 d = _mm256_loadu_ps(h);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m256& a = acc[r * NV + v];
        a = _mm256_fmadd_ps(d, _mm256_add_ps(even[r * NV + v], odd[r * NV + v]), a);
        if constexpr (Kind == kQ4) a = _mm256_fmadd_ps(_mm256_loadu_ps(h + 8), _mm256_broadcast_ss(xs + r * ldxs + b), a);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __m256 s = acc[r * NV + v];
      const int64_t c = kUnit * (u + v);
      if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + c));
      _mm256_storeu_ps(out + r * ldo + c, s);
    }
}

using PassFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                       int64_t, int64_t);

// Units per pass by rows (MR x NV accumulator pairs fit 16 ymm with the rebuilt weights).
template <int Kind>
PassFn pick(int mr, int nv) {
  switch (mr) {
    case 1: return nv == 4 ? pass<Kind, 1, 4> : pass<Kind, 1, 1>;
    case 2: return nv == 2 ? pass<Kind, 2, 2> : pass<Kind, 2, 1>;
    case 3: return pass<Kind, 3, 1>;
    default: return pass<Kind, 4, 1>;
  }
}

constexpr int units_per_pass(int mr) { return mr == 1 ? 4 : mr == 2 ? 2 : 1; }

#endif  // PDSERVE_QF32

at::Tensor linear(const at::Tensor& x, const at::Tensor& q, const c10::optional<at::Tensor>& bias) {
#ifndef PDSERVE_QF32
  (void)x, (void)q, (void)bias;
  TORCH_CHECK(false, "quant_linear_f32: built without AVX2 and FMA");
#else
  const Header h = header_of(q);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  x.size(1) == h.k,
              "quant_linear_f32: x must be a contiguous fp32 [M, ", h.k, "] CPU tensor");
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == h.n && bias->is_contiguous(),
                "quant_linear_f32: bias must be a contiguous fp32 [", h.n, "] tensor");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), N = h.n, K = h.k, units = N / kUnit, blocks = K / 32;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>() + kHeader;
  // Each row's sum over each block, in order (Q4_1's m S).
  at::Tensor xsum = at::empty({M, blocks}, x.options());
  float* xs = xsum.data_ptr<float>();
  if (h.kind == kQ4)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        float t = 0.0f;
        for (int k = 0; k < 32; ++k) t += xp[r * K + 32 * b + k];
        xs[r * blocks + b] = t;
      }
  // Work items of 4 units (32 columns): the weights of one item stay in L1/L2 while every row
  // group of x runs over them.
  constexpr int64_t kItem = 4;
  const int64_t items = (units + kItem - 1) / kItem;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t ua = it * kItem, ue = std::min(units, ua + kItem);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, M - r0));
        const int nv = units_per_pass(mr);
        for (int64_t u = ua; u < ue;) {
          const int take = u + nv <= ue ? nv : 1;
          const PassFn fn = h.kind == kQ4 ? pick<kQ4>(mr, take) : pick<kQ8>(mr, take);
          fn(xp + r0 * K, K, xs + r0 * blocks, blocks, qp, blocks, bp, op + r0 * N, N, u);
          u += take;
        }
      }
    }
  });
  return out;
#endif
}

bool supported() {
#ifdef PDSERVE_QF32
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace qf32
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quant_linear_f32(Tensor x, Tensor quant, Tensor? bias=None) -> Tensor");
  m.def("pack_quant_f32(Tensor w32) -> Tensor");
  m.def("quant_f32_supported() -> bool", &pdserve::qf32::supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("quant_linear_f32", &pdserve::qf32::linear);
  m.impl("pack_quant_f32", &pdserve::qf32::pack);
}

// bf16 linear for a few rows (decode steps), registered as
// torch.ops.pdserve.small_linear (loader: engine/layers/linear_op.py).
//
//   x     [M, K]   bf16, contiguous, M small (a decode batch)
//   w     [N, K]   bf16, contiguous (nn.Linear's layout)
//   bias  [N]      bf16 or absent
//   out   [M, N]   bf16: x @ w.T + bias, accumulated in fp32 and rounded once
//
// Why: at batch 1 a decode step reads every weight once and does two flops per
// weight, so it is bound by memory bandwidth. oneDNN's bf16 path for M = 1 ran at
// about half the bandwidth a plain streaming read reaches on this CPU (the fp32
// GEMV of the same matrix was faster despite twice the bytes).
//
// Two paths, chosen per weight matrix (never per batch):
//  * AMX (when compiled in, K % 32 == 0, and the kernel grants AMX state): 16 W
//    rows are one A tile exactly as they lie in memory; x is packed once per call
//    into the VNNI B tile layout (16 columns of x rows, zero-padded); one
//    TDPBF16PS per 32 k. Rows past the last full 16 take the AVX-512 path.
//  * AVX512-BF16: vdpbf16ps dot products, eight W rows at a time (eight read
//    streams, prefetched on the first pass) applied to three x rows per pass (24
//    accumulators in registers), over slices of x rows that stay in L2. It also
//    runs prefill chunks on CPUs without AMX (one thread on AMD Zen 4: 0.8-0.95x
//    oneDNN at 64-512 rows, where the 4 x 4 version, its accumulators kept in
//    memory by GCC, ran at ~0.35x).
//
// Numerics: every product of two bf16 values is exact in fp32; each output's fp32
// sum runs over k in an order fixed by K and its row n alone (never by M, the
// batch position or the thread count), so a row's result does not depend on the
// batch it ran in. Rounded to bf16 once, after the bias.
//
// Without AVX512-BF16 at compile time the op reports itself unsupported
// (small_linear_supported() == false) and the loader uses torch's linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_gemm.h"
#include "amx_tiles.h"
#include "bf16_vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef _OPENMP
#error "compile with -fopenmp: without it at::parallel_for runs on one thread"
#endif

namespace pdserve {
namespace {

constexpr int64_t kRows = 8;  // W rows per block (independent read streams)
constexpr int64_t kXRows = 3;  // x rows per pass over a W block
constexpr int64_t kGrainBytes = 64 * 1024;  // W bytes per parallel work chunk, at least
constexpr int64_t kSliceBytes = 192 * 1024;  // x bytes per pass over a chunk's W blocks, at most
// Above this many x rows the AMX GEMM (csrc/amx_gemm.cpp: w packed per block, reused
// by every row) replaces the streaming path for matrices up to kGemmMaxWeights; both give
// every row the same bits. Same-process alternation (1 thread): the streaming path is
// faster up to 64-128 rows (packing costs a pass over w) and at any row count tried (33-256)
// for a 49,152 x 576 vocabulary head; the GEMM from 128-256 rows on for the layer shapes.
constexpr int64_t kGemmRows = 128;
constexpr int64_t kGemmMaxWeights = 8 << 20;

#if defined(__AVX512BF16__)

inline __m512bh load_bf16(const c10::BFloat16* p, int64_t k, int64_t K) {
  // 32 bf16 from p + k; lanes past K read as zero.
  if (k + 32 <= K) return (__m512bh)_mm512_loadu_si512(p + k);
  const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p + k);
}

// out[m][r] = dot(x[m], w[r]) for r < nr (<= kRows), m < nm (<= kXRows).
// NOTE: the full 32-wide steps and the masked tail are separate loops: with one loop and a
// load that branches per step, GCC kept the accumulators in memory (a store per product).
template <int NR, int NM, bool Tail, bool Prefetch>
inline void block_step(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, int64_t K, __m512 (&acc)[NM][NR]) {
  __m512bh xv[NM];
  for (int m = 0; m < NM; ++m)
    xv[m] = Tail ? load_bf16(x + m * K, k, K) : (__m512bh)_mm512_loadu_si512(x + m * K + k);
  for (int r = 0; r < NR; ++r) {
    // The block two blocks ahead, same offset: rows are adjacent, so that is
    // 2 * kRows * K elements further on (past the end only reads the next
    // allocation's address; a prefetch never faults).
    if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + 2 * kRows * K), _MM_HINT_T0);
    const __m512bh wv = Tail ? load_bf16(w + r * K, k, K) : (__m512bh)_mm512_loadu_si512(w + r * K + k);
    for (int m = 0; m < NM; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
  }
}

// The rounded outputs of one block: out[m * N + r] = bf16(sum[m][r] + bias[r]).
// A full block of kRows rows sums its 8 accumulators per x row in one vec::hsum8 and writes
// 8 outputs at once (with 24 scalar sums the epilogue cost about what 7 of a block's 18 k steps cost at
// K = 576, fitted from the K = 576 and K = 1536 rates).
template <int NR, int NM>
inline void finish(const __m512 (&acc)[NM][NR], const c10::BFloat16* bias, c10::BFloat16* out, int64_t N) {
  if constexpr (NR == 8) {
    for (int m = 0; m < NM; ++m) {
      vec::f32x16 rows[8];
      std::memcpy(rows, acc[m], sizeof rows);
      vec::f32x8 v = vec::hsum8(rows);
      if (bias) v += vec::load_bf16x8(bias);
      // rounded as c10::BFloat16(float) rounds (only a NaN's bits may differ: both NaN)
      vec::store_bf16x8(out + m * N, v);
    }
  } else {
    for (int m = 0; m < NM; ++m)
      for (int r = 0; r < NR; ++r) {
        float v = _mm512_reduce_add_ps(acc[m][r]);  // hsum's order
        if (bias) v += static_cast<float>(bias[r]);
        out[m * N + r] = c10::BFloat16(v);  // round to nearest even
      }
  }
}

// out[m][r] = dot(x[m], w[r]) + bias[r] for r < NR (<= kRows), m < NM (<= kXRows), rounded.
// Prefetch: the first pass over this W block (it comes from memory; later passes find it in L1).
template <int NR, int NM, bool Prefetch>
inline void block(const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, const c10::BFloat16* bias,
                  c10::BFloat16* out, int64_t N) {
  __m512 acc[NM][NR];
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t full = K / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) block_step<NR, NM, false, Prefetch>(w, x, k, K, acc);
  if (full < K) block_step<NR, NM, true, Prefetch>(w, x, full, K, acc);
  finish<NR, NM>(acc, bias, out, N);
}

// block<NR, NM, Prefetch> for run-time nr in [1, kRows], nm in [1, kXRows].
using BlockFn = void (*)(const c10::BFloat16*, const c10::BFloat16*, int64_t, const c10::BFloat16*, c10::BFloat16*,
                         int64_t);

template <int... NR>
struct BlockTable {
  template <int NM, bool Prefetch>
  static constexpr BlockFn pick(int nr) {
    BlockFn fns[] = {block<NR + 1, NM, Prefetch>...};
    return fns[nr - 1];
  }
};

template <bool Prefetch>
inline BlockFn block_fn(int nr, int nm) {
  using T = BlockTable<0, 1, 2, 3, 4, 5, 6, 7>;
  static_assert(kRows == 8 && kXRows == 3, "block_fn's table lists 8 x 3 instances");
  switch (nm) {
    case 1: return T::pick<1, Prefetch>(nr);
    case 2: return T::pick<2, Prefetch>(nr);
    default: return T::pick<3, Prefetch>(nr);
  }
}

// Rows [n0, N) of the output with AVX512-BF16 dot products.
void run_avx512(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K, int64_t n0) {
  const int64_t blocks = (N - n0 + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kRows * K * 2));
  // x rows per pass over a thread's W blocks: a slice that stays in L2 while each W block is
  // applied to it (with all of x per W block, x came from L3 at a few hundred rows).
  const int64_t slice = std::max<int64_t>(kXRows, kSliceBytes / (K * 2) / kXRows * kXRows);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += slice) {
      const int64_t m1 = std::min(M, m0 + slice);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = n0 + b * kRows;
        const int nr = (int)std::min<int64_t>(kRows, N - n);
        const c10::BFloat16* wb = w + n * K;
        for (int64_t m = m0; m < m1; m += kXRows) {
          const int nm = (int)std::min<int64_t>(kXRows, m1 - m);
          const BlockFn fn = m == m0 ? block_fn<true>(nr, nm) : block_fn<false>(nr, nm);
          fn(wb, x + m * K, K, bias ? bias + n : nullptr, out + m * N + n, N);
        }
      }
    }
  });
}


#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PDSERVE_AMX 1

// AMX: tiles of 16 rows x 64 bytes. C[n][m] += sum_k W[n][k] * x[m][k] is one
// TDPBF16PS per 32 k with A = 16 rows of W as they lie in memory and B = x
// packed once per call into the VNNI layout B[k/2][m][k%2] (16 columns of m,
// zero past M). Four C tiles cover 64 rows of W per pass over k.
constexpr int64_t kTileN = 16;  // W rows per A tile
constexpr int64_t kTileM = 16;  // x rows per B tile
constexpr int64_t kTilesN = 4;  // C tiles (W row blocks) per pass

using amx::load_tile_config;

// xp[kc][kp][m][j] = x[m0 + m][32 kc + 2 kp + j], zero for m >= M - m0.
void pack_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t m0, uint16_t* xp) {
  const int64_t mm = std::min<int64_t>(kTileM, M - m0);
  std::memset(xp, 0, sizeof(uint16_t) * K * kTileM);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  for (int64_t m = 0; m < mm; ++m)
    for (int64_t k = 0; k < K; ++k)
      xp[(k / 32) * 512 + ((k % 32) / 2) * 32 + m * 2 + (k % 2)] = xs[(m0 + m) * K + k];
}

template <int NT>
inline void amx_rows(const c10::BFloat16* w, const uint16_t* xp, int64_t K, float* c) {
  // c[t][16 n][16 m] for NT row blocks of W starting at w.
  if (NT > 0) _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (NT > 2) _tile_zero(2);
  if (NT > 3) _tile_zero(3);
  const int64_t stride = K * 2;
  for (int64_t kc = 0; kc < K / 32; ++kc) {
    _tile_loadd(5, xp + kc * 512, 64);
    const c10::BFloat16* a = w + kc * 32;
    _tile_loadd(4, a, stride);
    _tile_dpbf16ps(0, 4, 5);
    if (NT > 1) { _tile_loadd(4, a + kTileN * K, stride); _tile_dpbf16ps(1, 4, 5); }
    if (NT > 2) { _tile_loadd(4, a + 2 * kTileN * K, stride); _tile_dpbf16ps(2, 4, 5); }
    if (NT > 3) { _tile_loadd(4, a + 3 * kTileN * K, stride); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, c, 64);
  if (NT > 1) _tile_stored(1, c + 256, 64);
  if (NT > 2) _tile_stored(2, c + 512, 64);
  if (NT > 3) _tile_stored(3, c + 768, 64);
}

// Rows [0, N / 16 * 16) of the output with AMX; returns the first row left over.
int64_t run_amx(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = N / kTileN;
  if (K % 32 || nblocks == 0 || !amx::permitted()) return 0;
  const int64_t groups = (M + kTileM - 1) / kTileM;
  std::vector<uint16_t> xp(static_cast<size_t>(groups * K * kTileM));
  for (int64_t g = 0; g < groups; ++g) pack_x(x, M, K, g * kTileM, xp.data() + g * K * kTileM);
  const int64_t passes = (nblocks + kTilesN - 1) / kTilesN;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kTilesN * kTileN * K * 2));
  const __m512i kColumn = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kTileM));
  at::parallel_for(0, passes, grain, [&](int64_t p0, int64_t p1) {
    load_tile_config();
    alignas(64) float c[kTilesN * kTileN * kTileM];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = p * kTilesN;
      const int nt = (int)std::min<int64_t>(kTilesN, nblocks - nb);
      const c10::BFloat16* wb = w + nb * kTileN * K;
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* xg = xp.data() + g * K * kTileM;
        switch (nt) {
          case 1: amx_rows<1>(wb, xg, K, c); break;
          case 2: amx_rows<2>(wb, xg, K, c); break;
          case 3: amx_rows<3>(wb, xg, K, c); break;
          default: amx_rows<4>(wb, xg, K, c); break;
        }
        // c[t][n][m] -> out[m][16 n]: one gather down a column of each C tile per x row
        // (the scalar transpose was ~25% of a 16-row step). Rounds to nearest even, as
        // c10::BFloat16 does.
        const int64_t mm = std::min<int64_t>(kTileM, M - g * kTileM);
        for (int t = 0; t < nt; ++t) {
          const int64_t n0 = (nb + t) * kTileN;
          const __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0))), 16))
                                 : _mm512_setzero_ps();
          for (int64_t m = 0; m < mm; ++m) {
            const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(kColumn, c + t * 256 + m, 4), bv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * kTileM + m) * N + n0),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
    }
    _tile_release();
  });
  return nblocks * kTileN;
}
#endif  // AMX

#endif  // __AVX512BF16__

}  // namespace

bool small_linear_amx() {
#if defined(PDSERVE_AMX)
  return amx::permitted();
#else
  return false;
#endif
}

bool small_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(small_linear_supported(), "small_linear: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear: x and w must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "small_linear: x has ", K, " columns, w has ", w.size(1));
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(),
                "small_linear: bias must be a contiguous bfloat16 [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  if (M && N && K) {
    const auto* xd = x.data_ptr<c10::BFloat16>();
    const auto* wd = w.data_ptr<c10::BFloat16>();
    auto* od = out.data_ptr<c10::BFloat16>();
    int64_t n0 = 0;
#if defined(PDSERVE_AMX)
    if (M > kGemmRows && N * K <= kGemmMaxWeights && amx_gemm(xd, wd, b, od, M, N, K))
      n0 = N / 16 * 16;
    else
      n0 = run_amx(xd, wd, b, od, M, N, K);
#endif
    if (n0 < N) run_avx512(xd, wd, b, od, M, N, K, n0);
  } else if (M && N) {
    out.zero_();
    if (b) out.add_(*bias);
  }
#endif
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_supported() -> bool", &pdserve::small_linear_supported);
  m.def("small_linear_amx() -> bool", &pdserve::small_linear_amx);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("small_linear", &pdserve::small_linear_cpu);
}

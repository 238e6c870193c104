// bf16 linear for decode steps and prefill chunks, registered as
// torch.ops.pdserve.small_linear and pack_linear_weight (loader: engine/layers/linear.py).
//
//   x     [M, K]   bf16, contiguous (a decode batch, a prefill chunk)
//   w     [N, K]   bf16, contiguous (nn.Linear's layout)
//   bias  [N]      bf16 or absent
//   packed          pack_linear_weight(w), or absent
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
//  * AVX512-BF16 on w packed once per weight (pack_linear_weight; the Linear layer keeps
//    the copy): panels of 64 output columns with k in pairs, wp[p][q][c][j] =
//    w[64 p + c][2 q + j]. Per k pair, x's pair is broadcast against four zmm of the
//    panel (vdpbf16ps), 6 x rows x 4 zmm (24 accumulators) per block, 1-3 rows over
//    2-4 panels at once; no horizontal sums, one sequential read stream per panel.
//    x in slices that stay in L2; threads split the panels (and the slices, for few
//    panels). It also runs prefill chunks on CPUs without AMX.
//    One thread on AMD Zen 4, SmolLM2's 30 layers: ~220 GFLOP/s from 16 rows on
//    (1.1-1.6x oneDNN at 16-1024 rows; 1.3-1.4x the dot-product kernel it
//    replaced, which paid a horizontal sum per output); 1-row decode with the
//    weights from memory 17.5 -> 8.7 ms (the 8-row-stream dot products read slower).
//    Called without the packed copy, the op packs one itself (a pass over w).
//  * small_linear_gated: a gated MLP's gate|up projection with the activation in the
//    epilogue (pack_gated_linear_weight interleaves gate and up rows in blocks of 32, so a
//    64-column panel holds the gate and up sums of 32 outputs): out [M, I] = act(gate) * up
//    with small_linear + act_and_mul's roundings, without writing and re-reading [M, 2 I]
//    (542-row SmolLM2 prefill, 2 threads: 5.07 -> 4.63 ms a layer; 4-row decode 51 -> 41 us).
//
// Numerics: every product of two bf16 values is exact in fp32; each output's fp32
// sum runs over k in an order fixed by K and its row n alone (never by M, the
// batch position or the thread count), so a row's result does not depend on the
// batch it ran in. Rounded to bf16 once, after the bias. AVX-512: one fp32 lane
// per output, the k pairs in order (vdpbf16ps adds a pair's two products).
//
// Without AVX512-BF16 at compile time the op reports itself unsupported
// (small_linear_supported() == false) and the loader uses torch's linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "act_vec.h"
#include "amx_gemm.h"
#include "amx_tiles.h"
#include "bf16_vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef _OPENMP
#error "compile with -fopenmp: without it at::parallel_for runs on one thread"
#endif

namespace pdserve {
namespace {

constexpr int64_t kPanel = 64;  // output columns per packed panel (four zmm of 16 fp32)
constexpr int kPanelVecs = 4;
constexpr int kMaxMR = 6;  // x rows per block (6 x 4 zmm = 24 accumulators)
constexpr int kGroup = 4;  // panels per group: each row block of an x slice runs over a group in turn
constexpr int64_t kGrainBytes = 64 * 1024;  // packed W bytes per parallel work chunk, at least
constexpr int64_t kSliceBytes = 192 * 1024;  // x bytes per pass over a chunk's panels, at most
constexpr int64_t kFewPanels = 8;  // panels per thread below which threads split x's rows too
// Above this many x rows the AMX GEMM (csrc/amx_gemm.cpp: w packed per block, reused
// by every row) replaces the streaming path for matrices up to kGemmMaxWeights; both give
// every row the same bits. Same-process alternation (1 thread): the streaming path is
// faster up to 64-128 rows (packing costs a pass over w) and at any row count tried (33-256)
// for a 49,152 x 576 vocabulary head; the GEMM from 128-256 rows on for the layer shapes.
constexpr int64_t kGemmRows = 128;
constexpr int64_t kGemmMaxWeights = 8 << 20;

#if defined(__AVX512BF16__)

// out[m][col + c] for m < MR and the NP panels' columns c (cut to [c0, c1)):
//   sum over pairs q = 0, 1, ..., K2 - 1 of x[m][2q] w[col + c][2q] + x[m][2q + 1] w[col + c][2q + 1]
// in one fp32 lane per output (vdpbf16ps: x's pair broadcast against a panel row of 16
// columns x 2), plus the bias, rounded once. wp: the first panel; later ones pstride further.
// Epilogues: what a block does with its fp32 sums.
enum Epi : int {
  kPlain = 0,     // out[m][col + c] = round(sum + bias)
  kGatedSilu = 1,  // gated (pack_gated): a panel's first 32 columns are gate, the last 32 up;
  kGatedGelu = 2,  //   out[m][col / 2 + j] = round(round(act(round(gate_j))) * round(up_j))
};

template <int MR, int NP, int E>
void packed_block(const uint16_t* x, int64_t ldx, const c10::BFloat16* wp, int64_t pstride, int64_t K2,
                  const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, int64_t col, int64_t c0, int64_t c1) {
  constexpr int NV = NP * kPanelVecs;
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < K2; ++q) {
    __m512bh wv[NV];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kPanelVecs; ++v)
        wv[p * kPanelVecs + v] = (__m512bh)_mm512_loadu_si512(wp + p * pstride + q * 2 * kPanel + v * 32);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * q, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xb);
    }
  }
  if constexpr (E != kPlain) {
    // Whole panels only (N a multiple of 64, no bias): gate and up of output columns
    // col / 2 + 16 j, rounded to bf16 as the plain epilogue stores them, then the activation
    // as act_and_mul computes it (act_vec.h): the bits of small_linear + act_and_mul.
    (void)bias, (void)c0, (void)c1;
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < 2; ++j) {
        const int gv = p * kPanelVecs + j, uv = gv + 2;
        c10::BFloat16* dst = out + (col + p * kPanel) / 2 + j * 16;
        for (int m = 0; m < MR; ++m) {
          const vec::f32x16 g = vec::round_bf16((vec::f32x16)acc[m][gv]), u = vec::round_bf16((vec::f32x16)acc[m][uv]);
          vec::store_bf16(dst + m * ldo, act::gated16<E == kGatedGelu>(g, u));
        }
      }
    return;
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col + v * 16;
    const int64_t lo = std::max(c0, c) - c, hi = std::min(c1, c + 16) - c;
    if (lo >= hi) continue;
    const __mmask16 mask = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
    __m512 b = _mm512_setzero_ps();
    if (bias)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c)), 16));
    for (int m = 0; m < MR; ++m) {
      const __m512 s = bias ? _mm512_add_ps(acc[m][v], b) : acc[m][v];
      // rounded to nearest even, as c10::BFloat16(float) rounds (only a NaN's bits may differ)
      _mm256_mask_storeu_epi16(out + m * ldo + c, mask, (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

using PackedFn = void (*)(const uint16_t*, int64_t, const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*,
                          c10::BFloat16*, int64_t, int64_t, int64_t, int64_t);

// Panels per block for a block of mr rows: 16-24 accumulators (fewer rows, more read streams).
constexpr int panels_for(int mr) { return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1; }

template <int MR, int E>
PackedFn pick(int np) {
  if constexpr (panels_for(MR) == 1) return packed_block<MR, 1, E>;
  else return np == panels_for(MR) ? packed_block<MR, panels_for(MR), E> : packed_block<MR, 1, E>;
}

template <int E>
PackedFn pick_rows(int mr, int np) {
  static_assert(kMaxMR == 6, "packed_fn lists 6 row counts");
  switch (mr) {
    case 1: return pick<1, E>(np);
    case 2: return pick<2, E>(np);
    case 3: return pick<3, E>(np);
    case 4: return pick<4, E>(np);
    case 5: return pick<5, E>(np);
    default: return pick<6, E>(np);
  }
}

// packed_block<mr, np, epi> for np == panels_for(mr) or 1.
PackedFn packed_fn(int mr, int np, int epi) {
  return epi == kGatedSilu ? pick_rows<kGatedSilu>(mr, np)
         : epi == kGatedGelu ? pick_rows<kGatedGelu>(mr, np)
                             : pick_rows<kPlain>(mr, np);
}

// f(u) for u in [0, units) on the pool's threads, each taking the next unit from a shared
// counter as it finishes one: a thread the OS or the hypervisor takes away for a while leaves
// its share to the others instead of holding them at the join (a static split makes every
// thread wait for the slowest). Units are claimed in order, so neighbours still share caches.
// An output's bits do not depend on which thread computes it.
template <class F>
void dynamic_for(int64_t units, F&& f) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), units);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t u = 0; u < units; ++u) f(u);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) f(u);
  });
}

// Columns [n0, N) of out; wp packs exactly those (panel p: columns n0 + 64 p ...). With a gated
// epilogue (n0 = 0, N % 64 == 0, wp = pack_gated(w)), out is [M, N / 2].
void run_packed(const c10::BFloat16* x, const c10::BFloat16* wp, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K, int64_t n0, int epi = kPlain) {
  const int64_t ldo = epi == kPlain ? N : N / 2;
  const int64_t K2 = (K + 1) / 2;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  int64_t ldx = K;
  std::vector<uint16_t> xpad;
  if (K % 2) {  // odd K: rows padded with a zero, so a row's last pair does not read the next row
    ldx = K + 1;
    xpad.assign(static_cast<size_t>(M * ldx), 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * ldx, xs + m * K, K * sizeof(uint16_t));
    xs = xpad.data();
  }
  const int64_t pstride = K2 * 2 * kPanel;  // elements per panel
  const int64_t panels = (N - n0 + kPanel - 1) / kPanel;
  // x rows [m0, m0 + rows) over panels [pb, pe): groups of kGroup panels, each applied to the
  // rows' blocks (of near-equal size, kMaxMR at most) in turn.
  auto rows_over_panels = [&](int64_t m0, int64_t rows, int64_t pb, int64_t pe) {
    const int64_t blocks = (rows + kMaxMR - 1) / kMaxMR;
    for (int64_t g = pb; g < pe; g += kGroup) {
      const int64_t ge = std::min(pe, g + kGroup);
      for (int64_t bi = 0, m = m0; bi < blocks; ++bi) {
        const int mr = (int)(rows * (bi + 1) / blocks - (m - m0));
        for (int64_t p = g; p < ge;) {
          const int np = p + panels_for(mr) <= ge ? panels_for(mr) : 1;
          packed_fn(mr, np, epi)(xs + m * ldx, ldx, wp + p * pstride, pstride, K2, bias, out + m * ldo, ldo,
                                 n0 + p * kPanel, n0, N);
          p += np;
        }
        m += mr;
      }
    }
  };
  // x in slices of near-equal size that stay in L2 (at most kSliceBytes), each applied to the
  // panels in turn (the panels stream from L3 once per slice). With few panels per thread
  // (9 for N = 576) the work units are (panel, slice) pairs instead, panel-major (consecutive
  // units reuse a panel from L2), so threads split the rows too; with many, that order reads x
  // from L3 once per panel, which cost more.
  const int64_t max_rows = std::max<int64_t>(kMaxMR, kSliceBytes / (ldx * 2));
  const int64_t slices = (M + max_rows - 1) / max_rows;
  auto slice_rows = [&](int64_t sl) { return std::make_pair(M * sl / slices, M * (sl + 1) / slices - M * sl / slices); };
  // Both orders run through dynamic_for: a thread that is descheduled mid-call leaves its units
  // to the other (a 542-row SmolLM2 prefill on 2 threads: 5 ms faster quiet, 12 ms faster
  // next to a process taking 2 ms of every 20, paired in-process A/B; decode rows unchanged).
  if (slices > 1 && panels < kFewPanels * at::get_num_threads()) {
    dynamic_for(panels * slices, [&](int64_t u) {
      const auto [m0, rows] = slice_rows(u % slices);
      rows_over_panels(m0, rows, u / slices, u / slices + 1);
    });
    return;
  }
  // Slice-major: a slice of x stays in L2 while chunks of kGroup panels (at least kGrainBytes
  // of W) go by.
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (pstride * 2));
  const int64_t chunk = std::max<int64_t>(grain, kGroup), chunks = (panels + chunk - 1) / chunk;
  dynamic_for(slices * chunks, [&](int64_t u) {
    const auto [m0, rows] = slice_rows(u / chunks);
    const int64_t pb = (u % chunks) * chunk;
    rows_over_panels(m0, rows, pb, std::min(panels, pb + chunk));
  });
}

// w's columns [n0, N) packed as run_packed reads them: wp[p][q][c][j] = w[n0 + 64 p + c][2 q + j],
// zero past N and K.
at::Tensor pack(const at::Tensor& w, int64_t n0) {
  const int64_t N = w.size(0), K = w.size(1), K2 = (K + 1) / 2, P = (N - n0 + kPanel - 1) / kPanel;
  at::Tensor wp = at::zeros({P, K2, kPanel, 2}, w.options());
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(wp.data_ptr<c10::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && n0 + p * kPanel + c < N; ++c) {
        const uint16_t* row = ws + (n0 + p * kPanel + c) * K;
        uint16_t* dst = d + p * K2 * 2 * kPanel + c * 2;
        for (int64_t k = 0; k < K; ++k) dst[(k / 2) * 2 * kPanel + (k % 2)] = row[k];
      }
  });
  return wp;
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

// The first output column the AVX-512 path computes (and pack_linear_weight packs): past the
// last full 16 where the AMX paths run this shape (K % 32 == 0, N >= 16, AMX granted), else 0.
int64_t avx_first_column(int64_t N, int64_t K) {
#if defined(PDSERVE_AMX)
  if (K % 32 == 0 && N >= 16 && amx::permitted()) return N / 16 * 16;
#endif
  (void)K;
  (void)N;
  return 0;
}

void check_weight(const at::Tensor& w, const char* who) {
  TORCH_CHECK(small_linear_supported(), who, ": built without AVX512-BF16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), who,
              ": w must be a contiguous bfloat16 [N, K]");
}

at::Tensor pack_linear_weight_cpu(const at::Tensor& w) {
  check_weight(w, "pack_linear_weight");
#if defined(__AVX512BF16__)
  return pack(w, avx_first_column(w.size(0), w.size(1)));
#else
  return at::Tensor();
#endif
}

// The gate|up projection of a gated MLP with its activation in the epilogue (Epi): w [2 I, K] is
// gate rows then up rows (GatedMLP's fused gate_up_proj). Only where the AVX-512 path runs the
// whole matrix (no AMX for this shape) and I % 32 == 0, so every panel is whole.
bool gated_supported(int64_t N, int64_t K) {
  return small_linear_supported() && N > 0 && K > 0 && N % (2 * 32) == 0 && avx_first_column(N, K) == 0;
}

// pack of w's rows permuted so that panel p holds gate rows 32 p .. 32 p + 31, then up rows
// I + 32 p .. I + 32 p + 31: a block's four vectors are the gate and up sums of 32 outputs.
at::Tensor pack_gated_linear_weight_cpu(const at::Tensor& w) {
  check_weight(w, "pack_gated_linear_weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(gated_supported(N, K), "pack_gated_linear_weight: unsupported here for [", N, ", ", K,
              "] (needs AVX512-BF16 without AMX for this shape, and rows a multiple of 64)");
#if defined(__AVX512BF16__)
  return pack(w.view({2, N / 64, 32, K}).transpose(0, 1).reshape({N, K}).contiguous(), 0);
#else
  return at::Tensor();
#endif
}

at::Tensor small_linear_gated_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t K, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == K,
              "small_linear_gated: x must be a contiguous bfloat16 [M, K] with K = ", K);
  const int64_t M = x.size(0), K2 = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(1) == K2 && packed.size(2) == kPanel && packed.size(3) == 2,
              "small_linear_gated: packed must be pack_gated_linear_weight(w) of a w with ", K, " columns");
  const int64_t N = packed.size(0) * kPanel;
  TORCH_CHECK(gated_supported(N, K), "small_linear_gated: unsupported here");
  at::Tensor out = at::empty({M, N / 2}, x.options());
#if defined(__AVX512BF16__)
  if (M)
    run_packed(x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), nullptr, out.data_ptr<c10::BFloat16>(),
               M, N, K, 0, gelu ? kGatedGelu : kGatedSilu);
#endif
  return out;
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& packed) {
  check_weight(w, "small_linear");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "small_linear: x must be a contiguous bfloat16 [M, K]");
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
  const int64_t n0 = avx_first_column(N, K);
  at::Tensor wp;
  if (packed.has_value() && packed->defined()) {
    wp = *packed;
    const int64_t P = (N - n0 + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
    TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.dim() == 4 && wp.size(0) == P &&
                    wp.size(1) == K2 && wp.size(2) == kPanel && wp.size(3) == 2,
                "small_linear: packed must be pack_linear_weight(w) for this w");
  }
  if (M && N && K) {
    const auto* xd = x.data_ptr<c10::BFloat16>();
    const auto* wd = w.data_ptr<c10::BFloat16>();
    auto* od = out.data_ptr<c10::BFloat16>();
#if defined(PDSERVE_AMX)
    if (n0) {
      if (!(M > kGemmRows && N * K <= kGemmMaxWeights && amx_gemm(xd, wd, b, od, M, N, K)))
        TORCH_CHECK(run_amx(xd, wd, b, od, M, N, K) == n0, "small_linear: AMX path covered fewer columns");
    }
#endif
    if (n0 < N) {
      if (!wp.defined()) wp = pack(w, n0);  // a call without the layer's packed copy: packed here
      run_packed(xd, wp.data_ptr<c10::BFloat16>(), b, od, M, N, K, n0);
    }
  } else if (M && N) {
    out.zero_();
    if (b) out.add_(*bias);
  }
#endif
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("small_linear_supported() -> bool", &pdserve::small_linear_supported);
  m.def("small_linear_amx() -> bool", &pdserve::small_linear_amx);
  m.def("pack_gated_linear_weight(Tensor w) -> Tensor");
  m.def("small_linear_gated(Tensor x, Tensor packed, int k, bool gelu) -> Tensor");
  m.def("small_linear_gated_supported(int n, int k) -> bool", &pdserve::gated_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("small_linear", &pdserve::small_linear_cpu);
  m.impl("pack_linear_weight", &pdserve::pack_linear_weight_cpu);
  m.impl("pack_gated_linear_weight", &pdserve::pack_gated_linear_weight_cpu);
  m.impl("small_linear_gated", &pdserve::small_linear_gated_cpu);
}

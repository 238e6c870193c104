// small_linear's AVX512-BF16 path (declared in include/packed_linear.h; the op, its checks
// and the AMX paths are csrc/linear/small_linear.cpp): w packed once per weight (the Linear layer keeps
// the copy) in panels of 64 output columns with k in pairs, wp[p][q][c][j] = w[64 p + c][2 q + j].
// Per k pair, x's pair is broadcast against four zmm of the panel (vdpbf16ps), 6 x rows x 4 zmm
// (24 accumulators) per block, 1-3 rows over 2-4 panels at once; no horizontal sums, one
// sequential read stream per panel. x in slices that stay in L2; the work units (panel x slice,
// or slice x chunk of panels) are taken from a shared counter by torch's threads.
// Numerics: one fp32 lane per output, the k pairs in order (vdpbf16ps adds a pair's two exact
// products), bias added once, one rounding to bf16; nothing depends on M, the row's position or
// the thread count.
#include "packed_linear.h"

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "act_vec.h"
#include "bf16_vec.h"
#include "dynamic_for.h"

namespace pdserve {
namespace linear {
namespace {

constexpr int kPanelVecs = 4;
constexpr int kMaxMR = 6;  // x rows per block (6 x 4 zmm = 24 accumulators)
constexpr int kGroup = 4;  // panels per group: each row block of an x slice runs over a group in turn
constexpr int64_t kGrainBytes = 64 * 1024;  // packed W bytes per parallel work chunk, at least
constexpr int64_t kSliceBytes = 192 * 1024;  // x bytes per pass over a chunk's panels, at most
constexpr int64_t kFewPanels = 8;  // panels per thread below which threads split x's rows too

// out[m][col + c] for m < MR and the NP panels' columns c (cut to [c0, c1)):
//   sum over pairs q = 0, 1, ..., K2 - 1 of x[m][2q] w[col + c][2q] + x[m][2q + 1] w[col + c][2q + 1]
// in one fp32 lane per output (vdpbf16ps: x's pair broadcast against a panel row of 16
// columns x 2), plus the bias, rounded once. wp: the first panel; later ones pstride further.

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
          act::store_gated16<E == kGatedGelu>(dst + m * ldo, g, u);
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

}  // namespace

// Columns [n0, N) of out; wp packs exactly those (panel p: columns n0 + 64 p ...). With a gated
// epilogue (n0 = 0, N % 64 == 0, wp = pack_gated(w)), out is [M, N / 2].
void run_packed(const c10::BFloat16* x, const c10::BFloat16* wp, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K, int64_t n0, int epi) {
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

}  // namespace linear
}  // namespace pdserve

#endif  // __AVX512BF16__

// bf16 GEMM for many rows (prefill chunks) on the AMX tile unit, called by
// small_linear (csrc/linear/small_linear.cpp) when M is large:
//
//   out[m][n] = bf16(sum_k x[m][k] * w[n][k] + bias[n])     (w in nn.Linear's [N, K] layout)
//
// Tiles: A = 16 rows of x as they lie in memory (row stride K), B = 16 rows of w
// repacked into the VNNI layout B[kp][n][j] = w[n][32 kc + 2 kp + j] (a 16 x 16
// transpose of 32-bit pairs), C[m][n] = out rows directly (no transpose on the way
// out). Each thread owns blocks of 32 w rows and packs each once per call into its own
// buffer; x is taken in spans of rows that fit L2, and k in slices whose w block stays in L1
// while the span's 32-row blocks of x stream past it, 2 x 2 tiles, one TDPBF16PS per 32 k per
// C tile (partial sums kept in fp32 between slices). K up to 576 is one slice (a 36 KB w block)
// and longer K goes in 256-wide ones (16 KB): each slice costs a store and a reload of the C
// tiles, and x's tiles are loaded with the streaming hint (TILELOADDT1), so that the rows
// passing through do not evict the w block. Measured on the AMX Xeon (30 layers of SmolLM2's
// 530-row GEMMs, 2 threads, medians of 3): 53.1-57.8 -> 47.5-49.8 ms, the K = 576 ones ~15%
// faster (256-wide slices and plain loads before; either change alone did not gain).
//
// A weight the model keeps can be packed once at load instead (amx_gemm_pack: the same
// blocks, all of them, in one buffer), which saves a pass over w per call. The gated form
// (a gated MLP's gate|up weight [2 I, K]) pairs gate rows 16 b.. with up rows I + 16 b.. in
// block b, so a block's two C tiles are the gate and up sums of the same 16 outputs, and the
// epilogue writes act(gate) * up (act_vec.h) instead of [M, 2 I] for act_and_mul to re-read.
// A row block's epilogue runs a few rows at a time between the next row block's tile products
// (Pending), so the vector units work while the tile unit does: the gated epilogue costs about
// as much as its tile products (a 530 x 3072 x 576 gated GEMM on one thread: 1.59 -> 1.42 ms).
//
// Numerics are small_linear's exactly: C[m][n] accumulates in fp32, one TDPBF16PS
// per 32 k in increasing k, products of the same pairs in the same order (the
// instruction is symmetric in its two sources), bias added once, one rounding to
// bf16 (RNE). So a row's output does not depend on M, on its position, or on the
// thread count, and equals what small_linear's decode path gives it. The gated epilogue
// rounds gate and up as that store does and then computes act_and_mul's roundings (act_vec.h),
// so it gives small_linear followed by act_and_mul bit for bit.
#include "amx_gemm.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "act_vec.h"
#include "amx_tiles.h"
#include "bf16_vec.h"
#include "transpose16.h"

namespace pdserve {
namespace {

constexpr int64_t kBlockN = 32;  // w rows per packed block (2 B tiles)
constexpr int64_t kBlockM = 32;  // x rows per pass (2 A tiles)
constexpr int64_t kSliceKc = 8;  // 32-k steps per k slice (256 k) where K > 32 kFullKc
constexpr int64_t kFullKc = 18;  // up to this many 32-k steps (K <= 576) in one slice
constexpr int64_t kSpanBytes = 768 * 1024;  // x bytes per span (L2 is 2 MB a core here)

// wp[kc * step + 16 kp + n] (32-bit pairs) = w32[n][16 kc + kp] for the 16 rows of w at w.
void pack_w16(const c10::BFloat16* w, int64_t K, uint32_t* wp, int64_t step) {
  const int64_t kcs = K / 32;
  for (int64_t kc = 0; kc < kcs; ++kc) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(w + n * K + kc * 32);
    transpose16(r);
    for (int kp = 0; kp < 16; ++kp) _mm512_storeu_si512(wp + kc * step + kp * 16, r[kp]);
  }
}

// C tiles 0..3 = x rows [m, m + 32) x w rows [n, n + 32) over k in [32 kc0, 32 kc1);
// A tiles 4, 5; B tiles 6, 7. The partial sums start at zero (first) or from c, where
// they are stored again (fp32, exact), so splitting k keeps the order of the sum.
template <int NB, int MB, class Pend>
inline void tiles(const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t K, const uint32_t* wp, int64_t kc0,
                  int64_t kc1, float* c, bool first, Pend& pend) {
  constexpr int64_t ldc = kBlockN * 4;
  if (first) {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MB > 1) _tile_zero(2);
    if (NB > 1 && MB > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, c, ldc);
    if (NB > 1) _tile_loadd(1, c + 16, ldc);
    if (MB > 1) _tile_loadd(2, c + 512, ldc);
    if (NB > 1 && MB > 1) _tile_loadd(3, c + 512 + 16, ldc);
  }
  const int64_t stride = K * 2;
  for (int64_t kc = kc0; kc < kc1; ++kc) {
    const uint32_t* b = wp + kc * 256 * NB;
    _tile_loadd(6, b, 64);
    _tile_stream_loadd(4, x0 + kc * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) { _tile_loadd(7, b + 256, 64); _tile_dpbf16ps(1, 4, 7); }
    if (MB > 1) {
      _tile_stream_loadd(5, x1 + kc * 32, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    pend.step(kc1 - kc);
  }
  _tile_stored(0, c, ldc);
  if (NB > 1) _tile_stored(1, c + 16, ldc);
  if (MB > 1) _tile_stored(2, c + 512, ldc);
  if (NB > 1 && MB > 1) _tile_stored(3, c + 512 + 16, ldc);
}

template <int NB, class Pend>
inline void tiles_m(int mb, const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t K, const uint32_t* wp,
                    int64_t kc0, int64_t kc1, float* c, bool first, Pend& pend) {
  if (mb == 2) tiles<NB, 2>(x0, x1, K, wp, kc0, kc1, c, first, pend);
  else tiles<NB, 1>(x0, x1, K, wp, kc0, kc1, c, first, pend);
}

// Block blk of the GEMM's copy of w (see amx_gemm_pack) into wp.
void pack_block(const c10::BFloat16* w, int64_t N, int64_t K, int64_t blk, bool gated, uint32_t* wp) {
  // [kc][tile][16 kp][16 n] so a kc step reads a block's B tiles adjacently.
  if (gated) {
    pack_w16(w + blk * 16 * K, K, wp, 2 * 256);
    pack_w16(w + (N / 2 + blk * 16) * K, K, wp + 256, 2 * 256);
    return;
  }
  const int64_t n0 = blk * kBlockN;
  const int nb = (int)std::min<int64_t>(2, (N / 16 * 16 - n0) / 16);
  for (int t = 0; t < nb; ++t) pack_w16(w + (n0 + t * 16) * K, K, wp + t * 256, nb * 256);
}

// out rows [m0, m1) x the block's columns from the fp32 sums c (rows from m0, kBlockN apart):
// plus bias, one rounding (plain); or gate and up rounded as that store rounds them, then
// act_and_mul's two roundings (gated: c's first 16 columns are gate, the next 16 up).
template <int Epi>
inline void store_rows(const float* c, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, int64_t m0,
                       int64_t m1, int nb) {
  if constexpr (Epi == kGemmPlain) {
    __m512 bv[2];
    for (int t = 0; t < nb; ++t)
      bv[t] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                         _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + t * 16))), 16))
                   : _mm512_setzero_ps();
    for (int64_t m = m0; m < m1; ++m)
      for (int t = 0; t < nb; ++t) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + (m - m0) * kBlockN + t * 16), bv[t]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + t * 16), (__m256i)_mm512_cvtneps_pbh(v));
      }
  } else {
    (void)bias, (void)nb;
    const vec::f32x16 zero{};  // + 0 as the plain store adds a missing bias (-0 becomes +0)
    for (int64_t m = m0; m < m1; ++m) {
      vec::f32x16 g, u;
      std::memcpy(&g, c + (m - m0) * kBlockN, sizeof g);
      std::memcpy(&u, c + (m - m0) * kBlockN + 16, sizeof u);
      g = vec::round_bf16(g + zero);
      u = vec::round_bf16(u + zero);
      act::store_gated16<Epi == kGemmGatedGelu>(out + m * ldo, g, u);
    }
  }
}

// A row block's outputs waiting to be stored from its sums (store_rows), a few rows after each k
// step of the next row block's tile products: the vector work then runs beside the tile unit's
// instead of after it (the gated epilogue costs about as much as its tile products).
template <int Epi>
struct Pending {
  const float* c = nullptr;  // sums of rows [m, m1) (kBlockN floats a row from row m0's)
  const c10::BFloat16* bias = nullptr;
  c10::BFloat16* out = nullptr;
  int64_t ldo = 0, m0 = 0, m = 0, m1 = 0;
  int nb = 0;
  // Stores ceil(left / steps) rows: called with the k steps left in the running tile loop.
  inline void step(int64_t steps) {
    if (m >= m1) return;
    const int64_t to = std::min<int64_t>(m1, m + (m1 - m + steps - 1) / steps);
    store_rows<Epi>(c + (m - m0) * kBlockN, bias, out, ldo, m, to, nb);
    m = to;
  }
  inline void finish() { step(1); }
};

template <int Epi>
void gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
          int64_t M, int64_t N, int64_t K, const uint32_t* prepacked) {
  // Plain: blocks of 32 w rows over the columns [0, N / 16 * 16), the last one 16 rows if N / 16
  // is odd. Gated: N = 2 I, block b = gate rows 16 b.. and up rows I + 16 b.. (2 tiles, 16 outputs).
  const bool gated = Epi != kGemmPlain;
  const int64_t cols = gated ? N / 2 : N / 16 * 16;  // output columns computed
  const int64_t ldo = gated ? N / 2 : N;
  const int64_t step_cols = gated ? 16 : kBlockN;  // output columns per block
  const int64_t kcs = K / 32;
  const int64_t slice_kc = kcs <= kFullKc ? kcs : kSliceKc;
  const int64_t nblocks = (cols + step_cols - 1) / step_cols;
  const int64_t block_words = kBlockN * K / 2;
  // x rows past the last full 16 are copied into a zero-padded tail so tile loads
  // never read past x.
  const int64_t mfull = M / 16 * 16;
  std::vector<c10::BFloat16> tail(M > mfull ? 16 * K : 0);
  if (M > mfull) {
    std::memset(tail.data(), 0, tail.size() * sizeof(c10::BFloat16));
    std::memcpy(tail.data(), x + mfull * K, (M - mfull) * K * sizeof(c10::BFloat16));
  }
  // x is read in spans of rows that fit in L2 with room to spare (at least one 32-row
  // block), of even sizes: 530 rows of K = 1536 go as 192 + 192 + 146, not 256 + 256 + 18 (a
  // last span of a few rows streams every w block again for little work; SmolLM2's down
  // projection, 30 layers on one thread: 22.3 -> 20.5 ms; on two, no change measured). Without a
  // packed copy a thread packs its w blocks during the first span and keeps them.
  const int64_t span_max = std::max<int64_t>(kBlockM, (kSpanBytes / (K * 2)) / kBlockM * kBlockM);
  const int64_t nspans = (M + span_max - 1) / span_max;
  const int64_t span = ((M + nspans - 1) / nspans + kBlockM - 1) / kBlockM * kBlockM;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    amx::load_tile_config();
    uint32_t* packed = nullptr;
    thread_local std::vector<uint32_t> wbuf;
    if (!prepacked) {
      wbuf.resize(static_cast<size_t>((b1 - b0) * block_words + 16));
      packed = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t(63));
    }
    thread_local std::vector<float> cbuf;
    cbuf.resize(static_cast<size_t>((span + kBlockM) * kBlockN + 16));
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf.data()) + 63) & ~uintptr_t(63));
    const char* pf_end = reinterpret_cast<const char*>(prepacked ? prepacked + b1 * block_words  // this thread's w
                                                                   : packed + (b1 - b0) * block_words);
    Pending<Epi> pend;
    for (int64_t s0 = 0; s0 < M; s0 += span) {
      const int64_t s1 = std::min<int64_t>(M, s0 + span);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * step_cols;
        const int nb = gated ? 2 : (int)std::min<int64_t>(2, (cols - n0) / 16);
        const uint32_t* wp;
        if (prepacked) {
          wp = prepacked + blk * block_words;
        } else {
          uint32_t* own = packed + (blk - b0) * block_words;
          if (s0 == 0) pack_block(w, N, K, blk, gated, own);
          wp = own;
        }
        // k in slices whose w block (36 or 16 KB) stays in L1 while the x rows stream past it, the short
        // one first so that the last (where a row block's epilogue overlaps the next one's tiles) is long.
        const int64_t first_kc = kcs - (kcs - 1) / slice_kc * slice_kc;
        for (int64_t kc0 = 0; kc0 < kcs; kc0 = kc0 ? kc0 + slice_kc : first_kc) {
          const int64_t kc1 = kc0 ? kc0 + slice_kc : first_kc;
          // The next slice's w bytes (or the next block's first slice's) are fetched into L2 while
          // this slice's row blocks run, a share per block: a weight that is not in cache (a
          // prefill reads each layer's once) then streams in behind the tile work instead of
          // stalling the first row block's tile loads (measured: 5-10% of a cold GEMM here).
          const char* pf = reinterpret_cast<const char*>(wp + kc1 * 256 * nb);
          const int64_t pf_lines = std::max<int64_t>(0, std::min<int64_t>(slice_kc * nb * 1024, pf_end - pf) / 64);
          const int64_t nm = (s1 - s0 + kBlockM - 1) / kBlockM;
          int64_t pf_done = 0, mi = 0;
          for (int64_t m0 = s0; m0 < s1; m0 += kBlockM) {
            for (const int64_t pf_to = pf_lines * ++mi / nm; pf_done < pf_to; ++pf_done)
              _mm_prefetch(pf + pf_done * 64, _MM_HINT_T1);
            const int mb = s1 - m0 > 16 ? 2 : 1;
            // A sources: x itself for full 16-row tiles, the zero-padded tail for the last partial one.
            const c10::BFloat16* a0 = m0 + 16 <= mfull ? x + m0 * K : tail.data();
            const c10::BFloat16* a1 = m0 + 32 <= mfull ? x + (m0 + 16) * K : tail.data();
            float* cm = c + (m0 - s0) * kBlockN;
            if (pend.c == cm) pend.finish();  // (one row block a span: its sums are about to be replaced)
            if (nb == 2) tiles_m<2>(mb, a0, a1, K, wp, kc0, kc1, cm, kc0 == 0, pend);
            else tiles_m<1>(mb, a0, a1, K, wp, kc0, kc1, cm, kc0 == 0, pend);
            if (kc1 == kcs) {
              pend.finish();
              pend = Pending<Epi>{cm, bias ? bias + n0 : nullptr, out + n0, ldo, m0, m0, std::min<int64_t>(s1, m0 + kBlockM), nb};
            }
          }
        }
      }
    }
    pend.finish();
    _tile_release();
  });
}

}  // namespace

int64_t amx_gemm_packed_words(int64_t N, int64_t K, bool gated) {
  if (K % 32 || K < 32 || (gated ? N % 32 : N < 16)) return 0;
  const int64_t blocks = gated ? N / 32 : (N / 16 * 16 + kBlockN - 1) / kBlockN;
  return blocks * kBlockN * K / 2;
}

void amx_gemm_pack(const c10::BFloat16* w, int64_t N, int64_t K, bool gated, uint32_t* out) {
  const int64_t words = amx_gemm_packed_words(N, K, gated);
  if (!words) return;
  const int64_t block_words = kBlockN * K / 2;
  at::parallel_for(0, words / block_words, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) pack_block(w, N, K, b, gated, out + b * block_words);
  });
}

bool amx_gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
              int64_t M, int64_t N, int64_t K, const uint32_t* packed, int epi) {
  if (K % 32 || N < 16 || M < 1 || !amx::permitted()) return false;
  if (epi != kGemmPlain && (N % 32 || bias)) return false;
  if (epi == kGemmPlain) gemm<kGemmPlain>(x, w, bias, out, M, N, K, packed);
  else if (epi == kGemmGatedSilu) gemm<kGemmGatedSilu>(x, w, nullptr, out, M, N, K, packed);
  else gemm<kGemmGatedGelu>(x, w, nullptr, out, M, N, K, packed);
  return true;
}

}  // namespace pdserve

#else

namespace pdserve {
bool amx_gemm(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t,
              int64_t, const uint32_t*, int) {
  return false;
}
int64_t amx_gemm_packed_words(int64_t, int64_t, bool) { return 0; }
void amx_gemm_pack(const c10::BFloat16*, int64_t, int64_t, bool, uint32_t*) {}
}  // namespace pdserve

#endif

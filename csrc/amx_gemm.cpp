// bf16 GEMM for many rows (prefill chunks) on the AMX tile unit, called by
// small_linear (csrc/small_linear.cpp) when M is large:
//
//   out[m][n] = bf16(sum_k x[m][k] * w[n][k] + bias[n])     (w in nn.Linear's [N, K] layout)
//
// Tiles: A = 16 rows of x as they lie in memory (row stride K), B = 16 rows of w
// repacked into the VNNI layout B[kp][n][j] = w[n][32 kc + 2 kp + j] (a 16 x 16
// transpose of 32-bit pairs), C[m][n] = out rows directly (no transpose on the way
// out). Each thread owns blocks of 32 w rows and packs each once per call into its own
// buffer; x is taken in spans of rows that fit L2, and k in 256-wide slices whose w
// block (16 KB) stays in L1 while the span's 32-row blocks of x stream past it, 2 x 2
// tiles, one TDPBF16PS per 32 k per C tile (partial sums kept in fp32 between slices).
//
// Numerics are small_linear's exactly: C[m][n] accumulates in fp32, one TDPBF16PS
// per 32 k in increasing k, products of the same pairs in the same order (the
// instruction is symmetric in its two sources), bias added once, one rounding to
// bf16 (RNE). So a row's output does not depend on M, on its position, or on the
// thread count, and equals what small_linear's decode path gives it.
#include "amx_gemm.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace pdserve {
namespace {

constexpr int64_t kBlockN = 32;  // w rows per packed block (2 B tiles)
constexpr int64_t kBlockM = 32;  // x rows per pass (2 A tiles)
constexpr int64_t kSliceKc = 8;  // 32-k steps per k slice (256 k)
constexpr int64_t kSpanBytes = 768 * 1024;  // x bytes per span (L2 is 2 MB a core here)

// 16 x 16 transpose of 32-bit lanes: r[i] holds row i on entry, column i on exit.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now 128-bit lane L of r[4c + d] holds column 4L + d, rows 4c..4c+3; two rounds
  // of 128-bit shuffles put each column's four pieces together.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// wp[kc * step + 16 kp + n] (32-bit pairs) = w32[n][16 kc + kp] for the 16 rows of w at w.
void pack_w16(const c10::BFloat16* w, int64_t K, uint32_t* wp, int64_t step) {
  const int64_t kcs = K / 32;
  for (int64_t kc = 0; kc < kcs; ++kc) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(w + n * K + kc * 32);
    transpose16(r);
    for (int kp = 0; kp < 16; ++kp) _mm512_store_si512(wp + kc * step + kp * 16, r[kp]);
  }
}

// C tiles 0..3 = x rows [m, m + 32) x w rows [n, n + 32) over k in [32 kc0, 32 kc1);
// A tiles 4, 5; B tiles 6, 7. The partial sums start at zero (first) or from c, where
// they are stored again (fp32, exact), so splitting k keeps the order of the sum.
template <int NB, int MB>
inline void tiles(const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t K, const uint32_t* wp, int64_t kc0,
                  int64_t kc1, float* c, bool first) {
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
    _tile_loadd(4, x0 + kc * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) { _tile_loadd(7, b + 256, 64); _tile_dpbf16ps(1, 4, 7); }
    if (MB > 1) {
      _tile_loadd(5, x1 + kc * 32, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldc);
  if (NB > 1) _tile_stored(1, c + 16, ldc);
  if (MB > 1) _tile_stored(2, c + 512, ldc);
  if (NB > 1 && MB > 1) _tile_stored(3, c + 512 + 16, ldc);
}

template <int NB>
inline void tiles_m(int mb, const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t K, const uint32_t* wp,
                    int64_t kc0, int64_t kc1, float* c, bool first) {
  if (mb == 2) tiles<NB, 2>(x0, x1, K, wp, kc0, kc1, c, first);
  else tiles<NB, 1>(x0, x1, K, wp, kc0, kc1, c, first);
}

}  // namespace

bool amx_gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
              int64_t M, int64_t N, int64_t K) {
  if (K % 32 || N < 16 || M < 1 || !amx::permitted()) return false;
  const int64_t n16 = N / 16 * 16;
  const int64_t kcs = K / 32;
  const int64_t nblocks = (n16 + kBlockN - 1) / kBlockN;
  // x rows past the last full 16 are copied into a zero-padded tail so tile loads
  // never read past x.
  const int64_t mfull = M / 16 * 16;
  std::vector<c10::BFloat16> tail(M > mfull ? 16 * K : 0);
  if (M > mfull) {
    std::memset(tail.data(), 0, tail.size() * sizeof(c10::BFloat16));
    std::memcpy(tail.data(), x + mfull * K, (M - mfull) * K * sizeof(c10::BFloat16));
  }
  // x is read in spans of rows that fit in L2 with room to spare (at least one 32-row
  // block); a thread packs its w blocks during the first span and keeps them for the rest.
  const int64_t span = std::max<int64_t>(kBlockM, (kSpanBytes / (K * 2)) / kBlockM * kBlockM);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    amx::load_tile_config();
    const int64_t block_words = kBlockN * K / 2;
    thread_local std::vector<uint32_t> wbuf;
    wbuf.resize(static_cast<size_t>((b1 - b0) * block_words + 16));
    uint32_t* packed = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t(63));
    thread_local std::vector<float> cbuf;
    cbuf.resize(static_cast<size_t>((span + kBlockM) * kBlockN + 16));
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf.data()) + 63) & ~uintptr_t(63));
    for (int64_t s0 = 0; s0 < M; s0 += span) {
      const int64_t s1 = std::min<int64_t>(M, s0 + span);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * kBlockN;
        const int nb = (int)std::min<int64_t>(2, (n16 - n0) / 16);
        uint32_t* wp = packed + (blk - b0) * block_words;
        // Packed as [kc][tile][16 kp][16 n] so a kc step reads both B tiles adjacently.
        if (s0 == 0)
          for (int t = 0; t < nb; ++t) pack_w16(w + (n0 + t * 16) * K, K, wp + t * 256, nb * 256);
        // k in slices whose w block (16 KB) stays in L1 while the x rows stream past it.
        for (int64_t kc0 = 0; kc0 < kcs; kc0 += kSliceKc) {
          const int64_t kc1 = std::min<int64_t>(kcs, kc0 + kSliceKc);
          for (int64_t m0 = s0; m0 < s1; m0 += kBlockM) {
            const int mb = s1 - m0 > 16 ? 2 : 1;
            // A sources: x itself for full 16-row tiles, the zero-padded tail for the last partial one.
            const c10::BFloat16* a0 = m0 + 16 <= mfull ? x + m0 * K : tail.data();
            const c10::BFloat16* a1 = m0 + 32 <= mfull ? x + (m0 + 16) * K : tail.data();
            float* cm = c + (m0 - s0) * kBlockN;
            if (nb == 2) tiles_m<2>(mb, a0, a1, K, wp, kc0, kc1, cm, kc0 == 0);
            else tiles_m<1>(mb, a0, a1, K, wp, kc0, kc1, cm, kc0 == 0);
          }
        }
        __m512 bv[2];
        for (int t = 0; t < nb; ++t)
          bv[t] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                             reinterpret_cast<const __m256i*>(bias + n0 + t * 16))), 16))
                       : _mm512_setzero_ps();
        for (int64_t m = s0; m < s1; ++m)
          for (int t = 0; t < nb; ++t) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(c + (m - s0) * kBlockN + t * 16), bv[t]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + n0 + t * 16),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
    _tile_release();
  });
  return true;
}

}  // namespace pdserve

#else

namespace pdserve {
bool amx_gemm(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t,
              int64_t) {
  return false;
}
}  // namespace pdserve

#endif

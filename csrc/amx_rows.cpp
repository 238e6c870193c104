// small_linear's AMX path for decode-size batches (declared in include/amx_gemm.h; large
// batches take the GEMM in csrc/amx_gemm.cpp): 16 W rows are one A tile exactly as they lie in
// memory, x is packed once per call into the VNNI B tile layout (16 columns of x rows,
// zero-padded), one TDPBF16PS per 32 k. Rows past the last full 16 take the AVX-512 path
// (csrc/packed_linear.cpp). Numerics: fp32 sums over k in increasing order, bias once, one
// rounding to bf16, as the other paths.
#include "amx_gemm.h"

#if defined(PDSERVE_AMX)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace pdserve {
namespace {

constexpr int64_t kGrainBytes = 64 * 1024;  // W bytes per parallel work chunk, at least

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

}  // namespace

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

}  // namespace pdserve

#endif  // PDSERVE_AMX

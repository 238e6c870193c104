// small_linear's AMX path for decode-size batches (declared in include/amx_gemm.h; large
// batches take the GEMM in csrc/linear/amx_gemm.cpp): 16 W rows are one A tile exactly as they lie in
// memory, x is packed once per call into the VNNI B tile layout (16 columns of x rows,
// zero-padded), one TDPBF16PS per 32 k. Rows past the last full 16 take the AVX-512 path
// (csrc/linear/packed_linear.cpp). Numerics: fp32 sums over k in increasing order, bias once, one
// rounding to bf16, as the other paths.
#include "amx_gemm.h"

#if defined(PDSERVE_AMX)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include <c10/util/Half.h>

#include "amx_tiles.h"
#include "quant_blocks.h"
#include "transpose16.h"

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

// xp[kc][kp][m][j] = x[m0 + m][32 kc + 2 kp + j], zero for m >= M - m0 (K % 32 == 0): per 32-k
// slice, the rows' 64-byte pieces transposed as 16 x 16 k pairs (scalar stores were ~10 us of a
// 16-row call with K = 1536).
void pack_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t m0, uint16_t* xp) {
  const int64_t mm = std::min<int64_t>(kTileM, M - m0);
  const c10::BFloat16* xs = x + m0 * K;
  for (int64_t kc = 0; kc < K / 32; ++kc) {
    __m512i r[16];
    for (int64_t m = 0; m < 16; ++m)
      r[m] = m < mm ? _mm512_loadu_si512(xs + m * K + kc * 32) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t kp = 0; kp < 16; ++kp) _mm512_storeu_si512(xp + kc * 512 + kp * 32, r[kp]);
  }
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


// The weight's 16 x 32 tiles rebuilt from a block-quantized copy (amx_quant_pack) into a bf16
// A tile in L1, in the order run_tiles reads them: pass (4 row blocks) -> 32-k slice -> row block.
// Each tile row is one 32-weight block:
//   kQuantQ4 (GGUF Q4_1's form): w = bf16(d * q + m), q in 0..15; a tile is d[16], m[16] (fp32)
//     then 16 rows of 16 bytes of nibbles (q4_nibble's order): 384 bytes;
//   kQuantQ4H: the same with d[16], m[16] as fp16 (320 bytes), made where every block's d and m
//     are fp16 values (a Q4_1 GGUF's are; the rebuild widens them exactly);
//   kQuantQ8 (GGUF Q8_0's form): w = bf16(d * q), q in -128..127; a tile is d[16] then 16 rows of
//     32 int8.
// The rebuild rounds as the bf16 copy was made (fp32 -> bf16, nearest even) with the same fp32
// value: fma(d, q, m) is exact where d * q is (every GGUF block: d has 11 significant bits);
// amx_quant_pack checks every rebuilt weight against the bf16 weight and refuses a copy that
// differs in one bit. So the tiles, and the products, are the W-tile path's.
// Q4 nibble order: a row's 16 bytes, broadcast to the four 128-bit lanes of a zmm, are four
// 32-bit words; lane L shifts each right by 4 L (one vpsrlvd, a port-0 shift: vpmultishiftqb,
// which took nibbles from any position, competed with vpermw for port 5), so that 16-bit half h of
// word i in lane L starts with nibble 8 i + 4 h + L of the row, which holds weight
// e = 8 L + 2 i + h (zmm word e). With d and m broadcast from memory (below), one thread, Xeon
// with AMX: a tile's rebuild from L2 ~26 -> ~19 ns; the pass with its tile products only ~5% (the
// tile loads and products then take as long); a 1-row decode step over 1500 tokens 18.9-19.3 ->
// 17.9-18.1 ms, alternated (4 rows: within the noise).
constexpr int q4_nibble(int e) {  // nibble index (byte n / 2, low nibble for even n) of weight e
  const int lane = e / 8, i = (e % 8) / 2, h = e % 2;
  return 8 * i + 4 * h + lane;
}

inline __m512i q4_shifts() { return _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12); }

template <int Kind>
inline void rebuild_tile(const uint8_t* q, uint16_t* buf) {
  const float* d = reinterpret_cast<const float*>(q);
  if (Kind == kQuantQ4 || Kind == kQuantQ4H) {
    const float* m = d + 16;
    const uint8_t* nib = q + 128;
    alignas(64) float dm[32];  // Q4H: its fp16 d and m as fp32 (exact)
    if (Kind == kQuantQ4H) {
      _mm512_store_ps(dm, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))));
      _mm512_store_ps(dm + 16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
      // read back as broadcasts from memory (load ports only): GCC otherwise keeps dm in registers
      // and broadcasts each d and m with a vpermd and a vpbroadcastd, port 5 again
      asm volatile("" : : "r"(dm) : "memory");
      d = dm;
      m = dm + 16;
      nib = q + 64;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shifts = q4_shifts(), low = _mm512_set1_epi16(0x0f), high = _mm512_set1_epi16(0x10);
    // two rows a step: one conversion makes both tables (row r's 16 values in words 0-15, row
    // r + 1's in 16-31); a row's 16 bytes broadcast to every lane, vpsrlvd puts weight e's
    // nibble in the low bits of word e, bit 4 then picks the row's table and vpermw looks it up
#pragma GCC unroll 8
    for (int r = 0; r < 16; r += 2) {
      const __m512 v0 = _mm512_fmadd_ps(_mm512_set1_ps(d[r]), iota, _mm512_set1_ps(m[r]));
      const __m512 v1 = _mm512_fmadd_ps(_mm512_set1_ps(d[r + 1]), iota, _mm512_set1_ps(m[r + 1]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
      const __m512i b0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 16 * r)));
      const __m512i b1 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 16 * r + 16)));
      const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi32(b0, shifts), low);
      const __m512i i1 = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(b1, shifts), low, high, 0xea);  // a & b | c
      _mm512_store_si512(reinterpret_cast<__m512i*>(buf + 32 * r), _mm512_permutexvar_epi16(i0, table));
      _mm512_store_si512(reinterpret_cast<__m512i*>(buf + 32 * r + 32), _mm512_permutexvar_epi16(i1, table));
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(q + 64);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512 dv = _mm512_set1_ps(d[r]);
      const __m512 lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * r)))));
      const __m512 hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * r + 16)))));
      _mm512_store_si512(reinterpret_cast<__m512i*>(buf + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

template <int Kind>
constexpr int64_t tile_bytes() {
  return Kind == kQuantQ4 ? 384 : Kind == kQuantQ4H ? 320 : 576;
}

int64_t tile_bytes(int kind) {
  return kind == kQuantQ4 ? tile_bytes<kQuantQ4>() : kind == kQuantQ4H ? tile_bytes<kQuantQ4H>()
                                                                       : tile_bytes<kQuantQ8>();
}

template <int NT, int Kind>
inline void amx_rows_quant(const uint8_t* q, const uint16_t* xp, int64_t K, float* c, uint16_t* bufs) {
  // amx_rows with the A tiles rebuilt from q (NT tiles a 32-k slice, consecutive)
  if (NT > 0) _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (NT > 2) _tile_zero(2);
  if (NT > 3) _tile_zero(3);
  constexpr int64_t kTile = tile_bytes<Kind>();
  for (int64_t kc = 0; kc < K / 32; ++kc) {
    // the copy is one sequential stream read ~6 bits a weight at a time, too slowly for the
    // hardware prefetcher to run far enough ahead alone (30 layers of SmolLM2, 4 rows: 11 -> 9.3 ms)
    for (int i = 0; i < NT * kTile / 64; ++i) _mm_prefetch(reinterpret_cast<const char*>(q) + 4 * kTile + 64 * i, _MM_HINT_T0);
    for (int t = 0; t < NT; ++t) rebuild_tile<Kind>(q + t * kTile, bufs + t * 512);
    q += NT * kTile;
    _tile_loadd(5, xp + kc * 512, 64);
    _tile_loadd(4, bufs, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NT > 1) { _tile_loadd(6, bufs + 512, 64); _tile_dpbf16ps(1, 6, 5); }
    if (NT > 2) { _tile_loadd(7, bufs + 1024, 64); _tile_dpbf16ps(2, 7, 5); }
    if (NT > 3) { _tile_loadd(4, bufs + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, c, 64);
  if (NT > 1) _tile_stored(1, c + 256, 64);
  if (NT > 2) _tile_stored(2, c + 512, 64);
  if (NT > 3) _tile_stored(3, c + 768, 64);
}

template <int Kind>
void pass_quant(int nt, const uint8_t* q, const uint16_t* xg, int64_t K, float* c, uint16_t* bufs) {
  switch (nt) {
    case 1: amx_rows_quant<1, Kind>(q, xg, K, c, bufs); break;
    case 2: amx_rows_quant<2, Kind>(q, xg, K, c, bufs); break;
    case 3: amx_rows_quant<3, Kind>(q, xg, K, c, bufs); break;
    default: amx_rows_quant<4, Kind>(q, xg, K, c, bufs); break;
  }
}

// out rows' columns [0, N / 16 * 16): with W tiles from w (quant == nullptr) or rebuilt from quant.
int64_t run_tiles(const c10::BFloat16* x, const c10::BFloat16* w, const uint8_t* quant, int kind,
                  const c10::BFloat16* bias, c10::BFloat16* out, int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = N / kTileN;
  if (K % 32 || nblocks == 0 || !amx::permitted()) return 0;
  const int64_t groups = (M + kTileM - 1) / kTileM;
  std::vector<uint16_t> xp(static_cast<size_t>(groups * K * kTileM));
  for (int64_t g = 0; g < groups; ++g) pack_x(x, M, K, g * kTileM, xp.data() + g * K * kTileM);
  const int64_t passes = (nblocks + kTilesN - 1) / kTilesN;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kTilesN * kTileN * K * 2));
  const int64_t tile = tile_bytes(kind);
  const __m512i kColumn = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kTileM));
  at::parallel_for(0, passes, grain, [&](int64_t p0, int64_t p1) {
    load_tile_config();
    alignas(64) float c[kTilesN * kTileN * kTileM];
    alignas(64) uint16_t bufs[kTilesN * 512];  // rebuilt A tiles
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = p * kTilesN;
      const int nt = (int)std::min<int64_t>(kTilesN, nblocks - nb);
      const c10::BFloat16* wb = w + nb * kTileN * K;
      const uint8_t* qb = quant ? quant + nb * (K / 32) * tile : nullptr;
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* xg = xp.data() + g * K * kTileM;
        if (quant && kind == kQuantQ8) {
          pass_quant<kQuantQ8>(nt, qb, xg, K, c, bufs);
        } else if (quant && kind == kQuantQ4H) {
          pass_quant<kQuantQ4H>(nt, qb, xg, K, c, bufs);
        } else if (quant) {
          pass_quant<kQuantQ4>(nt, qb, xg, K, c, bufs);
        } else {
          switch (nt) {
            case 1: amx_rows<1>(wb, xg, K, c); break;
            case 2: amx_rows<2>(wb, xg, K, c); break;
            case 3: amx_rows<3>(wb, xg, K, c); break;
            default: amx_rows<4>(wb, xg, K, c); break;
          }
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

}  // namespace

int64_t run_amx(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K) {
  return run_tiles(x, w, nullptr, 0, bias, out, M, N, K);
}

int64_t run_amx_quant(const c10::BFloat16* x, const uint8_t* quant, int kind, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t M, int64_t N, int64_t K) {
  return run_tiles(x, nullptr, quant, kind, bias, out, M, N, K);
}

int64_t amx_quant_bytes(int64_t N, int64_t K, int kind) {
  if (K % 32 || N < 16) return 0;
  return N / 16 * (K / 32) * tile_bytes(kind);
}

bool amx_quant_pack(const float* w32, const c10::BFloat16* w, int64_t N, int64_t K, int kind, uint8_t* out) {
  // Rows past the last full 16 are not in the copy (the AVX-512 path computes them).
  const int64_t nblocks = N / kTileN, kcs = K / 32;
  if (K % 32 || nblocks == 0 || !amx::permitted()) return false;
  const int64_t tile = tile_bytes(kind);
  std::atomic<bool> ok{true};
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint16_t buf[512];
    uint8_t q[32];
    for (int64_t nb = b0; nb < b1 && ok.load(std::memory_order_relaxed); ++nb) {
      const int64_t p = nb / kTilesN, t = nb % kTilesN;
      const int64_t nt = std::min<int64_t>(kTilesN, nblocks - p * kTilesN);
      for (int64_t kc = 0; kc < kcs && ok.load(std::memory_order_relaxed); ++kc) {
        uint8_t* tp = out + ((p * kTilesN) * kcs + kc * nt + t) * tile;
        float* d = reinterpret_cast<float*>(tp);
        float dm[2];
        for (int r = 0; r < 16 && ok.load(std::memory_order_relaxed); ++r) {
          const float* v = w32 + (nb * kTileN + r) * K + kc * 32;
          if (kind == kQuantQ8) {
            if (!quant::find_q8(v, d + r, reinterpret_cast<int8_t*>(tp + 64 + 32 * r))) ok = false;
          } else if (!quant::find_q4(v, dm, dm + 1, q)) {
            ok = false;
          } else if (kind == kQuantQ4H && !(static_cast<float>(c10::Half(dm[0])) == dm[0] &&
                                            static_cast<float>(c10::Half(dm[1])) == dm[1])) {
            ok = false;  // d or m not exactly fp16: the fp32 form (kQuantQ4) takes this weight
          } else {
            if (kind == kQuantQ4H) {
              reinterpret_cast<c10::Half*>(tp)[r] = c10::Half(dm[0]);
              reinterpret_cast<c10::Half*>(tp)[16 + r] = c10::Half(dm[1]);
            } else {
              d[r] = dm[0];
              d[16 + r] = dm[1];
            }
            uint8_t* row = tp + (kind == kQuantQ4H ? 64 : 128) + 16 * r;
            std::memset(row, 0, 16);
            for (int e = 0; e < 32; ++e) row[q4_nibble(e) / 2] |= static_cast<uint8_t>(q[e] << (4 * (q4_nibble(e) % 2)));
          }
        }
        if (!ok.load(std::memory_order_relaxed)) break;
        // every rebuilt weight must be the bf16 weight, bit for bit
        if (kind == kQuantQ8) rebuild_tile<kQuantQ8>(tp, buf);
        else if (kind == kQuantQ4H) rebuild_tile<kQuantQ4H>(tp, buf);
        else rebuild_tile<kQuantQ4>(tp, buf);
        for (int r = 0; r < 16 && ok.load(std::memory_order_relaxed); ++r)
          if (std::memcmp(buf + 32 * r, w + (nb * kTileN + r) * K + kc * 32, 64) != 0) ok = false;
      }
    }
  });
  return ok;
}

}  // namespace pdserve

#endif  // PDSERVE_AMX

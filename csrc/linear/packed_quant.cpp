// small_linear's decode batches on CPUs without AMX, read from a block-quantized copy of the
// weight (declared in include/packed_linear.h; the op is csrc/linear/small_linear.cpp). A decode step
// streams every weight once: with 16-bit weights the AVX512-BF16 path (csrc/linear/packed_linear.cpp)
// waits on memory. Where every 32-weight block of a weight is exactly GGUF Q4_1's d q + m or
// Q8_0's d q (quant_blocks.h, found from the fp32 values the bf16 weight was rounded from), this
// copy holds the blocks in 5, 6 or 9 bits a weight, and the kernel rebuilds each zmm of the
// packed path's k-pair layout in registers before its vdpbf16ps: the same bf16 values (the copy
// is checked weight for weight when it is made), the same products in the same order, so the
// same bits as run_packed, for any M, position or thread count.
//
// Layout: units of 32 output columns (plain: columns 32 u .. 32 u + 31, as two vectors A and B
// of 16; gated, w = gate|up [2 I, K]: A = gate rows 16 u .., B = up rows I + 16 u .., whose
// activation gives output columns 16 u ..), then 32-k blocks; a block is its header, then for
// each of its 16 k pairs q, A's then B's 16 (Q4) or 32 (Q8) bytes.
//   kQ4H: d[32], m[32] as fp16 (a Q4_1 GGUF's are), nibbles: 640 bytes a block (5 bits a weight)
//   kQ4:  d[32], m[32] as fp32 (Gemma 3's Q4_K sub-blocks): 768 bytes (6 bits)
//   kQ8:  d[32] as fp32, int8: 1152 bytes (9 bits)
// A vector's zmm for pair q is words w = 2 c + j = w[col c][2 q + j] (c < 16): built as
// cvtne2ps(hi, lo) of two fp32 vectors, lo = words 0-15 (columns 0-7), hi = words 16-31. Q4: byte
// i of the 16 holds word i in its low nibble and word 16 + i in its high one. Q8: byte w, word w.
#include "packed_linear.h"

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "act_vec.h"
#include "bf16_vec.h"
#include "dynamic_for.h"
#include "quant_blocks.h"

namespace pdserve {
namespace linear {
namespace {

constexpr int64_t kUnit = 32;  // output columns (two vectors) per unit
constexpr int kMaxQR = 8;  // x rows per block (8 x 2 accumulators)

constexpr int64_t block_bytes(int kind) { return kind == kQ4H ? 640 : kind == kQ4 ? 768 : 1152; }

// The per-lane scales of one vector for its lo / hi halves: lane l of lo is column l / 2, of hi
// column 8 + l / 2, from the block's 16 values at v (fp32).
struct Scales {
  __m512 lo, hi;
};

inline Scales spread(__m512 v) {
  const __m512i ilo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i ihi = _mm512_add_epi32(ilo, _mm512_set1_epi32(8));
  return {_mm512_permutexvar_ps(ilo, v), _mm512_permutexvar_ps(ihi, v)};
}

// A block's scales for vector v (0: A, 1: B): d, and m for Q4.
template <int Kind>
inline void block_scales(const uint8_t* blk, int v, Scales& d, Scales& m) {
  if constexpr (Kind == kQ4H) {
    const auto* h = reinterpret_cast<const __m256i*>(blk);
    d = spread(_mm512_cvtph_ps(_mm256_loadu_si256(h + v)));
    m = spread(_mm512_cvtph_ps(_mm256_loadu_si256(h + 2 + v)));
  } else {
    const float* f = reinterpret_cast<const float*>(blk);
    d = spread(_mm512_loadu_ps(f + 16 * v));
    if constexpr (Kind == kQ4) m = spread(_mm512_loadu_ps(f + 32 + 16 * v));
  }
}

template <int Kind>
constexpr int64_t header_bytes() { return Kind == kQ4H ? 128 : Kind == kQ4 ? 256 : 128; }
template <int Kind>
constexpr int64_t vec_bytes() { return Kind == kQ8 ? 32 : 16; }

// The zmm of k pair q for one vector, from its bytes p: the packed path's bf16 weights.
template <int Kind>
inline __m512bh rebuild(const uint8_t* p, const Scales& d, const Scales& m) {
  __m512 lo, hi;
  if constexpr (Kind == kQ8) {
    lo = _mm512_mul_ps(d.lo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    hi = _mm512_mul_ps(d.hi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))));
  } else {
    const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_fmadd_ps(d.lo, _mm512_cvtepi32_ps(_mm512_and_si512(t, _mm512_set1_epi32(15))), m.lo);
    hi = _mm512_fmadd_ps(d.hi, _mm512_cvtepi32_ps(_mm512_srli_epi32(t, 4)), m.hi);
  }
  return _mm512_cvtne2ps_pbh(hi, lo);  // rounded to nearest even, as the bf16 weight was
}

// out for x rows [0, MR) of one unit: A and B accumulated over the K / 32 blocks at q.
template <int MR, int Kind, int E>
void quant_block(const uint16_t* x, int64_t ldx, const uint8_t* q, int64_t K, const c10::BFloat16* bias,
                 c10::BFloat16* out, int64_t ldo, int64_t unit) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b, q += block_bytes(Kind)) {
    Scales da, db, ma{}, mb{};
    block_scales<Kind>(q, 0, da, ma);
    block_scales<Kind>(q, 1, db, mb);
    const uint8_t* p = q + header_bytes<Kind>();
#pragma GCC unroll 2
    for (int j = 0; j < 16; ++j, p += 2 * vec_bytes<Kind>()) {
      const __m512bh wa = rebuild<Kind>(p, da, ma), wb = rebuild<Kind>(p + vec_bytes<Kind>(), db, mb);
      const int64_t k = 32 * b + 2 * j;
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + k, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wa, xb);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wb, xb);
      }
    }
  }
  if constexpr (E != kPlain) {
    (void)bias;
    for (int r = 0; r < MR; ++r)
      act::store_gated16<E == kGatedGelu>(out + r * ldo + 16 * unit, vec::round_bf16((vec::f32x16)acc[r][0]),
                                          vec::round_bf16((vec::f32x16)acc[r][1]));
    return;
  }
  for (int v = 0; v < 2; ++v) {
    const int64_t c = kUnit * unit + 16 * v;
    __m512 bv = _mm512_setzero_ps();
    if (bias) bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                       reinterpret_cast<const __m256i*>(bias + c))), 16));
    for (int r = 0; r < MR; ++r) {
      const __m512 s = bias ? _mm512_add_ps(acc[r][v], bv) : acc[r][v];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c), (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

using QuantFn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, const c10::BFloat16*, c10::BFloat16*,
                         int64_t, int64_t);

template <int Kind, int E>
QuantFn pick_rows(int mr) {
  static_assert(kMaxQR == 8, "pick_rows lists 8 row counts");
  switch (mr) {
    case 1: return quant_block<1, Kind, E>;
    case 2: return quant_block<2, Kind, E>;
    case 3: return quant_block<3, Kind, E>;
    case 4: return quant_block<4, Kind, E>;
    case 5: return quant_block<5, Kind, E>;
    case 6: return quant_block<6, Kind, E>;
    case 7: return quant_block<7, Kind, E>;
    default: return quant_block<8, Kind, E>;
  }
}

template <int Kind>
QuantFn quant_fn(int mr, int epi) {
  return epi == kGatedSilu ? pick_rows<Kind, kGatedSilu>(mr)
         : epi == kGatedGelu ? pick_rows<Kind, kGatedGelu>(mr)
                             : pick_rows<Kind, kPlain>(mr);
}

// w's row for column c (0..31) of unit u: plain 32 u + c; gated (w = gate|up [N, K]) gate row
// 16 u + c for A (c < 16), up row N / 2 + 16 u + c - 16 for B.
inline int64_t unit_row(int64_t u, int c, int64_t N, bool gated) {
  if (!gated) return kUnit * u + c;
  return c < 16 ? 16 * u + c : N / 2 + 16 * u + (c - 16);
}

// Fill block (u, b) of kind Kind from w32; false where a block of the form does not reproduce
// it. Then every weight rebuilt by the kernel's own code must be w's bf16, bit for bit.
template <int Kind>
bool pack_block(const float* w32, const c10::BFloat16* w, int64_t N, int64_t K, bool gated, int64_t u,
                int64_t b, uint8_t* blk) {
  std::memset(blk, 0, block_bytes(Kind));
  uint8_t* body = blk + header_bytes<Kind>();
  for (int c = 0; c < 32; ++c) {
    const float* v = w32 + unit_row(u, c, N, gated) * K + 32 * b;
    const int vec = c / 16, col = c % 16;
    uint8_t q4[32];
    int8_t q8[32];
    float d, m = 0.0f;
    if constexpr (Kind == kQ8) {
      if (!quant::find_q8(v, &d, q8)) return false;
      reinterpret_cast<float*>(blk)[c] = d;
    } else {
      if (!quant::find_q4(v, &d, &m, q4)) return false;
      if constexpr (Kind == kQ4H) {
        if (static_cast<float>(c10::Half(d)) != d || static_cast<float>(c10::Half(m)) != m) return false;
        reinterpret_cast<c10::Half*>(blk)[c] = c10::Half(d);
        reinterpret_cast<c10::Half*>(blk)[32 + c] = c10::Half(m);
      } else {
        reinterpret_cast<float*>(blk)[c] = d;
        reinterpret_cast<float*>(blk)[32 + c] = m;
      }
    }
    for (int e = 0; e < 32; ++e) {  // weight k = 32 b + e: pair e / 2, word 2 col + e % 2
      uint8_t* p = body + (e / 2) * 2 * vec_bytes<Kind>() + vec * vec_bytes<Kind>();
      const int word = 2 * col + e % 2;
      if constexpr (Kind == kQ8) p[word] = static_cast<uint8_t>(q8[e]);
      else p[word % 16] |= static_cast<uint8_t>(q4[e] << (word < 16 ? 0 : 4));
    }
  }
  Scales d[2], m[2] = {};
  for (int v = 0; v < 2; ++v) block_scales<Kind>(blk, v, d[v], m[v]);
  for (int j = 0; j < 16; ++j)
    for (int v = 0; v < 2; ++v) {
      alignas(64) uint16_t words[32];
      _mm512_store_si512(words, (__m512i)rebuild<Kind>(body + (2 * j + v) * vec_bytes<Kind>(), d[v], m[v]));
      for (int wd = 0; wd < 32; ++wd) {
        const uint16_t want = w[unit_row(u, 16 * v + wd / 2, N, gated) * K + 32 * b + 2 * j + wd % 2].x;
        if (words[wd] != want) return false;
      }
    }
  return true;
}

}  // namespace

int64_t quant_copy_bytes(int64_t N, int64_t K, int kind) {
  if (N % kUnit || K % 32 || N == 0 || K == 0) return 0;
  return N / kUnit * (K / 32) * block_bytes(kind);
}

int quant_copy_kind(int64_t bytes, int64_t N, int64_t K) {
  for (int kind : {kQ4H, kQ4, kQ8})
    if (bytes && bytes == quant_copy_bytes(N, K, kind)) return kind;
  return 0;
}

bool pack_quant(const float* w32, const c10::BFloat16* w, int64_t N, int64_t K, bool gated, int kind, uint8_t* out) {
  if (!quant_copy_bytes(N, K, kind) || (gated && N % (2 * 16))) return false;
  const int64_t units = N / kUnit, blocks = K / 32;
  std::atomic<bool> ok{true};
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1 && ok.load(std::memory_order_relaxed); ++u)
      for (int64_t b = 0; b < blocks && ok.load(std::memory_order_relaxed); ++b) {
        uint8_t* blk = out + (u * blocks + b) * block_bytes(kind);
        const bool fit = kind == kQ4H ? pack_block<kQ4H>(w32, w, N, K, gated, u, b, blk)
                         : kind == kQ4 ? pack_block<kQ4>(w32, w, N, K, gated, u, b, blk)
                                       : pack_block<kQ8>(w32, w, N, K, gated, u, b, blk);
        if (!fit) ok = false;
      }
  });
  return ok;
}

void run_packed_quant(const c10::BFloat16* x, const uint8_t* q, int kind, const c10::BFloat16* bias, c10::BFloat16* out,
                      int64_t M, int64_t N, int64_t K, int epi) {
  const int64_t ldo = epi == kPlain ? N : N / 2, units = N / kUnit, ubytes = (K / 32) * block_bytes(kind);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  const int64_t rblocks = (M + kMaxQR - 1) / kMaxQR;
  // units in chunks of about 16 KB of the copy, each chunk's rows in near-equal blocks
  const int64_t chunk = std::max<int64_t>(1, (16 << 10) / ubytes), chunks = (units + chunk - 1) / chunk;
  dynamic_for(chunks, [&](int64_t ch) {
    for (int64_t bi = 0, m = 0; bi < rblocks; ++bi) {
      const int mr = static_cast<int>(M * (bi + 1) / rblocks - m);
      const QuantFn f = kind == kQ4H ? quant_fn<kQ4H>(mr, epi) : kind == kQ4 ? quant_fn<kQ4>(mr, epi) : quant_fn<kQ8>(mr, epi);
      for (int64_t u = ch * chunk; u < std::min(units, (ch + 1) * chunk); ++u)
        f(xs + m * K, K, q + u * ubytes, K, bias, out + m * ldo, ldo, u);
      m += mr;
    }
  });
}

}  // namespace linear
}  // namespace pdserve

#endif  // __AVX512BF16__

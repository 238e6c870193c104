// Causal attention of a prefill chunk with AMX tiles, or AVX512-BF16 dot products where the
// CPU has no AMX (flash-style online softmax), registered as torch.ops.pdserve.prefill_attention
// (loader: engine/layers/prefill_attention_op.py).
//
//   q    [n, H, D]   bf16, last dim contiguous, heads D apart (any token stride)
//   k, v [L, KVH, D] bf16, same layout; L >= n, H % KVH == 0, D % 32 == 0, D <= 256
//   out  [n, H, D]   bf16 contiguous: query i attends keys 0 .. L - n + i (the chunk's own
//                    keys are the last n; the first L - n are earlier context)
//   window           > 0: sliding window, query i attends only keys above L - n + i - window
//                    (a key no query sees may hold anything finite: zeros, say)
//
// Why: torch's CPU flash SDPA ran a 530-token SmolLM2 prefill's attention at ~100 GFLOP/s on
// one core, a quarter of the prefill. Here both products run on the tile unit and the
// softmax runs "vertically": S is computed transposed (keys x queries), so the running max and
// sum of each query are lane-wise operations over key rows, with no horizontal reductions.
//
// Per kv head g: K is packed as A tiles (16 keys x 32 d), V transposed as A tiles (16 d x 32
// keys), zero past L. Per (kv head, block of 16 queries): Q of each of the group's heads packed
// as VNNI B tiles; then for each step of 32 keys up to the block's last query, for each head
// of the group in turn (the step's K/V tiles come from memory once, then from L1):
//   1. S^T [32 keys][16 q] = K Q^T: 2 C tiles, D / 32 TDPBF16PS each;
//   2. scale, causal mask, new running max m, p = exp(s - m), l = l * alpha + sum p, with
//      alpha = exp(m_old - m) (16 lanes = 16 queries);
//   3. P^T to a VNNI B tile (bf16, pairs of keys interleaved);
//   4. O^T [D][16 q] (fp32, in L1) scaled by alpha, then += V^T P^T: D / 16 TDPBF16PS.
// Finally out = O^T transposed / l. Accumulation is fp32; P is rounded to bf16 for the
// product with V (as torch's bf16 flash path does). Not bitwise torch's: tests compare with
// an fp32 reference within bf16 tolerance.
// Without AMX (scores_avx512, values_avx512) steps 1 and 4 broadcast a bf16 pair of a packed
// K or V row against a row of the same VNNI B tile; the rest is the same code. Its bits are
// not the tile unit's, but the property below holds for either.
//
// A query's result depends only on its keys' values and their indices mod 32: a 32-key step in
// which it sees no key changes nothing of its state (p = 0 exactly, alpha = 1 once it has seen
// a key), so steps no query of a block sees are skipped. Hence a sequence cut into chunks gets
// the bits it gets in one chunk, provided key 0 of each call sits at a position that is a
// multiple of 32 (engine/layers/attention.py pads sliding-window context down to one).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_tiles.h"

#include "bf16_vec.h"
#include "transpose16.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve {
namespace {

#if defined(__AVX512BF16__)
#define PDSERVE_PREFILL_AVX512 1
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PDSERVE_PREFILL_AMX 1
#endif

// 2^t for t <= 0, 16 lanes: t = n + f with |f| <= 1/2, 2^f = 1 + f q(f) with q a degree-2
// polynomial fitted for relative error (1.0e-4 over [-1/2, 1/2]: P is rounded to bf16, 2^-9,
// for its product with V, so a closer fit changes little but costs two FMAs a vector more),
// scaled by 2^n; below -126 gives 2^-126. 2^0 is exactly 1, so a step that moves no query's
// maximum leaves its state alone (alpha = 1: chunked prompts keep their bits). The softmax
// takes exp(scale (s - m)) as 2^(log2(e) scale s - log2(e) scale m): 7 instructions a vector
// (Cephes' expf: 14; the exponentials were a quarter of this kernel's time).
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(5.500858277e-2f), f, _mm512_set1_ps(2.422103733e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932829022e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct Args {
  const uint16_t *q, *k, *v;
  int64_t q_tok, k_tok, v_tok;  // token strides (elements)
  int64_t n, L, H, KVH, D;
  int64_t window;  // 0: none
  float scale;
  c10::BFloat16* out;  // [n, H, D]
};

// Per kv head: kt = K as A tiles [ks16][dc][16 keys][32 d]; vt = V^T as A tiles [db][ks][16 d][32 keys].
void pack_kv(const Args& a, int64_t g, int64_t steps, uint16_t* kt, uint16_t* vt) {
  const int64_t D = a.D, dcs = D / 32;
  for (int64_t key = 0; key < steps * 32; ++key)
    for (int64_t dc = 0; dc < dcs; ++dc) {
      uint16_t* dst = kt + ((key / 16) * dcs + dc) * 512 + (key % 16) * 32;
      if (key < a.L) std::memcpy(dst, a.k + key * a.k_tok + g * D + dc * 32, 64);
      else std::memset(dst, 0, 64);
    }
  // V^T tile (db, s): row j = dim 16 db + j, 32-bit word i = keys (32 s + 2 i, 32 s + 2 i + 1) of
  // it; the words of a key pair for the 16 dims, transposed.
  for (int64_t db = 0; db < D / 16; ++db)
    for (int64_t s = 0; s < steps; ++s) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t key = s * 32 + 2 * i;
        const __m256i lo = key < a.L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.v + key * a.v_tok + g * D + db * 16))
                                     : _mm256_setzero_si256();
        const __m256i hi = key + 1 < a.L
                               ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.v + (key + 1) * a.v_tok + g * D + db * 16))
                               : _mm256_setzero_si256();
        r[i] = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      }
      transpose16(r);
      uint16_t* tile = vt + (db * steps + s) * 512;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + j * 32, r[j]);
    }
}

// The tile products without the tile unit (AVX512-BF16), on the same packed layouts. Lane =
// query, as in the C tiles: a 32-bit word of a packed K or V row (a pair of bf16) is
// broadcast and multiplied with a row of the VNNI B tile (Q or P), which holds that pair's
// partners for 16 queries. Each fp32 sum runs over the pairs in order: not the tile unit's
// bits, but again a query's result depends only on its keys and their indices mod 32.
inline __m512 bcast_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return _mm512_castsi512_ps(_mm512_set1_epi32((int)w));
}

// s[j][16 q] = S of key 32 st + j (kt: [ks16][dc][16 keys][32 d]) and Q as VNNI B tiles qp.
inline void scores_avx512(const uint16_t* kt, const uint16_t* qp, int64_t st, int64_t dcs, float* s) {
  for (int64_t j0 = 0; j0 < 32; j0 += 8) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    const uint16_t* rows = kt + ((32 * st + j0) / 16) * dcs * 512 + (j0 % 16) * 32;  // key j0's row, dc 0
    for (int64_t dc = 0; dc < dcs; ++dc)
      for (int64_t kp = 0; kp < 16; ++kp) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + dc * 512 + kp * 32);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)bcast_pair(rows + dc * 512 + i * 32 + 2 * kp), qv);
      }
    for (int i = 0; i < 8; ++i) _mm512_store_ps(s + (j0 + i) * 16, acc[i]);
  }
}

// O^T [D][16 q] += V^T P^T for step st (vt: [db][ks][16 d][32 keys], pt: P^T as a VNNI B tile).
inline void values_avx512(const uint16_t* vt, const uint16_t* pt, int64_t st, int64_t steps_all, int64_t D,
                          float* ot) {
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    const uint16_t* rows = vt + ((d0 / 16) * steps_all + st) * 512 + (d0 % 16) * 32;  // dim d0's 32 keys
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_load_ps(ot + (d0 + i) * 16);
    for (int64_t kp = 0; kp < 16; ++kp) {
      const __m512bh pv = (__m512bh)_mm512_loadu_si512(pt + kp * 32);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)bcast_pair(rows + i * 32 + 2 * kp), pv);
    }
    for (int i = 0; i < 8; ++i) _mm512_store_ps(ot + (d0 + i) * 16, acc[i]);
  }
}

// Per-head state of one block of 16 queries.
struct HeadState {
  uint16_t* qp;  // Q as VNNI B tiles: [D / 32][kp 16][q 16][2]
  float* ot;     // O^T [D][16 q], fp32
  __m512 m, l;   // running max (raw scores) and denominator, lane = query
};

// The heads h0 .. h0 + G - 1 of one kv head (a GQA group), queries r0 .. r0 + 15 (rows past n
// are zero and discarded). The group's heads take each 32-key step in turn, so the step's K/V
// tiles are read from memory once and from L1 by the other heads.
template <bool Amx>
void block(const Args& a, int64_t h0, int64_t G, int64_t r0, int64_t steps_all, const uint16_t* kt,
           const uint16_t* vt, HeadState* hs, float* s) {
  const int64_t D = a.D, dcs = D / 32, dbs = D / 16, offset = a.L - a.n;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Q as VNNI B tiles: qp[dc][kp][q][e] = Q[r0 + q][h][32 dc + 2 kp + e]; as 32-bit pairs that is
  // qp32[dc][kp][q] = Q32[q][16 dc + kp]: a 16 x 16 transpose of the block's 64-byte row chunks.
  for (int64_t hi = 0; hi < G; ++hi) {
    for (int64_t dc = 0; dc < dcs; ++dc) {
      __m512i r[16];
      for (int64_t q = 0; q < 16; ++q)
        r[q] = r0 + q < a.n ? _mm512_loadu_si512(a.q + (r0 + q) * a.q_tok + (h0 + hi) * D + dc * 32)
                            : _mm512_setzero_si512();
      transpose16(r);
      for (int kp = 0; kp < 16; ++kp) _mm512_storeu_si512(hs[hi].qp + dc * 512 + kp * 32, r[kp]);
    }
    std::memset(hs[hi].ot, 0, sizeof(float) * D * 16);
    hs[hi].m = neg_inf;
    hs[hi].l = _mm512_setzero_ps();
  }
  const int64_t last_key = std::min(a.L - 1, offset + r0 + 15);  // the block's last query's last key
  const int64_t steps = std::min(steps_all, last_key / 32 + 1);
  // With a window, query q sees keys from offset + r0 + q - window + 1; steps below the block's
  // first query's first key are skipped.
  const int64_t first_key = a.window > 0 ? offset + r0 - a.window + 1 : 0;
  const int64_t st0 = first_key > 0 ? first_key / 32 : 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Query q's last key: min(offset + r0 + q, L - 1).
  const __m512i limit = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32((int)(offset + r0))),
                                         _mm512_set1_epi32((int)(a.L - 1)));
  // Query q's first key (window): first_key + q; without one, every key from 0.
  const __m512i lower = a.window > 0 ? _mm512_add_epi32(lane, _mm512_set1_epi32((int)std::max<int64_t>(first_key, -(1 << 29))))
                                     : _mm512_set1_epi32(-(1 << 29));
  const __m512 scale2 = _mm512_set1_ps(a.scale * 1.44269504088896341f);  // log2(e) scale
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  alignas(64) uint16_t pt[512];  // P^T as a VNNI B tile: pt[kp][q][e] = P[q][2 kp + e]
  // 1. S^T of head hi for keys 32 st .. 32 st + 31 into tiles 0, 1. Issued one item ahead: the
  // tile unit computes the next (step, head)'s scores while the vector units run this softmax.
  auto scores = [&](int64_t st, int64_t hi) {
#if defined(PDSERVE_PREFILL_AMX)
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t dc = 0; dc < dcs; ++dc) {
      _tile_loadd(5, hs[hi].qp + dc * 512, 64);
      _tile_loadd(4, kt + ((2 * st) * dcs + dc) * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, kt + ((2 * st + 1) * dcs + dc) * 512, 64);
      _tile_dpbf16ps(1, 6, 5);
    }
#endif
  };
  if constexpr (Amx) scores(st0, 0);
  for (int64_t st = st0; st < steps; ++st) {
    // Some key past some query's limit, or (window) below some query's first key.
    const bool edge = 32 * st + 31 > offset + r0 || 32 * st + 31 >= a.L || (a.window > 0 && 32 * st < first_key + 15);
    for (int64_t hi = 0; hi < G; ++hi) {
      HeadState& h = hs[hi];
      if constexpr (Amx) {
#if defined(PDSERVE_PREFILL_AMX)
        _tile_stored(0, s, 64);
        _tile_stored(1, s + 256, 64);
        if (hi + 1 < G) scores(st, hi + 1);
        else if (st + 1 < steps) scores(st + 1, 0);
#endif
      } else {
        scores_avx512(kt, h.qp, st, dcs, s);
      }
      // 2. Online softmax, lane = query. Raw scores; the scale (> 0) is applied inside the
      // exponent: 2^(log2(e) scale s - log2(e) scale max). Four running maxima: one chain of 32
      // dependent maxes would take ~130 cycles.
      __m512 mx4[4] = {h.m, h.m, h.m, h.m};
      if (edge) {
        for (int64_t j = 0; j < 32; ++j) {
          const __m512i key = _mm512_set1_epi32((int)(32 * st + j));
          const __mmask16 ok = _mm512_cmp_epi32_mask(key, limit, _MM_CMPINT_LE) &
                               _mm512_cmp_epi32_mask(key, lower, _MM_CMPINT_NLT);
          const __m512 x = _mm512_mask_blend_ps(ok, neg_inf, _mm512_load_ps(s + j * 16));
          _mm512_store_ps(s + j * 16, x);
          mx4[j & 3] = _mm512_max_ps(mx4[j & 3], x);
        }
      } else {
        for (int64_t j = 0; j < 32; ++j) mx4[j & 3] = _mm512_max_ps(mx4[j & 3], _mm512_load_ps(s + j * 16));
      }
      const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
      // m = -inf at a query's first seen key: ~0; no key seen yet (window): 1, not exp(NaN).
      const __m512 alpha = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ),
                                                exp2_16(_mm512_mul_ps(_mm512_sub_ps(h.m, mx), scale2)),
                                                _mm512_set1_ps(1.f));
      h.m = mx;
      const __m512 mxs = _mm512_mul_ps(mx, scale2);
      __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
      for (int64_t kp = 0; kp < 16; ++kp) {
        const __m512 x0 = _mm512_load_ps(s + (2 * kp) * 16), x1 = _mm512_load_ps(s + (2 * kp + 1) * 16);
        __m512 p0 = exp2_16(_mm512_fmsub_ps(x0, scale2, mxs)), p1 = exp2_16(_mm512_fmsub_ps(x1, scale2, mxs));
        if (edge) {  // a masked key (x = -inf) gets exactly 0, not exp2_16's ~1e-38
          p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, neg_inf, _CMP_NEQ_OQ), p0);
          p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, neg_inf, _CMP_NEQ_OQ), p1);
        }
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
        // 3. [p0 (16 bf16) | p1 (16 bf16)] -> pairs (p0[q], p1[q]).
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_store_si512(pt + kp * 32, _mm512_permutexvar_epi16(interleave, both));
      }
      h.l = _mm512_fmadd_ps(h.l, alpha, _mm512_add_ps(sum0, sum1));
      // 4. O^T = alpha * O^T + V^T P^T (alpha is exactly 1 where the max did not move).
      float* ot = h.ot;
      if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
        for (int64_t d = 0; d < D; ++d) _mm512_store_ps(ot + d * 16, _mm512_mul_ps(_mm512_load_ps(ot + d * 16), alpha));
      if constexpr (Amx) {
#if defined(PDSERVE_PREFILL_AMX)
        _tile_loadd(3, pt, 64);
        for (int64_t db = 0; db < dbs; db += 2) {  // two chunks in flight (tiles 2 and 7)
          _tile_loadd(2, ot + db * 256, 64);
          _tile_loadd(4, vt + (db * steps_all + st) * 512, 64);
          _tile_loadd(7, ot + (db + 1) * 256, 64);
          _tile_loadd(6, vt + ((db + 1) * steps_all + st) * 512, 64);
          _tile_dpbf16ps(2, 4, 3);
          _tile_dpbf16ps(7, 6, 3);
          _tile_stored(2, ot + db * 256, 64);
          _tile_stored(7, ot + (db + 1) * 256, 64);
        }
#endif
      } else {
        values_avx512(vt, pt, st, steps_all, D, ot);
      }
    }
  }
  // out[r0 + q][h][d] = O^T[d][q] / l[q]: O^T's 16 x 16 fp32 blocks transposed into rows.
  const int64_t rows = std::min<int64_t>(16, a.n - r0);
  for (int64_t hi = 0; hi < G; ++hi) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), hs[hi].l));
    for (int64_t db = 0; db < dbs; ++db) {
      __m512i r[16];
      for (int d = 0; d < 16; ++d) r[d] = _mm512_load_si512(hs[hi].ot + db * 256 + d * 16);
      transpose16(r);
      for (int64_t q = 0; q < rows; ++q) {
        c10::BFloat16* dst = a.out + ((r0 + q) * a.H + h0 + hi) * D + db * 16;
        const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(r[q]), _mm512_set1_ps(inv[q]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
  }
}

template <bool Amx>
void run(const Args& a) {
  const int64_t steps = (a.L + 31) / 32, qblocks = (a.n + 15) / 16, group = a.H / a.KVH;
  const int64_t tiles_per_head = steps * 2 * (a.D / 32) * 512;  // kt; vt has the same size
  // The packed K/V of every kv head, in a buffer the calling thread keeps at its largest call's
  // size (pack_kv writes all of it; ~6 MB for SmolLM2 at 8k tokens): a fresh zeroed vector per
  // call (~0.8 MB for 530 tokens, past malloc's mmap threshold) cost page faults and a memset,
  // ~90 us of a ~520 us call on two threads.
  static thread_local std::vector<uint16_t> kv;
  const size_t kv_elems = static_cast<size_t>(a.KVH * 2 * tiles_per_head);
  if (kv.size() < kv_elems) kv.resize(kv_elems);
  // (A worker thread sees its own thread_local: the lambdas below take this pointer.)
  uint16_t* const kvp = kv.data();
  at::parallel_for(0, a.KVH, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      pack_kv(a, g, steps, kvp + g * 2 * tiles_per_head, kvp + (g * 2 + 1) * tiles_per_head);
  });
  // Work: (kv head, query block); a group of more than kMaxGroup heads goes in slices. Threads
  // pull items from a shared counter, the last query blocks (the most keys: causal) first, so
  // the uneven items balance themselves (a static split of the items in head order gave one of
  // two threads 1.4x the other's keys for a 542-token prompt). An item's bits do not depend on
  // the thread that runs it.
  constexpr int64_t kMaxGroup = 8;
  const int64_t slices = (group + kMaxGroup - 1) / kMaxGroup, per = (group + slices - 1) / slices;
  const int64_t items = a.KVH * slices * qblocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#if defined(PDSERVE_PREFILL_AMX)
    if constexpr (Amx) amx::load_tile_config();
#endif
    std::vector<uint16_t> qp(static_cast<size_t>(per * (a.D / 32) * 512));
    std::vector<float> ot(static_cast<size_t>(per * a.D * 16 + 16));  // + 16: room to align
    float* ot0 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ot.data()) + 63) & ~uintptr_t(63));
    HeadState hs[kMaxGroup];
    for (int64_t i = 0; i < per; ++i) {
      hs[i].qp = qp.data() + i * (a.D / 32) * 512;
      hs[i].ot = ot0 + i * a.D * 16;
    }
    alignas(64) float s[512];
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t qb = qblocks - 1 - w / (a.KVH * slices), g = (w / slices) % a.KVH, slice = w % slices;
      const int64_t h0 = g * group + slice * per, G = std::min(per, group - slice * per);
      block<Amx>(a, h0, G, qb * 16, steps, kvp + g * 2 * tiles_per_head,
                 kvp + (g * 2 + 1) * tiles_per_head, hs, s);
    }
#if defined(PDSERVE_PREFILL_AMX)
    if constexpr (Amx) _tile_release();
#endif
  });
}

bool amx_granted() {
#if defined(PDSERVE_PREFILL_AMX)
  return amx::permitted();
#else
  return false;
#endif
}
#endif

}  // namespace

bool prefill_attention_supported() {
#if defined(PDSERVE_PREFILL_AVX512)
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                 int64_t window) {
  TORCH_CHECK(prefill_attention_supported(), "prefill_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [n, H, D], k/v [L, KVH, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "prefill_attention: bfloat16 with heads contiguous in each token");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && L >= n && KVH > 0 && H % KVH == 0,
              "prefill_attention: shapes q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(D % 32 == 0 && D <= 256, "prefill_attention: head dim must be a multiple of 32, at most 256");
  TORCH_CHECK(L < (int64_t(1) << 30), "prefill_attention: context too long");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0");
  at::Tensor out = at::empty({n, H, D}, q.options());
#if defined(PDSERVE_PREFILL_AVX512)
  if (n) {
    Args a{static_cast<const uint16_t*>(q.data_ptr()), static_cast<const uint16_t*>(k.data_ptr()),
           static_cast<const uint16_t*>(v.data_ptr()), q.stride(0), k.stride(0), v.stride(0), n, L, H, KVH, D,
           window, static_cast<float>(scale), out.data_ptr<c10::BFloat16>()};
    if (amx_granted()) run<true>(a);
    else run<false>(a);
  }
#endif
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0) -> Tensor");
  m.def("prefill_attention_supported() -> bool", &pdserve::prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("prefill_attention", &pdserve::prefill_attention_cpu);
}

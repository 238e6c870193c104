// One work item of the paged decode attention kernel (paged_attention.cpp plans the items,
// merges split contexts and holds the op): every query head of one sequence attended to a
// range of its context over the paged KV pool, with an online softmax over 64-token tiles.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>

#include "lane_pairs.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pdserve {
namespace paged {

using namespace vec;  // f32x16, load32 / store32, reduce16, ... (lane_pairs.h)

constexpr int64_t kTile = 64;  // tokens per online-softmax step
constexpr int64_t kMaxVecs = 32;  // D <= 512
// V accumulators of up to kMaxHeads query heads stay in registers together (kMaxAccVecs vectors).
constexpr int64_t kMaxHeads = 4;
constexpr int64_t kMaxAccVecs = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Running softmax state of n query heads: max m [n], denominator l [n], numerator acc [n, D].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

struct Problem {
  const void* q;  // [B, H, D] contiguous
  const char* kv;
  int64_t kv_stride[4];  // elements: page, K/V, slot, kv head
  int64_t page_size;
  const int64_t* page_table;  // [B, max_pages] (converted to int64, contiguous)
  int64_t max_pages;
  const int64_t* ctx_lens;  // [B]
  int64_t kvh, groups, d;
  float scale;
  int64_t batch;  // sequences (rows of page_table)
};

// acc[g] = alpha[g] * acc[g] + sum_i w[g * kTile + i] * v_i for NG heads, each V row converted
// once for all of them; every head's sum runs over i in the same order as one head alone would.
// kC = 0: D from `d`, one head at a time (NG = 1).
template <typename T, int64_t kC, int64_t NG>
inline void accumulate_v(const T* const* krow, int64_t v_off, int64_t n, const float* __restrict w,
                         const float* alpha, float* __restrict acc, int64_t d) {
  static_assert(kC || NG == 1, "an unknown head dim takes one head at a time");
  const int64_t C = kC ? kC : d / kLanes;
  f32x16 a[NG][kC ? kC : kMaxVecs];
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c) a[g][c] = load16(acc + g * C * kLanes + c * kLanes) * alpha[g];
  for (int64_t i = 0; i < n; ++i) {
    const T* v = krow[i] + v_off;
    for (int64_t c = 0; c < C; c += 2) {
      f32x16 lo, hi;
      load32(v + c * kLanes, lo, hi);
      for (int64_t g = 0; g < NG; ++g) {
        const float wg = w[g * kTile + i];
        a[g][c] += wg * lo;
        a[g][c + 1] += wg * hi;
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c) store16(acc + g * C * kLanes + c * kLanes, a[g][c]);
}

// Slots of tokens [t, t + n) of one sequence (pages: its page table row): kv head h's K row is
// kv_stride[3] * h further, its V row kv_stride[1] more.
template <typename T>
inline void find_rows(const Problem& p, const int64_t* pages, int64_t t, int64_t n, const T** rows) {
  const T* base = reinterpret_cast<const T*>(p.kv);
  for (int64_t i = 0, pi = t / p.page_size, slot = t % p.page_size; i < n; ++i) {
    rows[i] = base + pages[pi] * p.kv_stride[0] + slot * p.kv_stride[2];
    if (++slot == p.page_size) {
      slot = 0;
      ++pi;
    }
  }
}

// An empty softmax state of H heads of D.
inline void reset_state(Partial st, int64_t H, int64_t D) {
  std::fill(st.m, st.m + H, kNegInf);
  std::fill(st.l, st.l + H, 0.f);
  std::fill(st.acc, st.acc + H * D, 0.f);
}

// Rows of the tile after [tt, tt + n) of sequence b's item (which ends at t1) into `next`; where
// that tile is the item's last, the first rows of this thread's likely next item (the next chunk,
// else the next sequence), to prefetch only. Returns how many.
template <typename T>
inline int64_t next_rows(const Problem& p, int64_t b, int64_t tt, int64_t n, int64_t t1, const T** next) {
  const int64_t* pages = p.page_table + b * p.max_pages;
  int64_t n_next = std::min(kTile, t1 - tt - n);
  find_rows(p, pages, tt + n, n_next, next);
  if (n_next == 0) {
    if (t1 < p.ctx_lens[b]) {
      n_next = std::min(kTile, p.ctx_lens[b] - t1);
      find_rows(p, pages, t1, n_next, next);
    } else if (b + 1 < p.batch) {
      n_next = std::min(kTile, p.ctx_lens[b + 1]);
      find_rows(p, p.page_table + (b + 1) * p.max_pages, 0, n_next, next);
    }
  }
  return n_next;
}

// Prefetch (into L2) the cache lines of [p, p + bytes): pages are scattered, so the hardware
// prefetcher loses the stream at every page boundary.
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* a = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(a + off, 0, 2);
}

// One head's K and V rows of a token of the next tile, as this one is read.
template <typename T>
inline void prefetch_row(const T* k_row, int64_t v_off, int64_t row_bytes) {
  prefetch_lines(k_row, row_bytes);
  prefetch_lines(k_row + v_off, row_bytes);
}

// Online softmax of one head over a tile: rescale the old state (m, l) to the new max and turn
// the scores sg[0, n) into weights (sg[n, kTile) become 0); returns the old state's factor.
inline float softmax_tile(float* sg, int64_t n, float& m, float& l) {
  std::fill(sg + n, sg + kTile, kNegInf);  // pad a short tile: fixed trip counts below
  const float mx = std::max(m, max_of<kTile>(sg));
  for (int64_t i = 0; i < kTile; ++i) sg[i] = i < n ? exp_nonpos(sg[i] - mx) : 0.f;
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mx);
  l = l * alpha + sum_of<kTile>(sg);
  m = mx;
  return alpha;
}

// The walk every variant shares: resets the state, then for each tile of [t0, t1) and each kv
// head h calls body(h, krow, n, next, n_next): krow[i] is head h's K row of the tile's token i
// (its V row kv_stride[1] further), next[i] + h * kv_stride[3] the same for the next tile's
// token i (n_next of them, to prefetch).
template <typename T, typename Body>
inline void walk_tiles(const Problem& p, int64_t b, int64_t t0, int64_t t1, Partial st, Body&& body) {
  const int64_t H = p.kvh * p.groups;
  reset_state(st, H, p.d);
  const int64_t* pages = p.page_table + b * p.max_pages;
  const T* rows_buf[3][kTile];
  const T** slot = rows_buf[0];
  const T** next = rows_buf[1];
  const T** krow = rows_buf[2];
  find_rows(p, pages, t0, std::min(kTile, t1 - t0), slot);
  for (int64_t tt = t0; tt < t1; tt += kTile) {
    const int64_t n = std::min(kTile, t1 - tt);
    const int64_t n_next = std::min(kTile, t1 - tt - n);
    find_rows(p, pages, tt + n, n_next, next);
    for (int64_t h = 0; h < p.kvh; ++h) {
      for (int64_t i = 0; i < n; ++i) krow[i] = slot[i] + h * p.kv_stride[3];
      body(h, static_cast<const T* const*>(krow), n, static_cast<const T* const*>(next), n_next);
    }
    std::swap(slot, next);
  }
}

// Scores of one kv head's G query heads over a tile, 16 tokens at a time: dot(i, part_i) leaves
// token i's 16-lane partial sums of head g at part_i + g * 256, and reduce16 folds 16 tokens'
// at once (hsum's order): s[g * kTile + i] = scale * that sum. (dot should capture by value:
// captured references are reloaded after every store to part, which GCC cannot rule out.) Each token's rows of the next
// tile are prefetched as this one's are read (spread over the tile: one burst measured slower).
template <typename T, typename Dot>
inline void tile_scores(const Problem& p, int64_t h, const T* const* next, int64_t n, int64_t n_next, float scale,
                        float* __restrict s, float* __restrict part, Dot&& dot) {
  const int64_t G = p.groups, hoff = h * p.kv_stride[3], row_bytes = p.d * static_cast<int64_t>(sizeof(T));
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t m = std::min(kLanes, n - i0);
    for (int64_t i = i0; i < i0 + m; ++i) {
      if (i < n_next) prefetch_row(next[i] + hoff, p.kv_stride[1], row_bytes);
      dot(i, part + (i - i0) * kLanes);
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t i = m; i < kLanes; ++i) store16(part + (g * kLanes + i) * kLanes, f32x16{});
      store16(s + g * kTile + i0, reduce16(part + g * kLanes * kLanes) * scale);
    }
  }
}

// The online softmax of every query head of kv head h over a tile (scores s [G, kTile] become
// weights), in groups of `per` heads whose V accumulators fit in registers together:
// group(g0, ng, alpha) adds the weighted V rows of heads [g0, g0 + ng), alpha their old
// state's factors.
template <typename Group>
inline void weigh_groups(const Problem& p, int64_t h, int64_t per, int64_t n, float* s, Partial st, Group&& group) {
  const int64_t G = p.groups;
  float alpha[kMaxHeads];
  for (int64_t g0 = 0; g0 < G; g0 += per) {
    const int64_t ng = std::min(per, G - g0);
    for (int64_t g = g0; g < g0 + ng; ++g)
      alpha[g - g0] = softmax_tile(s + g * kTile, n, st.m[h * G + g], st.l[h * G + g]);
    group(g0, ng, static_cast<const float*>(alpha));
  }
}

// Attends every query head of sequence b to tokens [t0, t1), leaving the unnormalized state
// in `st` (m [H], l [H], acc [H, D], acc in load32 lane order). Scratch: qf [H * D],
// s [G * kTile] then [G * 256]. A tile's tokens are visited once per kv head, in turn, so the
// heads of a slot are read one after another while its lines are in cache.
//
// kC = D / 16 vectors per row when known at compile time (0: from p.d): the row
// loops then have constant trip counts, and K and the V accumulators live in registers.
template <typename T, int64_t kC>
void attend_chunk(const Problem& p, int64_t b, int64_t t0, int64_t t1, Partial st,
                  float* __restrict qf, float* __restrict s) {
  const int64_t G = p.groups, D = p.d, C = kC ? kC : D / kLanes, H = p.kvh * G;
  float* __restrict part = s + G * kTile;  // [G, 16, 16]
  const T* q = static_cast<const T*>(p.q) + b * H * D;
  for (int64_t c = 0; c < H * C; c += 2) {
    f32x16 lo, hi;
    load32(q + c * kLanes, lo, hi);
    store32(qf + c * kLanes, lo * p.scale, hi * p.scale);  // fold the scale into q
  }
  const int64_t v_off = p.kv_stride[1];
  const int64_t per = kC ? std::clamp<int64_t>(kMaxAccVecs / kC, 1, kMaxHeads) : 1;
  walk_tiles<T>(p, b, t0, t1, st, [&](int64_t h, const T* const* krow, int64_t n, const T* const* next,
                                      int64_t n_next) {
    const float* qh = qf + h * G * D;
    // Scores s[g, i] = (scale * q_g) . k_{tt+i} in fp32 (the scale is in q).
    tile_scores(p, h, next, n, n_next, 1.f, s, part, [=](int64_t i, float* __restrict part_i) {
      f32x16 k[kC ? kC : kMaxVecs];
      for (int64_t c = 0; c < C; c += 2) load32(krow[i] + c * kLanes, k[c], k[c + 1]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qh + g * D;
        f32x16 a0 = {}, a1 = {};  // two chains hide the FMA latency
        for (int64_t c = 0; c < C; c += 2) {
          a0 += load16(qg + c * kLanes) * k[c];
          a1 += load16(qg + (c + 1) * kLanes) * k[c + 1];
        }
        store16(part_i + g * kLanes * kLanes, a0 + a1);
      }
    });
    // acc[g] = alpha * acc[g] + sum_i w[g, i] * v_{tt+i}, accumulated in registers.
    weigh_groups(p, h, per, n, s, st, [&](int64_t g0, int64_t ng, const float* alpha) {
      const float* wg = s + g0 * kTile;
      float* ag = st.acc + (h * G + g0) * D;
      if constexpr (kC == 0) {
        accumulate_v<T, kC, 1>(krow, v_off, n, wg, alpha, ag, D);  // per == 1
      } else {
        switch (ng) {
          case 1: accumulate_v<T, kC, 1>(krow, v_off, n, wg, alpha, ag, D); break;
          case 2: accumulate_v<T, kC, 2>(krow, v_off, n, wg, alpha, ag, D); break;
          case 3: accumulate_v<T, kC, 3>(krow, v_off, n, wg, alpha, ag, D); break;
          default: accumulate_v<T, kC, 4>(krow, v_off, n, wg, alpha, ag, D); break;
        }
      }
    });
  });
}

#if defined(__AVX512BF16__)
// ---- bf16 K/V with AVX512-BF16 dot products (vdpbf16ps) ----------------------------------
// The same tiles, page walk, prefetch and online softmax as attend_chunk; the products differ:
//   scores: q . k as vdpbf16ps over the raw bf16 rows (two products per lane and step, each
//     exact in fp32), the 16 lanes summed by reduce16, then times the scale;
//   values: acc += w_i v_i + w_j v_j for token pairs (i, j = i + 1), the softmax weights
//     rounded to bf16 (as the prefill kernel's P and SDPA's bf16 path), V's bf16 pairs of the
//     two tokens interleaved per lane so that the accumulators keep load32's lane order (lo:
//     even elements, hi: odd), which the merge and store_row expect.
// A short tile's missing partner token is the last one again with weight 0.

// acc[g] = alpha[g] * acc[g] + sum over token pairs for NG heads (wb: bf16 weights [G, kTile]).
template <int64_t kC, int64_t NG>
inline void accumulate_v_bf16(const c10::BFloat16* const* krow, int64_t v_off, int64_t n, const uint16_t* wb,
                              const float* alpha, float* __restrict acc) {
  constexpr int64_t C = kC;  // 16-lane vectors per row; blocks of 32 elements: C / 2
  __m512 a[NG][C];
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c)
      a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * C * kLanes + c * kLanes), _mm512_set1_ps(alpha[g]));
  const __mmask32 odd = 0xAAAAAAAAu;
  for (int64_t i = 0; i < n; i += 2) {
    const c10::BFloat16* vi = krow[i] + v_off;
    const c10::BFloat16* vj = (i + 1 < n ? krow[i + 1] : krow[i]) + v_off;
    for (int64_t c = 0; c < C; c += 2) {
      const __m512i x = _mm512_loadu_si512(vi + c * kLanes), y = _mm512_loadu_si512(vj + c * kLanes);
      // lane l: (x[2l], y[2l]) and (x[2l + 1], y[2l + 1])
      const __m512bh lo = (__m512bh)_mm512_mask_blend_epi16(odd, x, _mm512_slli_epi32(y, 16));
      const __m512bh hi = (__m512bh)_mm512_mask_blend_epi16(odd, _mm512_srli_epi32(x, 16), y);
      for (int64_t g = 0; g < NG; ++g) {
        int32_t pair;
        std::memcpy(&pair, wb + g * kTile + i, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        a[g][c] = _mm512_dpbf16_ps(a[g][c], lo, w);
        a[g][c + 1] = _mm512_dpbf16_ps(a[g][c + 1], hi, w);
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * C * kLanes + c * kLanes, a[g][c]);
}

// attend_chunk for bf16 K/V and D = 16 kC (kC in 4, 8, 16); kKVH, kG: the kv head count and the
// query heads per kv head where known at compile time (0: from p). qf is unused scratch here.
// A tile's scores come first for every kv head, token pair by token pair: a token's K rows of all
// heads are one dense run, so a page's K block is read front to back, and two tokens' partial sums
// take reduce16's first level in registers (reduce16_pairs does the rest; the same bits). Then
// the softmax and the V rows, head by head, as attend_chunk.
// Prefetch (into L2) runs 16 tokens ahead for K rows and one scores pass ahead for V rows (a
// token's V rows as its K rows are scored, read in the V pass after the tile's scores), so that
// the lines a step needs soon are in flight, not those of a whole tile ahead (the fill buffers
// are few: 16 x 585 tokens, one thread, 910 -> 815 us a layer); the last tile prefetches the
// first of the item this thread most likely takes next (the next chunk, else the next sequence).
template <int64_t kC, int64_t kKVH, int64_t kG>
void attend_chunk_bf16(const Problem& p, int64_t b, int64_t t0, int64_t t1, Partial st,
                       float* __restrict /*qf*/, float* __restrict s) {
  using T = c10::BFloat16;
  constexpr int64_t C = kC;
  constexpr int64_t kAhead = 16;  // tokens between a K row's prefetch and its use
  const int64_t G = kG ? kG : p.groups, KVH = kKVH ? kKVH : p.kvh, D = C * kLanes, H = KVH * G;
  float* __restrict part = s + H * kTile;  // [H, 8, 16]: reduce16's first level
  alignas(64) uint16_t wb[kMaxHeads * kTile];  // bf16 weights of a head group
  const T* q = static_cast<const T*>(p.q) + b * H * D;
  const int64_t v_off = p.kv_stride[1], hs = p.kv_stride[3];
  const int64_t tok_bytes = KVH * D * static_cast<int64_t>(sizeof(T));  // a token's rows, all heads
  constexpr int64_t per = std::clamp<int64_t>(kMaxAccVecs / kC, 1, kMaxHeads);
  reset_state(st, H, D);
  const int64_t* pages = p.page_table + b * p.max_pages;
  const T* rows_buf[3][kTile];
  const T** slot = rows_buf[0];
  const T** next = rows_buf[1];
  const T** krow = rows_buf[2];
  // (scale * q) . k as vdpbf16ps over the raw bf16 rows in two chains, 16 lanes of partial sums
  auto dot = [](const __m512bh* k, const T* qg) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t c = 0; c < C / 2; c += 2) {
      a0 = _mm512_dpbf16_ps(a0, k[c], (__m512bh)_mm512_loadu_si512(qg + c * 2 * kLanes));
      if (c + 1 < C / 2)
        a1 = _mm512_dpbf16_ps(a1, k[c + 1], (__m512bh)_mm512_loadu_si512(qg + (c + 1) * 2 * kLanes));
    }
    const __m512 sum = _mm512_add_ps(a0, a1);
    f32x16 r;
    std::memcpy(&r, &sum, sizeof r);
    return r;
  };
  find_rows(p, pages, t0, std::min(kTile, t1 - t0), slot);
  for (int64_t tt = t0; tt < t1; tt += kTile) {
    const int64_t n = std::min(kTile, t1 - tt);
    const int64_t n_next = next_rows(p, b, tt, n, t1, next);
    for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
      const int64_t m = std::min(kLanes, n - i0);
      for (int64_t j = 0; j < kLanes; j += 2) {
        if (j >= m) {  // past a short tile: zero rows
          for (int64_t hg = 0; hg < H; ++hg) store16(part + (hg * 8 + j / 2) * kLanes, f32x16{});
          continue;
        }
        const int64_t i = i0 + j;
        const bool two = j + 1 < m;
        for (int64_t e = i; e < i + 2; ++e) {
          const int64_t f = e + kAhead;
          if (f < n) prefetch_lines(slot[f], tok_bytes);
          else if (f - n < n_next) prefetch_lines(next[f - n], tok_bytes);
          if (e < n) prefetch_lines(slot[e] + v_off, tok_bytes);
        }
        for (int64_t h = 0; h < KVH; ++h) {
          __m512bh ka[C / 2], kb[C / 2];
          for (int64_t c = 0; c < C / 2; ++c) {
            ka[c] = (__m512bh)_mm512_loadu_si512(slot[i] + h * hs + c * 2 * kLanes);
            kb[c] = two ? (__m512bh)_mm512_loadu_si512(slot[i + 1] + h * hs + c * 2 * kLanes)
                        : (__m512bh)_mm512_setzero_si512();
          }
          for (int64_t g = 0; g < G; ++g) {
            const T* qg = q + (h * G + g) * D;
            const f32x16 va = dot(ka, qg);
            const f32x16 vb = two ? dot(kb, qg) : f32x16{};
            store16(part + ((h * G + g) * 8 + j / 2) * kLanes, pair_rows(va, vb));
          }
        }
      }
      for (int64_t hg = 0; hg < H; ++hg)
        store16(s + hg * kTile + i0, reduce16_pairs(part + hg * 8 * kLanes) * p.scale);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t i = 0; i < n; ++i) krow[i] = slot[i] + h * hs;
      float* sh = s + h * G * kTile;  // kv head h's scores [G, kTile]
      weigh_groups(p, h, per, n, sh, st, [&](int64_t g0, int64_t ng, const float* alpha) {
        for (int64_t g = 0; g < ng; ++g)  // the weights as bf16, rounded to nearest even
          for (int64_t i = 0; i < kTile; i += kLanes)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + g * kTile + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sh + (g0 + g) * kTile + i)));
        float* ag = st.acc + (h * G + g0) * D;
        const T* const* kr = krow;
        switch (ng) {
          case 1: accumulate_v_bf16<kC, 1>(kr, v_off, n, wb, alpha, ag); break;
          case 2: accumulate_v_bf16<kC, 2>(kr, v_off, n, wb, alpha, ag); break;
          case 3: accumulate_v_bf16<kC, 3>(kr, v_off, n, wb, alpha, ag); break;
          default: accumulate_v_bf16<kC, 4>(kr, v_off, n, wb, alpha, ag); break;
        }
      });
    }
    std::swap(slot, next);
  }
}
#endif  // __AVX512BF16__

// out[0, D) = acc * inv, from load32 lane order back to element order.
template <typename T>
inline void store_row(const float* acc, float inv, T* out, int64_t d) {
  for (int64_t j = 0; j < d; j += 2 * kLanes) {
    store32(out + j, load16(acc + j) * inv, load16(acc + j + kLanes) * inv);
  }
}

}  // namespace paged
}  // namespace pdserve

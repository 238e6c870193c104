// fp32 K/V on CPUs with AVX2 + FMA but no AVX-512 (paged_attention.cpp picks it there): the
// same work item as attend_chunk (include/paged_attention_item.h: tiles of kTile tokens, online
// softmax, split-K states in the same layout), written for
// sixteen 8-lane registers. attend_chunk's 16-lane vectors lower to pairs of ymm registers on
// such a CPU, and GCC keeps its K rows, partial sums and four heads' V accumulators on the
// stack (one thread, SmolLM2's shape, 4 sequences of 512 tokens: 1.22 ms a layer, ~2.6 GB/s).
// Here:
//   scores: blocks of 8 tokens x one query head, one accumulator per token (K rows as memory
//     operands, q's vector in a register), the 8 sums folded by a hadd tree (hsum8x8), every
//     kv head's before the V passes (a page's K block read front to back);
//   softmax: 8 lanes at a time (Cephes exp as lane_pairs.h's exp_nonpos, padded lanes 0);
//   values: up to 3 heads x 32 columns of accumulators (12 registers) per pass over the tile,
//     each V chunk loaded once for the heads, each weight broadcast once per token.
// Every output depends only on its sequence's rows and the chunk bounds, so a row's bits do
// not depend on the batch or the thread count (split-K is planned as for attend_chunk).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cephes_exp.h"
#include "paged_attention_item.h"

namespace pdserve {
namespace paged {

// Lane t = the sum of a[t]'s 8 lanes.
inline __m256 hsum8x8(const __m256 (&a)[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 x = _mm256_hadd_ps(s01, s23), y = _mm256_hadd_ps(s45, s67);  // 128-bit halves: lanes 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hadd8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0, 8 lanes (exp_nonpos's steps).
inline __m256 exp8_nonpos(__m256 x) {
  const __m256 round = _mm256_set1_ps(12582912.f);  // 1.5 * 2^23
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), round), round);
  const __m256 p = exp_reduced(x, n);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Online softmax of one head over a tile: scores sg[0, n) become weights (sg[n, round8(n)) 0).
inline float softmax_tile8(float* sg, int64_t n, float& m, float& l) {
  const int64_t n8 = (n + 7) / 8 * 8;
  std::fill(sg + n, sg + n8, kNegInf);
  __m256 mv = _mm256_set1_ps(kNegInf);
  for (int64_t i = 0; i < n8; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + i));
  const float mx = std::max(m, hmax8(mv));
  const __m256 mxv = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(kNegInf);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 x = _mm256_loadu_ps(sg + i);
    const __m256 w = _mm256_and_ps(exp8_nonpos(_mm256_sub_ps(x, mxv)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(sg + i, w);
    sum = _mm256_add_ps(sum, w);
  }
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mx);
  l = l * alpha + hadd8(sum);
  m = mx;
  return alpha;
}

// acc[g] = alpha[g] * acc[g] + sum_i w[g * kTile + i] * v_i for NG heads, 32 columns a pass.
template <int NG>
inline void accumulate_v8(const float* const* krow, int64_t v_off, int64_t n, const float* w, const float* alpha,
                          float* acc, int64_t d) {
  for (int64_t c0 = 0; c0 < d; c0 += 32) {
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g) {
      const __m256 al = _mm256_set1_ps(alpha[g]);
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + c0 + 8 * j), al);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* v = krow[i] + v_off + c0;
      __m256 wg[NG];
      for (int g = 0; g < NG; ++g) wg[g] = _mm256_broadcast_ss(w + g * kTile + i);
      for (int j = 0; j < 4; ++j) {
        const __m256 vj = _mm256_loadu_ps(v + 8 * j);
        for (int g = 0; g < NG; ++g) a[g][j] = _mm256_fmadd_ps(wg[g], vj, a[g][j]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + g * d + c0 + 8 * j, a[g][j]);
  }
}

// attend_chunk for fp32 K/V (any D multiple of 32); scratch as attend_chunk's. A tile's scores
// come first for every kv head, 8 tokens at a time (a token's K rows of all heads are one dense
// run, so a page's K block is read front to back), then the softmax and the V rows head by head.
// Prefetch runs kAhead tokens ahead for K rows and one scores pass ahead for V rows.
inline void attend_chunk_f32_avx2(const Problem& p, int64_t b, int64_t t0, int64_t t1, Partial st,
                                  float* __restrict qf, float* __restrict s) {
  constexpr int64_t kAhead = 16;
  const int64_t G = p.groups, D = p.d, KVH = p.kvh, H = KVH * G;
  const float* q = static_cast<const float*>(p.q) + b * H * D;
  for (int64_t j = 0; j < H * D; j += 8)  // fold the scale into q
    _mm256_storeu_ps(qf + j, _mm256_mul_ps(_mm256_loadu_ps(q + j), _mm256_set1_ps(p.scale)));
  const int64_t v_off = p.kv_stride[1], hs = p.kv_stride[3];
  const int64_t tok_bytes = KVH * D * static_cast<int64_t>(sizeof(float));  // a token's rows, all heads
  reset_state(st, H, D);
  const int64_t* pages = p.page_table + b * p.max_pages;
  const float* rows_buf[3][kTile];
  const float** slot = rows_buf[0];
  const float** next = rows_buf[1];
  const float** krow = rows_buf[2];
  find_rows(p, pages, t0, std::min(kTile, t1 - t0), slot);
  for (int64_t tt = t0; tt < t1; tt += kTile) {
    const int64_t n = std::min(kTile, t1 - tt);
    const int64_t n_next = next_rows(p, b, tt, n, t1, next);
    // Scores s[h * G + g, i] = (scale q_hg) . k_hi, 8 tokens at a time (a short block repeats its
    // last row; softmax_tile8 drops those lanes).
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      for (int64_t e = i0; e < i0 + 8; ++e) {
        const int64_t f = e + kAhead;
        if (f < n) prefetch_lines(slot[f], tok_bytes);
        else if (f - n < n_next) prefetch_lines(next[f - n], tok_bytes);
        if (e < n) prefetch_lines(slot[e] + v_off, tok_bytes);
      }
      const float* k0[8];
      for (int64_t t = 0; t < 8; ++t) k0[t] = slot[std::min(i0 + t, n - 1)];
      for (int64_t h = 0; h < KVH; ++h) {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf + (h * G + g) * D;
          __m256 acc[8];
          for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
          for (int64_t c = 0; c < D; c += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + c);
            for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0[t] + h * hs + c), acc[t]);
          }
          _mm256_storeu_ps(s + (h * G + g) * kTile + i0, hsum8x8(acc));
        }
      }
    }
    // acc[hg] = alpha * acc[hg] + sum_i w[hg, i] v_hi, up to 3 heads a pass.
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t i = 0; i < n; ++i) krow[i] = slot[i] + h * hs;
      float alpha[3];
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t ng = std::min<int64_t>(3, G - g0), hg = h * G + g0;
        for (int64_t g = 0; g < ng; ++g) alpha[g] = softmax_tile8(s + (hg + g) * kTile, n, st.m[hg + g], st.l[hg + g]);
        const float* wg = s + hg * kTile;
        float* ag = st.acc + hg * D;
        switch (ng) {
          case 1: accumulate_v8<1>(krow, v_off, n, wg, alpha, ag, D); break;
          case 2: accumulate_v8<2>(krow, v_off, n, wg, alpha, ag, D); break;
          default: accumulate_v8<3>(krow, v_off, n, wg, alpha, ag, D); break;
        }
      }
    }
    std::swap(slot, next);
  }
}

}  // namespace paged
}  // namespace pdserve
#endif  // __AVX2__ && __FMA__

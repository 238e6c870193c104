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

#include "lane_pairs.h"

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

// Attends every query head of sequence b to tokens [t0, t1), leaving the unnormalized state
// in `st` (m [H], l [H], acc [H, D], acc in load32 lane order). Scratch: qf [H * D],
// s [G * kTile] then [G * 256]. A tile's tokens are visited once per kv head, in turn, so the
// heads of a slot are read one after another while its lines are in cache; each head's rows
// of the next tile are prefetched while that head reads this tile (spread over the tile, not
// in one burst, which measured slower).
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
  std::fill(st.m, st.m + H, kNegInf);
  std::fill(st.l, st.l + H, 0.f);
  std::fill(st.acc, st.acc + H * D, 0.f);

  const T* base = reinterpret_cast<const T*>(p.kv);
  const int64_t v_off = p.kv_stride[1];
  const int64_t* pages = p.page_table + b * p.max_pages;
  // Slots of tokens [t, t + n): kv head h's K row is kv_stride[3] * h further, its V row v_off more.
  auto find_rows = [&](int64_t t, int64_t n, const T** rows) {
    for (int64_t i = 0, pi = t / p.page_size, slot = t % p.page_size; i < n; ++i) {
      rows[i] = base + pages[pi] * p.kv_stride[0] + slot * p.kv_stride[2];
      if (++slot == p.page_size) {
        slot = 0;
        ++pi;
      }
    }
  };
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const T* rows_buf[3][kTile];
  const T** slot = rows_buf[0];
  const T** next = rows_buf[1];
  const T** krow = rows_buf[2];
  find_rows(t0, std::min(kTile, t1 - t0), slot);

  for (int64_t tt = t0; tt < t1; tt += kTile) {
    const int64_t n = std::min(kTile, t1 - tt);
    const int64_t n_next = std::min(kTile, t1 - tt - n);
    find_rows(tt + n, n_next, next);
    for (int64_t h = 0; h < p.kvh; ++h) {
      const int64_t hoff = h * p.kv_stride[3];
      for (int64_t i = 0; i < n; ++i) krow[i] = slot[i] + hoff;
      float* qh = qf + h * G * D;
      float* mh = st.m + h * G;
      float* lh = st.l + h * G;
      float* acc = st.acc + h * G * D;

      // Scores s[g, i] = (scale * q_g) . k_{tt+i}, 16 tokens at a time: each token's 16-lane
      // partial sums go to `part`, and reduce16 folds 16 of them at once (hsum's order).
      for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
        const int64_t m = std::min(kLanes, n - i0);
        for (int64_t i = i0; i < i0 + m; ++i) {
          if (i < n_next) {
            // Prefetch (into L2) this head's rows of the next tile as this one is read: pages
            // are scattered, so the hardware prefetcher loses the stream at every page boundary.
            const char* k = reinterpret_cast<const char*>(next[i] + hoff);
            const char* v = reinterpret_cast<const char*>(next[i] + hoff + v_off);
            for (int64_t off = 0; off < row_bytes; off += 64) {
              __builtin_prefetch(k + off, 0, 2);
              __builtin_prefetch(v + off, 0, 2);
            }
          }
          f32x16 k[kC ? kC : kMaxVecs];
          for (int64_t c = 0; c < C; c += 2) load32(krow[i] + c * kLanes, k[c], k[c + 1]);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qh + g * D;
            f32x16 a0 = {}, a1 = {};  // two chains hide the FMA latency
            for (int64_t c = 0; c < C; c += 2) {
              a0 += load16(qg + c * kLanes) * k[c];
              a1 += load16(qg + (c + 1) * kLanes) * k[c + 1];
            }
            store16(part + (g * kLanes + i - i0) * kLanes, a0 + a1);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = m; i < kLanes; ++i) store16(part + (g * kLanes + i) * kLanes, f32x16{});
          store16(s + g * kTile + i0, reduce16(part + g * kLanes * kLanes));
        }
      }

      // Query heads in groups whose V accumulators fit in registers together.
      const int64_t per = kC ? std::clamp<int64_t>(kMaxAccVecs / kC, 1, kMaxHeads) : 1;
      float alpha[kMaxHeads];
      for (int64_t g0 = 0; g0 < G; g0 += per) {
        const int64_t ng = std::min(per, G - g0);
        for (int64_t g = g0; g < g0 + ng; ++g) {
          // Online softmax: rescale the old state to the new max, turn scores into weights.
          float* sg = s + g * kTile;
          std::fill(sg + n, sg + kTile, kNegInf);  // pad a short tile: fixed trip counts below
          const float mx = std::max(mh[g], max_of<kTile>(sg));
          for (int64_t i = 0; i < kTile; ++i) sg[i] = i < n ? exp_nonpos(sg[i] - mx) : 0.f;
          alpha[g - g0] = mh[g] == kNegInf ? 0.f : std::exp(mh[g] - mx);
          lh[g] = lh[g] * alpha[g - g0] + sum_of<kTile>(sg);
          mh[g] = mx;
        }
        // acc[g] = alpha * acc[g] + sum_i w[g, i] * v_{tt+i}, accumulated in registers.
        const float* wg = s + g0 * kTile;
        float* ag = acc + g0 * D;
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
      }
    }
    std::swap(slot, next);
  }
}

// out[0, D) = acc * inv, from load32 lane order back to element order.
template <typename T>
inline void store_row(const float* acc, float inv, T* out, int64_t d) {
  for (int64_t j = 0; j < d; j += 2 * kLanes) {
    store32(out + j, load16(acc + j) * inv, load16(acc + j + kLanes) * inv);
  }
}

}  // namespace paged
}  // namespace pdserve

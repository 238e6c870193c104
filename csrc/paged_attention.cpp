// CPU decode attention over the paged KV pool: one query token per sequence,
// registered as torch.ops.pdserve.paged_decode_attention (loader:
// engine/layers/paged_attention_op.py).
//
//   q          [B, H, D]                      bf16 / fp16 / fp32, contiguous
//   kv         [P, 2, page_size, KVH, D]      same dtype; dim 1: 0 = K, 1 = V; any
//                                             strides for dims 0-2, [KVH, D] dense
//   page_table [B, max_pages]                 int32 / int64 page ids
//   ctx_lens   [B]                            int32 / int64; token t of sequence b
//                                             is kv[page_table[b, t / ps], :, t % ps]
//   out        [B, H, D]                      softmax(scale * q.k) @ v, q's dtype
//   D must be a multiple of 32 and at most 512.
//
// A work item is (sequence, context chunk). It streams its tokens in tiles of
// kTile, visiting each tile once per kv head in turn (the tile's slots stay in
// cache between heads): score every K row against all G = H / KVH query heads of
// that kv head (16 rows' partial sums reduced together, in a scalar fold's order),
// update the running max and denominator (online softmax), then add the weighted V
// rows into the fp32 accumulators of up to four heads at once, held in registers
// across the tile (each V row converted once for them). K/V rows are converted to
// fp32 as they are loaded; each head's rows of the next tile are prefetched while
// that head reads this one. When there are fewer sequences than threads, long
// contexts are cut into chunks whose partial softmax states are merged at the end
// (split-K, "flash-decoding"). Threads pull items from a shared counter, so ragged
// context lengths balance themselves.
//
// Vector code uses the GCC/Clang vector extensions (16-float vectors, lowered to
// whatever the -march allows), not per-ISA intrinsics; only fp16 loads use F16C.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cephes_exp.h"

// 64-byte vectors passed between functions warn about an ABI change when the
// target lacks AVX-512; every such function here is internal and inlined.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace pdserve {
namespace {

constexpr int64_t kTile = 64;  // tokens per online-softmax step
constexpr int64_t kLanes = 16;  // floats per vector
constexpr int64_t kMaxVecs = 32;  // D <= 512
// V accumulators of up to kMaxHeads query heads stay in registers together (kMaxAccVecs vectors).
constexpr int64_t kMaxHeads = 4;
constexpr int64_t kMaxAccVecs = 16;
// Split-K only when every chunk keeps at least this many tokens: a chunk costs
// one extra partial state (H * (D + 2) floats) and a merge.
constexpr int64_t kMinChunk = 512;
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMinRowsPerThread = 2048;  // K+V rows of one kv head
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// ---- 32-element blocks as two fp32 vectors ------------------------------------
//
// load32 turns 32 consecutive elements into two fp32 vectors, and store32 undoes
// it. The lane order is the type's own: bf16 splits even and odd elements (one
// shift or mask per vector instead of a widening shuffle), the others keep the
// natural order. q, K and V go through the same load32, so dot products are
// unaffected, and the fp32 accumulators keep that order until store32.

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline void load32(const float* p, f32x16& lo, f32x16& hi) {
  lo = load16(p);
  hi = load16(p + kLanes);
}

inline void store32(float* p, f32x16 lo, f32x16 hi) {
  store16(p, lo);
  store16(p + kLanes, hi);
}

// lo = elements 0, 2, .., 30 and hi = 1, 3, .., 31: a bf16 is the top half of an fp32.
inline void load32(const c10::BFloat16* p, f32x16& lo, f32x16& hi) {
  u32x16 pairs;  // element 2l in the low half of lane l, 2l + 1 in the high half
  std::memcpy(&pairs, p, sizeof pairs);
  const u32x16 even = pairs << 16, odd = pairs & 0xFFFF0000u;
  std::memcpy(&lo, &even, sizeof lo);
  std::memcpy(&hi, &odd, sizeof hi);
}

inline u32x16 round_to_bf16(f32x16 v) {  // fp32 bits rounded to the nearest even bf16 (top half)
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const u32x16 nan = (bits | 0x00400000u) & 0xFFFF0000u;  // keep NaNs NaN (quiet)
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

inline void store32(c10::BFloat16* p, f32x16 lo, f32x16 hi) {
  const u32x16 pairs = (round_to_bf16(lo) >> 16) | round_to_bf16(hi);
  std::memcpy(p, &pairs, sizeof pairs);
}

inline void load32(const c10::Half* p, f32x16& lo, f32x16& hi) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kLanes)));
  std::memcpy(&lo, &a, sizeof lo);
  std::memcpy(&hi, &b, sizeof hi);
#elif defined(__F16C__)
  __m256 parts[4];
  for (int64_t j = 0; j < 4; ++j) {
    parts[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j)));
  }
  std::memcpy(&lo, parts, sizeof lo);
  std::memcpy(&hi, parts + 2, sizeof hi);
#else
  for (int64_t l = 0; l < kLanes; ++l) {
    lo[l] = static_cast<float>(p[l]);
    hi[l] = static_cast<float>(p[kLanes + l]);
  }
#endif
}

inline void store32(c10::Half* p, f32x16 lo, f32x16 hi) {
  for (int64_t l = 0; l < kLanes; ++l) {
    p[l] = static_cast<c10::Half>(lo[l]);  // round to nearest even
    p[kLanes + l] = static_cast<c10::Half>(hi[l]);
  }
}

// ---- math --------------------------------------------------------------------

inline float hsum(f32x16 v) {  // folds halves: 4 shuffle + add steps
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane t of the result = hsum(row t) of p [16, 16], with hsum's additions in hsum's order (so
// the same bits): rows are paired at each level so that one vector add serves 2, 4, 8 rows.
inline f32x16 reduce16(const float* p) {
  f32x16 x[8], y[4], z[2];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: row 2k's v[j] + v[j + 8]; 8-15: row 2k + 1's
    const f32x16 a = load16(p + 32 * k), b = load16(p + 32 * k + 16);
    x[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: row 4k + L's a[j] + a[j + 4]
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // lane L: (b0 + b2, b1 + b3) of row 8k + L, then of row 8k + 4 + L
    z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(y[2 * k], y[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // lane L, element j: row L + 4 j
  const f32x16 r = __builtin_shufflevector(z[0], z[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
                   __builtin_shufflevector(z[0], z[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  return __builtin_shufflevector(r, r, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// max / sum of x[0, kTile), in 16 lanes folded at the end. A plain `s += x[i]`
// loop does not vectorize without -ffast-math, and gcc ends `omp simd reduction`
// with 16 dependent scalar adds.
inline float max_of_tile(const float* __restrict x) {
  f32x16 m = load16(x);
  for (int64_t i = kLanes; i < kTile; i += kLanes) {
    const f32x16 v = load16(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int64_t l = 1; l < kLanes; ++l) r = std::max(r, m[l]);
  return r;
}

inline float sum_of_tile(const float* __restrict x) {
  f32x16 s = load16(x);
  for (int64_t i = kLanes; i < kTile; i += kLanes) s += load16(x + i);
  return hsum(s);
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp). Inputs below -87 give ~1e-38 instead of 0, which no softmax notices.
inline float exp_nonpos(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = std::max(x, -87.f);
  // n = round(x / ln 2); std::floor would not vectorize without -fno-trapping-math.
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float p = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Running softmax state of G query heads: max m, denominator l, numerator acc [G, D].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// ---- the per-item kernel ------------------------------------------------------

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
// kC = 0: D from `d` (the caller then passes one head at a time).
template <typename T, int64_t kC, int64_t NG>
inline void accumulate_v(const T* const* krow, int64_t v_off, int64_t n, const float* __restrict w,
                         const float* alpha, float* __restrict acc, int64_t d) {
  const int64_t C = kC ? kC : d / kLanes;
  if (!kC && NG > 1) return;  // never called: keeps the unused instances small
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
// s [G * kTile] then [G * 256]. A tile's tokens are visited once per kv head, in turn; the tile's K and V slots
// (all kv heads: one contiguous run per page) are prefetched while the tile before is read, so
// memory is read in whole slots, not one head's third of each.
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
          const float mx = std::max(mh[g], max_of_tile(sg));
          for (int64_t i = 0; i < kTile; ++i) sg[i] = i < n ? exp_nonpos(sg[i] - mx) : 0.f;
          alpha[g - g0] = mh[g] == kNegInf ? 0.f : std::exp(mh[g] - mx);
          lh[g] = lh[g] * alpha[g - g0] + sum_of_tile(sg);
          mh[g] = mx;
        }
        // acc[g] = alpha * acc[g] + sum_i w[g, i] * v_{tt+i}, accumulated in registers.
        const float* wg = s + g0 * kTile;
        float* ag = acc + g0 * D;
        switch (ng) {
          case 1: accumulate_v<T, kC, 1>(krow, v_off, n, wg, alpha, ag, D); break;
          case 2: accumulate_v<T, kC, 2>(krow, v_off, n, wg, alpha, ag, D); break;
          case 3: accumulate_v<T, kC, 3>(krow, v_off, n, wg, alpha, ag, D); break;
          default: accumulate_v<T, kC, 4>(krow, v_off, n, wg, alpha, ag, D); break;
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

// How many chunks to cut each sequence's context into: the fewest that minimize
// the rounds of work per thread, ceil(pairs * s / threads) / s, with chunks of at
// least kMinChunk tokens.
int64_t choose_splits(int64_t pairs, int64_t threads, int64_t max_ctx) {
  const int64_t cap = std::min(kMaxSplits, std::max<int64_t>(1, max_ctx / kMinChunk));
  int64_t best = 1;
  double best_cost = static_cast<double>((pairs + threads - 1) / threads);
  for (int64_t s = 2; s <= cap; ++s) {
    const double cost = static_cast<double>((pairs * s + threads - 1) / threads) / s;
    if (cost < best_cost * 0.95) {  // a split must pay for its merge
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// Runs fn(item, scratch) for item in [0, n) on the intra-op threads, each thread
// pulling the next item from a shared counter; scratch is the thread's own arena.
template <typename Fn>
void for_each_item(int64_t n, int64_t threads, int64_t scratch_floats, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(n, threads), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i, scratch.data());
  });
}

// The thread count split-K is planned for (0: torch's current one). A rank that borrows idle
// cores for some steps pins it to its own count, so that a sequence's context is cut the same
// way (and its result has the same bits) at any thread count it runs with.
std::atomic<int64_t> g_split_threads{0};

template <typename T>
void run(const Problem& p, int64_t batch, at::Tensor& out) {
  const int64_t G = p.groups, D = p.d, KVH = p.kvh, H = G * KVH;
  int64_t max_ctx = 0, rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    max_ctx = std::max(max_ctx, p.ctx_lens[b]);
    rows += p.ctx_lens[b] * KVH;
  }
  // Waking a thread costs more than a few thousand rows of work.
  const int64_t threads =
      std::clamp<int64_t>(rows / kMinRowsPerThread, 1, std::max(1, at::get_num_threads()));
  const int64_t pinned = g_split_threads.load(std::memory_order_relaxed);
  const int64_t splits =
      choose_splits(batch, pinned > 0 ? std::clamp<int64_t>(rows / kMinRowsPerThread, 1, pinned) : threads, max_ctx);
  auto* attend = D == 64    ? &attend_chunk<T, 4>
                 : D == 128 ? &attend_chunk<T, 8>
                 : D == 256 ? &attend_chunk<T, 16>
                            : &attend_chunk<T, 0>;
  // Scratch per thread: qf [H, D], s [G, kTile + 256], then a state m [H], l [H], acc [H, D].
  const int64_t state = H * (D + 2);
  const int64_t s_floats = G * (kTile + kLanes * kLanes);
  const int64_t scratch = H * D + s_floats + state;
  T* o = out.data_ptr<T>();

  auto chunk_range = [&](int64_t b, int64_t c) {
    const int64_t len = p.ctx_lens[b];
    // Chunk lengths are whole tiles so that only the last tile of a chunk is partial.
    const int64_t per = ((len + splits - 1) / splits + kTile - 1) / kTile * kTile;
    return std::pair<int64_t, int64_t>{std::min(len, c * per), std::min(len, (c + 1) * per)};
  };

  // A work item is a sequence (splits == 1) or one chunk of its context.
  if (splits == 1) {
    for_each_item(batch, threads, scratch, [&](int64_t b, float* w) {
      T* dst = o + b * H * D;
      if (p.ctx_lens[b] == 0) {
        std::fill(dst, dst + H * D, static_cast<T>(0.f));
        return;
      }
      float *qf = w, *s = qf + H * D, *st_m = s + s_floats;
      Partial st{st_m, st_m + H, st_m + 2 * H};
      attend(p, b, 0, p.ctx_lens[b], st, qf, s);
      for (int64_t g = 0; g < H; ++g) store_row(st.acc + g * D, 1.f / st.l[g], dst + g * D, D);
    });
    return;
  }

  // Split-K: partial states [batch, splits] x {m [H], l [H], acc [H, D]}, then merge.
  std::vector<float> partials(batch * splits * state);
  for_each_item(batch * splits, threads, scratch, [&](int64_t item, float* w) {
    const int64_t b = item / splits, c = item % splits;
    float* ps = partials.data() + item * state;
    Partial st{ps, ps + H, ps + 2 * H};
    const auto [t0, t1] = chunk_range(b, c);
    if (t0 >= t1) {  // an empty chunk merges with weight 0
      std::fill(ps, ps + H, kNegInf);
      std::fill(ps + H, ps + state, 0.f);
      return;
    }
    attend(p, b, t0, t1, st, w, w + H * D);
  });
  for_each_item(batch, threads, scratch, [&](int64_t b, float* w) {
    float* res = w;  // [D]
    for (int64_t g = 0; g < H; ++g) {
      float mx = kNegInf;
      for (int64_t c = 0; c < splits; ++c) mx = std::max(mx, partials[(b * splits + c) * state + g]);
      std::fill(res, res + D, 0.f);
      float l = 0.f;
      if (mx != kNegInf) {
        for (int64_t c = 0; c < splits; ++c) {
          const float* ps = partials.data() + (b * splits + c) * state;
          const float wgt = std::exp(ps[g] - mx);  // 0 for an empty chunk
          l += wgt * ps[H + g];
          const float* a = ps + 2 * H + g * D;
          for (int64_t j = 0; j < D; ++j) res[j] += wgt * a[j];
        }
        l = 1.f / l;
      }  // else ctx_len == 0: zeros
      store_row(res, l, o + (b * H + g) * D, D);
    }
  });
}

// ---- the op --------------------------------------------------------------------

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& kv,
                                      const at::Tensor& page_table, const at::Tensor& ctx_lens,
                                      double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]; got shape ", q.sizes());
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2,
              "kv must be [num_pages, 2, page_size, KVH, D]; got shape ", kv.sizes());
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && page_table.device().is_cpu() &&
                  ctx_lens.device().is_cpu(),
              "paged_decode_attention (CPU kernel): all tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ: ", q.scalar_type(),
              " vs ", kv.scalar_type());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_decode_attention supports float32, bfloat16 and float16; got ", dtype);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = kv.size(0), ps = kv.size(2), KVH = kv.size(3);
  TORCH_CHECK(kv.size(4) == D, "head dims differ: q has ", D, ", kv has ", kv.size(4));
  TORCH_CHECK(D % (2 * kLanes) == 0 && D <= kLanes * kMaxVecs,
              "paged_decode_attention needs a head dim that is a multiple of 32, at most 512; got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads (", H, ") must be a multiple of kv heads (",
              KVH, ")");
  TORCH_CHECK(kv.stride(4) == 1 && (KVH == 1 || kv.stride(3) == D),
              "kv rows must be dense: the innermost [KVH, D] needs strides [", D, ", 1]; got ",
              kv.strides());
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == B,
              "page_table must be [B, max_pages] with B = ", B, "; got shape ", page_table.sizes());
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.size(0) == B,
              "ctx_lens must be [B] with B = ", B, "; got shape ", ctx_lens.sizes());
  for (const auto* t : {&page_table, &ctx_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong || t->scalar_type() == at::kInt,
                "page_table and ctx_lens must be int32 or int64; got ", t->scalar_type());
  }

  const at::Tensor qc = q.contiguous();
  const at::Tensor table = page_table.to(at::kLong).contiguous();
  const at::Tensor lens = ctx_lens.to(at::kLong).contiguous();
  const int64_t max_pages = table.size(1);
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  // Validate every page a sequence reads before touching memory.
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= max_pages * ps, "ctx_lens[", b, "] = ", lp[b],
                " is outside [0, max_pages * page_size = ", max_pages * ps, "]");
    for (int64_t i = 0; i < (lp[b] + ps - 1) / ps; ++i) {
      const int64_t pg = tp[b * max_pages + i];
      TORCH_CHECK(pg >= 0 && pg < P, "page_table[", b, ", ", i, "] = ", pg,
                  " is out of range for a pool of ", P, " pages");
    }
  }

  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B == 0 || H == 0 || D == 0) return out;
  Problem p{qc.const_data_ptr(),
            static_cast<const char*>(kv.const_data_ptr()),
            {kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3)},
            ps, tp, max_pages, lp, KVH, H / KVH, D, static_cast<float>(scale)};
  switch (dtype) {
    case at::kFloat: run<float>(p, B, out); break;
    case at::kBFloat16: run<c10::BFloat16>(p, B, out); break;
    default: run<c10::Half>(p, B, out); break;
  }
  return out;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor ctx_lens, "
      "float scale) -> Tensor");
  m.def("set_decode_split_threads(int n) -> ()",
        [](int64_t n) { pdserve::g_split_threads.store(std::max<int64_t>(0, n)); });
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &pdserve::paged_decode_attention_cpu);
}

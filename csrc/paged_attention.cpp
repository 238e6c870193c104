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
//
// A work item is (sequence, kv head, context chunk). It streams its tokens in
// tiles of kTile: convert each K row to fp32 once, score it against all G = H / KVH
// query heads of that kv head, update the running max / denominator (online
// softmax), then convert each V row once and accumulate it into G fp32 rows.
// When there are fewer (sequence, kv head) pairs than threads, long contexts are
// cut into chunks whose partial softmax states are merged at the end (split-K,
// "flash-decoding"). Threads pull items from a shared counter, so ragged context
// lengths balance themselves.
//
// Loops are written for gcc's auto-vectorizer (-O3 -fopenmp; `omp simd` marks
// the reductions, which it may not reorder on its own). exp() is a polynomial so
// that it vectorizes too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve {
namespace {

constexpr int64_t kTile = 64;  // tokens per online-softmax step
// Split-K only when every chunk keeps at least this many tokens: a chunk costs
// one extra partial state (G * (D + 2) floats) and a merge.
constexpr int64_t kMinChunk = 512;
constexpr int64_t kMaxSplits = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- element loads and stores ------------------------------------------------

inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;  // bf16 is the top half of fp32
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[i] = f;
  }
}

inline void load_row(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);  // round to nearest even
}

// A K or V row as fp32: fp32 rows are read in place, others are converted into buf.
template <typename T>
inline const float* row_f32(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, buf, n);
    return buf;
  }
}

// ---- math --------------------------------------------------------------------

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// ~1 ulp). Inputs below -87 give ~1e-38 instead of 0, which no softmax notices.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
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

// Attends query heads [kvh * G, (kvh + 1) * G) of sequence b to tokens [t0, t1),
// leaving the unnormalized state in `st`. Scratch: qf [G*D], kbuf/vbuf [D], s [G*kTile].
template <typename T>
void attend_chunk(const Problem& p, int64_t b, int64_t h, int64_t t0, int64_t t1, Partial st,
                  float* qf, float* kbuf, float* vbuf, float* s) {
  const int64_t G = p.groups, D = p.d;
  const T* q = static_cast<const T*>(p.q) + (b * p.kvh + h) * G * D;
  load_row(q, qf, G * D);
  for (int64_t i = 0; i < G * D; ++i) qf[i] *= p.scale;  // fold the scale into q
  for (int64_t g = 0; g < G; ++g) {
    st.m[g] = kNegInf;
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + G * D, 0.f);

  const T* base = reinterpret_cast<const T*>(p.kv) + h * p.kv_stride[3];
  const int64_t* pages = p.page_table + b * p.max_pages;
  const T* krow[kTile];  // K row of each token in the tile; its V row is kv_stride[1] further

  for (int64_t tt = t0; tt < t1; tt += kTile) {
    const int64_t n = std::min(kTile, t1 - tt);
    for (int64_t i = 0, pi = tt / p.page_size, slot = tt % p.page_size; i < n; ++i) {
      krow[i] = base + pages[pi] * p.kv_stride[0] + slot * p.kv_stride[2];
      if (++slot == p.page_size) {
        slot = 0;
        ++pi;
      }
    }
    // Scores s[g, i] = (scale * q_g) . k_{tt+i}
    for (int64_t i = 0; i < n; ++i) {
      const float* k = row_f32(krow[i], kbuf, D);
      for (int64_t g = 0; g < G; ++g) s[g * kTile + i] = dot(qf + g * D, k, D);
    }
    // Online softmax: rescale the old state to the new max, turn scores into weights.
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * kTile;
      float mx = st.m[g];
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sg[i] = exp_nonpos(sg[i] - mx);
        sum += sg[i];
      }
      if (mx != st.m[g]) {
        const float alpha = st.m[g] == kNegInf ? 0.f : std::exp(st.m[g] - mx);
        float* a = st.acc + g * D;
        for (int64_t j = 0; j < D; ++j) a[j] *= alpha;
        st.l[g] *= alpha;
        st.m[g] = mx;
      }
      st.l[g] += sum;
    }
    // acc[g] += sum_i w[g, i] * v_{tt+i}
    for (int64_t i = 0; i < n; ++i) {
      const float* v = row_f32(krow[i] + p.kv_stride[1], vbuf, D);
      for (int64_t g = 0; g < G; ++g) {
        const float w = s[g * kTile + i];
        float* a = st.acc + g * D;
        for (int64_t j = 0; j < D; ++j) a[j] += w * v[j];
      }
    }
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

// Runs fn(item) for item in [0, n) on the intra-op threads, each thread pulling the
// next item from a shared counter; fn gets the calling thread's scratch arena.
template <typename Fn>
void for_each_item(int64_t n, int64_t threads, int64_t scratch_floats, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(n, threads), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i, scratch.data());
  });
}

template <typename T>
void run(const Problem& p, int64_t batch, at::Tensor& out) {
  const int64_t G = p.groups, D = p.d, KVH = p.kvh;
  const int64_t pairs = batch * KVH;
  const int64_t threads = at::get_num_threads();
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < batch; ++b) max_ctx = std::max(max_ctx, p.ctx_lens[b]);
  const int64_t splits = choose_splits(pairs, threads, max_ctx);
  // Scratch per thread: qf [G*D], kbuf [D], vbuf [D], s [G*kTile], m [G], l [G], acc [G*D]
  const int64_t scratch = 2 * G * D + 2 * D + G * kTile + 2 * G;
  T* o = out.data_ptr<T>();

  auto chunk_range = [&](int64_t b, int64_t c) {
    const int64_t len = p.ctx_lens[b];
    // Chunk lengths are whole tiles so that only the last tile of a chunk is partial.
    const int64_t per = ((len + splits - 1) / splits + kTile - 1) / kTile * kTile;
    return std::pair<int64_t, int64_t>{std::min(len, c * per), std::min(len, (c + 1) * per)};
  };

  if (splits == 1) {
    for_each_item(pairs, threads, scratch, [&](int64_t item, float* w) {
      const int64_t b = item / KVH, h = item % KVH;
      T* dst = o + item * G * D;
      if (p.ctx_lens[b] == 0) {
        std::fill(dst, dst + G * D, static_cast<T>(0.f));
        return;
      }
      float *qf = w, *kbuf = qf + G * D, *vbuf = kbuf + D, *s = vbuf + D;
      Partial st{s + G * kTile, s + G * kTile + G, s + G * kTile + 2 * G};
      attend_chunk<T>(p, b, h, 0, p.ctx_lens[b], st, qf, kbuf, vbuf, s);
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / st.l[g];
        float* a = st.acc + g * D;
        for (int64_t j = 0; j < D; ++j) a[j] *= inv;
        store_row(a, dst + g * D, D);
      }
    });
    return;
  }

  // Split-K: partial states [pairs, splits] x {m [G], l [G], acc [G, D]}, then merge.
  const int64_t state = G * (D + 2);
  std::vector<float> partials(pairs * splits * state);
  for_each_item(pairs * splits, threads, scratch, [&](int64_t item, float* w) {
    const int64_t pair = item / splits, c = item % splits;
    const int64_t b = pair / KVH, h = pair % KVH;
    float* ps = partials.data() + item * state;
    Partial st{ps, ps + G, ps + 2 * G};
    const auto [t0, t1] = chunk_range(b, c);
    if (t0 >= t1) {  // an empty chunk merges with weight 0
      std::fill(ps, ps + G, kNegInf);
      std::fill(ps + G, ps + state, 0.f);
      return;
    }
    float *qf = w, *kbuf = qf + G * D, *vbuf = kbuf + D, *s = vbuf + D;
    attend_chunk<T>(p, b, h, t0, t1, st, qf, kbuf, vbuf, s);
  });
  for_each_item(pairs, threads, scratch, [&](int64_t pair, float* w) {
    float* res = w;  // [D]
    for (int64_t g = 0; g < G; ++g) {
      float mx = kNegInf;
      for (int64_t c = 0; c < splits; ++c) mx = std::max(mx, partials[(pair * splits + c) * state + g]);
      std::fill(res, res + D, 0.f);
      float l = 0.f;
      if (mx != kNegInf) {
        for (int64_t c = 0; c < splits; ++c) {
          const float* ps = partials.data() + (pair * splits + c) * state;
          const float wgt = std::exp(ps[g] - mx);  // 0 for an empty chunk
          l += wgt * ps[G + g];
          const float* a = ps + 2 * G + g * D;
          for (int64_t j = 0; j < D; ++j) res[j] += wgt * a[j];
        }
        const float inv = 1.f / l;
        for (int64_t j = 0; j < D; ++j) res[j] *= inv;
      }  // else ctx_len == 0: zeros
      store_row(res, o + (pair * G + g) * D, D);
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
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &pdserve::paged_decode_attention_cpu);
}

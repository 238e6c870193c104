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
// bf16 K/V on CPUs with AVX512-BF16 (D = 64, 128, 256) take vdpbf16ps products instead
// (attend_chunk_bf16: q . k over the raw bf16 rows, P V over token pairs with the softmax
// weights rounded to bf16, as the prefill kernel and SDPA's bf16 path round P); one thread,
// SmolLM2's shape (9 / 3 heads of 64, 4 sequences of 540 tokens): 171 -> 134 us a layer with
// K/V from memory, 111 -> 88 us from cache. set_decode_bf16_dots(false) keeps fp32 products.
// Its item scores a tile for every kv head first (a page's K block front to back) and prefetches
// 16 tokens ahead rather than a tile (include/paged_attention_item.h): 16 sequences of 585 tokens,
// one thread, 910 -> 815 us a layer from memory; a 16-row decode step 54.7 -> 50.3 ms.
//
// This file plans the items, merges split contexts and holds the op; one item's
// attention is include/paged_attention_item.h, its vector helpers include/lane_pairs.h.
// Vector code uses the GCC/Clang vector extensions (16-float vectors, lowered to
// whatever the -march allows), not per-ISA intrinsics; only fp16 loads use F16C (and the
// bf16 path, AVX512-BF16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_attention_item.h"
#include "paged_attention_avx2.h"

namespace pdserve {
namespace {

// Split-K only when every chunk keeps at least this many tokens: a chunk costs
// one extra partial state (H * (D + 2) floats) and a merge.
constexpr int64_t kMinChunk = 512;
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMinRowsPerThread = 2048;  // K+V rows of one kv head

using namespace paged;  // the per-item kernel: include/paged_attention_item.h

// How many chunks to cut each sequence's context into: the fewest that minimize
// the rounds of work per thread, ceil(seqs * s / threads) / s, with chunks of at
// least kMinChunk tokens.
int64_t choose_splits(int64_t seqs, int64_t threads, int64_t max_ctx) {
  const int64_t cap = std::min(kMaxSplits, std::max<int64_t>(1, max_ctx / kMinChunk));
  int64_t best = 1;
  double best_cost = static_cast<double>((seqs + threads - 1) / threads);
  for (int64_t s = 2; s <= cap; ++s) {
    const double cost = static_cast<double>((seqs * s + threads - 1) / threads) / s;
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
// bf16 K/V with AVX512-BF16 dot products (attend_chunk_bf16) where compiled in; off: fp32 products.
std::atomic<bool> g_bf16_dots{true};

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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) attend = &attend_chunk_f32_avx2;  // 16 ymm registers
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16 K/V: vdpbf16ps products
    if (g_bf16_dots.load(std::memory_order_relaxed)) {
      if (D == 64) attend = KVH == 3 && G == 3 ? &attend_chunk_bf16<4, 3, 3> : &attend_chunk_bf16<4, 0, 0>;
      if (D == 128) attend = &attend_chunk_bf16<8, 0, 0>;
      if (D == 256) attend = KVH == 1 && G == 4 ? &attend_chunk_bf16<16, 1, 4> : &attend_chunk_bf16<16, 0, 0>;
    }
  }
#endif
  // Scratch per thread: qf [H, D], s [H, kTile + 256] (attend_chunk uses [G, ..]), then a state
  // m [H], l [H], acc [H, D].
  const int64_t state = H * (D + 2);
  const int64_t s_floats = H * (kTile + kLanes * kLanes);
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
            ps, tp, max_pages, lp, KVH, H / KVH, D, static_cast<float>(scale), B};
  switch (dtype) {
    case at::kFloat: run<float>(p, B, out); break;
    case at::kBFloat16: run<c10::BFloat16>(p, B, out); break;
    default: run<c10::Half>(p, B, out); break;
  }
  return out;
}

// kv[pages[t], 0, offs[t]] = k[t] and kv[pages[t], 1, offs[t]] = v[t] for every token t of a
// step: the two index_puts a layer makes, as one call of row copies (a [KVH, D] row block is
// dense in the pool and in k/v). Validates every index before writing anything.
void write_kv_cpu(const at::Tensor& kv, const at::Tensor& pages, const at::Tensor& offs, const at::Tensor& k,
                  const at::Tensor& v) {
  TORCH_CHECK(kv.dim() == 5 && k.dim() == 3 && v.dim() == 3, "write_kv: kv [P, 2, S, KVH, D], k/v [T, KVH, D]");
  const int64_t P = kv.size(0), S = kv.size(2), KVH = kv.size(3), D = kv.size(4), T = k.size(0);
  TORCH_CHECK(kv.size(1) == 2 && k.sizes() == v.sizes() && k.size(1) == KVH && k.size(2) == D,
              "write_kv: shapes kv ", kv.sizes(), " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
              "write_kv: k and v must have kv's dtype");
  for (const at::Tensor* t : {&kv, &k, &v})
    TORCH_CHECK(t->stride(-1) == 1 && t->stride(-2) == D, "write_kv: each token's [KVH, D] rows must be dense");
  TORCH_CHECK(pages.dim() == 1 && offs.dim() == 1 && pages.size(0) == T && offs.size(0) == T &&
                  pages.scalar_type() == at::kLong && offs.scalar_type() == at::kLong,
              "write_kv: pages and offs must be int64 [T]");
  const at::Tensor pc = pages.contiguous(), oc = offs.contiguous();
  const int64_t* pp = pc.const_data_ptr<int64_t>();
  const int64_t* op = oc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P && op[t] >= 0 && op[t] < S, "write_kv: token ", t, " goes to page ", pp[t],
                " offset ", op[t], ", outside a pool of ", P, " pages of ", S);
  const int64_t es = static_cast<int64_t>(kv.element_size()), row = KVH * D * es;
  char* base = static_cast<char*>(kv.data_ptr());
  const char* ks = static_cast<const char*>(k.const_data_ptr());
  const char* vs = static_cast<const char*>(v.const_data_ptr());
  const int64_t s0 = kv.stride(0) * es, s1 = kv.stride(1) * es, s2 = kv.stride(2) * es;
  const int64_t kt = k.stride(0) * es, vt = v.stride(0) * es;
  // Small steps (decode) on the calling thread: waking a worker costs more than the copy.
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      char* dst = base + pp[t] * s0 + op[t] * s2;
      std::memcpy(dst, ks + t * kt, row);
      std::memcpy(dst + s1, vs + t * vt, row);
    }
  });
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("write_kv(Tensor(a!) kv, Tensor pages, Tensor offs, Tensor k, Tensor v) -> ()");
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor ctx_lens, "
      "float scale) -> Tensor");
  m.def("set_decode_split_threads(int n) -> ()",
        [](int64_t n) { pdserve::g_split_threads.store(std::max<int64_t>(0, n)); });
  m.def("set_decode_bf16_dots(bool on) -> ()", [](bool on) { pdserve::g_bf16_dots.store(on); });
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &pdserve::paged_decode_attention_cpu);
  m.impl("write_kv", &pdserve::write_kv_cpu);
}

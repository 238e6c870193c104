// bf16 linear for decode steps and prefill chunks, registered as
// torch.ops.pdserve.small_linear and pack_linear_weight (loader: engine/layers/linear.py).
//
//   x     [M, K]   bf16, contiguous (a decode batch, a prefill chunk)
//   w     [N, K]   bf16, contiguous (nn.Linear's layout)
//   bias  [N]      bf16 or absent
//   packed          pack_linear_weight(w), or absent
//   out   [M, N]   bf16: x @ w.T + bias, accumulated in fp32 and rounded once
//
// Why: at batch 1 a decode step reads every weight once and does two flops per
// weight, so it is bound by memory bandwidth. oneDNN's bf16 path for M = 1 ran at
// about half the bandwidth a plain streaming read reaches on this CPU (the fp32
// GEMV of the same matrix was faster despite twice the bytes).
//
// Two paths, chosen per weight matrix (never per batch):
//  * AMX (when compiled in, K % 32 == 0, and the kernel grants AMX state): 16 W
//    rows are one A tile exactly as they lie in memory; x is packed once per call
//    into the VNNI B tile layout; one TDPBF16PS per 32 k (csrc/linear/amx_rows.cpp; above
//    kGemmRows rows the GEMM of csrc/linear/amx_gemm.cpp, above kGemmRowsCopy rows where the
//    caller passes the weight's GEMM copy). Rows past the last full 16 take the AVX-512 path.
//    With a block-quantized copy of w (pack_quant_weight: every 32-weight block exactly GGUF
//    Q4_1's d q + m or Q8_0's d q, found from w's fp32 values at load and checked weight for
//    weight), batches up to kQuantRows rows rebuild each 16 x 32 A tile from it in L1 (a table
//    of the block's 16 values and one vpermw for Q4, int8 -> fp32 -> bf16 for Q8) instead of
//    loading it from w: the same tiles, so the same bits, from 5 (Q4_1 with GGUF's fp16 d and m),
//    6 (d, m not fp16) or 9 bits a weight instead of 16.
//  * AVX512-BF16 on w packed once per weight (pack_linear_weight; the Linear layer keeps
//    the copy; csrc/linear/packed_linear.cpp): panels of 64 output columns with k in pairs,
//    x's pairs broadcast against four zmm of a panel (vdpbf16ps), 6 x rows x 4 zmm per
//    block; no horizontal sums, one sequential read stream per panel. It also runs
//    prefill chunks on CPUs without AMX.
//    One thread on AMD Zen 4, SmolLM2's 30 layers: ~220 GFLOP/s from 16 rows on
//    (1.1-1.6x oneDNN at 16-1024 rows; 1.3-1.4x the dot-product kernel it
//    replaced, which paid a horizontal sum per output); 1-row decode with the
//    weights from memory 17.5 -> 8.7 ms (the 8-row-stream dot products read slower).
//    Called without the packed copy, the op packs one itself (a pass over w).
//  * small_linear_gated: a gated MLP's gate|up projection with the activation in the
//    epilogue (pack_gated_linear_weight interleaves gate and up rows in blocks of 32, so a
//    64-column panel holds the gate and up sums of 32 outputs): out [M, I] = act(gate) * up
//    with small_linear + act_and_mul's roundings, without writing and re-reading [M, 2 I]
//    (542-row SmolLM2 prefill, 2 threads: 5.07 -> 4.63 ms a layer; 4-row decode 51 -> 41 us).
//
// Numerics: every product of two bf16 values is exact in fp32; each output's fp32
// sum runs over k in an order fixed by K and its row n alone (never by M, the
// batch position or the thread count), so a row's result does not depend on the
// batch it ran in. Rounded to bf16 once, after the bias. AVX-512: one fp32 lane
// per output, the k pairs in order (vdpbf16ps adds a pair's two products).
//
// Without AVX512-BF16 at compile time the op reports itself unsupported
// (small_linear_supported() == false) and the loader uses torch's linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_gemm.h"
#include "amx_tiles.h"
#include "packed_linear.h"

#include <cstdint>
#include <utility>

namespace pdserve {
namespace {

using linear::kGatedGelu;
using linear::kGatedSilu;
using linear::kPanel;
#if defined(__AVX512BF16__)
using linear::pack;
using linear::run_packed;
#endif
// Above this many x rows the AMX GEMM (csrc/linear/amx_gemm.cpp: w packed per block, reused
// by every row) replaces the streaming path for matrices up to kGemmMaxWeights; both give
// every row the same bits. Same-process alternation (1 thread): the streaming path is
// faster up to 64-128 rows (packing costs a pass over w) and at any row count tried (33-256)
// for a 49,152 x 576 vocabulary head; the GEMM from 128-256 rows on for the layer shapes.
constexpr int64_t kGemmRows = 128;
// With the weight's GEMM copy (pack_amx_gemm_weight, made at load) nothing is packed per call, and
// the GEMM reads w as one sequential stream of B tiles: faster than the 16-row W tiles from 17 rows
// on (30 layers of SmolLM2 from memory, one thread: 0.96x at 16 rows, 0.84x at 32, 0.68x at 128;
// 1.01-1.06x at 1-8 rows).
constexpr int64_t kGemmRowsCopy = 16;
constexpr int64_t kGemmMaxWeights = 8 << 20;
// Up to this many x rows the W tiles are rebuilt from the weight's quant copy where the caller
// passes one (pack_quant_weight): one x tile, so each rebuilt tile is used once.
constexpr int64_t kQuantRows = 16;
// Without AMX, up to this many x rows read the AVX-512 path's quant copy (weights rebuilt in
// registers, csrc/linear/packed_quant.cpp) instead of the packed bf16 weight. AMD Zen 4, SmolLM2's decode
// step on one thread, alternated: 1 row 13.4-14.5 -> 11.4-12.1 ms, 2 rows 14.4-17.9 -> 13.7-14.2,
// 3 rows the same (the rebuild, ~7 cycles a zmm, then costs what the reads save).
constexpr int64_t kQuantRowsAvx = 2;

}  // namespace

bool small_linear_amx() {
#if defined(PDSERVE_AMX)
  return amx::permitted();
#else
  return false;
#endif
}

bool small_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The first output column the AVX-512 path computes (and pack_linear_weight packs): past the
// last full 16 where the AMX paths run this shape (K % 32 == 0, N >= 16, AMX granted), else 0.
int64_t avx_first_column(int64_t N, int64_t K) {
#if defined(PDSERVE_AMX)
  if (K % 32 == 0 && N >= 16 && amx::permitted()) return N / 16 * 16;
#endif
  (void)K;
  (void)N;
  return 0;
}

void check_weight(const at::Tensor& w, const char* who) {
  TORCH_CHECK(small_linear_supported(), who, ": built without AVX512-BF16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), who,
              ": w must be a contiguous bfloat16 [N, K]");
}

#if defined(__AVX512BF16__)
// The kind of an AVX-512 quant copy given for w [N, K] (pack_quant_weight without AMX); 0 for none.
int avx_quant_kind(const c10::optional<at::Tensor>& quant, int64_t N, int64_t K) {
  if (!quant.has_value() || !quant->defined()) return 0;
  const int kind = linear::quant_copy_kind(quant->numel(), N, K);
  TORCH_CHECK(quant->scalar_type() == at::kByte && quant->is_contiguous() && kind,
              "small_linear: quant must be pack_quant_weight(w32, w) for this w");
  return kind;
}
#endif

at::Tensor pack_linear_weight_cpu(const at::Tensor& w) {
  check_weight(w, "pack_linear_weight");
#if defined(__AVX512BF16__)
  return pack(w, avx_first_column(w.size(0), w.size(1)));
#else
  return at::Tensor();
#endif
}

// The gate|up projection of a gated MLP with its activation in the epilogue (Epi): w [2 I, K] is
// gate rows then up rows (GatedMLP's fused gate_up_proj). Only where the AVX-512 path runs the
// whole matrix (no AMX for this shape) and I % 32 == 0, so every panel is whole.
bool gated_supported(int64_t N, int64_t K) {
  return small_linear_supported() && N > 0 && K > 0 && N % (2 * 32) == 0 && avx_first_column(N, K) == 0;
}

// pack of w's rows permuted so that panel p holds gate rows 32 p .. 32 p + 31, then up rows
// I + 32 p .. I + 32 p + 31: a block's four vectors are the gate and up sums of 32 outputs.
at::Tensor pack_gated_linear_weight_cpu(const at::Tensor& w) {
  check_weight(w, "pack_gated_linear_weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(gated_supported(N, K), "pack_gated_linear_weight: unsupported here for [", N, ", ", K,
              "] (needs AVX512-BF16 without AMX for this shape, and rows a multiple of 64)");
#if defined(__AVX512BF16__)
  return pack(w.view({2, N / 64, 32, K}).transpose(0, 1).reshape({N, K}).contiguous(), 0);
#else
  return at::Tensor();
#endif
}

at::Tensor small_linear_gated_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t K, bool gelu,
                                  const c10::optional<at::Tensor>& quant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == K,
              "small_linear_gated: x must be a contiguous bfloat16 [M, K] with K = ", K);
  const int64_t M = x.size(0), K2 = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(1) == K2 && packed.size(2) == kPanel && packed.size(3) == 2,
              "small_linear_gated: packed must be pack_gated_linear_weight(w) of a w with ", K, " columns");
  const int64_t N = packed.size(0) * kPanel;
  TORCH_CHECK(gated_supported(N, K), "small_linear_gated: unsupported here");
  at::Tensor out = at::empty({M, N / 2}, x.options());
#if defined(__AVX512BF16__)
  const int qkind = M <= kQuantRowsAvx ? avx_quant_kind(quant, N, K) : 0;
  if (M && qkind)
    linear::run_packed_quant(x.data_ptr<c10::BFloat16>(), quant->data_ptr<uint8_t>(), qkind, nullptr,
                             out.data_ptr<c10::BFloat16>(), M, N, K, gelu ? kGatedGelu : kGatedSilu);
  else if (M)
    run_packed(x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), nullptr, out.data_ptr<c10::BFloat16>(),
               M, N, K, 0, gelu ? kGatedGelu : kGatedSilu);
#endif
  return out;
}

// The AMX GEMM's copy of w (amx_gemm_pack), made once where the GEMM runs this shape: int32
// words; empty where it does not (no AMX, K % 32 != 0, N < 16, more than kGemmMaxWeights; gated:
// 2 I rows with I % 16 != 0).
at::Tensor pack_amx_gemm_weight_cpu(const at::Tensor& w, bool gated) {
  check_weight(w, "pack_amx_gemm_weight");
  const int64_t N = w.size(0), K = w.size(1);
  int64_t words = 0;
#if defined(PDSERVE_AMX)
  if (amx::permitted() && N * K <= kGemmMaxWeights) words = amx_gemm_packed_words(N, K, gated);
#endif
  at::Tensor out = at::empty({words}, w.options().dtype(at::kInt));
  if (words) amx_gemm_pack(w.data_ptr<c10::BFloat16>(), N, K, gated, reinterpret_cast<uint32_t*>(out.data_ptr()));
  return out;
}

// The fewest x rows for which small_linear with a gemm copy, and small_linear_gated_amx, take the
// AMX GEMM: kGemmRowsCopy + 1; 0 where the GEMM does not run (no AMX).
int64_t amx_gemm_rows() {
#if defined(PDSERVE_AMX)
  if (amx::permitted()) return kGemmRowsCopy + 1;
#endif
  return 0;
}

const uint32_t* gemm_copy(const c10::optional<at::Tensor>& gemm, int64_t N, int64_t K, bool gated) {
  if (!gemm.has_value() || !gemm->defined() || gemm->numel() == 0) return nullptr;
  const int64_t words = amx_gemm_packed_words(N, K, gated);
  TORCH_CHECK(gemm->scalar_type() == at::kInt && gemm->is_contiguous() && gemm->dim() == 1 && words &&
                  gemm->numel() == words,
              "small_linear: gemm must be pack_amx_gemm_weight(w", gated ? ", True" : "", ") for this w");
  return reinterpret_cast<const uint32_t*>(gemm->data_ptr());
}

// act_and_mul(small_linear(x, w), gelu) for a gated MLP's gate|up weight w [2 I, K] on the AMX
// GEMM with the activation in its epilogue (x more than kGemmRowsCopy rows; same bits).
at::Tensor small_linear_gated_amx_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& gemm, bool gelu) {
  check_weight(w, "small_linear_gated_amx");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == w.size(1),
              "small_linear_gated_amx: x must be a contiguous bfloat16 [M, K] with w's K");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(amx_gemm_rows() && M >= amx_gemm_rows(), "small_linear_gated_amx: needs AMX and more than ",
              amx_gemm_rows() - 1, " rows");
  const uint32_t* wp = gemm_copy(gemm, N, K, true);
  TORCH_CHECK(wp, "small_linear_gated_amx: gemm must be pack_amx_gemm_weight(w, True)");
  at::Tensor out = at::empty({M, N / 2}, x.options());
  TORCH_CHECK(amx_gemm(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), nullptr,
                       out.data_ptr<c10::BFloat16>(), M, N, K, wp, gelu ? kGemmGatedGelu : kGemmGatedSilu),
              "small_linear_gated_amx: the GEMM refused the shape");
  return out;
}

// A block-quantized copy of w (the 16-row AMX tiles rebuilt from it per call where AMX runs, else
// the AVX-512 path's zmm in registers, csrc/linear/packed_quant.cpp; same bits), made from w's fp32
// values where every 32-weight block is exactly in GGUF Q4_1's form (5 or 6 bits a weight read,
// d and m as fp16 or fp32) or Q8_0's (9 bits); gated: w is gate|up, the copy small_linear_gated
// reads (AVX-512 only). An empty tensor where no form holds. uint8, its size tells the form.
at::Tensor pack_quant_weight_cpu(const at::Tensor& w32, const at::Tensor& w, bool gated) {
  check_weight(w, "pack_quant_weight");
  TORCH_CHECK(w32.scalar_type() == at::kFloat && w32.is_contiguous() && w32.sizes() == w.sizes(),
              "pack_quant_weight: w32 must be a contiguous float32 tensor of w's shape");
  const int64_t N = w.size(0), K = w.size(1);
#if defined(PDSERVE_AMX)
  if (!gated && amx::permitted()) {
    for (int kind : {kQuantQ4H, kQuantQ4, kQuantQ8}) {  // fewest bytes first
      const int64_t bytes = amx_quant_bytes(N, K, kind);
      if (!bytes) break;
      at::Tensor q = at::empty({bytes}, w.options().dtype(at::kByte));
      if (amx_quant_pack(w32.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), N, K, kind, q.data_ptr<uint8_t>())) return q;
    }
  }
#endif
#if defined(__AVX512BF16__)
  // Without AMX: the AVX-512 path's form, for the whole matrix (gated: the gated epilogue's units)
  if (avx_first_column(N, K) == 0 && (!gated || gated_supported(N, K))) {
    for (int kind : {linear::kQ4H, linear::kQ4, linear::kQ8}) {
      const int64_t bytes = linear::quant_copy_bytes(N, K, kind);
      if (!bytes) break;
      at::Tensor q = at::empty({bytes}, w.options().dtype(at::kByte));
      if (linear::pack_quant(w32.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), N, K, gated, kind,
                             q.data_ptr<uint8_t>()))
        return q;
    }
  }
#endif
  (void)gated;
  (void)N;
  (void)K;
  return at::empty({0}, w.options().dtype(at::kByte));
}

#if defined(PDSERVE_AMX)
// (pointer, kind) of a quant copy given for w [N, K]; (null, 0) for none.
std::pair<const uint8_t*, int> quant_copy(const c10::optional<at::Tensor>& quant, int64_t N, int64_t K) {
  if (!quant.has_value() || !quant->defined()) return {nullptr, 0};
  const at::Tensor& q = *quant;
  const int64_t n = q.numel();
  int kind = 0;  // the forms' sizes differ (320, 384 and 576 bytes a 16 x 32 tile)
  for (int k : {kQuantQ4H, kQuantQ4, kQuantQ8})
    if (n && n == amx_quant_bytes(N, K, k)) kind = k;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && kind,
              "small_linear: quant must be pack_quant_weight(w32, w) for this w");
  return {q.data_ptr<uint8_t>(), kind};
}
#endif

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& packed, const c10::optional<at::Tensor>& gemm,
                            const c10::optional<at::Tensor>& quant) {
  check_weight(w, "small_linear");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "small_linear: x must be a contiguous bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "small_linear: x has ", K, " columns, w has ", w.size(1));
  const c10::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous(),
                "small_linear: bias must be a contiguous bfloat16 [N]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const int64_t n0 = avx_first_column(N, K);
  at::Tensor wp;
  if (packed.has_value() && packed->defined()) {
    wp = *packed;
    const int64_t P = (N - n0 + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
    TORCH_CHECK(wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.dim() == 4 && wp.size(0) == P &&
                    wp.size(1) == K2 && wp.size(2) == kPanel && wp.size(3) == 2,
                "small_linear: packed must be pack_linear_weight(w) for this w");
  }
  if (M && N && K) {
    const auto* xd = x.data_ptr<c10::BFloat16>();
    const auto* wd = w.data_ptr<c10::BFloat16>();
    auto* od = out.data_ptr<c10::BFloat16>();
#if defined(PDSERVE_AMX)
    if (n0) {
      const uint32_t* copy = gemm_copy(gemm, N, K, false);
      const auto [qp, kind] = quant_copy(quant, N, K);
      if (qp && M <= kQuantRows) {
        TORCH_CHECK(run_amx_quant(xd, qp, kind, b, od, M, N, K) == n0, "small_linear: AMX path covered fewer columns");
      } else if (!(M > (copy ? kGemmRowsCopy : kGemmRows) && N * K <= kGemmMaxWeights &&
                   amx_gemm(xd, wd, b, od, M, N, K, copy))) {
        TORCH_CHECK(run_amx(xd, wd, b, od, M, N, K) == n0, "small_linear: AMX path covered fewer columns");
      }
    }
#endif
    const int qkind = n0 == 0 && M <= kQuantRowsAvx ? avx_quant_kind(quant, N, K) : 0;
    if (qkind) {
      linear::run_packed_quant(xd, quant->data_ptr<uint8_t>(), qkind, b, od, M, N, K);
    } else if (n0 < N) {
      if (!wp.defined()) wp = pack(w, n0);  // a call without the layer's packed copy: packed here
      run_packed(xd, wp.data_ptr<c10::BFloat16>(), b, od, M, N, K, n0);
    }
  } else if (M && N) {
    out.zero_();
    if (b) out.add_(*bias);
  }
#endif
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias, Tensor? packed=None, Tensor? gemm=None, Tensor? quant=None) -> Tensor");
  m.def("pack_quant_weight(Tensor w32, Tensor w, bool gated=False) -> Tensor");
  m.def("pack_amx_gemm_weight(Tensor w, bool gated) -> Tensor");
  m.def("amx_gemm_rows() -> int", &pdserve::amx_gemm_rows);
  m.def("small_linear_gated_amx(Tensor x, Tensor w, Tensor gemm, bool gelu) -> Tensor");
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("small_linear_supported() -> bool", &pdserve::small_linear_supported);
  m.def("small_linear_amx() -> bool", &pdserve::small_linear_amx);
  m.def("pack_gated_linear_weight(Tensor w) -> Tensor");
  m.def("small_linear_gated(Tensor x, Tensor packed, int k, bool gelu, Tensor? quant=None) -> Tensor");
  m.def("small_linear_gated_supported(int n, int k) -> bool", &pdserve::gated_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("small_linear", &pdserve::small_linear_cpu);
  m.impl("pack_linear_weight", &pdserve::pack_linear_weight_cpu);
  m.impl("pack_gated_linear_weight", &pdserve::pack_gated_linear_weight_cpu);
  m.impl("small_linear_gated", &pdserve::small_linear_gated_cpu);
  m.impl("pack_amx_gemm_weight", &pdserve::pack_amx_gemm_weight_cpu);
  m.impl("small_linear_gated_amx", &pdserve::small_linear_gated_amx_cpu);
  m.impl("pack_quant_weight", &pdserve::pack_quant_weight_cpu);
}

// bf16 linear for a few rows (decode steps), registered as
// torch.ops.pdserve.small_linear (loader: engine/layers/linear_op.py).
//
//   x     [M, K]   bf16, contiguous, M small (a decode batch)
//   w     [N, K]   bf16, contiguous (nn.Linear's layout)
//   bias  [N]      bf16 or absent
//   out   [M, N]   bf16: x @ w.T + bias, accumulated in fp32 and rounded once
//
// Why: at batch 1 a decode step reads every weight once and does two flops per
// weight, so it is bound by memory bandwidth. oneDNN's bf16 path for M = 1 ran at
// about half the bandwidth a plain streaming read reaches on this CPU (the fp32
// GEMV of the same matrix was faster despite twice the bytes). This kernel streams
// W once with AVX512-BF16 dot products (vdpbf16ps: pairs of bf16 products summed
// into fp32 lanes), four output rows at a time so four independent streams keep the
// prefetchers busy, and applies those rows to up to four x rows per pass; for M > 4
// the next passes find the 4-row W block in L1.
//
// Numerics: every product of two bf16 values is exact in fp32; sums are fp32 in a
// fixed order that depends only on K (never on M, N or the thread count), so a row's
// result does not depend on which batch it ran in.
//
// Without AVX512-BF16 at compile time the op reports itself unsupported
// (small_linear_supported() == false) and the loader uses torch's linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifndef _OPENMP
#error "compile with -fopenmp: without it at::parallel_for runs on one thread"
#endif

namespace pdserve {
namespace {

constexpr int64_t kRows = 4;  // W rows per block (independent read streams)
constexpr int64_t kXRows = 4;  // x rows per pass over a W block
constexpr int64_t kGrainBytes = 64 * 1024;  // W bytes per parallel work chunk, at least

#if defined(__AVX512BF16__)

inline __m512bh load_bf16(const c10::BFloat16* p, int64_t k, int64_t K) {
  // 32 bf16 from p + k; lanes past K read as zero.
  if (k + 32 <= K) return (__m512bh)_mm512_loadu_si512(p + k);
  const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p + k);
}

// out[m][r] = dot(x[m], w[r]) for r < nr (<= kRows), m < nm (<= kXRows).
template <int NR, int NM>
inline void block(const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, float out[kXRows][kRows]) {
  __m512 acc[NM][NR];
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      // The block two blocks ahead, same offset: rows are adjacent, so that is
      // 2 * kRows * K elements further on (past the end only reads the next
      // allocation's address; a prefetch never faults).
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + 2 * kRows * K), _MM_HINT_T0);
      wv[r] = load_bf16(w + r * K, k, K);
    }
    for (int m = 0; m < NM; ++m) {
      const __m512bh xv = load_bf16(x + m * K, k, K);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < NR; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int NR>
inline void block_m(int nm, const c10::BFloat16* w, const c10::BFloat16* x, int64_t K,
                    float out[kXRows][kRows]) {
  switch (nm) {
    case 1: block<NR, 1>(w, x, K, out); break;
    case 2: block<NR, 2>(w, x, K, out); break;
    case 3: block<NR, 3>(w, x, K, out); break;
    default: block<NR, 4>(w, x, K, out); break;
  }
}

void run(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
         int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kRows * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float acc[kXRows][kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      const int nr = (int)std::min<int64_t>(kRows, N - n);
      const c10::BFloat16* wb = w + n * K;
      for (int64_t m = 0; m < M; m += kXRows) {
        const int nm = (int)std::min<int64_t>(kXRows, M - m);
        const c10::BFloat16* xm = x + m * K;
        switch (nr) {
          case 1: block_m<1>(nm, wb, xm, K, acc); break;
          case 2: block_m<2>(nm, wb, xm, K, acc); break;
          case 3: block_m<3>(nm, wb, xm, K, acc); break;
          default: block_m<4>(nm, wb, xm, K, acc); break;
        }
        for (int i = 0; i < nm; ++i)
          for (int r = 0; r < nr; ++r) {
            float v = acc[i][r];
            if (bias) v += static_cast<float>(bias[n + r]);
            out[(m + i) * N + n + r] = c10::BFloat16(v);  // round to nearest even
          }
      }
    }
  });
}

#endif  // __AVX512BF16__

}  // namespace

bool small_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(small_linear_supported(), "small_linear: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear: x and w must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
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
  if (M && N && K) {
    run(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), b, out.data_ptr<c10::BFloat16>(), M, N, K);
  } else if (M && N) {
    out.zero_();
    if (b) out.add_(*bias);
  }
#endif
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_supported() -> bool", &pdserve::small_linear_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("small_linear", &pdserve::small_linear_cpu);
}

// The AVX512-BF16 path of small_linear (csrc/packed_linear.cpp; the op and its other paths are
// csrc/small_linear.cpp): w packed once per weight in panels of 64 output columns with k in
// pairs, wp[p][q][c][j] = w[n0 + 64 p + c][2 q + j]; x's pairs broadcast against the panels.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pdserve {
namespace linear {

constexpr int64_t kPanel = 64;  // output columns per packed panel (four zmm of 16 fp32)

// Epilogues: what a block does with its fp32 sums.
enum Epi : int {
  kPlain = 0,     // out[m][col + c] = round(sum + bias)
  kGatedSilu = 1,  // gated (pack_gated): a panel's first 32 columns are gate, the last 32 up;
  kGatedGelu = 2,  //   out[m][col / 2 + j] = round(round(act(round(gate_j))) * round(up_j))
};

#if defined(__AVX512BF16__)
// out[:, n0:N] = x @ w[n0:N].T + bias for x [M, K] (bf16, contiguous), wp = pack(w, n0), on
// torch's threads; with a gated epilogue (n0 = 0, N % 64 == 0, wp = pack of the interleaved
// gate|up rows, no bias) out is [M, N / 2]. Each output's bits depend on K and its row of w only.
void run_packed(const c10::BFloat16* x, const c10::BFloat16* wp, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K, int64_t n0, int epi = kPlain);

// w's columns [n0, N) packed as run_packed reads them (zero past N and K): [P, K2, 64, 2].
at::Tensor pack(const at::Tensor& w, int64_t n0);
#endif

}  // namespace linear
}  // namespace pdserve

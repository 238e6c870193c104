// The AVX512-BF16 path of small_linear (csrc/linear/packed_linear.cpp; the op and its other paths are
// csrc/linear/small_linear.cpp): w packed once per weight in panels of 64 output columns with k in
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

// The block-quantized copy that decode batches read without AMX (csrc/linear/packed_quant.cpp): GGUF
// Q4_1 blocks with fp16 d and m (5 bits a weight), with fp32 ones (6), or Q8_0 blocks (9).
enum QuantKind : int { kQ4H = 1, kQ4 = 2, kQ8 = 3 };
// Bytes of a copy of w [N, K] of that kind; 0 where the shape has none (N % 32, K % 32).
int64_t quant_copy_bytes(int64_t N, int64_t K, int kind);
// The kind a copy of `bytes` bytes for [N, K] is (their sizes differ); 0 for none.
int quant_copy_kind(int64_t bytes, int64_t N, int64_t K);
// Fills out (quant_copy_bytes) from w's fp32 values w32, every rebuilt weight checked against w;
// false where a block does not fit the kind. gated: w is gate|up [2 I, K] (I % 16 == 0), the copy
// for a gated epilogue.
bool pack_quant(const float* w32, const c10::BFloat16* w, int64_t N, int64_t K, bool gated, int kind, uint8_t* out);
// run_packed's result (n0 = 0, same bits) from the copy q: out [M, N] or, gated, [M, N / 2].
void run_packed_quant(const c10::BFloat16* x, const uint8_t* q, int kind, const c10::BFloat16* bias, c10::BFloat16* out,
                      int64_t M, int64_t N, int64_t K, int epi = kPlain);
#endif

}  // namespace linear
}  // namespace pdserve

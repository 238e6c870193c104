// small_linear's AMX paths: the GEMM for many rows (csrc/linear/amx_gemm.cpp) and the tile path for
// decode-size batches (csrc/linear/amx_rows.cpp).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1  // the AMX paths are compiled in (whether the kernel grants AMX is asked at run time)
#endif

namespace pdserve {

// out[M, N] = x[M, K] @ w[N, K].T + bias (bf16, contiguous) for the output columns
// [0, N / 16 * 16); returns false (and writes nothing) when AMX is not compiled in
// or not granted, K % 32 != 0 or N < 16. The caller computes columns past N / 16 * 16.
//
// packed: amx_gemm_pack(w) (the blocks the GEMM would pack per call, made once), or null.
// epi: kGemmPlain, or kGemmGatedSilu / kGemmGatedGelu for a gated MLP's gate|up weight w [2 I, K]
// (no bias, I % 16 == 0): out [M, I] = act_and_mul(x @ w.T) with its bits, all I columns.
enum { kGemmPlain = 0, kGemmGatedSilu = 1, kGemmGatedGelu = 2 };
bool amx_gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
              int64_t M, int64_t N, int64_t K, const uint32_t* packed = nullptr, int epi = kGemmPlain);

// 32-bit words of amx_gemm_pack's copy of a [N, K] weight (gated: the gate|up layout); 0 where
// the GEMM cannot take the shape (K % 32 != 0, N < 16; gated: N % 32 != 0).
int64_t amx_gemm_packed_words(int64_t N, int64_t K, bool gated);
// Writes that copy (amx_gemm_packed_words(N, K, gated) words; any alignment) to out.
void amx_gemm_pack(const c10::BFloat16* w, int64_t N, int64_t K, bool gated, uint32_t* out);

#if defined(PDSERVE_AMX)
// Decode-size batches (csrc/linear/amx_rows.cpp): out rows' columns [0, N / 16 * 16) with 16-row W
// tiles, x packed per call; returns the first column left over (0: K % 32 != 0, N < 16 or AMX
// not granted, nothing written).
int64_t run_amx(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K);

// The same with the W tiles rebuilt from a block-quantized copy of w (amx_quant_pack; same bits).
// Q4: Q4_1 blocks with d, m as fp32 (384 bytes a tile); Q4H: the same with d, m as fp16 where
// they are exactly fp16 (GGUF's own: 320 bytes); Q8: Q8_0 blocks, d as fp32 (576 bytes).
enum { kQuantQ4 = 1, kQuantQ8 = 2, kQuantQ4H = 3 };
int64_t run_amx_quant(const c10::BFloat16* x, const uint8_t* quant, int kind, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t M, int64_t N, int64_t K);
// Bytes of that copy of a [N, K] weight in `kind`'s form (0: K % 32 != 0 or N < 16).
int64_t amx_quant_bytes(int64_t N, int64_t K, int kind);
// Writes w's rows [0, N / 16 * 16) in `kind`'s form (amx_quant_bytes(N, K, kind) bytes) to out,
// found from its fp32 values w32, each rebuilt weight checked against the bf16 w; false (out
// half written) where some block is not in that form.
bool amx_quant_pack(const float* w32, const c10::BFloat16* w, int64_t N, int64_t K, int kind, uint8_t* out);
#endif

}  // namespace pdserve

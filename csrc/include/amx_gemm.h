// AMX bf16 GEMM for many rows (csrc/amx_gemm.cpp), used by small_linear for large M.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pdserve {

// out[M, N] = x[M, K] @ w[N, K].T + bias (bf16, contiguous) for the output columns
// [0, N / 16 * 16); returns false (and writes nothing) when AMX is not compiled in
// or not granted, K % 32 != 0 or N < 16. The caller computes columns past N / 16 * 16.
bool amx_gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
              int64_t M, int64_t N, int64_t K);

}  // namespace pdserve

// small_linear's AMX paths: the GEMM for many rows (csrc/amx_gemm.cpp) and the tile path for
// decode-size batches (csrc/amx_rows.cpp).
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
bool amx_gemm(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
              int64_t M, int64_t N, int64_t K);

#if defined(PDSERVE_AMX)
// Decode-size batches (csrc/amx_rows.cpp): out rows' columns [0, N / 16 * 16) with 16-row W
// tiles, x packed per call; returns the first column left over (0: K % 32 != 0, N < 16 or AMX
// not granted, nothing written).
int64_t run_amx(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                int64_t M, int64_t N, int64_t K);
#endif

}  // namespace pdserve

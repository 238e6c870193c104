// Rotary position embedding (HF's rotate-half form) of bf16 rows in one pass, registered as
// torch.ops.pdserve.rotary (loader: engine/layers/rotary.py).
//
//   x         [T, H, D]  bf16; heads D apart, last dim contiguous, any token stride
//   cos, sin  [T, D]     bf16, contiguous (the step's tables, one row per token)
//   out       [T, H, D]  bf16 contiguous: x * cos + rotate_half(x) * sin
//
// Rounding follows the torch ops it replaces (engine/layers/rotary.py: apply_rotary): both
// products are rounded to bf16, then their sum, so the result is bitwise torch's (products of
// two bf16 values are exact in fp32; each rounding is to nearest even). Why: in torch that is
// five passes over [T, H, D] (two products, a negation, a concatenation, a sum), ~6% of a
// 530-token SmolLM2 prefill on one core.
//
// Vector code uses the GCC/Clang vector extensions (lowered to what -march allows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_vec.h"

namespace pdserve {
namespace {

using namespace vec;

void rotate_rows(const c10::BFloat16* x, int64_t x_tok, const c10::BFloat16* cos, const c10::BFloat16* sin,
                 c10::BFloat16* out, int64_t T, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    std::vector<f32x16> cs(static_cast<size_t>(2 * D / kLanes));  // the token's cos, sin as fp32
    for (int64_t t = t0; t < t1; ++t) {
      f32x16* c = cs.data();
      f32x16* s = c + D / kLanes;
      for (int64_t i = 0; i < D / kLanes; ++i) {
        c[i] = load_bf16(cos + t * D + i * kLanes);
        s[i] = load_bf16(sin + t * D + i * kLanes);
      }
      const int64_t hv = half / kLanes;
      for (int64_t h = 0; h < H; ++h) {
        const c10::BFloat16* xr = x + t * x_tok + h * D;
        c10::BFloat16* o = out + (t * H + h) * D;
        for (int64_t j = 0; j < hv; ++j) {
          const int64_t i = j * kLanes;
          const f32x16 x1 = load_bf16(xr + i), x2 = load_bf16(xr + half + i);
          // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin
          store_round_bf16(o + i, round_bf16(x1 * c[j]) - round_bf16(x2 * s[j]));
          store_round_bf16(o + half + i, round_bf16(x2 * c[hv + j]) + round_bf16(x1 * s[hv + j]));
        }
      }
    }
  });
}

}  // namespace

at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "rotary: x must be a bf16 [T, H, D] CPU tensor");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && (H == 1 || x.stride(1) == D), "rotary: x's heads must be dense rows of D");
  TORCH_CHECK(D % (2 * kLanes) == 0, "rotary: head dim must be a multiple of 32; got ", D);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == T && t->size(1) == D &&
                    t->is_contiguous(),
                "rotary: cos and sin must be contiguous bf16 [T, D] with T = ", T, ", D = ", D);
  at::Tensor out = at::empty({T, H, D}, x.options());
  if (T && H)
    rotate_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), cos.data_ptr<c10::BFloat16>(),
                sin.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), T, H, D);
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("rotary", &pdserve::rotary_cpu); }

// Gated MLP activation, registered as torch.ops.pdserve.act_and_mul (loader:
// engine/layers/activation.py).
//
//   x    [T, 2 * I]  bf16, contiguous: gate in the first I columns, up in the rest
//   out  [T, I]      bf16: act(gate) * up
//   act: silu(g) = g / (1 + exp(-g)), or with gelu: HF's gelu-tanh
//        0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3)))
//
// Rounding follows the two torch ops it replaces (`act(gate) * up` in bf16): the
// activation is computed in fp32 and rounded to bf16, then multiplied by `up` in
// fp32 and rounded again. exp is a Cephes-style polynomial (~1 ulp in fp32), so a
// result can differ from torch's by one bf16 ulp where the fp32 value lies on a
// rounding boundary. Why a kernel: for a prefill chunk torch makes three passes
// over [T, I] (silu into a new tensor, then the product), each converting bf16 to
// fp32 and back; here it is one pass, 16 lanes at a time.
//
// Vector code uses the GCC/Clang vector extensions (lowered to what -march allows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "act_vec.h"
#include "bf16_vec.h"

namespace pdserve {
namespace {

using namespace vec;
using act::gelu_tanh1;
using act::silu1;

template <bool kGelu>
void act_rows(const c10::BFloat16* x, c10::BFloat16* out, int64_t T, int64_t I) {
  // Rows in blocks so that a thread's share stays large (a row is I elements).
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const c10::BFloat16* g = x + r * 2 * I;
      const c10::BFloat16* u = g + I;
      c10::BFloat16* o = out + r * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        act::store_gated16<kGelu>(o + i, load_bf16(g + i), load_bf16(u + i));
      }
      for (; i < I; ++i) {
        const float gv = static_cast<float>(g[i]);
        const float a = static_cast<float>(static_cast<c10::BFloat16>(kGelu ? gelu_tanh1(gv) : silu1(gv)));
        o[i] = static_cast<c10::BFloat16>(a * static_cast<float>(u[i]));
      }
    }
  });
}

}  // namespace

at::Tensor act_and_mul_cpu(const at::Tensor& x, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "act_and_mul: x must be a contiguous bf16 [T, 2 * I] tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, "act_and_mul: x's last dim must be even (gate | up)");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  if (gelu) {
    act_rows<true>(xp, op, T, I);
  } else {
    act_rows<false>(xp, op, T, I);
  }
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("act_and_mul(Tensor x, bool gelu) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("act_and_mul", &pdserve::act_and_mul_cpu); }

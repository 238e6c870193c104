// RMSNorm with an optional residual add in front, registered as
// torch.ops.pdserve.rms_norm (loader: engine/layers/norm.py).
//
//   x         [T, D]  bf16 / fp32, contiguous
//   residual  [T, D]  same dtype, or absent
//   weight    [D]     same dtype as x
//   returns   (out [T, D], sum [T, D]) where
//             sum = x + residual, rounded to x's dtype (x itself when absent)
//             out = norm(sum)
//   llama:  out = weight * to_dtype(h * rsqrt(mean(h^2) + eps)),  h = float(sum)
//   gemma:  out = to_dtype(h * rsqrt(mean(h^2) + eps) * (1 + float(weight)))
//
// The formulas and every rounding step follow Hugging Face's LlamaRMSNorm and
// Gemma3RMSNorm (fp32 inside, the llama form multiplies in the model dtype after
// casting back), so outputs equal the torch modules' up to the order of the fp32
// sum of squares. Why a kernel: a decode step runs 2-4 norms per layer on a few
// rows, and the eight small torch ops each one takes cost more than the math; a
// prefill chunk makes as many passes over [T, D] as there are ops. bf16 rows run
// 16 lanes at a time (sum of squares in 16 fp32 partial sums, folded at the end).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16_vec.h"

namespace pdserve {
namespace {

// One bf16 row, vectorised; same formulas and roundings as norm_rows below.
// wf: the weight as fp32 (gemma: 1 + weight), converted once per call.
void norm_row_bf16(const c10::BFloat16* xr, const c10::BFloat16* rr, const c10::BFloat16* w, const float* wf,
                   c10::BFloat16* o, c10::BFloat16* sr, int64_t D, float eps, bool gemma) {
  using namespace vec;
  const int64_t Dv = D - D % kLanes;
  f32x16 acc = splat(0.f);
  float ss = 0.f;
  if (rr) {
    for (int64_t i = 0; i < Dv; i += kLanes) {
      const f32x16 s = round_store_bf16(sr + i, load_bf16(xr + i) + load_bf16(rr + i));
      acc += s * s;
    }
    for (int64_t i = Dv; i < D; ++i) {
      const c10::BFloat16 s = static_cast<c10::BFloat16>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      sr[i] = s;
      ss += static_cast<float>(s) * static_cast<float>(s);
    }
  } else {
    for (int64_t i = 0; i < Dv; i += kLanes) {
      const f32x16 h = load_bf16(xr + i);
      acc += h * h;
    }
    for (int64_t i = Dv; i < D; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
  }
  ss += hsum(acc);
  const c10::BFloat16* src = rr ? sr : xr;
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  if (gemma) {
    for (int64_t i = 0; i < Dv; i += kLanes) {
      f32x16 w1;
      std::memcpy(&w1, wf + i, sizeof w1);
      store_round_bf16(o + i, (load_bf16(src + i) * inv) * w1);
    }
  } else {
    for (int64_t i = 0; i < Dv; i += kLanes) {
      f32x16 wv;
      std::memcpy(&wv, wf + i, sizeof wv);
      store_round_bf16(o + i, wv * round_bf16(load_bf16(src + i) * inv));
    }
  }
  for (int64_t i = Dv; i < D; ++i) {
    const float h = static_cast<float>(src[i]) * inv;
    o[i] = gemma ? static_cast<c10::BFloat16>(h * (1.0f + static_cast<float>(w[i])))
                 : static_cast<c10::BFloat16>(static_cast<float>(w[i]) *
                                              static_cast<float>(static_cast<c10::BFloat16>(h)));
  }
}

template <typename T>
void norm_rows(const T* x, const T* res, const T* w, T* out, T* sum, int64_t T_, int64_t D, double eps,
               bool gemma) {
  std::vector<float> wf;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    wf.resize(static_cast<size_t>(D));
    for (int64_t i = 0; i < D; ++i) wf[i] = gemma ? 1.0f + static_cast<float>(w[i]) : static_cast<float>(w[i]);
  }
  at::parallel_for(0, T_, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        norm_row_bf16(x + r * D, res ? res + r * D : nullptr, w, wf.data(), out + r * D, sum + r * D, D,
                      static_cast<float>(eps), gemma);
        continue;
      }
      const T* xr = x + r * D;
      T* sr = sum + r * D;
      float ss = 0.f;
      if (res) {
        const T* rr = res + r * D;
        for (int64_t i = 0; i < D; ++i) {
          const T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          sr[i] = s;
          const float h = static_cast<float>(s);
          ss += h * h;
        }
      } else {
        for (int64_t i = 0; i < D; ++i) {
          const float h = static_cast<float>(xr[i]);
          ss += h * h;
        }
      }
      const T* src = res ? sr : xr;
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      T* o = out + r * D;
      if (gemma) {
        for (int64_t i = 0; i < D; ++i)
          o[i] = static_cast<T>(static_cast<float>(src[i]) * inv * (1.0f + static_cast<float>(w[i])));
      } else {
        for (int64_t i = 0; i < D; ++i) {
          const T n = static_cast<T>(static_cast<float>(src[i]) * inv);
          o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(n));
        }
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [T, D] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32 only");
  const int64_t T_ = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [D] tensor of x's dtype");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be a contiguous tensor shaped and typed like x");
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = has_res ? at::empty_like(x) : x;
  if (x.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    norm_rows<T>(x.data_ptr<T>(), has_res ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                 out.data_ptr<T>(), sum.data_ptr<T>(), T_, D, eps, gemma);
  } else {
    norm_rows<float>(x.data_ptr<float>(), has_res ? residual->data_ptr<float>() : nullptr,
                     weight.data_ptr<float>(), out.data_ptr<float>(), sum.data_ptr<float>(), T_, D, eps, gemma);
  }
  return {out, sum};
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &pdserve::rms_norm_cpu);
}

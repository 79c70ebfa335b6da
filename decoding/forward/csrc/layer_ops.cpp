// The row-wise arithmetic of a decoder layer around its GEMMs, one pass each (decoding/forward/kernels.py).
//
// torch runs each of these as several ops (~10 for a CPU rms_norm, ~5 for the rotary embedding),
// and in bf16 rounds after each; here each is one loop with fp32 math and one rounding per output.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <tuple>

namespace {
using namespace specstop_vec;
// torch's rms_norm on a CPU is a composite of ~10 ops (~12 us a row); this is one pass. fp32 math,
// one rounding of the output: y = x / sqrt(mean(x^2) + eps) * w. With `res`, x + res first
// (rounded to x's dtype, as the residual stream is stored), returned beside the norm.
template <class T>
void rms_rows(const T* x, const T* res, T* sum, const T* w, T* y, int64_t R, int64_t C, double eps) {
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * C;
      if (res) {  // the residual add, stored in T, then normed as stored
        for (int64_t c = 0; c < C; c += 16) {
          const __mmask16 m = live(c, C);
          store16(sum + r * C + c, _mm512_add_ps(load16(xr + c, m), load16(res + r * C + c, m)), m);
        }
        xr = sum + r * C;
      }
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; c += 16) {
        const __m512 v = load16(xr + c, live(c, C));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)C + (float)eps));
      for (int64_t c = 0; c < C; c += 16) {
        const __mmask16 m = live(c, C);
        store16(y + r * C + c, _mm512_mul_ps(_mm512_mul_ps(load16(xr + c, m), scale), load16(w + c, m)), m);
      }
    }
  });
}

}  // namespace

namespace specstop {
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                                const at::Tensor& w, double eps) {
  const bool has_res = res.has_value() && res->defined();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1) &&
              w.scalar_type() == x.scalar_type() &&
              (!has_res || (res->sizes() == x.sizes() && res->is_contiguous() && res->scalar_type() == x.scalar_type())),
              "rms_norm: contiguous x [R, C] (and res like it), weight [C], one dtype");
  at::Tensor y = at::empty_like(x), sum = has_res ? at::empty_like(x) : x;
  const int64_t R = x.size(0), C = x.size(1);
  if (x.scalar_type() == at::kBFloat16)
    rms_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), has_res ? res->data_ptr<at::BFloat16>() : nullptr,
                           sum.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), R, C, eps);
  else if (x.scalar_type() == at::kFloat)
    rms_rows<float>(x.data_ptr<float>(), has_res ? res->data_ptr<float>() : nullptr, sum.data_ptr<float>(),
                    w.data_ptr<float>(), y.data_ptr<float>(), R, C, eps);
  else TORCH_CHECK(false, "rms_norm: bfloat16 or float32");
  return {sum, y};
}
}  // namespace specstop

namespace {


// ---- the rest of a decoder layer's row-wise arithmetic --------------------------------------
// Each is several torch ops (and several roundings in bf16) around one small tensor; one pass
// here, fp32 math, one rounding per output.

// y [R = B * T, (H + 2 * KV) * D] (a fused q/k/v projection), cos / sin [R, D] ->
// q [B, H, T, D], k and v [B, KV, T, D]: q and k rotated (rotate_half convention), v as is.
template <class T>
void rope_rows(const T* y, const T* cs, const T* sn, T* q, T* k, T* v, int64_t B, int64_t Tn, int64_t H,
               int64_t KV, int64_t D) {
  const int64_t W = (H + 2 * KV) * D, half = D / 2;
  // a prompt's rows split across the threads (a step's few stay on one: no parallel region)
  at::parallel_for(0, B * Tn, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const T* yr = y + r * W;
      const T* c = cs + r * D;
      const T* s = sn + r * D;
      for (int64_t h = 0; h < H + 2 * KV; ++h) {
        const T* src = yr + h * D;
        T* dst = h < H ? q + ((b * H + h) * Tn + t) * D
                 : h < H + KV ? k + ((b * KV + h - H) * Tn + t) * D : v + ((b * KV + h - H - KV) * Tn + t) * D;
        if (h >= H + KV) {
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          const float x = (float)src[d], rot = d < half ? -(float)src[d + half] : (float)src[d - half];
          dst[d] = T(x * (float)c[d] + rot * (float)s[d]);
        }
      }
    }
  });
}

}  // namespace

namespace specstop {
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& y, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t B, int64_t H, int64_t KV) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == y.scalar_type() && sin.scalar_type() == y.scalar_type() &&
              y.size(0) % B == 0 && y.size(1) % (H + 2 * KV) == 0,
              "rope_qkv: contiguous y [B*T, (H+2KV)*D], cos / sin [B*T, D] of y's dtype");
  const int64_t Tn = y.size(0) / B, D = y.size(1) / (H + 2 * KV);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == y.size(0) * D && sin.numel() == cos.numel(), "rope_qkv: shapes");
  at::Tensor q = at::empty({B, H, Tn, D}, y.options()), k = at::empty({B, KV, Tn, D}, y.options()),
             v = at::empty({B, KV, Tn, D}, y.options());
  if (y.scalar_type() == at::kBFloat16)
    rope_rows<at::BFloat16>(y.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                            q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                            B, Tn, H, KV, D);
  else if (y.scalar_type() == at::kFloat)
    rope_rows<float>(y.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                     k.data_ptr<float>(), v.data_ptr<float>(), B, Tn, H, KV, D);
  else TORCH_CHECK(false, "rope_qkv: bfloat16 or float32");
  return {q, k, v};
}
}  // namespace specstop

namespace {

// g [R, 2 * I] (a fused gate / up projection) -> silu(gate) * up [R, I]
template <class T>
void silu_mul_rows(const T* g, T* out, int64_t R, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = live(i, I);
      const __m512 a = load16(g + r * 2 * I + i, m), b = load16(g + r * 2 * I + I + i, m);
      const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      store16(out + r * I + i, _mm512_mul_ps(silu, b), m);
    }
}

}  // namespace

namespace specstop {
at::Tensor silu_mul(const at::Tensor& g) {
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.size(1) % 2 == 0, "silu_mul: contiguous g [R, 2I]");
  const int64_t R = g.size(0), I = g.size(1) / 2;
  at::Tensor out = at::empty({R, I}, g.options());
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kFloat, "silu_mul: bfloat16 or float32");
  at::parallel_for(0, R, 32, [&](int64_t r0, int64_t r1) {  // a prompt's rows across the threads
    if (g.scalar_type() == at::kBFloat16)
      silu_mul_rows<at::BFloat16>(g.data_ptr<at::BFloat16>() + r0 * 2 * I, out.data_ptr<at::BFloat16>() + r0 * I, r1 - r0, I);
    else
      silu_mul_rows<float>(g.data_ptr<float>() + r0 * 2 * I, out.data_ptr<float>() + r0 * I, r1 - r0, I);
  });
  return out;
}
}  // namespace specstop


TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("add_rms_norm(Tensor x, Tensor? res, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor y, Tensor cos, Tensor sin, int b, int h, int kv) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor g) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) {
  m.impl("add_rms_norm", &specstop::add_rms_norm);
  m.impl("rope_qkv", &specstop::rope_qkv);
  m.impl("silu_mul", &specstop::silu_mul);
}

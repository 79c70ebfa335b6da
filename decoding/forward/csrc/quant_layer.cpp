// A GGUF target's Llama-family decoder layer where decoding.forward.kernels does not build (CPUs
// without AVX512-BF16): float32, AVX2. The row-wise ops (RMSNorm, rotary, SiLU gate) and the whole
// layer of a step or a verify in ONE call, as specstop::decoder_layer does on AVX512
// (decoding/forward/csrc/layer.cpp), with the same contracts.
//
// Why: on that path the lean layer ran ~20 torch ops a layer around its four quantized linears;
// their dispatch and the Python between them took more time than the linears (a 2-core EPYC
// with the AVX2 path forced: 3.9 of 7.5 ms a token, against 2.0 of 5.6 on the AVX512 path).
//
// The lean layer calls these same ops one by one where it does not take the one call (a prompt):
// the same functions on the same inputs, so a row of a verify equals a 1-token step bit for bit.
// Each op computes a row alone, in a fixed order (8-lane sums, an exp polynomial), so the result
// never depends on the number of rows or threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <immintrin.h>

#include "quant.h"
#include "segments.h"

#include <cmath>
#include <tuple>

namespace {

AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x, 8 lanes: x clamped to [-87, 88] (normal results: 2^n built in the exponent bits), n =
// round(x log2 e), r = x - n ln2 in two parts, a degree-7 Taylor polynomial (decoding.forward.kernels's
// exp16 on AVX512 uses the same one, with a wider clamp)
AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// y = x / sqrt(mean(x^2) + eps) * w, one row; with res, x + res first (into sum)
AVX2 void rms_row(const float* x, const float* res, float* sum, const float* w, float* y, int64_t C, double eps) {
  if (res) {
    for (int64_t c = 0; c < C; ++c) sum[c] = x[c] + res[c];
    x = sum;
  }
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; c < C; ++c) ss = std::fma(x[c], x[c], ss);
  const float scale = 1.0f / std::sqrt(ss / (float)C + (float)eps);
  for (c = 0; c < C; ++c) y[c] = x[c] * scale * w[c];
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                                const at::Tensor& w, double eps) {
  const bool has_res = res.has_value() && res->defined();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && w.is_contiguous() &&
              w.scalar_type() == at::kFloat && w.numel() == x.size(1) &&
              (!has_res || (res->sizes() == x.sizes() && res->is_contiguous() && res->scalar_type() == at::kFloat)),
              "quant add_rms_norm: contiguous float32 x [R, C] (and res like it), weight [C]");
  at::Tensor y = at::empty_like(x), sum = has_res ? at::empty_like(x) : x;
  const int64_t C = x.size(1);
  const float *X = x.data_ptr<float>(), *Rs = has_res ? res->data_ptr<float>() : nullptr, *Wt = w.data_ptr<float>();
  float *S = sum.data_ptr<float>(), *Y = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(X + r * C, Rs ? Rs + r * C : nullptr, S + r * C, Wt, Y + r * C, C, eps);
  });
  return {sum, y};
}

// y [B * T, (H + 2 KV) D] -> q [B, H, T, D], k / v [B, KV, T, D]; q and k rotated (rotate_half)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& y, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t B, int64_t H, int64_t KV) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              y.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              y.size(0) % B == 0 && y.size(1) % (H + 2 * KV) == 0,
              "quant rope_qkv: contiguous float32 y [B*T, (H+2KV)*D], cos / sin [B*T, D]");
  const int64_t Tn = y.size(0) / B, D = y.size(1) / (H + 2 * KV), W = (H + 2 * KV) * D, half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.numel() == y.size(0) * D && sin.numel() == cos.numel(), "quant rope_qkv: shapes");
  at::Tensor q = at::empty({B, H, Tn, D}, y.options()), k = at::empty({B, KV, Tn, D}, y.options()),
             v = at::empty({B, KV, Tn, D}, y.options());
  const float *Y = y.data_ptr<float>(), *CS = cos.data_ptr<float>(), *SN = sin.data_ptr<float>();
  float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  // a prompt's rows split across the threads (a step's few stay on one: no parallel region)
  at::parallel_for(0, B * Tn, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const float *c = CS + r * D, *s = SN + r * D;
      for (int64_t h = 0; h < H + 2 * KV; ++h) {
        const float* src = Y + r * W + h * D;
        float* dst = h < H ? Q + ((b * H + h) * Tn + t) * D
                     : h < H + KV ? K + ((b * KV + h - H) * Tn + t) * D : V + ((b * KV + h - H - KV) * Tn + t) * D;
        for (int64_t d = 0; d < D; ++d) {
          if (h >= H + KV) { dst[d] = src[d]; continue; }
          const float rot = d < half ? -src[d + half] : src[d - half];
          dst[d] = src[d] * c[d] + rot * s[d];
        }
      }
    }
  });
  return {q, k, v};
}

// g [R, 2 I] (gate, up) -> silu(gate) * up [R, I]
AVX2 void silu_rows(const float* g, float* out, int64_t R, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < R; ++r) {
    const float *a = g + r * 2 * I, *u = a + I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 x = _mm256_loadu_ps(a + i);
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      _mm256_storeu_ps(out + r * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
    for (; i < I; ++i) out[r * I + i] = a[i] / (1.0f + std::exp(-a[i])) * u[i];
  }
}

at::Tensor silu_mul(const at::Tensor& g) {
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.scalar_type() == at::kFloat && g.size(1) % 2 == 0,
              "quant silu_mul: contiguous float32 g [R, 2I]");
  at::Tensor out = at::empty({g.size(0), g.size(1) / 2}, g.options());
  const float* G = g.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t I = g.size(1) / 2;
  at::parallel_for(0, g.size(0), 32, [&](int64_t r0, int64_t r1) {  // a prompt's rows across the threads
    silu_rows(G + r0 * 2 * I, O + r0 * I, r1 - r0, I);
  });
  return out;
}

using LinSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const c10::optional<at::Tensor>&, int64_t);
using AttSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, double);

// The layer around its attention, as specstop::layer_around with GGUF blocks (dims: B, H, KV, four
// output widths, four ggml kinds, the activations' form (1: q8), the instruction set), every step
// this extension's
template <class Attend>
at::Tensor layer_around(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t B,
                        at::TensorList w, const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims,
                        double eps1, double eps2, Attend attend) {
  TORCH_CHECK(w.size() == 6 && dims.size() == 13 && x.dim() == 2,
              "quant decoder_layer: 6 weights, 13 dims, x [B*T, C]");
  static auto& d = c10::Dispatcher::singleton();
  static const auto f32 = d.findSchemaOrThrow("specstop_quant::linear", "").typed<LinSig>();
  static const auto q8 = d.findSchemaOrThrow("specstop_quant::linear_q8", "").typed<LinSig>();
  const auto& lin = dims[11] ? q8 : f32;
  auto L = [&](const at::Tensor& a, int i, const c10::optional<at::Tensor>& b = c10::nullopt) {
    return lin.call(a, w[i == 0 ? 1 : i == 1 ? 2 : i == 2 ? 4 : 5], dims[7 + i], a.size(1), b, dims[12]);
  };
  auto [x0, h] = add_rms_norm(x, c10::nullopt, w[0], eps1);
  auto [qs, k, v] = rope_qkv(L(h, 0, qkv_bias), cos, sin, B, dims[1], dims[2]);
  const at::Tensor att = attend(qs, k, v);
  auto [x1, h1] = add_rms_norm(x, L(att, 1), w[3], eps2);
  return L(silu_mul(L(h1, 2)), 3).add_(x1);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double scale) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specstop_quant::row_attention", "")
                             .typed<AttSig>();
  return op.call(q, k, v, mask, scale);
}

// as specstop::decoder_layer
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kbuf,
                         const at::Tensor& vbuf, int64_t start, int64_t n, const c10::optional<at::Tensor>& mask,
                         at::TensorList w, const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims,
                         double eps1, double eps2, double scale) {
  auto attend = [&](auto&&... a) { return attention(a..., scale); };
  return layer_around(x, cos, sin, dims[0], w, qkv_bias, dims, eps1, eps2, [&](auto& qs, auto& k, auto& v) {
    return attend_cached(qs, k, v, kbuf, vbuf, start, n, mask, attend);
  });
}

// as specstop::decoder_layer_segments
at::Tensor decoder_layer_segments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  at::TensorList kbufs, at::TensorList vbufs, at::IntArrayRef starts,
                                  at::IntArrayRef ns, at::IntArrayRef rows,
                                  const c10::List<c10::optional<at::Tensor>>& masks, at::TensorList w,
                                  const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims, double eps1,
                                  double eps2, double scale) {
  TORCH_CHECK(dims[0] == 1, "quant decoder_layer_segments: dims with B = 1");
  return layer_around(x, cos, sin, 1, w, qkv_bias, dims, eps1, eps2, [&](auto& qs, auto& k, auto& v) {
    return attend_segments(qs, k, v, kbufs, vbufs, starts, ns, rows, masks, x.size(0), [&](auto&&... a) {
      return attention(a..., scale);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) {
  m.def("add_rms_norm(Tensor x, Tensor? res, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor y, Tensor cos, Tensor sin, int b, int h, int kv) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor g) -> Tensor");
  m.def("decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kbuf, Tensor(b!) vbuf, int start, int n, "
        "Tensor? mask, Tensor[] w, Tensor? qkv_bias, int[] dims, float eps1, float eps2, float scale) -> Tensor");
  m.def("decoder_layer_segments(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "int[] starts, int[] ns, int[] rows, Tensor?[] masks, Tensor[] w, Tensor? qkv_bias, int[] dims, "
        "float eps1, float eps2, float scale) -> Tensor");
  m.def("decoder_stack_segments(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "int[] starts, int[] ns, int[] rows, Tensor?[] masks, Tensor[] w, Tensor?[] qkv_bias, int[] dims, "
        "float[] eps1, float[] eps2, float scale, int[] capture) -> (Tensor, Tensor[])");
  m.def("keep_rows(Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, int[] starts, int s, int[] kept) -> ()");
}
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_segments", &decoder_layer_segments);
  m.impl("decoder_stack_segments", &decoder_stack_segments<&decoder_layer_segments>);
  m.impl("keep_rows", &keep_rows);
}

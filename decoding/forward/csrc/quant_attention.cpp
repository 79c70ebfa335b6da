// Attention of a step, a verify or a prompt where decoding.forward.kernels does not build (CPUs
// without AVX512-BF16), for a GGUF target's lean layers (decoding/forward/quant.py): float32, AVX2;
// keys and values float32 or float16 (a float16 KV cache), the math float32.
//
// Why: torch's attention is not batch-invariant (a row's blocking over keys follows how many keys
// and rows the call has), so a verify row and the step that would produce the same token differ in
// the last bits; with activations rounded to 8 bits (q8) that becomes a whole quantum about once a
// token and flips greedy near-ties. Here each row is computed alone over its visible keys in cache
// order: scores q.k * scale (a fixed 8-lane dot product), the max, exp, their sum in key order, the
// values summed in key order, divided once. Masked keys are skipped (adding their zeros changes
// nothing), so the same token sees the same keys in the same order in a step and in a verify.
// Same contract as specstop::row_attention: q [B, H, T, D], k / v [B, KV, S, D] (stride 1 on D),
// mask [1 or B, 1, T, >= S] bool (true: seen) or float (added), or none (every key seen);
// out [B, T, H, D].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include "quant.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

// 8 fp32 lanes of keys / values as the cache holds them: float32, or float16 (a float16 KV cache)
AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

template <class KT>
AVX2 inline float dot(const float* a, const KT* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  float r = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  for (; d < D; ++d) r = std::fma(a[d], (float)b[d], r);
  return r;
}

template <class KT>
AVX2 inline void axpy(float p, const KT* v, float* o, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(o + d)));
  for (; d < D; ++d) o[d] = std::fma(p, (float)v[d], o[d]);
}

template <typename M, class KT>
AVX2 void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& m, double scale,
                 at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), S = k.size(2);
  const int64_t rep = H / KV;
  const float* Q = q.data_ptr<float>();
  const KT* K = k.data_ptr<KT>();
  const KT* Vv = v.data_ptr<KT>();
  float* O = out.data_ptr<float>();
  const M* Mp = m.defined() ? m.data_ptr<M>() : nullptr;
  const float sc = (float)scale, NEG = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H * T, 16, [&](int64_t a, int64_t e) {
    std::vector<float> s(S);
    for (int64_t i = a; i < e; ++i) {
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T, g = h / rep;
      const float* qr = Q + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
      const M* mr = Mp ? Mp + (m.size(0) == 1 ? 0 : b * m.stride(0)) + t * m.stride(2) : nullptr;
      float mx = NEG;
      for (int64_t j = 0; j < S; ++j) {
        float add = 0.0f;
        if (mr) {
          if constexpr (std::is_same_v<M, bool>) add = mr[j * m.stride(3)] ? 0.0f : NEG;
          else add = mr[j * m.stride(3)];
        }
        s[j] = add == NEG ? NEG : dot(qr, K + b * k.stride(0) + g * k.stride(1) + j * k.stride(2), D) * sc + add;
        mx = std::max(mx, s[j]);
      }
      float* o = O + ((b * T + t) * H + h) * D;
      std::fill(o, o + D, 0.0f);
      float sum = 0.0f;
      for (int64_t j = 0; j < S; ++j) {
        if (s[j] == NEG) continue;
        const float p = std::exp(s[j] - mx);
        sum += p;
        axpy(p, Vv + b * v.stride(0) + g * v.stride(1) + j * v.stride(2), o, D);
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

at::Tensor row_attention_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(specstop_quant::has_avx2(), "row_attention_avx2: the CPU lacks AVX2 / FMA");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && k.sizes() == v.sizes() &&
              q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.stride(3) == 1 &&
              k.stride(3) == 1 && v.stride(3) == 1 && q.scalar_type() == at::kFloat &&
              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) && v.scalar_type() == k.scalar_type(),
              "row_attention_avx2: float32 q [B, H, T, D], k / v [B, KV, S, D] float32 or float16, H a multiple of KV");
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == q.size(2) && mask->size(3) >= k.size(2) &&
                (mask->size(0) == 1 || mask->size(0) == q.size(0)) && mask->size(1) == 1 &&
                (mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat),
                "row_attention_avx2: mask [1 or B, 1, T, >= S], bool or float32");
  } else {
    TORCH_CHECK(q.size(2) == 1, "row_attention_avx2: more than one row needs a mask");
  }
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const at::Tensor m = has_mask ? *mask : at::Tensor();
  const bool half = k.scalar_type() == at::kHalf;
  if (has_mask && m.scalar_type() == at::kBool) half ? attend<bool, c10::Half>(q, k, v, m, scale, out) : attend<bool, float>(q, k, v, m, scale, out);
  else half ? attend<float, c10::Half>(q, k, v, m, scale, out) : attend<float, float>(q, k, v, m, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) { m.impl("row_attention", &row_attention_avx2); }

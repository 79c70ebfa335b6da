// Attention for a decoding step or a verified tree (decoding/cpu_kernels.py): each query row
// visits exactly the keys its mask lets it see, in position order, with a fixed fp32 reduction.
//
// Why not torch's scaled_dot_product_attention: its CPU kernels vectorise over the key axis, so
// a row's rounding depends on how many keys the call carries, visible or not; a token attended
// alone (a plain step, every key visible) and the same token inside a verify (one more key per
// tree node, masked) then differ in the last bf16 bit, and greedy bf16 speculation drifts from
// bf16 `ar` at near-ties. Here a row's result depends only on its visible keys.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using namespace specstop_vec;

constexpr int MAXD = 256;  // head_dim up to 256: 16 vectors of accumulators

// q [B, H, T, D], k / v [B, KV, N, D] (any strides, unit last), mask: none (every key visible),
// bool [Bm, Hm, T, >= N] (true: visible) or additive [Bm, Hm, T, >= N] (visible unless <= -1e30)
// -> out [B, T, H, D]. The query heads of one kv head are done together, each key and value read once.
template <class T, class M, int DV>  // DV: 16-float vectors per head row (compile-time: registers)
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tn = q.size(2), D = q.size(3), KV = k.size(1), N = k.size(2);
  const int64_t rep = H / KV;
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* V = v.data_ptr<T>();
  const M* Mk = mask.defined() ? mask.data_ptr<M>() : nullptr;
  T* O = out.data_ptr<T>();
  const int64_t mb = mask.defined() && mask.size(0) > 1 ? mask.stride(0) : 0,
                mh = mask.defined() && mask.size(1) > 1 ? mask.stride(1) : 0,
                mt = mask.defined() ? mask.stride(2) : 0, mn = mask.defined() ? mask.stride(3) : 0;
  constexpr int MAXREP = 16;  // query heads per kv head handled together (each key loaded once)
  TORCH_CHECK(rep <= MAXREP, "row_attention: at most 16 query heads per kv head");
  at::parallel_for(0, B * KV * Tn, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> score((size_t)rep * N);
    std::vector<int64_t> key(N);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (KV * Tn), g = (i / Tn) % KV, t = i % Tn;
      // the rep heads of kv head g share one mask row (a mask per head is refused above)
      const M* mrow = Mk ? Mk + b * mb + g * rep * mh + t * mt : nullptr;
      int64_t n = 0;
      for (int64_t j = 0; j < N; ++j) {  // visible keys in position order
        if (mrow) {
          if constexpr (std::is_same_v<M, bool>) {
            if (!mrow[j * mn]) continue;
          } else {
            if ((float)mrow[j * mn] <= -1e30f) continue;
          }
        }
        key[n++] = j;
      }
      float top[MAXREP];
      __m512 qv[MAXREP][DV];
      for (int r = 0; r < rep; ++r) {
        top[r] = -INFINITY;
        const T* qr = Q + b * q.stride(0) + (g * rep + r) * q.stride(1) + t * q.stride(2);
        for (int c = 0; c < DV; ++c) qv[r][c] = load16(qr + 16 * c, live(16 * c, D));
      }
      for (int64_t m = 0; m < n; ++m) {  // each key row loaded once for the rep heads
        const T* kr = K + b * k.stride(0) + g * k.stride(1) + key[m] * k.stride(2);
        __m512 kv[DV];
        for (int c = 0; c < DV; ++c) kv[c] = load16(kr + 16 * c, live(16 * c, D));
        float add = 0.0f;
        if constexpr (!std::is_same_v<M, bool>)
          if (mrow) add = (float)mrow[key[m] * mn];
        for (int r = 0; r < rep; ++r) {
          __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
          for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(qv[r][c], kv[c], acc);
          const float s = _mm512_reduce_add_ps(acc) * (float)scale + add;
          score[r * N + m] = s;
          top[r] = std::max(top[r], s);
        }
      }
      float total[MAXREP];
      for (int r = 0; r < rep; ++r) {  // fixed order: the same n visible keys give the same sums
        float* sr = score.data() + r * N;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t m = 0; m < n; m += 16) {
          const __mmask16 lm = live(m, n);
          const __m512 p = _mm512_maskz_mov_ps(lm, exp16(_mm512_sub_ps(load16(sr + m, lm), _mm512_set1_ps(top[r]))));
          _mm512_mask_storeu_ps(sr + m, lm, p);
          sum = _mm512_add_ps(sum, p);
        }
        total[r] = _mm512_reduce_add_ps(sum);
      }
      for (int r = 0; r < rep; ++r) {  // in the keys' order, accumulators in registers
        const float* pr = score.data() + r * N;
        __m512 o[DV];
        for (int c = 0; c < DV; ++c) o[c] = _mm512_setzero_ps();
        for (int64_t m = 0; m < n; ++m) {
          const T* vr = V + b * v.stride(0) + g * v.stride(1) + key[m] * v.stride(2);
          const __m512 p = _mm512_set1_ps(pr[m]);
          for (int c = 0; c < DV; ++c) o[c] = _mm512_fmadd_ps(p, load16(vr + 16 * c, live(16 * c, D)), o[c]);
        }
        const __m512 inv = _mm512_set1_ps(n ? 1.0f / total[r] : 0.0f);
        T* orow = O + ((b * Tn + t) * H + g * rep + r) * D;
        for (int c = 0; c < DV; ++c) store16(orow + 16 * c, _mm512_mul_ps(o[c], inv), live(16 * c, D));
      }
    }
  });
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && k.sizes() == v.sizes() &&
              q.size(3) == k.size(3) && q.size(3) <= MAXD && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
              q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "row_attention: q [B, H, T, D], k / v [B, KV, N, D] of one dtype, H a multiple of KV, D <= 256");
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask)
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == q.size(2) && mask->size(3) >= k.size(2) &&
                (mask->size(0) == 1 || mask->size(0) == q.size(0)) && mask->size(1) == 1,
                "row_attention: mask [1 or B, 1, T, >= N] (one mask for every head)");
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const at::Tensor m = has_mask ? *mask : at::Tensor();
  const auto st = q.scalar_type();
  const auto mt = has_mask ? m.scalar_type() : st;
  TORCH_CHECK(st == at::kBFloat16 || st == at::kFloat, "row_attention: bfloat16 or float32");
  TORCH_CHECK(mt == at::kBool || mt == st, "row_attention: a bool mask or one of q's dtype");
  const int64_t D = q.size(3);
  // head_dim 64 / 128 (most models) get their vector count at compile time, the rest up to 256
#define SPECSTOP_ATTEND(T, M) \
  (D == 64 ? attend<T, M, 4>(q, k, v, m, scale, out) : D == 128 ? attend<T, M, 8>(q, k, v, m, scale, out) \
           : D <= 32 ? attend<T, M, 2>(q, k, v, m, scale, out) : attend<T, M, MAXD / 16>(q, k, v, m, scale, out))
  if (st == at::kBFloat16) {
    if (mt == at::kBool) SPECSTOP_ATTEND(at::BFloat16, bool);
    else SPECSTOP_ATTEND(at::BFloat16, at::BFloat16);
  } else {
    if (mt == at::kBool) SPECSTOP_ATTEND(float, bool);
    else SPECSTOP_ATTEND(float, float);
  }
#undef SPECSTOP_ATTEND
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) { m.impl("row_attention", &row_attention); }

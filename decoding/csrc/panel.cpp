// y = x @ w.T (+ bias) in float32 for 1-32 rows of x, over a weight packed once into panels of 64
// output columns (decoding/cpu_kernels.py).
//
// Why: the row-major fp32 kernel (gemm.cpp, small_linear) reduces along K, one dot product per
// output, and runs out of arithmetic above ~6 rows; oneDNN then streams the weights at ~9 GB/s.
// Here the weight is laid out [N / 64][K][64]: for each k, 64 outputs' weights are one 256-byte
// load, each row of x a broadcast, and every output one FMA chain over k in order. So a row's
// result does not depend on the other rows of the call or on the thread count (batch-invariant),
// and up to ~16-20 rows cost about what reading the weights once costs (streamed with our own
// prefetch, as the bf16 kernels do); more rows re-read each panel from L2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t PW = 64;      // outputs per panel: 4 vectors
constexpr int64_t PF = 16384;   // bytes of lookahead in the panel stream
constexpr int TR = 6;           // rows per pass (4 x 6 accumulators)

// w [N, K] -> [ceil(N / 64), K, 64], zero-padded past N
at::Tensor panel_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "panel_pack: a float32 [N, K] weight");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + PW - 1) / PW;
  at::Tensor out = at::zeros({NB, K, PW}, wc.options());
  const float* W = wc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < PW && b * PW + c < N; ++c) {
        const float* src = W + (b * PW + c) * K;
        float* dst = O + b * K * PW + c;
        for (int64_t k = 0; k < K; ++k) dst[k * PW] = src[k];
      }
  });
  return out;
}

template <int R>
inline void pass(const float* x, int64_t K, const float* p, bool prefetch, __m512 (&acc)[TR][4]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = p + k * PW;
    if (prefetch) {
      const char* f = (const char*)pk + PF;
      for (int l = 0; l < 256; l += 64) _mm_prefetch(f + l, _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + 16), w2 = _mm512_loadu_ps(pk + 32),
                 w3 = _mm512_loadu_ps(pk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && wp.dim() == 3 && wp.size(2) == PW &&
              wp.size(1) == x.size(1) && N <= wp.size(0) * PW && N > (wp.size(0) - 1) * PW,
              "panel_linear: float32 x [T, K] and a panel_pack'ed weight of K columns");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), NB = wp.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({T, N}, x.options());
  const float* X = xc.data_ptr<float>();
  const float* P = wp.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    __m512 acc[TR][4];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const float* p = P + nb * K * PW;
      const int64_t n0 = nb * PW;
      for (int64_t t0 = 0; t0 < T; t0 += TR) {  // a second pass re-reads the panel from cache
        const int R = (int)std::min<int64_t>(TR, T - t0);
        const float* xr = X + t0 * K;
        switch (R) {
          case 6: pass<6>(xr, K, p, t0 == 0, acc); break;
          case 5: pass<5>(xr, K, p, t0 == 0, acc); break;
          case 4: pass<4>(xr, K, p, t0 == 0, acc); break;
          case 3: pass<3>(xr, K, p, t0 == 0, acc); break;
          case 2: pass<2>(xr, K, p, t0 == 0, acc); break;
          default: pass<1>(xr, K, p, t0 == 0, acc); break;
        }
        for (int c = 0; c < 4; ++c) {
          const int64_t n = n0 + 16 * c;
          if (n >= N) break;
          const __mmask16 live = n + 16 <= N ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
          const __m512 bv = B ? _mm512_maskz_loadu_ps(live, B + n) : _mm512_setzero_ps();
          for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(Y + (t0 + r) * N + n, live, _mm512_add_ps(acc[r][c], bv));
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("panel_pack(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}

// y = x @ w.T (+ bias) in float32 for 1-32 rows of x, over a weight packed once into panels of 48
// output columns (decoding/forward/kernels.py).
//
// Why: the row-major fp32 kernel (gemm.cpp, small_linear) reduces along K, one dot product per
// output, and runs out of arithmetic above ~6 rows; oneDNN then streams the weights at ~9 GB/s.
// Here the weight is laid out [N / 48][K][48]: for each k, 48 outputs' weights are one 192-byte
// load, each row of x a broadcast, and every output one FMA chain over k in order. So a row's
// result does not depend on the other rows of the call or on the thread count (batch-invariant).
// Up to 8 rows share one pass over a panel (8 x 3 accumulators fill the registers), so a verify of
// up to 8 tokens reads each weight once, streamed with our own prefetch as the bf16 kernels do;
// more rows go in groups over chunks of K (KC). The CPU would allow a verify of up to 16 tokens at
// the cost of a step (the forward suite's roofline); the FMAs only partly hide under the weight
// stream, so it costs more (reports/forward-2026-11-27-panels-48).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ops.h"

#include <algorithm>
#include <vector>

namespace {

constexpr int V = 3;            // vectors of 16 outputs per panel
constexpr int64_t PW = 16 * V;  // outputs per panel
constexpr int64_t PF = 16384;   // bytes of lookahead in the panel stream
constexpr int TR = 8;           // most rows per pass (TR x V accumulators)
// Where the first pass prefetches the panel stream: into L1 for 1-2 rows; for more, into L2,
// which leaves L1 to the rows of x and the FMAs (4 / 8 / 16 rows: 0.88x / 0.89x / 0.94x the time
// of L1 prefetches; 1 row 1.03x; reports/forward-2026-11-27-panels-48)
constexpr int NO_PREFETCH = 0, TO_L1 = 1, TO_L2 = 2;
// More than TR rows: the rows go in balanced groups (12 = 6 + 6) and K in chunks of KC steps
// (12 KiB of panel): the first group streams a chunk in, the others reuse it from L1, so the
// weight stream never waits for a whole second pass (12 / 16 / 24 rows: 0.91-0.96x / 0.92-0.96x
// / 0.95-0.97x the time of whole passes, same packed weights, two runs). Accumulators carry over chunks through memory, so every
// output is still one FMA chain over k in order.
constexpr int64_t KC = 64;

// w [N, K] -> [ceil(N / 48), K, 48], zero-padded past N
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

// rows [0, R) of x against k in [k0, k1) of one panel: acc[r][c] += x[r][k] * w[k][c], k in
// order; the accumulators start at zero (k0 == 0) or where `carry` left them, and end in `carry`
template <int R>
inline void pass(const float* x, int64_t K, const float* p, int64_t k0, int64_t k1, int prefetch, float* carry) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = k0 ? _mm512_loadu_ps(carry + (r * V + c) * 16) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const float* pk = p + k * PW;
    const char* f = (const char*)pk + PF;
    if (prefetch == TO_L1)
      for (int l = 0; l < PW * 4; l += 64) _mm_prefetch(f + l, _MM_HINT_T0);
    else if (prefetch == TO_L2)
      for (int l = 0; l < PW * 4; l += 64) _mm_prefetch(f + l, _MM_HINT_T1);
    __m512 w[V];
    for (int c = 0; c < V; ++c) w[c] = _mm512_loadu_ps(pk + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(carry + (r * V + c) * 16, acc[r][c]);
}

}  // namespace

namespace specstop {
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
  const int64_t groups = (T + TR - 1) / TR;
  std::vector<int64_t> first_row(groups + 1, 0);  // balanced: 12 rows are 6 + 6, not 8 + 4
  for (int64_t q = 0; q < groups; ++q) first_row[q + 1] = first_row[q] + (T - first_row[q]) / (groups - q);
  const int64_t kc = groups == 1 ? K : KC;
  const int stream = T <= 2 ? TO_L1 : TO_L2;
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<float> carry;  // per thread, reused across calls
    carry.resize((size_t)T * V * 16);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const float* p = P + nb * K * PW;
      for (int64_t k0 = 0; k0 < K; k0 += kc)
        for (int64_t q = 0; q < groups; ++q) {
          const int64_t t0 = first_row[q];
          const float* xr = X + t0 * K;
          float* cr = carry.data() + t0 * V * 16;
          const int64_t k1 = std::min(K, k0 + kc);
          const int pf = q == 0 ? stream : NO_PREFETCH;
          switch (first_row[q + 1] - t0) {
#define SPECSTOP_PASS(r) \
  case r: pass<r>(xr, K, p, k0, k1, pf, cr); break;
            SPECSTOP_PASS(8) SPECSTOP_PASS(7) SPECSTOP_PASS(6) SPECSTOP_PASS(5) SPECSTOP_PASS(4) SPECSTOP_PASS(3)
            SPECSTOP_PASS(2) SPECSTOP_PASS(1)
#undef SPECSTOP_PASS
          }
        }
      for (int c = 0; c < V; ++c) {
        const int64_t n = nb * PW + 16 * c;
        if (n >= N) break;
        const __mmask16 live = n + 16 <= N ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __m512 bv = B ? _mm512_maskz_loadu_ps(live, B + n) : _mm512_setzero_ps();
        for (int64_t t = 0; t < T; ++t)
          _mm512_mask_storeu_ps(Y + t * N + n, live, _mm512_add_ps(_mm512_loadu_ps(carry.data() + (t * V + c) * 16), bv));
      }
    }
  });
  return y;
}
}  // namespace specstop


TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("panel_pack(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &specstop::panel_linear);
}

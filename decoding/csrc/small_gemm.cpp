// y = x @ w.T (+ bias) for a few rows of x over a row-major weight, read from memory once.
//
// Why: a decode step multiplies 1-16 rows by each weight matrix, so its cost is streaming the
// weights. oneDNN's kernels reach ~9-10 GB/s on one core over a layer's small cold matrices;
// this loop reaches the core's streaming rate by prefetching PF bytes ahead of the rows it
// reads (the hardware prefetcher stops at 4 KiB page boundaries). See decoding/small_gemm.py.
//
// Each output is one fp32 chain per vector lane over K, summed at the end, whatever T and the
// thread count: a row's result does not depend on the other rows of the call (batch-invariant).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int64_t PF = 16384;  // bytes of lookahead (4-32 KiB measured; 16 best on an AMX Xeon)
constexpr int R = 4;           // weight rows per block
constexpr int TB = 4;          // x rows per pass over a block (R * TB accumulators)

struct Bf16 {  // 32 bf16 per step, pairwise dot products into 16 fp32 lanes
  using T = at::BFloat16;
  static constexpr int64_t S = 32;
  static __m512i load(const T* p, int64_t n) {
    return n >= S ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
  }
  static __m512 fma(__m512 a, __m512i w, __m512i x) { return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x); }
};

struct F32 {  // 16 floats per step
  using T = float;
  static constexpr int64_t S = 16;
  static __m512 load(const T* p, int64_t n) {
    return n >= S ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
  }
  static __m512 fma(__m512 a, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, a); }
};

template <class V, int NR, int NT>
inline void block(const typename V::T* x, const typename V::T* w, const float* bias, typename V::T* y,
                  int64_t K, int64_t N, bool prefetch) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t row_bytes = K * (int64_t)sizeof(typename V::T);
  for (int64_t k = 0; k < K; k += V::S) {
    const int64_t n = K - k;
    if (prefetch) {
      const char* p = (const char*)(w + k) + PF;
      for (int r = 0; r < NR; ++r) _mm_prefetch(p + r * row_bytes, _MM_HINT_T0);
    }
    decltype(V::load(w, 0)) wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = V::load(w + r * K + k, n);
    for (int t = 0; t < NT; ++t) {
      auto xv = V::load(x + t * K + k, n);
      for (int r = 0; r < NR; ++r) acc[r][t] = V::fma(acc[r][t], wv[r], xv);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) {
      float s = _mm512_reduce_add_ps(acc[r][t]);
      if (bias) s += bias[r];
      y[t * N + r] = typename V::T(s);  // round to nearest even (bf16), as oneDNN does
    }
}

template <class V, int NR>
inline void rows(const typename V::T* x, const typename V::T* w, const float* bias, typename V::T* y,
                 int64_t T, int64_t K, int64_t N) {
  int64_t t = 0;
  for (; t + TB <= T; t += TB) block<V, NR, TB>(x + t * K, w, bias, y + t * N, K, N, t == 0);
  const bool first = t == 0;
  switch (T - t) {
    case 3: block<V, NR, 3>(x + t * K, w, bias, y + t * N, K, N, first); break;
    case 2: block<V, NR, 2>(x + t * K, w, bias, y + t * N, K, N, first); break;
    case 1: block<V, NR, 1>(x + t * K, w, bias, y + t * N, K, N, first); break;
  }
}

template <class V>
void run(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  using T = typename V::T;
  const int64_t Tn = x.size(0), K = x.size(1), N = w.size(0);
  const T* X = x.data_ptr<T>();
  const T* W = w.data_ptr<T>();
  T* Y = y.data_ptr<T>();
  // grain: blocks of 64 rows, so two threads split a matrix into two long streams
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * R;
      const float* bn = bias ? bias + n : nullptr;
      if (n + R <= N) rows<V, R>(X, W + n * K, bn, Y + n, Tn, K, N);
      else
        for (int64_t m = n; m < N; ++m) rows<V, 1>(X, W + m * K, bias ? bias + m : nullptr, Y + m, Tn, K, N);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: x [T, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "small_gemm: contiguous x and w of one dtype");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) run<Bf16>(x, w, bp, y);
  else if (x.scalar_type() == at::kFloat) run<F32>(x, w, bp, y);
  else TORCH_CHECK(false, "small_gemm: bfloat16 or float32");
  return y;
}

}  // namespace

TORCH_LIBRARY(specstop, m) { m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specstop, CPU, m) { m.impl("small_linear", &linear); }

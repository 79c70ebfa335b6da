// y = x @ w.T (+ bias) for a few rows of x over a row-major weight, read from memory once.
//
// Why: a decode step multiplies 1-16 rows by each weight matrix, so its cost is streaming the
// weights. oneDNN's kernels reach ~9-10 GB/s on one core over a layer's small cold matrices;
// this loop reaches the core's streaming rate by prefetching PF bytes ahead of the rows it
// reads (the hardware prefetcher stops at 4 KiB page boundaries). See decoding/forward/kernels.py.
//
// Two kernels, both batch-invariant (a row's result does not depend on the other rows of the call
// or on the thread count):
// - small_linear: AVX512-BF16 / AVX512F dot products over the row-major weight, one fp32 chain per
//   vector lane; good for 1-3 bf16 rows (then out of arithmetic), 1-6 fp32 rows.
// - amx_linear: AMX tiles (bf16) over a weight packed once by amx_pack into the tiles' layout
//   (VNNI pairs, 32 columns by 32 rows of K per 2 KiB step), prefetched the same way; memory-bound
//   up to ~16-32 rows, so a 1-token step and a verify share one kernel (up to kernels.AMX_ROWS).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops.h"
#include "vec.h"

namespace {

using specstop_vec::amx_ready;

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
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "cpu_kernels: x [T, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "cpu_kernels: contiguous x and w of one dtype");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) run<Bf16>(x, w, bp, y);
  else if (x.scalar_type() == at::kFloat) run<F32>(x, w, bp, y);
  else TORCH_CHECK(false, "cpu_kernels: bfloat16 or float32");
  return y;
}


// ---- AMX -----------------------------------------------------------------------------------
struct TileCfg {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// w [N, K] -> [N/32][K/32][2 tiles][16 pair-rows][16 columns x 2], zero-padded to multiples of 32
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack: a bf16 [N, K] weight");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), NB = (N + 31) / 32, KB = (K + 31) / 32;
  at::Tensor out = at::zeros({NB, KB, 2, 16, 32}, wc.options());
  const uint16_t* W = (const uint16_t*)wc.data_ptr();
  uint16_t* O = (uint16_t*)out.data_ptr();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t nb = n / 32, t = (n % 32) / 16, c = n % 16, kb = k / 32, pr = (k % 32) / 2, e = k % 2;
      O[((((nb * KB + kb) * 2 + t) * 16 + pr) * 32) + c * 2 + e] = W[n * K + k];
    }
  return out;
}

}  // namespace

namespace specstop {
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_ready(), "amx_linear: the OS refused the AMX tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && wp.dim() == 5, "amx_linear: bf16 x [T, K], packed w");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), KB = wp.size(1), Kp = KB * 32;
  TORCH_CHECK(K <= Kp && Kp - K < 32 && N <= NB * 32 && NB * 32 - N < 32, "amx_linear: x and w disagree");
  const int64_t Mp = (M + 15) / 16 * 16;
  at::Tensor xp = x.contiguous();  // tiles read whole 16-row blocks of 32 columns: pad if short
  if (K != Kp || (M > 16 && M != Mp)) {
    xp = at::zeros({Mp, Kp}, x.options());
    xp.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  const uint16_t* X = (const uint16_t*)xp.data_ptr();
  const uint16_t* Wp = (const uint16_t*)wp.data_ptr();
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    alignas(64) float cbuf[2][16][16];
    TileCfg cfg{};
    cfg.palette = 1;
    const int tr = (int)std::min<int64_t>(16, M);  // tiles 0, 1: C; 2: A (rows of x); 3, 4: B
    for (int t = 0; t < 5; ++t) { cfg.rows[t] = t < 3 ? tr : 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint16_t* wb = Wp + nb * KB * 1024;
      for (int64_t mb = 0; mb < Mp; mb += 16) {  // more than 16 rows: this block again, from cache
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < KB; ++kb) {
          if (mb == 0) {
            const char* p = (const char*)(wb + kb * 1024) + PF;
            for (int l = 0; l < 2048; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
          }
          _tile_loadd(2, X + mb * Kp + kb * 32, Kp * 2);
          _tile_loadd(3, wb + kb * 1024, 64);
          _tile_loadd(4, wb + kb * 1024 + 512, 64);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        const int rows = (int)std::min<int64_t>(16, M - mb);
        for (int t = 0; t < 2; ++t) {
          const int64_t n = nb * 32 + t * 16;
          if (n >= N) break;
          const __mmask16 live = n + 16 <= N ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
          const __m512 bv = B ? _mm512_maskz_loadu_ps(live, B + n) : _mm512_setzero_ps();
          for (int r = 0; r < rows; ++r) {
            const __m512 v = B ? _mm512_add_ps(_mm512_load_ps(cbuf[t][r]), bv) : _mm512_load_ps(cbuf[t][r]);
            _mm256_mask_storeu_epi16(Y + (mb + r) * N + n, live, (__m256i)_mm512_cvtneps_pbh(v));  // RNE
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}
}  // namespace specstop


TORCH_LIBRARY(specstop, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.def("amx_ready() -> bool", &amx_ready);
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) {
  m.impl("small_linear", &linear);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &specstop::amx_linear);
}

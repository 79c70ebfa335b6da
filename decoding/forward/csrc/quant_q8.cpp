// y = x @ w.T (+ bias) over GGUF blocks with the activations quantized too, as llama.cpp's dot
// products do (decoding/forward/quant.py, ACT "q8"): each row of x, per block of 32, becomes int8 with one
// fp32 scale (dx = max|x| / 127, q = round-to-even(x / dx)); a block's dot product is an exact
// integer sum (AVX512-VNNI vpdpbusd, or AVX2 maddubs + madd), then y += (d dx) * isum (+ m dx sum(q)
// for Q4_1 and KQ4) in float, block after block in order; KQ6 (two scales a block) sums each half of
// 16 apart and adds the first half's term, then the second's.
//
// Why: with float activations a step spends its time unpacking nibbles into floats (~6 uops for
// 16 multiply-adds); here 4 k of 16 outputs are one 64-byte vector and one instruction does 64.
// The inner passes and the panel layout are in quant_q8_kernels.h.
//
// Batch-invariant: a row's quantized x depends on that row only, its integer sums are exact and its
// float steps fixed, whatever the number of rows or the thread; AVX2 and AVX512 agree bit for bit.
// The result is not the dequantized model's: it is this law (tests/forward/test_quantized_blocks.py checks it against
// a float64 emulation of the same quantization).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "quant.h"
#include "quant_q8_kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {
using namespace specstop_quant;

AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// one block of 32, as the scalar loop below computes it (max is exact, x * inv the same product,
// round to nearest even, integer sums): the same bytes, ~10x fewer instructions (a 1-row step
// quantizes ~120 rows of x)
AVX2 void quantize_block(const float* x, int8_t* q, float& dx_out, int32_t& sq, int32_t& sq16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(x + 8 * c);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[c]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
  __m256i qi[4];
  for (int c = 0; c < 4; ++c) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[c], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[c] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvttps_epi32(r), _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
  }
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  dx_out = dx;
  sq16 = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
  sq = sq16 + hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
}

// the scalar law (a CPU without AVX2)
void quantize_scalar(const float* X, int64_t T, int64_t K, Rows& r) {
  for (int64_t i = 0; i < T * K / QK; ++i) {
    const float* x = X + i * QK;
    float amax = 0.0f;
    for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
    int32_t s = 0;
    for (int k = 0; k < QK; ++k) {
      const int v = std::min(127, std::max(-127, (int)std::nearbyint(x[k] * inv)));
      r.q[i * QK + k] = (int8_t)v;
      s += v;
      if (k == 15) r.sq16[i] = s;
    }
    r.dx[i] = dx;
    r.sq[i] = s;
  }
}

// into `r` (reused across calls: a step makes ~120 of them)
void quantize_rows(const float* X, int64_t T, int64_t K, Rows& r) {
  r.q.resize(T * K);
  r.dx.resize(T * K / QK);
  r.sq.resize(T * K / QK);
  r.sq16.resize(T * K / QK);
  r.dxsq.resize(T * K / QK);
  if (has_avx2()) {
    for (int64_t i = 0; i < T * K / QK; ++i) quantize_block(X + i * QK, r.q.data() + i * QK, r.dx[i], r.sq[i], r.sq16[i]);
  } else {
    quantize_scalar(X, T, K, r);
  }
  for (int64_t i = 0; i < T * K / QK; ++i) r.dxsq[i] = r.dx[i] * (float)r.sq[i];  // what a min multiplies
}

constexpr int RG512 = 4, RG256 = 4;  // rows a pass (the rest of a verify re-reads the panels from L1 / L2)

// work (weight bytes x rows) under this runs on one thread. Measured on a 2-core AVX512 EPYC (the
// embedded target at 2 threads, one forward of 1 / 8 / 16 rows): 256 KiB 4.6 / 8.9 / 13.8 ms,
// 1 MiB 4.9 / 9.3 / 14.8, always split 4.9 / 9.7 / 15.6, within ~5% noise of each other; without
// -fopenmp (before 2026-11-27) the split was a serial loop: 5.6 / 12.3 / 19.6 at any threshold
constexpr int64_t SPLIT_WORK = 256 << 10;

template <int64_t kind, int R, int V>
void pass512(const Job& j, int64_t t0, const uint8_t* const* pan) {
  if (byte_quants(kind)) rows512<kind, R, V>(j, t0, pan);
  else nib512<kind, R, V>(j, t0, pan);
}

template <int64_t kind>
void run(const Job& j, int64_t panels, int64_t isa) {
  const int64_t pstride = j.K / QK * j.pbb, whole = panels * pstride * j.T < SPLIT_WORK;
  if (isa == 2) {
    const int64_t units = (panels + 1) / 2;
    at::parallel_for(0, units, whole ? units : 1, [&](int64_t a, int64_t e) {
      for (int64_t u = a; u < e; ++u) {
        const uint8_t* pan[2] = {j.W + 2 * u * pstride, j.W + (2 * u + 1) * pstride};
        const bool pair = 2 * u + 1 < panels;
        for (int64_t t = 0; t < j.T; t += RG512) {
          const int64_t rows = std::min<int64_t>(RG512, j.T - t);
#define SPECSTOP_R(r) case r: pair ? pass512<kind, r, 2>(j, t, pan) : pass512<kind, r, 1>(j, t, pan); break;
          switch (rows) { SPECSTOP_R(1) SPECSTOP_R(2) SPECSTOP_R(3) SPECSTOP_R(4) }
#undef SPECSTOP_R
        }
      }
    });
  } else {
    at::parallel_for(0, panels, whole ? panels : 1, [&](int64_t a, int64_t e) {
      for (int64_t u = a; u < e; ++u)
        for (int64_t t = 0; t < j.T; t += RG256) {
          const uint8_t* pan = j.W + u * pstride;
          switch (std::min<int64_t>(RG256, j.T - t)) {
            case 4: rows256<kind, 4>(j, t, pan); break;
            case 3: rows256<kind, 3>(j, t, pan); break;
            case 2: rows256<kind, 2>(j, t, pan); break;
            default: rows256<kind, 1>(j, t, pan);
          }
        }
    });
  }
}

// GGUF blocks -> this file's panels (quant_q8_kernels.h): lane o holds 4 k of output o
at::Tensor pack_q8(const at::Tensor& w, int64_t kind, int64_t K) {
  return pack_panels(w, kind, K, [kind](uint8_t* q, int64_t o, int k, int v) {
    const int64_t lane = o * 4 + (k & 3);
    if (byte_quants(kind)) q[(k >> 2) * 64 + lane] = (uint8_t)(v + (kind == Q8_0 ? 128 : 32));
    else q[(k >> 3) * 64 + lane] |= (uint8_t)(v << ((k >> 2) & 1 ? 4 : 0));  // pair k / 8, odd group high
  });
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K,
                     const c10::optional<at::Tensor>& bias, int64_t isa) {
  const int64_t pbb = panel_block_bytes(kind);
  check_linear(x, w, kind, K, "quant linear_q8");
  const int64_t T0 = x.size(0);
  // auto: 1-2 rows run faster on the AVX2 path here (2-core AVX512-VNNI EPYC, a step's 121
  // linears streamed from memory, 1 thread, AVX2 vs AVX512: 2.6 vs 3.7 ms at 1 row, 3.4 vs 4.2 at
  // 2, 4.8 vs 4.4 at 3, 6.0 vs 4.2 at 4, 11.8 vs 6.7 at 8; 2 threads: 2.3 / 2.5 at 1, 2.2 / 2.6
  // at 2, 2.8 / 2.7 at 3, 3.5 / 2.9 at 4); both give the same bits
  isa = isa == 0 && has_avx512() ? (T0 <= 2 ? 1 : 2) : resolve_isa(isa);
  const at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), panels = w.size(0), N = panels * P;
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  static thread_local Rows rows;
  quantize_rows(xc.data_ptr<float>(), T, K, rows);
  const Job j{&rows, w.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(),
              T, K, N, kind, pbb};
  switch (kind) {
    case Q4_0: run<Q4_0>(j, panels, isa); break;
    case Q4_1: run<Q4_1>(j, panels, isa); break;
    case KQ4: run<KQ4>(j, panels, isa); break;
    case KQ6: run<KQ6>(j, panels, isa); break;
    default: run<Q8_0>(j, panels, isa); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) {
  m.def("pack_q8(Tensor w, int kind, int k) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor w, int kind, int k, Tensor? bias, int isa) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) {
  m.impl("pack_q8", &pack_q8);
  m.impl("linear_q8", &linear_q8);
}

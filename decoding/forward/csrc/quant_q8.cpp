// y = x @ w.T (+ bias) over GGUF blocks with the activations quantized too, as llama.cpp's dot
// products do (decoding/forward/quant.py, ACT "q8"): each row of x, per block of 32, becomes int8 with one
// fp32 scale (dx = max|x| / 127, q = round-to-even(x / dx)); a block's dot product is an exact
// integer sum (AVX512-VNNI vpdpbusd, or AVX2 maddubs + madd), then y += (d dx) * isum (+ m dx sum(q)
// for Q4_1 and KQ4) in float, block after block in order; KQ6 (two scales a block) sums each half of
// 16 apart and adds the first half's term, then the second's.
//
// Why: with float activations a step spends its time unpacking nibbles into floats (~6 uops for
// 16 multiply-adds); here 4 k of 16 outputs are one 64-byte vector and one instruction does 64.
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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {
using namespace specstop_quant;

// panel block layout (same size as quant.cpp's): scales, then 8 groups of 4 k; a group holds the
// 16 outputs x 4 k quants as 64 bytes in output-major order (lane o = bytes 4o..4o+3): Q8 as
// q + 128 (u8), Q4 packed in 32 bytes (byte i: value i low, value i + 32 high)
// (KQ6 as q + 32, 0..63)
int64_t group_bytes(int64_t kind) { return byte_quants(kind) ? 64 : 32; }

struct Rows {  // x quantized: int8 [T, K], dx [T, K / 32], sum of q [T, K / 32] and of its first 16
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> sq, sq16;
};

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

// into `r` (reused across calls: a step makes ~120 of them)
void quantize_rows(const float* X, int64_t T, int64_t K, Rows& r) {
  r.q.resize(T * K);
  r.dx.resize(T * K / QK);
  r.sq.resize(T * K / QK);
  r.sq16.resize(T * K / QK);
  if (has_avx2()) {
    for (int64_t i = 0; i < T * K / QK; ++i) quantize_block(X + i * QK, r.q.data() + i * QK, r.dx[i], r.sq[i], r.sq16[i]);
    return;
  }
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

struct Job {
  const Rows* x;
  const uint8_t* W;
  const float* B;
  float* Y;
  int64_t T, K, N, kind, pbb;
};

// the integer offset of a block's (or KQ6 half's) sum: Q4_0 stores q + 8, KQ6 q + 32, Q8_0 (in
// AVX512's bytes only) q + 128
template <int64_t kind>
inline int32_t offset_times(int32_t sq, bool avx512) {
  return kind == Q4_0 ? 8 * sq : kind == KQ6 ? 32 * sq : kind == Q8_0 && avx512 ? 128 * sq : 0;
}
// the sum of x's quants a scale multiplies: KQ6 the half's, else the block's
template <int64_t kind>
inline int32_t part_sum(const Rows& x, int64_t i, int part) {
  return kind != KQ6 ? x.sq[i] : part == 0 ? x.sq16[i] : x.sq[i] - x.sq16[i];
}
constexpr int parts(int64_t kind) { return kind == KQ6 ? 2 : 1; }  // scales a block

// ---- AVX512 + VNNI: a panel's 16 outputs are one vector of int32 lanes, 4 k a lane ----
template <int64_t kind>
AVX512 inline __m512i group512(const uint8_t* g) {
  if (byte_quants(kind)) return _mm512_loadu_si512(g);  // q + 128 (KQ6 q + 32)
  const __m256i p = _mm256_loadu_si256((const __m256i*)g), m = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(p, m), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <int64_t kind, int R, int V>
AVX512 void rows512(const Job& j, int64_t t0, const uint8_t* const* pan) {
  const int64_t nb = j.K / QK, so = scale_bytes(kind), gb = group_bytes(kind);
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int v = 0; v < V; ++v)
      for (int64_t l = 0; l < j.pbb; l += 64) _mm_prefetch((const char*)pan[v] + b * j.pbb + PF + l, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int part = 0; part < parts(kind); ++part) {
      __m512i acc[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = part * 8 / parts(kind); g < (part + 1) * 8 / parts(kind); ++g) {
        __m512i w[V];
        for (int v = 0; v < V; ++v) w[v] = group512<kind>(pan[v] + b * j.pbb + so + g * gb);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, j.x->q.data() + (t0 + r) * j.K + b * QK + 4 * g, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xv);
        }
      }
      for (int v = 0; v < V; ++v) {
        const uint8_t* sc = pan[v] + b * j.pbb;
        const __m512 d = f32_scales(kind) ? _mm512_loadu_ps((const float*)(sc + 64 * part))
                                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
        const __m512 m = kind == KQ4 ? _mm512_loadu_ps((const float*)(sc + 64))
                         : kind == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32))) : d;
        for (int r = 0; r < R; ++r) {
          const int64_t i = (t0 + r) * nb + b;
          const int32_t sq = part_sum<kind>(*j.x, i, part);
          const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], _mm512_set1_epi32(offset_times<kind>(sq, true))));
          y[r][v] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(j.x->dx[i])), y[r][v]);
          if (has_min(kind)) y[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(j.x->dx[i] * (float)sq), y[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t n = (pan[v] - j.W) / (nb * j.pbb) * P;
      __m512 out = y[r][v];
      if (j.B) out = _mm512_add_ps(out, _mm512_loadu_ps(j.B + n));
      _mm512_storeu_ps(j.Y + (t0 + r) * j.N + n, out);
    }
}

// ---- AVX2: a panel is two vectors (outputs 0-7, 8-15); maddubs + madd make the int32 sums ----
template <int64_t kind>
AVX2 inline void group256(const uint8_t* g, __m256i* w) {
  if (kind == KQ6) {  // q + 32 <= 63: unsigned as the nibbles
    w[0] = _mm256_loadu_si256((const __m256i*)g);
    w[1] = _mm256_loadu_si256((const __m256i*)(g + 32));
    return;
  }
  if (kind == Q8_0) {  // back to signed q: maddubs takes |q| and moves the sign onto x
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    w[0] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)g), flip);
    w[1] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(g + 32)), flip);
    return;
  }
  const __m256i p = _mm256_loadu_si256((const __m256i*)g), m = _mm256_set1_epi8(15);
  w[0] = _mm256_and_si256(p, m);
  w[1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m);
}

template <int64_t kind>
AVX2 inline __m256i dot256(__m256i w, __m256i xv) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (kind == Q8_0)  // |q| <= 128, |x| <= 127: a pair sums to at most 32512, no int16 saturation
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // q <= 63: pairs <= 16002
}

template <int64_t kind, int R>
AVX2 void rows256(const Job& j, int64_t t0, const uint8_t* pan) {
  const int64_t nb = j.K / QK, so = scale_bytes(kind), gb = group_bytes(kind);
  __m256 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = 0; l < j.pbb; l += 64) _mm_prefetch((const char*)pan + b * j.pbb + PF + l, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int part = 0; part < parts(kind); ++part) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = part * 8 / parts(kind); g < (part + 1) * 8 / parts(kind); ++g) {
        __m256i w[2];
        group256<kind>(pan + b * j.pbb + so + g * gb, w);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, j.x->q.data() + (t0 + r) * j.K + b * QK + 4 * g, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          for (int h = 0; h < 2; ++h)  // 4-bit q: int16 sums, widened once a block (below)
            acc[r][h] = byte_quants(kind) ? _mm256_add_epi32(acc[r][h], dot256<kind>(w[h], xv))
                                          : _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(w[h], xv));
        }
      }
      if (!byte_quants(kind))  // q <= 15, |x| <= 127: 16 products a lane, |sum| <= 30480, no saturation
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_madd_epi16(acc[r][h], _mm256_set1_epi16(1));
      const uint8_t* sc = pan + b * j.pbb;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = f32_scales(kind) ? _mm256_loadu_ps((const float*)(sc + 64 * part + 32 * h))
                                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 16 * h)));
        const __m256 m = kind == KQ4 ? _mm256_loadu_ps((const float*)(sc + 64 + 32 * h))
                         : kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32 + 16 * h))) : d;
        for (int r = 0; r < R; ++r) {
          const int64_t i = (t0 + r) * nb + b;
          const int32_t sq = part_sum<kind>(*j.x, i, part);
          const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][h], _mm256_set1_epi32(offset_times<kind>(sq, false))));
          y[r][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(j.x->dx[i])), y[r][h]);
          if (has_min(kind)) y[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(j.x->dx[i] * (float)sq), y[r][h]);
        }
      }
    }
  }
  const int64_t n = (pan - j.W) / (nb * j.pbb) * P;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 out = y[r][h];
      if (j.B) out = _mm256_add_ps(out, _mm256_loadu_ps(j.B + n + 8 * h));
      _mm256_storeu_ps(j.Y + (t0 + r) * j.N + n + 8 * h, out);
    }
}

constexpr int RG512 = 4, RG256 = 4;  // rows a pass (the rest of a verify re-reads the panels from L1 / L2)

// work (weight bytes x rows) under this runs on one thread. Measured on a 2-core AVX512 EPYC (the
// embedded target at 2 threads, one forward of 1 / 8 / 16 rows): 256 KiB 4.6 / 8.9 / 13.8 ms,
// 1 MiB 4.9 / 9.3 / 14.8, always split 4.9 / 9.7 / 15.6, within ~5% noise of each other; without
// -fopenmp (before 2026-11-27) the split was a serial loop: 5.6 / 12.3 / 19.6 at any threshold
constexpr int64_t SPLIT_WORK = 256 << 10;

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
#define SPECSTOP_R(r) case r: pair ? rows512<kind, r, 2>(j, t, pan) : rows512<kind, r, 1>(j, t, pan); break;
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

// GGUF blocks -> this file's panels: groups of 4 k, 16 outputs x 4 k output-major in each
at::Tensor pack_q8(const at::Tensor& w, int64_t kind, int64_t K) {
  const int64_t gb = group_bytes(kind);
  return pack_panels(w, kind, K, [kind, gb](uint8_t* q, int64_t o, int k, int v) {
    const int64_t i = o * 4 + (k & 3);  // value index inside group k / 4
    uint8_t* g = q + (k >> 2) * gb;
    if (byte_quants(kind)) g[i] = (uint8_t)(v + (kind == Q8_0 ? 128 : 32));
    else g[i & 31] |= (uint8_t)(v << (i < 32 ? 0 : 4));
  });
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K,
                     const c10::optional<at::Tensor>& bias, int64_t isa) {
  const int64_t pbb = panel_block_bytes(kind);
  check_linear(x, w, kind, K, "quant linear_q8");
  const int64_t T0 = x.size(0);
  // auto: up to 3 rows run faster on the AVX2 path here (2-core AVX512-VNNI EPYC, a step's 121
  // linears streamed from memory, 1 thread, AVX2 vs AVX512: 3.4 vs 4.2 ms at 1 row, 3.7 vs 5.1 at
  // 2, 4.9 vs 5.5 at 3, 6.4 vs 5.7 at 4, 12.4 vs 8.8 at 8; 2 threads: 2.6 / 3.2, 3.1 / 3.2 at 3,
  // 3.6 / 3.5 at 4); both give the same bits
  isa = isa == 0 && has_avx512() ? (T0 <= 3 ? 1 : 2) : resolve_isa(isa);
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

// y = x @ w.T (+ bias) over GGUF-quantized weights kept as their blocks (decoding/forward/quant.py):
// Q4_0, Q4_1, Q8_0 and the re-laid K-quants KQ4 / KQ6 (decoding/forward/kquants.py), 32 weights a
// block. The f32 form: weights only are quantized, x and y are float32 (quant_q8.cpp: the activations too).
//
// Why: a CPU user's GGUF is 4.5 bits a weight; dequantized to fp32 a step streams ~5x the bytes.
// The blocks are re-laid once into panels of 16 outputs (quant_pack), so one k's weights for 16
// outputs dequantize into one vector (AVX512) or two (AVX2) and each row of x is a broadcast: up
// to 4 (AVX512) / 2 (AVX2) rows straight from the quants; more rows dequantize a chunk into L1
// once and share it. Every row reads each weight from memory once.
//
// Exactness: q * d is exact in fp32 (q has at most 8 bits, d is fp16; KQ4 / KQ6: d has at most
// 17 / 18 bits, q 4 / 6), and q d + m rounds once as gguf's d q - dm does, so each dequantized
// weight is exactly the fp32 number the reference dequantizer gives (gguf's numpy code): this
// kernel differs from x @ dequant(w).T only in summation order.
//
// Batch-invariant: output n of row r is one FMA chain of x[r][k] * w[n][k] over k in order from
// zero (+ bias), whatever the number of rows, the path or the thread (threads split the outputs).
// So a row of a verify equals a 1-token step bit for bit; AVX2 and AVX512 compute the same chain,
// and so do decoding.forward.kernels's fp32 panels over the dequantized weights (tested).
//
// Compiled without -m flags: each path carries its own target attribute, so the extension builds
// and loads on any x86-64 CPU and picks AVX512 only where the CPU has it (isa argument).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <immintrin.h>

#include "quant.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
using namespace specstop_quant;

constexpr int64_t CB = 4;       // blocks per chunk of the buffered path (128 k x 32 outputs: 16 KiB of L1)

// a block of 32 k for the 16 outputs of a panel: the 16 scales d, the 16 offsets m (quant.h),
// then the quants k-major: Q4 two k a byte (k even low, k odd high) 16 bytes a k pair; Q8 one a byte
// (the reference dequantization: quant_ref.cpp)

// ---- AVX512: a panel's 16 outputs are one vector ----
struct Scales512 { __m512 d, m; };  // KQ6: m is the second half's d
template <int64_t kind>
AVX512 inline Scales512 scales512(const uint8_t* bp) {
  if (f32_scales(kind)) return {_mm512_loadu_ps((const float*)bp), _mm512_loadu_ps((const float*)(bp + 64))};
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)bp));
  if (kind == Q4_1) return {d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(bp + 32)))};
  return {d, kind == Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps()};  // (q - 8) d = q d - 8 d exactly
}
// weights of k (0..31 in the block) for the panel's 16 outputs
template <int64_t kind>
AVX512 inline __m512 weights512(const uint8_t* q, int k, const Scales512& s) {
  if (byte_quants(kind))
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k * 16)))),
                         kind == KQ6 && k >= 16 ? s.m : s.d);
  __m128i raw = _mm_loadu_si128((const __m128i*)(q + (k >> 1) * 16));
  if (k & 1) raw = _mm_srli_epi16(raw, 4);
  const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(15))));
  return _mm512_fmadd_ps(qf, s.d, s.m);
}

// rows [0, R) x outputs of V panels over blocks [b0, b1); acc[r][v] carries over calls in
// `carry`. Each output is ONE FMA chain over k in order from zero, as decoding.forward.kernels's fp32
// panels compute it: over the same (dequantized) weights the two kernels agree bit for bit.
template <int64_t kind, int R, int V, bool BUF>
AVX512 inline void pass512(const float* x, int64_t ldx, const uint8_t* const* pan, int64_t pbb,
                           int64_t b0, int64_t b1, const float* buf, float* carry) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(carry + (r * V + v) * 16);
  const int64_t so = scale_bytes(kind);
  for (int64_t b = b0; b < b1; ++b) {
    Scales512 sc[V];
    if (!BUF)
      for (int v = 0; v < V; ++v) {
        for (int64_t l = 0; l < pbb; l += 64) _mm_prefetch((const char*)pan[v] + b * pbb + PF + l, _MM_HINT_T0);
        sc[v] = scales512<kind>(pan[v] + b * pbb);
      }
    const float* xb = x + b * QK;
#pragma GCC unroll 8
    for (int k = 0; k < 32; ++k) {
      __m512 w[V];
      for (int v = 0; v < V; ++v)
        w[v] = BUF ? _mm512_load_ps(buf + (((b - b0) * QK + k) * V + v) * 16)
                   : weights512<kind>(pan[v] + b * pbb + so, k, sc[v]);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(xb[r * ldx + k]);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, w[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(carry + (r * V + v) * 16, acc[r][v]);
}

template <int64_t kind, int V>
AVX512 inline void dequant_chunk512(const uint8_t* const* pan, int64_t pbb, int64_t b0, int64_t b1, float* buf) {
  const int64_t so = scale_bytes(kind);
  for (int64_t b = b0; b < b1; ++b)
    for (int v = 0; v < V; ++v) {
      for (int64_t l = 0; l < pbb; l += 64) _mm_prefetch((const char*)pan[v] + b * pbb + PF + l, _MM_HINT_T0);
      const Scales512 sc = scales512<kind>(pan[v] + b * pbb);
      for (int k = 0; k < 32; ++k)
        _mm512_store_ps(buf + (((b - b0) * QK + k) * V + v) * 16, weights512<kind>(pan[v] + b * pbb + so, k, sc));
    }
}

// ---- AVX2: a panel's 16 outputs are two vectors (h = 0, 1) ----
struct Scales256 { __m256 d[2], m[2]; };
template <int64_t kind>
AVX2 inline Scales256 scales256(const uint8_t* bp) {
  Scales256 s;
  for (int h = 0; h < 2; ++h) {
    if (f32_scales(kind)) {
      s.d[h] = _mm256_loadu_ps((const float*)(bp + 32 * h));
      s.m[h] = _mm256_loadu_ps((const float*)(bp + 64 + 32 * h));
      continue;
    }
    s.d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(bp + 16 * h)));
    s.m[h] = kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(bp + 32 + 16 * h)))
             : kind == Q4_0 ? _mm256_mul_ps(s.d[h], _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
  }
  return s;
}
template <int64_t kind>
AVX2 inline void weights256(const uint8_t* q, int k, const Scales256& s, __m256* w) {
  __m128i raw;
  if (byte_quants(kind)) {
    const __m256* d = kind == KQ6 && k >= 16 ? s.m : s.d;
    raw = _mm_loadu_si128((const __m128i*)(q + k * 16));
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d[0]);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), d[1]);
    return;
  }
  raw = _mm_loadu_si128((const __m128i*)(q + (k >> 1) * 16));
  if (k & 1) raw = _mm_srli_epi16(raw, 4);
  raw = _mm_and_si128(raw, _mm_set1_epi8(15));
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), s.d[0], s.m[0]);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))), s.d[1], s.m[1]);
}

// as pass512, with a panel's 16 outputs in two vectors; V = 2 panels only for one row (4 chains
// in flight instead of 2: one row is otherwise bound by the FMA latency)
template <int64_t kind, int R, int V, bool BUF>
AVX2 inline void pass256(const float* x, int64_t ldx, const uint8_t* const* pan, int64_t pbb,
                         int64_t b0, int64_t b1, const float* buf, float* carry) {
  static_assert(!BUF || V == 1, "the buffered path runs one panel");
  __m256 acc[R][V][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      for (int h = 0; h < 2; ++h) acc[r][v][h] = _mm256_loadu_ps(carry + ((r * V + v) * 2 + h) * 8);
  const int64_t so = scale_bytes(kind);
  for (int64_t b = b0; b < b1; ++b) {
    Scales256 sc[V];
    if (!BUF)
      for (int v = 0; v < V; ++v) {
        for (int64_t l = 0; l < pbb; l += 64) _mm_prefetch((const char*)pan[v] + b * pbb + PF + l, _MM_HINT_T0);
        sc[v] = scales256<kind>(pan[v] + b * pbb);
      }
    const float* xb = x + b * QK;
#pragma GCC unroll 8
    for (int k = 0; k < 32; ++k) {
      __m256 w[V][2];
      for (int v = 0; v < V; ++v) {
        if (BUF) {
          w[v][0] = _mm256_load_ps(buf + ((b - b0) * QK + k) * 16);
          w[v][1] = _mm256_load_ps(buf + ((b - b0) * QK + k) * 16 + 8);
        } else {
          weights256<kind>(pan[v] + b * pbb + so, k, sc[v], w[v]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(xb[r * ldx + k]);
        for (int v = 0; v < V; ++v)
          for (int h = 0; h < 2; ++h) acc[r][v][h] = _mm256_fmadd_ps(xv, w[v][h], acc[r][v][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(carry + ((r * V + v) * 2 + h) * 8, acc[r][v][h]);
}

template <int64_t kind>
AVX2 inline void dequant_chunk256(const uint8_t* pan, int64_t pbb, int64_t b0, int64_t b1, float* buf) {
  const int64_t so = scale_bytes(kind);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t l = 0; l < pbb; l += 64) _mm_prefetch((const char*)pan + b * pbb + PF + l, _MM_HINT_T0);
    const Scales256 sc = scales256<kind>(pan + b * pbb);
    for (int k = 0; k < 32; ++k) {
      __m256 w[2];
      weights256<kind>(pan + b * pbb + so, k, sc, w);
      _mm256_store_ps(buf + ((b - b0) * QK + k) * 16, w[0]);
      _mm256_store_ps(buf + ((b - b0) * QK + k) * 16 + 8, w[1]);
    }
  }
}

struct Job {
  const float* X;
  const uint8_t* W;
  const float* B;
  float* Y;
  int64_t T, K, N, kind, pbb;
};

// the outputs of V panels from `first`, all rows: up to RD rows straight from the quants; more
// rows dequantize a chunk of CB blocks once into L1 and run groups of RD rows over it. Both
// paths make the same numbers in the same order (tested), so a row's result never depends on T.
constexpr int RD512 = 4, RD256 = 2;

template <int64_t kind, int V>
AVX512 void unit512(const Job& j, int64_t first, float* carry) {
  const int64_t nb = j.K / QK, pstride = nb * j.pbb;
  const uint8_t* pan[V];
  for (int v = 0; v < V; ++v) pan[v] = j.W + (first + v) * pstride;
  const int64_t per_row = V * 16;  // carry floats a row
  std::fill(carry, carry + j.T * per_row, 0.0f);
  auto group = [&](int64_t t, int64_t rows, int64_t b0, int64_t b1, const float* buf) {
    const float* x = j.X + t * j.K;
    float* c = carry + t * per_row;
#define SPECSTOP_G(r) case r: buf ? pass512<kind, r, V, true>(x, j.K, pan, j.pbb, b0, b1, buf, c) \
                                  : pass512<kind, r, V, false>(x, j.K, pan, j.pbb, b0, b1, buf, c); break;
    switch (rows) { SPECSTOP_G(1) SPECSTOP_G(2) SPECSTOP_G(3) SPECSTOP_G(4) }
#undef SPECSTOP_G
  };
  if (j.T <= RD512) {
    group(0, j.T, 0, nb, nullptr);
  } else {
    alignas(64) float buf[CB * QK * V * 16];
    for (int64_t b0 = 0; b0 < nb; b0 += CB) {
      const int64_t b1 = std::min(nb, b0 + CB);
      dequant_chunk512<kind, V>(pan, j.pbb, b0, b1, buf);
      for (int64_t t = 0; t < j.T; t += RD512) group(t, std::min<int64_t>(RD512, j.T - t), b0, b1, buf);
    }
  }
  // out (+ bias): carry of a group of R rows is [r][v]
  for (int64_t t0 = 0; t0 < j.T; t0 += RD512) {
    const int64_t R = j.T <= RD512 ? j.T : std::min<int64_t>(RD512, j.T - t0);
    const float* c = carry + t0 * per_row;
    for (int64_t r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        const int64_t n = (first + v) * P;
        __m512 y = _mm512_loadu_ps(c + (r * V + v) * 16);
        if (j.B) y = _mm512_add_ps(y, _mm512_loadu_ps(j.B + n));
        _mm512_storeu_ps(j.Y + (t0 + r) * j.N + n, y);
      }
    if (j.T <= RD512) break;
  }
}

template <int64_t kind, int V>
AVX2 void unit256(const Job& j, int64_t first, float* carry) {
  const int64_t nb = j.K / QK, pstride = nb * j.pbb;
  const uint8_t* pan[V];
  for (int v = 0; v < V; ++v) pan[v] = j.W + (first + v) * pstride;
  const int64_t per_row = V * 2 * 8;
  std::fill(carry, carry + j.T * per_row, 0.0f);
  if (j.T <= RD256) {
    if constexpr (V == 2) pass256<kind, 1, 2, false>(j.X, j.K, pan, j.pbb, 0, nb, nullptr, carry);
    else if (j.T == 2) pass256<kind, 2, 1, false>(j.X, j.K, pan, j.pbb, 0, nb, nullptr, carry);
    else pass256<kind, 1, 1, false>(j.X, j.K, pan, j.pbb, 0, nb, nullptr, carry);
  } else if constexpr (V == 1) {
    alignas(64) float buf[CB * QK * 16];
    for (int64_t b0 = 0; b0 < nb; b0 += CB) {
      const int64_t b1 = std::min(nb, b0 + CB);
      dequant_chunk256<kind>(pan[0], j.pbb, b0, b1, buf);
      for (int64_t t = 0; t < j.T; t += RD256) {
        const float* x = j.X + t * j.K;
        float* c = carry + t * per_row;
        if (j.T - t >= 2) pass256<kind, 2, 1, true>(x, j.K, pan, j.pbb, b0, b1, buf, c);
        else pass256<kind, 1, 1, true>(x, j.K, pan, j.pbb, b0, b1, buf, c);
      }
    }
  }
  for (int64_t t0 = 0; t0 < j.T; t0 += RD256) {
    const int64_t R = j.T <= RD256 ? j.T : std::min<int64_t>(RD256, j.T - t0);
    const float* c = carry + t0 * per_row;
    for (int64_t r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        for (int h = 0; h < 2; ++h) {
          const int64_t n = (first + v) * P + 8 * h;
          __m256 y = _mm256_loadu_ps(c + ((r * V + v) * 2 + h) * 8);
          if (j.B) y = _mm256_add_ps(y, _mm256_loadu_ps(j.B + n));
          _mm256_storeu_ps(j.Y + (t0 + r) * j.N + n, y);
        }
    if (j.T <= RD256) break;
  }
}

// blocks -> this file's panels: Q4 two k a byte (k even low), Q8 / KQ6 one a byte, k-major
at::Tensor quant_pack(const at::Tensor& w, int64_t kind, int64_t K) {
  return pack_panels(w, kind, K, [kind](uint8_t* q, int64_t o, int k, int v) {
    if (byte_quants(kind)) q[k * 16 + o] = (uint8_t)v;
    else q[(k >> 1) * 16 + o] |= (uint8_t)(v << (4 * (k & 1)));
  });
}

template <int64_t kind>
void run(const Job& j, int64_t panels, int64_t isa) {
  if (isa == 2) {
    // pairs of panels (R x 2 accumulators; 4 panels for one row measured no faster), an odd last
    // one alone
    const int64_t V = 2, units = panels / V;
    at::parallel_for(0, units + panels % V, 4, [&](int64_t a, int64_t e) {
      std::vector<float> carry((size_t)j.T * V * 16);
      for (int64_t u = a; u < e; ++u) {
        if (u >= units) unit512<kind, 1>(j, units * V + (u - units), carry.data());
        else unit512<kind, 2>(j, 2 * u, carry.data());
      }
    });
  } else {
    if (j.T == 1) {  // pairs of panels (an odd last one alone)
      at::parallel_for(0, (panels + 1) / 2, 8, [&](int64_t a, int64_t e) {
        std::vector<float> carry(2 * 2 * 8);
        for (int64_t u = a; u < e; ++u) {
          if (2 * u + 1 < panels) unit256<kind, 2>(j, 2 * u, carry.data());
          else unit256<kind, 1>(j, 2 * u, carry.data());
        }
      });
    } else {
      at::parallel_for(0, panels, 8, [&](int64_t a, int64_t e) {
        std::vector<float> carry((size_t)j.T * 2 * 8);
        for (int64_t u = a; u < e; ++u) unit256<kind, 1>(j, u, carry.data());
      });
    }
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K,
                        const c10::optional<at::Tensor>& bias, int64_t isa) {
  const int64_t pbb = panel_block_bytes(kind);
  check_linear(x, w, kind, K, "quant linear");
  isa = resolve_isa(isa);
  const at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), panels = w.size(0), N = panels * P;
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const Job j{xc.data_ptr<float>(), w.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
              y.data_ptr<float>(), T, K, N, kind, pbb};
  switch (kind) {
    case Q4_0: run<Q4_0>(j, panels, isa); break;
    case Q4_1: run<Q4_1>(j, panels, isa); break;
    case KQ4: run<KQ4>(j, panels, isa); break;
    case KQ6: run<KQ6>(j, panels, isa); break;
    default: run<Q8_0>(j, panels, isa); break;
  }
  return y;
}


int64_t quant_isa(int64_t isa) { return resolve_isa(isa); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) {
  m.def("linear(Tensor x, Tensor w, int kind, int k, Tensor? bias, int isa) -> Tensor");
  m.def("pack(Tensor w, int kind, int k) -> Tensor");
  m.def("isa(int isa) -> int", &quant_isa);
}
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) {
  m.impl("linear", &quant_linear);
  m.impl("pack", &quant_pack);
}

// The inner kernels of quant_q8.cpp: a pass of R rows of quantized x over V panels of 16 outputs,
// block after block of 32 k. Each block's integer sums are exact, so the order of the dot products
// inside a block is free; the float steps after it are the law's, in order (quant_q8.cpp's header).
#pragma once
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "quant.h"

namespace specstop_quant {

// panel block layout (same size as quant.cpp's): scales, then the quants of 16 outputs.
// - byte kinds (Q8_0 as q + 128 (u8), KQ6 as q + 32, 0..63): 8 groups of 4 k, a group 64 bytes in
//   output-major order (lane o = bytes 4o..4o+3);
// - 4-bit kinds: 4 pairs of groups, a pair 64 bytes in the same order, group 2p in the low nibbles
//   and group 2p + 1 in the high ones: one 512-bit load and three ops give two groups' lanes.

struct Rows {  // x quantized: int8 [T, K]; per block: dx, the sum of q and of its first 16, dx * sum
  std::vector<int8_t> q;
  std::vector<float> dx, dxsq;
  std::vector<int32_t> sq, sq16;
};

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

inline int32_t x4_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- AVX512 + VNNI: a panel's 16 outputs are one vector of int32 lanes, 4 k a lane ----

// a block's int32 sums -> y, the law's float steps (fp16 or f32 scales; Q4_1 / KQ4 add m dx sum q)
template <int64_t kind, int R, int V>
AVX512 inline void scale512(const Job& j, int64_t t0, int64_t b, int part, const uint8_t* const* blk,
                            __m512i (&acc)[R][V], __m512 (&y)[R][V]) {
  const int64_t nb = j.K / QK;
  for (int v = 0; v < V; ++v) {
    const uint8_t* sc = blk[v];
    const __m512 d = f32_scales(kind) ? _mm512_loadu_ps((const float*)(sc + 64 * part))
                                      : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
    const __m512 m = kind == KQ4 ? _mm512_loadu_ps((const float*)(sc + 64))
                     : kind == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32))) : d;
    for (int r = 0; r < R; ++r) {
      const int64_t i = (t0 + r) * nb + b;
      __m512i s = acc[r][v];
      if (offset_times<kind>(1, true)) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset_times<kind>(part_sum<kind>(*j.x, i, part), true)));
      y[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(j.x->dx[i])), y[r][v]);
      if (has_min(kind)) y[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(j.x->dxsq[i]), y[r][v]);
    }
  }
}

template <int R, int V>
AVX512 inline void store512(const Job& j, int64_t t0, const uint8_t* const* pan, __m512 (&y)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t n = (pan[v] - j.W) / (j.K / QK * j.pbb) * P;
      __m512 out = y[r][v];
      if (j.B) out = _mm512_add_ps(out, _mm512_loadu_ps(j.B + n));
      _mm512_storeu_ps(j.Y + (t0 + r) * j.N + n, out);
    }
}

// block b of each panel, its lines PF bytes on fetched ahead (the hardware prefetcher stops at pages)
template <int V>
AVX512 inline void block512(const Job& j, const uint8_t* const* pan, int64_t b, const uint8_t** blk) {
  for (int v = 0; v < V; ++v) {
    blk[v] = pan[v] + b * j.pbb;
    for (int64_t l = 0; l < j.pbb; l += 64) _mm_prefetch((const char*)blk[v] + PF + l, _MM_HINT_T0);
  }
}

// byte kinds: a group is one load
template <int64_t kind, int R, int V>
AVX512 void rows512(const Job& j, int64_t t0, const uint8_t* const* pan) {
  const int64_t nb = j.K / QK, so = scale_bytes(kind);
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[V];
    block512<V>(j, pan, b, blk);
#pragma GCC unroll 2
    for (int part = 0; part < parts(kind); ++part) {
      __m512i acc[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < 8 / parts(kind); ++g) {
        const int gg = part * 8 / parts(kind) + g;
        __m512i w[V];
        for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(blk[v] + so + gg * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_set1_epi32(x4_at(j.x->q.data() + (t0 + r) * j.K + b * QK + 4 * gg));
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xv);
        }
      }
      scale512<kind, R, V>(j, t0, b, part, blk, acc, y);
    }
  }
  store512<R, V>(j, t0, pan, y);
}

// 4-bit kinds: a pair of groups is one load, its low and high nibbles
template <int64_t kind, int R, int V>
AVX512 void nib512(const Job& j, int64_t t0, const uint8_t* const* pan) {
  const int64_t nb = j.K / QK, so = scale_bytes(kind);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[V];
    block512<V>(j, pan, b, blk);
    __m512i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      __m512i w0[V], w1[V];
      for (int v = 0; v < V; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk[v] + so + p * 64);
        w0[v] = _mm512_and_si512(raw, low);
        w1[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = j.x->q.data() + (t0 + r) * j.K + b * QK + 8 * p;
        const __m512i x0 = _mm512_set1_epi32(x4_at(xr)), x1 = _mm512_set1_epi32(x4_at(xr + 4));
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][v], w0[v], x0), w1[v], x1);
      }
    }
    scale512<kind, R, V>(j, t0, b, 0, blk, acc, y);
  }
  store512<R, V>(j, t0, pan, y);
}

// ---- AVX2: a panel is two vectors (outputs 0-7, 8-15); maddubs + madd make the int32 sums ----
template <int64_t kind>
AVX2 inline __m256i dot256(__m256i w, __m256i xv) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (kind == Q8_0)  // |q| <= 128, |x| <= 127: a pair sums to at most 32512, no int16 saturation
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // q <= 63: pairs <= 16002
}

template <int64_t kind, int R>
AVX2 void rows256(const Job& j, int64_t t0, const uint8_t* pan) {
  const int64_t nb = j.K / QK, so = scale_bytes(kind);
  const __m256i low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
  __m256 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = pan + b * j.pbb;
    for (int64_t l = 0; l < j.pbb; l += 64) _mm_prefetch((const char*)blk + PF + l, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int part = 0; part < parts(kind); ++part) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      if (byte_quants(kind)) {
#pragma GCC unroll 8
        for (int g = 0; g < 8 / parts(kind); ++g) {
          const int gg = part * 8 / parts(kind) + g;
          __m256i w[2];
          for (int h = 0; h < 2; ++h) {  // Q8_0 back to signed q: maddubs takes |q| and moves the sign onto x
            w[h] = _mm256_loadu_si256((const __m256i*)(blk + so + gg * 64 + 32 * h));
            if (kind == Q8_0) w[h] = _mm256_xor_si256(w[h], flip);
          }
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_set1_epi32(x4_at(j.x->q.data() + (t0 + r) * j.K + b * QK + 4 * gg));
            for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], dot256<kind>(w[h], xv));
          }
        }
      } else {
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {  // int16 sums, widened once a block (below)
          __m256i w0[2], w1[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + so + p * 64 + 32 * h));
            w0[h] = _mm256_and_si256(raw, low);
            w1[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = j.x->q.data() + (t0 + r) * j.K + b * QK + 8 * p;
            const __m256i x0 = _mm256_set1_epi32(x4_at(xr)), x1 = _mm256_set1_epi32(x4_at(xr + 4));
            for (int h = 0; h < 2; ++h)
              acc[r][h] = _mm256_add_epi16(_mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(w0[h], x0)),
                                           _mm256_maddubs_epi16(w1[h], x1));
          }
        }
        // q <= 15, |x| <= 127: 16 products a lane, |sum| <= 30480, no saturation
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_madd_epi16(acc[r][h], _mm256_set1_epi16(1));
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = f32_scales(kind) ? _mm256_loadu_ps((const float*)(blk + 64 * part + 32 * h))
                                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
        const __m256 m = kind == KQ4 ? _mm256_loadu_ps((const float*)(blk + 64 + 32 * h))
                         : kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * h))) : d;
        for (int r = 0; r < R; ++r) {
          const int64_t i = (t0 + r) * nb + b;
          __m256i s = acc[r][h];
          if (offset_times<kind>(1, false)) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset_times<kind>(part_sum<kind>(*j.x, i, part), false)));
          y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(j.x->dx[i])), y[r][h]);
          if (has_min(kind)) y[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(j.x->dxsq[i]), y[r][h]);
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

}  // namespace specstop_quant

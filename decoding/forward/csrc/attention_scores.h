// The two inner loops of attention.cpp's attend, per kv head and task: the scores S[key][row]
// (three ways, each row's score the same bits or, on AMX, the tile's) and the values weighed by
// the softmax. Included by attention.cpp only (its anonymous namespace).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "attention_mask.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>

namespace {

using namespace specstop_vec;

constexpr int MAXD = 256;  // head_dim up to 256

struct TileCfg {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// S[j][l] = q_l . k_j on AMX tiles: A = 16 keys x 32 dims (straight from the cache), B = 32 dims x
// 16 rows in VNNI pairs (QB, built per task), C = 16 keys x 16 rows, stored into S.
void scores_amx(const uint16_t* K, int64_t ks, int64_t N, int64_t D, const uint16_t* QB, int nv, float* S,
                int64_t LW, std::vector<uint16_t>& tail) {
  TileCfg cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  // 0: C, 1: A (keys), 2: B (rows)
  _tile_loadconfig(&cfg);
  const int64_t DC = D / 32;
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    const uint16_t* A = K + j0 * ks;
    int64_t as = ks * 2;
    if (j0 + 16 > N) {  // the last keys, zero-padded to a whole tile (never read past the cache)
      tail.assign(16 * D, 0);
      for (int64_t j = j0; j < N; ++j) std::memcpy(tail.data() + (j - j0) * D, K + j * ks, D * 2);
      A = tail.data();
      as = D * 2;
    }
    for (int c = 0; c < nv; ++c) {
      _tile_zero(0);
      for (int64_t kc = 0; kc < DC; ++kc) {
        _tile_loadd(1, A + kc * 32, as);
        _tile_loadd(2, QB + (c * DC + kc) * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, S + j0 * LW + 16 * c, LW * 4);
    }
  }
  _tile_release();
}

// The same scores by FMAs, lanes = rows: one chain per lane over d, KB keys at a time.
template <int NV, int KB>
void scores_fma(const float* KF, int64_t kstride, int64_t N, int64_t D, const float* QT, int64_t LW, float* S) {
  int64_t j = 0;
  for (; j + KB <= N; j += KB) {
    __m512 acc[NV][KB];
    for (int v = 0; v < NV; ++v)
      for (int k = 0; k < KB; ++k) acc[v][k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m512 q[NV];
      for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(QT + d * LW + 16 * v);
      for (int k = 0; k < KB; ++k) {
        const __m512 kv = _mm512_set1_ps(KF[(j + k) * kstride + d]);
        for (int v = 0; v < NV; ++v) acc[v][k] = _mm512_fmadd_ps(q[v], kv, acc[v][k]);
      }
    }
    for (int k = 0; k < KB; ++k)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(S + (j + k) * LW + 16 * v, acc[v][k]);
  }
  for (; j < N; ++j)
    for (int v = 0; v < NV; ++v) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(QT + d * LW + 16 * v), _mm512_set1_ps(KF[j * kstride + d]), acc);
      _mm512_storeu_ps(S + j * LW + 16 * v, acc);
    }
}

// 16 x 16 floats: r[i] lane j -> r[dim[j]] lane i (scores_keys's dim: the last stages leave
// dimensions 1 and 2 of each 4 swapped)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      r[i + h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + h + 2])));
      r[i + h + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + h + 2])));
    }
  for (int i = 0; i < 16; i += 8)
    for (int h = 0; h < 4; ++h) {
      t[i + h] = _mm512_shuffle_f32x4(r[i + h], r[i + h + 4], 0x88);
      t[i + h + 4] = _mm512_shuffle_f32x4(r[i + h], r[i + h + 4], 0xdd);
    }
  for (int h = 0; h < 8; ++h) {
    r[h] = _mm512_shuffle_f32x4(t[h], t[h + 8], 0x88);
    r[h + 8] = _mm512_shuffle_f32x4(t[h], t[h + 8], 0xdd);
  }
}

// The same scores (bit for bit: each is the same FMA chain over d from zero) with keys as the
// lanes, for a task of few live rows (a step: one row x the query heads of a kv head). Why: the
// lanes-as-rows chain above does 16 lanes of FMAs and a broadcast a key and a dimension however
// few rows are live (3 of 16 for a step of a 3:1 GQA head); here 16 keys are transposed once and
// each live row costs one FMA per dimension per 16 keys. Dead lanes of S are written as 0.
constexpr int KBLK = 4;  // blocks of 16 keys a pass: KBLK x (rows of a group) independent chains

// keys [j, j + 16 * nb) of K (row stride ks) into kt [nb][D][16] as fp32
template <class KT>
inline void transpose_keys(const KT* KF, int64_t ks, int64_t j, int nb, int64_t D, float* kt) {
  static constexpr int dim[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};  // r[i] after transpose16
  for (int b = 0; b < nb; ++b)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const __mmask16 live_d = D - d0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d0)) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {  // the same row 4 blocks on: the cache streams ahead of the loads
        _mm_prefetch((const char*)(KF + (j + 16 * b + i + 16 * KBLK) * ks + d0), _MM_HINT_T0);
        r[i] = load16(KF + (j + 16 * b + i) * ks + d0, live_d);
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i)
        if (d0 + dim[i] < D) _mm512_store_ps(kt + (b * D + d0 + dim[i]) * 16, r[i]);
    }
}

// rows [l0, l0 + L) against nb (<= KBLK) transposed blocks: S[j + 16 b + k][l]
template <int L>
void keys_pass(const float* kt, int nb, int64_t D, const float* QT, int64_t LW, int64_t l0, int64_t j, float* S) {
  __m512 acc[KBLK][L];
  for (int b = 0; b < KBLK; ++b)
    for (int i = 0; i < L; ++i) acc[b][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 q[L];
    for (int i = 0; i < L; ++i) q[i] = _mm512_set1_ps(QT[d * LW + l0 + i]);
    for (int b = 0; b < KBLK; ++b) {
      if (b >= nb) break;
      const __m512 kv = _mm512_load_ps(kt + (b * D + d) * 16);
      for (int i = 0; i < L; ++i) acc[b][i] = _mm512_fmadd_ps(q[i], kv, acc[b][i]);
    }
  }
  alignas(64) float a[16];
  for (int b = 0; b < nb; ++b)
    for (int i = 0; i < L; ++i) {
      _mm512_store_ps(a, acc[b][i]);
      for (int k = 0; k < 16; ++k) S[(j + 16 * b + k) * LW + l0 + i] = a[k];
    }
}

template <class KT>
void scores_keys(const KT* KF, int64_t kstride, int64_t N, int64_t D, const float* QT, int64_t LW, int64_t nl,
                 float* S) {
  alignas(64) float kt[KBLK * MAXD * 16];  // [block][d][16 keys]
  const int64_t full = N / 16 * 16;
  for (int64_t j = 0; j < full; j += 16 * KBLK) {
    const int nb = (int)std::min<int64_t>(KBLK, (full - j) / 16);
    transpose_keys(KF, kstride, j, nb, D, kt);
    for (int64_t k = 0; k < 16 * nb; ++k) _mm512_storeu_ps(S + (j + k) * LW, _mm512_setzero_ps());
    for (int64_t l0 = 0; l0 < nl; l0 += 4) switch (std::min<int64_t>(4, nl - l0)) {
        case 1: keys_pass<1>(kt, nb, D, QT, LW, l0, j, S); break;
        case 2: keys_pass<2>(kt, nb, D, QT, LW, l0, j, S); break;
        case 3: keys_pass<3>(kt, nb, D, QT, LW, l0, j, S); break;
        default: keys_pass<4>(kt, nb, D, QT, LW, l0, j, S);
      }
  }
  for (int64_t j = full; j < N; ++j) {  // the last keys: the lanes-as-rows chain, one key at a time
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(QT + d * LW), _mm512_set1_ps(to_f(KF[j * kstride + d])), acc);
    _mm512_storeu_ps(S + j * LW, acc);
  }
}

// out rows of lanes [g0, g0 + G): sum over keys of p * v, lanes = the head dimension (DV vectors;
// value row j at V + j * vs, DV whole vectors of any dtype load16 reads)
template <class VT, int DV, int G>
void weigh(const float* S, int64_t LW, const VT* V, int64_t vs, int64_t N, int64_t g0, float* o) {
  __m512 acc[G][DV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; ++j) {
    __m512 v[DV];
    for (int c = 0; c < DV; ++c) {  // (the row 32 on, fetched ahead: a cache's, in memory)
      _mm_prefetch((const char*)(V + (j + 32) * vs + 16 * c), _MM_HINT_T0);
      v[c] = load16(V + j * vs + 16 * c, (__mmask16)0xffff);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(S[j * LW + g0 + g]);
      for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + (g * DV + c) * 16, acc[g][c]);
}

}  // namespace

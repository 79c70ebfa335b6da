// Attention for a decoding step or a verified tree (decoding/forward/kernels.py), batch-invariant:
// a query row's result depends only on the keys its mask lets it see, not on how many rows or
// masked keys the call carries.
//
// Why not torch's scaled_dot_product_attention: its CPU kernels block the key axis, so a row's
// rounding depends on how many keys the call carries, visible or not; a token attended alone (a
// plain step) and the same token inside a verify (one more key per tree node, masked) then differ
// in the last bf16 bit, and greedy bf16 speculation drifts from bf16 `ar` at near-ties.
//
// How, for the query rows (t, head) of one kv head, laid out as vector lanes ("rows"):
// - scores S[key][row]: bf16 with AMX as K (16 keys) x Q^T (16 rows) tiles, each score one
//   tile dot product; otherwise (fp32, no AMX) one FMA chain per lane over the head dimension;
// - softmax per lane, keys in position order: max, exp, a sequential sum; a masked key is
//   -inf, so it adds an exact 0 to the sum;
// - out[row] = sum over keys in position order of p * v (lanes: the head dimension), one FMA
//   chain per output element; a masked key's p is 0 and leaves the chain as it was.
// Every step's arithmetic per row is the same whatever the other rows and masked keys are.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include "attention_mask.h"
#include "attention_scores.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace specstop_vec;

constexpr int CH = 2;  // lane vectors (16 query rows each) per task

struct Scratch {  // per thread, reused across calls
  std::vector<float> S, QT, VF, KF;
  std::vector<uint16_t> QB, tail;
};
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// q [B, H, T, D], k / v [B, KV, N, D] (any strides, unit last), mask: none (every key visible),
// bool [Bm, 1, T, >= N] (true: visible) or additive [Bm, 1, T, >= N] (visible unless <= -1e30)
// -> out [B, T, H, D].
// T: q and out; KT: the keys and values (T, or float16 under float32 q: a float16 KV cache)
template <class T, class M, int DV, class KT = T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            bool tiles, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tn = q.size(2), D = q.size(3), KV = k.size(1), NK = k.size(2);
  const int64_t rep = H / KV, NL = Tn * rep, chunk = 16 * CH, nch = (NL + chunk - 1) / chunk;
  constexpr int G = DV >= 16 ? 1 : 16 / DV;  // output rows per pass over the values
  std::vector<MaskView> mv;
  for (int64_t b = 0; b < B; ++b) mv.push_back(mask_view<M>(mask, b, Tn, NK));
  const T* Q = q.data_ptr<T>();
  const KT* K = k.data_ptr<KT>();
  const KT* V = v.data_ptr<KT>();
  T* O = out.data_ptr<T>();
  const float sc = (float)scale;
  at::parallel_for(0, B * KV * nch, 1, [&](int64_t i0, int64_t i1) {
    Scratch& s = scratch();
    for (int64_t i = i0; i < i1; ++i) {
      // chunks in the order first, last, second, ...: under a causal mask a chunk's keys grow with
      // its rows, and the threads take contiguous runs of tasks
      const int64_t b = i / (KV * nch), g = (i / nch) % KV, ci = i % nch;
      const int64_t l0 = (ci % 2 ? nch - 1 - ci / 2 : ci / 2) * chunk;
      const int64_t nl = std::min(chunk, NL - l0), nv = (nl + 15) / 16, LW = 16 * nv;
      const MaskView& m = mv[b];
      const int64_t N = m.keys(l0 / rep, (l0 + nl - 1) / rep, NK);  // the keys this task reads
      const KT* Kb = K + b * k.stride(0) + g * k.stride(1);
      const KT* Vb = V + b * v.stride(0) + g * v.stride(1);
      auto qrow = [&](int64_t l) {  // lane l of this task: row t, query head g * rep + r
        const int64_t t = (l0 + l) / rep, r = (l0 + l) % rep;
        return Q + b * q.stride(0) + (g * rep + r) * q.stride(1) + t * q.stride(2);
      };
      s.S.resize((size_t)((N + 15) / 16 * 16) * LW);
      float* S = s.S.data();
      if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<KT, T>) {
        if (tiles) {
          const int64_t DC = D / 32;
          s.QB.assign((size_t)nv * DC * 512, 0);  // [lane vector][32 dims][16 pairs][16 lanes] of bf16 pairs
          uint32_t* qb = (uint32_t*)s.QB.data();
          for (int64_t l = 0; l < nl; ++l) {
            const uint32_t* qr = (const uint32_t*)qrow(l);  // pairs of dims (D even: whole tiles)
            uint32_t* col = qb + (l / 16) * DC * 256 + l % 16;
            for (int64_t p = 0; p < D / 2; ++p) col[(p / 16) * 256 + (p % 16) * 16] = qr[p];
          }
          scores_amx((const uint16_t*)Kb, k.stride(2), N, D, s.QB.data(), (int)nv, S, LW, s.tail);
        }
      }
      if (!tiles) {
        s.QT.assign((size_t)D * LW, 0.0f);
        for (int64_t l = 0; l < nl; ++l) {
          const T* qr = qrow(l);
          for (int64_t d = 0; d < D; ++d) s.QT[d * LW + l] = to_f(qr[d]);
        }
        // one lane vector: keys as lanes, 5x faster at a step's 3 live rows, 1.9x at 16 (500 keys,
        // D 64, 2-core EPYC), reading the cache's dtype; two or more: the chain (its 4 keys x 2
        // vectors beat keys as lanes) over fp32 keys
        const int64_t kst = k.stride(2);
        if (nv == 1) {
          scores_keys(Kb, kst, N, D, s.QT.data(), LW, nl, S);
        } else if constexpr (std::is_same_v<KT, float>) {
          scores_fma<2, 4>(Kb, kst, N, D, s.QT.data(), LW, S);
        } else {
          s.KF.resize((size_t)N * D);
          float* kf = s.KF.data();
          for (int64_t j = 0; j < N; ++j)
            for (int64_t d = 0; d < D; d += 16) store16(kf + j * D + d, load16(Kb + j * kst + d, live(d, D)), live(d, D));
          scores_fma<2, 4>(kf, D, N, D, s.QT.data(), LW, S);
        }
      }
      // softmax per lane: scale, mask, max; then exp and a sequential sum, keys in position order
      alignas(64) float inv[16 * CH];
      for (int64_t c = 0; c < nv; ++c) {
        const int64_t t0 = (l0 + 16 * c) / rep;
        alignas(64) int32_t idx[16];
        for (int e = 0; e < 16; ++e) idx[e] = (int32_t)((l0 + 16 * c + e) / rep - t0);
        const __m512i perm = _mm512_load_si512(idx);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < N; ++j) {
          float* sj = S + j * LW + 16 * c;
          const __m512 add = j < m.full ? _mm512_setzero_ps()
                                        : _mm512_permutexvar_ps(perm, _mm512_loadu_ps(m.add.data() + (j - m.full) * m.TP + t0));
          const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(sj), _mm512_set1_ps(sc)), add);
          _mm512_storeu_ps(sj, x);
          mx = _mm512_max_ps(mx, x);
        }
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < N; ++j) {
          float* sj = S + j * LW + 16 * c;
          const __m512 x = _mm512_loadu_ps(sj);
          const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
          const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, mx)));
          _mm512_storeu_ps(sj, p);
          sum = _mm512_add_ps(sum, p);
        }
        const __mmask16 any = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_store_ps(inv + 16 * c, _mm512_maskz_div_ps(any, _mm512_set1_ps(1.0f), sum));
      }
      // values read in place where a row is whole vectors (D = 16 DV), else copied to fp32 rows
      // padded with zeros
      const int64_t vs = v.stride(2);
      if (D != DV * 16) {
        s.VF.assign((size_t)N * DV * 16, 0.0f);
        for (int64_t j = 0; j < N; ++j)
          for (int64_t d = 0; d < D; d += 16) store16(s.VF.data() + j * DV * 16 + d, load16(Vb + j * vs + d, live(d, D)), live(d, D));
      }
      alignas(64) float o[G * DV * 16];
      for (int64_t g0 = 0; g0 < nl; g0 += G) {
        if (D == DV * 16) weigh<KT, DV, G>(S, LW, Vb, vs, N, g0, o);
        else weigh<float, DV, G>(S, LW, s.VF.data(), DV * 16, N, g0, o);
        for (int64_t e = 0; e < G && g0 + e < nl; ++e) {
          const int64_t l = l0 + g0 + e, t = l / rep, h = g * rep + l % rep;
          T* orow = O + ((b * Tn + t) * H + h) * D;
          const __m512 iv = _mm512_set1_ps(inv[g0 + e]);
          for (int64_t d = 0; d < D; d += 16) store16(orow + d, _mm512_mul_ps(_mm512_loadu_ps(o + e * DV * 16 + d), iv), live(d, D));
        }
      }
    }
  });
}

}  // namespace

namespace specstop {
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  const bool half_kv = q.scalar_type() == at::kFloat && k.scalar_type() == at::kHalf;  // a float16 KV cache
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && k.sizes() == v.sizes() &&
              q.size(3) == k.size(3) && q.size(3) <= MAXD && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
              (q.scalar_type() == k.scalar_type() || half_kv) && k.scalar_type() == v.scalar_type(),
              "row_attention: q [B, H, T, D], k / v [B, KV, N, D] of q's dtype (or float16 under float32 q), "
              "H a multiple of KV, D <= 256");
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
  // bf16 scores on AMX tiles where the CPU has them and the head dimension is whole tiles
  const bool tiles = st == at::kBFloat16 && D % 32 == 0 && amx_ready();
  // head_dim 64 / 128 (most models) get their vector count at compile time, the rest up to 256
#define SPECSTOP_ATTEND_KV(T, M, KT)                                                                      \
  (D == 64    ? attend<T, M, 4, KT>(q, k, v, m, scale, tiles, out)                                           \
   : D == 128 ? attend<T, M, 8, KT>(q, k, v, m, scale, tiles, out)                                           \
   : D <= 32  ? attend<T, M, 2, KT>(q, k, v, m, scale, tiles, out)                                           \
              : attend<T, M, MAXD / 16, KT>(q, k, v, m, scale, tiles, out))
#define SPECSTOP_ATTEND(T, M) SPECSTOP_ATTEND_KV(T, M, T)
  if (st == at::kBFloat16) {
    if (mt == at::kBool) SPECSTOP_ATTEND(at::BFloat16, bool);
    else SPECSTOP_ATTEND(at::BFloat16, at::BFloat16);
  } else if (half_kv) {
    if (mt == at::kBool) SPECSTOP_ATTEND_KV(float, bool, c10::Half);
    else SPECSTOP_ATTEND_KV(float, float, c10::Half);
  } else {
    if (mt == at::kBool) SPECSTOP_ATTEND(float, bool);
    else SPECSTOP_ATTEND(float, float);
  }
#undef SPECSTOP_ATTEND
#undef SPECSTOP_ATTEND_KV
  return out;
}
}  // namespace specstop


TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) { m.impl("row_attention", &specstop::row_attention); }

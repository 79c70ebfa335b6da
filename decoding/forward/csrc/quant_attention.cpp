// Attention of a step, a verify or a prompt where decoding.forward.kernels does not build (CPUs
// without AVX512-BF16), for a GGUF target's lean layers (decoding/forward/quant.py): float32, AVX2;
// keys and values float32 or float16 (a float16 KV cache), the math float32.
//
// Why: torch's attention is not batch-invariant (a row's blocking over keys follows how many keys
// and rows the call has), so a verify row and the step that would produce the same token differ in
// the last bits; with activations rounded to 8 bits (q8) that becomes a whole quantum about once a
// token and flips greedy near-ties. Here a row's arithmetic depends only on the keys it sees, in
// cache order, as attention.cpp's on AVX512 (the same plan, lanes of 8):
// - the query rows of one kv head (t, head) are vector lanes, 16 a task;
// - scores S[key][row]: one FMA chain over the head dimension from zero, computed with the rows
//   as lanes (a key element broadcast) or, for a task of one lane vector (a step: the 3 query
//   heads of a kv head), with 8 keys as lanes (transposed once): the same bits either way;
// - softmax per lane, keys in position order: scale, mask (-inf), max, exp, a sequential sum;
// - out = sum over keys in position order of p * v, one FMA chain per element, divided once.
// A masked key adds an exact 0 to the sums, and a task stops at the last key its rows see.
// Same contract as specstop::row_attention: q [B, H, T, D], k / v [B, KV, S, D] (stride 1 on D),
// mask [1 or B, 1, T, >= S] bool (true: seen) or float (added), or none (every key seen);
// out [B, T, H, D].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include "attention_mask.h"
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int CH = 2;    // lane vectors (8 query rows each) per task
constexpr int KBLK = 4;  // blocks of 8 keys a keys-as-lanes pass
constexpr int VS = 8;    // value vectors (64 dims) a pass over the keys

// 8 fp32 lanes of keys / values as the cache holds them: float32, or float16 (a float16 KV cache)
AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// exp(x) to ~1 ulp, as vec.h's exp16: x = n ln2 + r, a degree-7 Taylor polynomial in r, times 2^n
// made from its exponent bits. Below -87 (2^n would leave the normal range) 0: under 2e-38 of a
// softmax sum that is at least 1.
AVX2 inline __m256 exp8(__m256 x) {
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), kept);
}

// S[j][l] for NV lane vectors, lanes = rows, KB keys at a time (K: float32 rows of stride ks)
template <int NV, int KB>
AVX2 void scores_rows(const float* K, int64_t ks, int64_t N, int64_t D, const float* QT, int64_t LW, float* S) {
  int64_t j = 0;
  for (; j + KB <= N; j += KB) {
    __m256 acc[NV][KB];
    for (int v = 0; v < NV; ++v)
      for (int k = 0; k < KB; ++k) acc[v][k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      __m256 q[NV];
      for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(QT + d * LW + 8 * v);
      for (int k = 0; k < KB; ++k) {
        const __m256 kv = _mm256_broadcast_ss(K + (j + k) * ks + d);
        for (int v = 0; v < NV; ++v) acc[v][k] = _mm256_fmadd_ps(q[v], kv, acc[v][k]);
      }
    }
    for (int k = 0; k < KB; ++k)
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(S + (j + k) * LW + 8 * v, acc[v][k]);
  }
  for (; j < N; ++j)
    for (int v = 0; v < NV; ++v) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(QT + d * LW + 8 * v), _mm256_broadcast_ss(K + j * ks + d), acc);
      _mm256_storeu_ps(S + j * LW + 8 * v, acc);
    }
}

// 8 x 8 floats: r[i] lane j -> r[j] lane i
AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// rows [l0, l0 + L) against nb (<= KBLK) transposed blocks kt [block][D][8 keys]: S[j + 8 b + k][l]
template <int L>
AVX2 void keys_pass(const float* kt, int nb, int64_t D, const float* QT, int64_t LW, int64_t l0, int64_t j, float* S) {
  __m256 acc[KBLK][L];
  for (int b = 0; b < KBLK; ++b)
    for (int i = 0; i < L; ++i) acc[b][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 q[L];
    for (int i = 0; i < L; ++i) q[i] = _mm256_broadcast_ss(QT + d * LW + l0 + i);
    for (int b = 0; b < KBLK; ++b) {
      if (b >= nb) break;
      const __m256 kv = _mm256_load_ps(kt + (b * D + d) * 8);
      for (int i = 0; i < L; ++i) acc[b][i] = _mm256_fmadd_ps(q[i], kv, acc[b][i]);
    }
  }
  alignas(32) float a[8];
  for (int b = 0; b < nb; ++b)
    for (int i = 0; i < L; ++i) {
      _mm256_store_ps(a, acc[b][i]);
      for (int k = 0; k < 8; ++k) S[(j + 8 * b + k) * LW + l0 + i] = a[k];
    }
}

// S[j][l] for one lane vector (nl live rows), keys as lanes; D a multiple of 8, kt KBLK * D * 8 floats
template <class KT>
AVX2 void scores_keys(const KT* K, int64_t ks, int64_t N, int64_t D, const float* QT, int64_t nl, float* S, float* kt) {
  const int64_t full = N / 8 * 8;
  for (int64_t j = 0; j < full; j += 8 * KBLK) {
    const int nb = (int)std::min<int64_t>(KBLK, (full - j) / 8);
    for (int b = 0; b < nb; ++b)
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {  // the same row 4 blocks on: the cache streams ahead of the loads
          _mm_prefetch((const char*)(K + (j + 8 * b + i + 8 * KBLK) * ks + d0), _MM_HINT_T0);
          r[i] = load8(K + (j + 8 * b + i) * ks + d0);
        }
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_store_ps(kt + (b * D + d0 + i) * 8, r[i]);
      }
    for (int64_t k = 0; k < 8 * nb; ++k) _mm256_storeu_ps(S + (j + k) * 8, _mm256_setzero_ps());  // dead lanes: 0
    for (int64_t l0 = 0; l0 < nl; l0 += 3) switch (std::min<int64_t>(3, nl - l0)) {
        case 1: keys_pass<1>(kt, nb, D, QT, 8, l0, j, S); break;
        case 2: keys_pass<2>(kt, nb, D, QT, 8, l0, j, S); break;
        default: keys_pass<3>(kt, nb, D, QT, 8, l0, j, S);
      }
  }
  for (int64_t j = full; j < N; ++j) {  // the last keys: rows as lanes, one key at a time
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) acc = _mm256_fmadd_ps(_mm256_loadu_ps(QT + d * 8), _mm256_set1_ps(to_f(K[j * ks + d])), acc);
    _mm256_storeu_ps(S + j * 8, acc);
  }
}

// out[c] (DV vectors of dims) = sum over keys j of S[j][l] * V[j] (row stride vs), keys in order
template <class VT, int DV>
AVX2 void weigh(const float* S, int64_t LW, int64_t l, const VT* V, int64_t vs, int64_t N, float* out) {
  __m256 acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < N; ++j) {
    _mm_prefetch((const char*)(V + (j + 16) * vs), _MM_HINT_T0);
    const __m256 p = _mm256_broadcast_ss(S + j * LW + l);
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(p, load8(V + j * vs + 8 * c), acc[c]);
  }
  for (int c = 0; c < DV; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

template <class VT>
AVX2 void weigh_slice(int dv, const float* S, int64_t LW, int64_t l, const VT* V, int64_t vs, int64_t N, float* out) {
  switch (dv) {
    case 1: return weigh<VT, 1>(S, LW, l, V, vs, N, out);
    case 2: return weigh<VT, 2>(S, LW, l, V, vs, N, out);
    case 3: return weigh<VT, 3>(S, LW, l, V, vs, N, out);
    case 4: return weigh<VT, 4>(S, LW, l, V, vs, N, out);
    case 5: return weigh<VT, 5>(S, LW, l, V, vs, N, out);
    case 6: return weigh<VT, 6>(S, LW, l, V, vs, N, out);
    case 7: return weigh<VT, 7>(S, LW, l, V, vs, N, out);
    default: return weigh<VT, VS>(S, LW, l, V, vs, N, out);
  }
}

// rows [0, N) of src (row stride ss) as float32 rows of stride ds, 8 lanes at a time (float16
// widens exactly)
template <class KT>
AVX2 void widen(const KT* src, int64_t ss, int64_t N, int64_t D, float* dst, int64_t ds) {
  for (int64_t j = 0; j < N; ++j) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + j * ds + d, load8(src + j * ss + d));
    for (; d < D; ++d) dst[j * ds + d] = to_f(src[j * ss + d]);
  }
}

struct Scratch {  // per thread, reused across calls
  std::vector<float> S, QT, KF, VF, kt, o;
};

// One call's shapes and pointers (attend below), read by its tasks
template <class KT>
struct Call {
  int64_t Tn, H, D, DP, KV, NK, rep, NL, nch;
  const float* Q;
  const KT* K;
  const KT* V;
  float* O;
  int64_t qs[3], ks[3], vs[3];  // strides of batch, head, position
  float sc;
  const std::vector<MaskView>* mv;
};

constexpr int64_t CHUNK = 8 * CH;  // query lanes a task

// Task i: the query lanes of one kv head's chunk
template <class KT>
AVX2 void attend_task(const Call<KT>& c, int64_t i, Scratch& s) {
  const int64_t D = c.D, DP = c.DP, rep = c.rep, nch = c.nch;
  // chunks in the order first, last, second, ...: under a causal mask a chunk's keys grow with
  // its rows, and the threads take contiguous runs of tasks
  const int64_t b = i / (c.KV * nch), g = (i / nch) % c.KV, ci = i % nch;
  const int64_t l0 = (ci % 2 ? nch - 1 - ci / 2 : ci / 2) * CHUNK;
  const int64_t nl = std::min(CHUNK, c.NL - l0), nv = (nl + 7) / 8, LW = 8 * nv;
  const MaskView& m = (*c.mv)[b];
  const int64_t N = m.keys(l0 / rep, (l0 + nl - 1) / rep, c.NK);  // the keys this task reads
  const KT* Kb = c.K + b * c.ks[0] + g * c.ks[1];
  const KT* Vb = c.V + b * c.vs[0] + g * c.vs[1];
  const int64_t ks = c.ks[2], vs = c.vs[2];
  s.QT.assign((size_t)D * LW, 0.0f);  // [d][lane]
  for (int64_t l = 0; l < nl; ++l) {
    const int64_t t = (l0 + l) / rep, h = g * rep + (l0 + l) % rep;
    const float* qr = c.Q + b * c.qs[0] + h * c.qs[1] + t * c.qs[2];
    for (int64_t d = 0; d < D; ++d) s.QT[d * LW + l] = qr[d];
  }
  s.S.resize((size_t)N * LW + 8);
  float* S = s.S.data();
  if (nv == 1 && D % 8 == 0) {
    s.kt.resize((size_t)KBLK * D * 8 + 8);
    float* kt = (float*)(((uintptr_t)s.kt.data() + 31) & ~(uintptr_t)31);  // 32-byte aligned
    scores_keys(Kb, ks, N, D, s.QT.data(), nl, S, kt);
  } else {
    const float* KF = (const float*)Kb;
    int64_t kfs = ks;
    if constexpr (!std::is_same_v<KT, float>) {  // float16 keys: widened once (exactly)
      s.KF.resize((size_t)N * D);
      widen(Kb, ks, N, D, s.KF.data(), D);
      KF = s.KF.data();
      kfs = D;
    }
    if (nv == 2) scores_rows<2, 4>(KF, kfs, N, D, s.QT.data(), LW, S);
    else scores_rows<1, 4>(KF, kfs, N, D, s.QT.data(), LW, S);
  }
  // softmax per lane: scale, mask, max; then exp and a sequential sum, keys in position order
  alignas(32) float inv[8 * CH];
  for (int64_t u = 0; u < nv; ++u) {
    const int64_t t0 = (l0 + 8 * u) / rep;
    alignas(32) int32_t idx[8];
    for (int e = 0; e < 8; ++e) idx[e] = (int32_t)((l0 + 8 * u + e) / rep - t0);
    const __m256i perm = _mm256_load_si256((const __m256i*)idx);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < N; ++j) {
      float* sj = S + j * LW + 8 * u;
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sj), _mm256_set1_ps(c.sc));
      if (j >= m.full)
        x = _mm256_add_ps(x, _mm256_permutevar8x32_ps(_mm256_loadu_ps(m.add.data() + (j - m.full) * m.TP + t0), perm));
      _mm256_storeu_ps(sj, x);
      mx = _mm256_max_ps(mx, x);
    }
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < N; ++j) {
      float* sj = S + j * LW + 8 * u;
      const __m256 x = _mm256_loadu_ps(sj);
      const __m256 seen = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, mx)), seen);
      _mm256_storeu_ps(sj, p);
      sum = _mm256_add_ps(sum, p);
    }
    const __m256 any = _mm256_cmp_ps(sum, _mm256_setzero_ps(), _CMP_GT_OQ);
    _mm256_store_ps(inv + 8 * u, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), sum), any));
  }
  // the values: read in place where a row is whole vectors, else widened into padded rows
  const float* VF = nullptr;
  if (D != DP) {
    s.VF.assign((size_t)N * DP, 0.0f);
    widen(Vb, vs, N, D, s.VF.data(), DP);
    VF = s.VF.data();
  }
  s.o.resize(DP);
  for (int64_t l = 0; l < nl; ++l) {
    for (int64_t d0 = 0; d0 < DP; d0 += 8 * VS) {
      const int dv = (int)std::min<int64_t>(VS, (DP - d0) / 8);
      if (VF) weigh_slice<float>(dv, S, LW, l, VF + d0, DP, N, s.o.data() + d0);
      else weigh_slice<KT>(dv, S, LW, l, Vb + d0, vs, N, s.o.data() + d0);
    }
    const int64_t t = (l0 + l) / rep, h = g * rep + (l0 + l) % rep;
    float* orow = c.O + ((b * c.Tn + t) * c.H + h) * D;
    const __m256 iv = _mm256_set1_ps(inv[l]);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(s.o.data() + d), iv));
    for (; d < D; ++d) orow[d] = s.o[d] * inv[l];
  }
}

template <typename M, class KT>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            at::Tensor& out) {
  Call<KT> c;
  c.Tn = q.size(2), c.H = q.size(1), c.D = q.size(3), c.DP = (c.D + 7) / 8 * 8, c.KV = k.size(1), c.NK = k.size(2);
  c.rep = c.H / c.KV, c.NL = c.Tn * c.rep, c.nch = (c.NL + CHUNK - 1) / CHUNK;
  std::vector<MaskView> mv;
  for (int64_t b = 0; b < q.size(0); ++b) mv.push_back(mask_view<M>(mask, b, c.Tn, c.NK));
  c.Q = q.data_ptr<float>(), c.K = k.data_ptr<KT>(), c.V = v.data_ptr<KT>(), c.O = out.data_ptr<float>();
  for (int a = 0; a < 3; ++a) c.qs[a] = q.stride(a), c.ks[a] = k.stride(a), c.vs[a] = v.stride(a);
  c.sc = (float)scale;
  c.mv = &mv;
  at::parallel_for(0, q.size(0) * c.KV * c.nch, 1, [&](int64_t i0, int64_t i1) {
    static thread_local Scratch s;
    for (int64_t i = i0; i < i1; ++i) attend_task(c, i, s);
  });
}

at::Tensor row_attention_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(specstop_quant::has_avx2(), "row_attention_avx2: the CPU lacks AVX2 / FMA");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && k.sizes() == v.sizes() &&
              q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.stride(3) == 1 &&
              k.stride(3) == 1 && v.stride(3) == 1 && q.scalar_type() == at::kFloat &&
              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) && v.scalar_type() == k.scalar_type(),
              "row_attention_avx2: float32 q [B, H, T, D], k / v [B, KV, S, D] float32 or float16, H a multiple of KV");
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask)
    TORCH_CHECK(mask->dim() == 4 && mask->size(2) == q.size(2) && mask->size(3) >= k.size(2) &&
                (mask->size(0) == 1 || mask->size(0) == q.size(0)) && mask->size(1) == 1 &&
                (mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat),
                "row_attention_avx2: mask [1 or B, 1, T, >= S], bool or float32");
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const at::Tensor m = has_mask ? *mask : at::Tensor();
  const bool half = k.scalar_type() == at::kHalf;
  if (!has_mask || m.scalar_type() == at::kBool) half ? attend<bool, c10::Half>(q, k, v, m, scale, out) : attend<bool, float>(q, k, v, m, scale, out);
  else half ? attend<float, c10::Half>(q, k, v, m, scale, out) : attend<float, float>(q, k, v, m, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) { m.impl("row_attention", &row_attention_avx2); }

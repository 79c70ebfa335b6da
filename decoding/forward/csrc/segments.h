// The attention step of decoder_layer and decoder_layer_segments (layer.cpp on the AVX512 kernels,
// quant_layer.cpp on AVX2), shared by the two libraries: a sequence against its cache buffer, and
// several requests' stacked rows each against its own (the one step that does not run over all rows).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstring>
#include <tuple>
#include <vector>

// float32 -> float16, round to nearest even (as torch's copy_ into a half tensor rounds: the
// same bits a prompt's per-op layer stores)
__attribute__((target("avx,f16c"))) inline void to_half(const float* s, c10::Half* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = c10::Half(s[i]);
}

// A cache buffer holds the keys' dtype, or float16 under float32 keys (a float16 KV cache:
// decoding/kv_cache.py set_kv_dtype)
inline bool holds(const at::Tensor& buf, const at::Tensor& keys) {
  return buf.scalar_type() == keys.scalar_type() ||
         (buf.scalar_type() == at::kHalf && keys.scalar_type() == at::kFloat);
}

// decoder_layer's attention: q [B, H, T, D] and the T new keys / values [B, KV, T, D], written into
// kbuf / vbuf [B, KV, cap, D] after the n cached ones from start; attend(q, k, v, mask) over those n + T.
// Returns [B * T, H * D].
template <class Attend>
at::Tensor attend_cached(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kbuf,
                         const at::Tensor& vbuf, int64_t start, int64_t n, const c10::optional<at::Tensor>& mask,
                         Attend attend) {
  const int64_t B = q.size(0), T = q.size(2);
  TORCH_CHECK(kbuf.dim() == 4 && vbuf.sizes() == kbuf.sizes() && start >= 0 && n >= 0 &&
                  start + n + T <= kbuf.size(2) && kbuf.size(0) == B && kbuf.size(1) == k.size(1) &&
                  holds(kbuf, k) && holds(vbuf, v),
              "decoder_layer: no room in the cache buffer [B, KV, cap, D] of the keys' dtype (or float16)");
  kbuf.narrow(2, start + n, T).copy_(k);
  vbuf.narrow(2, start + n, T).copy_(v);
  return attend(q, kbuf.narrow(2, start, n + T), vbuf.narrow(2, start, n + T), mask).view({B * T, -1});
}

// Segments of at most this many rows (steps, small trees) run one thread a segment
constexpr int64_t kFewRows = 8;

// src [1, KV, R, D] (contiguous) rows [from, from + T) -> dst [1, KV, cap, D] rows [at, at + T): a copy
// per head, not a trip through the dispatcher (~5 us a copy_, 2 a segment a layer); into a float16
// buffer, rounded
inline void append_rows(const at::Tensor& src, int64_t from, int64_t T, const at::Tensor& dst, int64_t at) {
  const int64_t KV = src.size(1), R = src.size(2), D = src.size(3), bytes = src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  if (dst.scalar_type() != src.scalar_type()) {  // float32 keys into a float16 cache (holds())
    c10::Half* d = dst.data_ptr<c10::Half>();
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t t = 0; t < T; ++t)
        to_half(src.data_ptr<float>() + (h * R + from + t) * D, d + h * dst.stride(1) + (at + t) * dst.stride(2), D);
    return;
  }
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t h = 0; h < KV; ++h)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(d + (h * dst.stride(1) + (at + t) * dst.stride(2)) * bytes, s + ((h * R + from + t) * D) * bytes,
                  D * bytes);
}

// q [1, H, R, D], k / v [1, KV, R, D]: the stacked rows after rotary, segment i's rows[i] rows in
// turn. Segment i's new keys and values go into kbufs[i] / vbufs[i] [1, KV, cap, D] after its ns[i]
// cached ones from starts[i]; its rows attend over those ns[i] + rows[i] keys with masks[i]
// (attend(q, k, v, mask), decoder_layer's attention). Returns [R, H * D].
template <class Attend>
at::Tensor attend_segments(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList kbufs,
                           at::TensorList vbufs, at::IntArrayRef starts, at::IntArrayRef ns, at::IntArrayRef rows,
                           const c10::List<c10::optional<at::Tensor>>& masks, int64_t R, Attend attend) {
  const size_t S = rows.size();
  TORCH_CHECK(kbufs.size() == S && vbufs.size() == S && starts.size() == S && ns.size() == S && masks.size() == S,
              "decoder_layer_segments: one buffer pair, start, count and mask per segment");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 4 && k.sizes() == v.sizes(),
              "decoder_layer_segments: contiguous new keys / values [1, KV, R, D]");
  std::vector<int64_t> first(S + 1, 0);
  bool steps = S > 1;  // every segment a few rows: one thread a segment (its attention runs inline)
  for (size_t i = 0; i < S; ++i) {
    const int64_t T = rows[i], s = starts[i], n = ns[i];
    const at::Tensor &kb = kbufs[i], &vb = vbufs[i];
    TORCH_CHECK(T > 0 && s >= 0 && n >= 0 && first[i] + T <= R && kb.dim() == 4 && kb.size(0) == 1 &&
                    kb.size(1) == k.size(1) && vb.sizes() == kb.sizes() && s + n + T <= kb.size(2) &&
                    holds(kb, k) && holds(vb, v) &&
                    kb.stride(3) == 1 && vb.stride(3) == 1,
                "decoder_layer_segments: segment ", i, " has no room in its buffers [1, KV, cap, D] of the keys' dtype");
    first[i + 1] = first[i] + T;
    steps = steps && T <= kFewRows;
  }
  TORCH_CHECK(first[S] == R, "decoder_layer_segments: the segments' rows must add up to x's");
  std::vector<at::Tensor> out(S);
  auto one = [&](size_t i) {
    const int64_t T = rows[i], s = starts[i], n = ns[i], at = first[i];
    append_rows(k, at, T, kbufs[i], s + n);
    append_rows(v, at, T, vbufs[i], s + n);
    out[i] = attend(q.narrow(2, at, T), kbufs[i].narrow(2, s, n + T), vbufs[i].narrow(2, s, n + T), masks.get(i))
                 .view({T, -1});
  };
  // A row's attention does not depend on the threads, so splitting by segment changes no bit; it
  // saves a parallel region a segment (~15 us a layer each on 2 cores, measured)
  if (steps) at::parallel_for(0, static_cast<int64_t>(S), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) one(static_cast<size_t>(i));
    });
  else for (size_t i = 0; i < S; ++i) one(i);
  return S == 1 ? out[0] : at::cat(out);
}

// The signature of decoder_layer_segments (layer.cpp, quant_layer.cpp)
using SegmentsLayer = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                 at::TensorList, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                 const c10::List<c10::optional<at::Tensor>>&, at::TensorList,
                                 const c10::optional<at::Tensor>&, at::IntArrayRef, double, double, double);

// Every layer of a stack in one call (decoding/batch/forward.py): layer l runs Layer (a library's
// decoder_layer_segments) on its S segments' buffers, starts and counts, its 6 weights, its q/k/v
// bias, its dims and its two norms' eps (all laid out layer after layer), as Python would call it
// once a layer; the segments' rows and masks are the same in every layer. Returns the last layer's
// output and the INPUT of each layer listed in `capture` (ascending: a feature head's aux layers).
// Saves a trip through Python and the dispatcher a layer (~30 a forward).
template <SegmentsLayer* Layer>
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_stack_segments(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList kbufs, at::TensorList vbufs,
    at::IntArrayRef starts, at::IntArrayRef ns, at::IntArrayRef rows, const c10::List<c10::optional<at::Tensor>>& masks,
    at::TensorList w, const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef dims,
    at::ArrayRef<double> eps1, at::ArrayRef<double> eps2, double scale, at::IntArrayRef capture) {
  const size_t L = eps1.size(), S = rows.size();
  TORCH_CHECK(L > 0 && eps2.size() == L && biases.size() == L && w.size() == 6 * L && dims.size() % L == 0 &&
                  kbufs.size() == L * S && vbufs.size() == L * S && starts.size() == L * S && ns.size() == L * S,
              "decoder_stack_segments: per layer 6 weights, a bias, dims, two eps, and a buffer pair, start and "
              "count per segment");
  const size_t nd = dims.size() / L;
  at::Tensor h = x;
  std::vector<at::Tensor> caps;
  size_t c = 0;
  for (size_t l = 0; l < L; ++l) {
    for (; c < capture.size() && capture[c] == static_cast<int64_t>(l); ++c) caps.push_back(h);
    h = Layer(h, cos, sin, kbufs.slice(l * S, S), vbufs.slice(l * S, S), starts.slice(l * S, S), ns.slice(l * S, S),
              rows, masks, w.slice(6 * l, 6), biases.get(l), dims.slice(l * nd, nd), eps1[l], eps2[l], scale);
  }
  TORCH_CHECK(c == capture.size(), "decoder_stack_segments: capture must list layers in order, each below ", L);
  return {h, caps};
}

// After a verified tree: in every cache buffer [1, KV, T, D] (kbufs[i] / vbufs[i], its cached rows
// from starts[i]), the kept tree rows s + kept[j] move to s + j (kept ascending, so a row never
// lands on one still to be read). What decoding/kv_cache.py keep_path does a layer with two
// gathers and two copies, for every layer in one call (a round's 30 layers x requests were ~0.4 ms
// of dispatch a request).
inline void keep_rows(at::TensorList kbufs, at::TensorList vbufs, at::IntArrayRef starts, int64_t s,
                      at::IntArrayRef kept) {
  TORCH_CHECK(kbufs.size() == vbufs.size() && kbufs.size() == starts.size(), "keep_rows: one start a buffer pair");
  for (size_t j = 0; j < kept.size(); ++j)
    TORCH_CHECK(kept[j] >= (int64_t)j && (j == 0 || kept[j] > kept[j - 1]), "keep_rows: kept must ascend from 0");
  for (size_t i = 0; i < kbufs.size(); ++i)
    for (const at::Tensor* b : {&kbufs[i], &vbufs[i]}) {
      TORCH_CHECK(b->dim() == 4 && b->size(0) == 1 && b->is_contiguous(), "keep_rows: buffers are contiguous [1, KV, T, D]");
      const int64_t T = b->size(2), row = b->size(3) * b->element_size(), base = starts[i] + s;
      TORCH_CHECK(kept.empty() || base + kept.back() < T, "keep_rows: a kept row is past the buffer");
      char* p = static_cast<char*>(b->data_ptr());
      for (int64_t h = 0; h < b->size(1); ++h)
        for (size_t j = 0; j < kept.size(); ++j)
          if (kept[j] != (int64_t)j)
            std::memmove(p + (h * T + base + j) * row, p + (h * T + base + kept[j]) * row, row);
    }
}

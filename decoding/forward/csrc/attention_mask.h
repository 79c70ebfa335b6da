// The attention mask as both row attentions read it (attention.cpp on AVX512, quant_attention.cpp on
// AVX2): bool (true: seen) or additive (-inf or <= -1e30: masked), made once per call and batch.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return (float)x; }
inline float to_f(c10::Half x) { return (float)x; }

template <class M> inline bool plain(M x) {  // visible with nothing added
  if constexpr (std::is_same_v<M, bool>) return x;
  else return to_f(x) == 0.0f;
}
template <class M> inline float additive(M x) {  // -inf: masked
  if constexpr (std::is_same_v<M, bool>) return x ? 0.0f : -INFINITY;
  else { const float f = to_f(x); return f <= -1e30f ? -INFINITY : f; }
}

// The mask of batch b, once per call: keys [0, full) are visible to every row with nothing added
// (a verify's cached prefix); for the rest, add[(j - full) * TP + t] (TP: T padded by 16 lanes: a vector of
// lanes loaded from any row's column stays inside).
// Row t sees no key from end[t] on: a task reads keys up to the largest end of its rows (a
// prompt's causal block: half the keys). The keys left out are masked for every lane of the task,
// so they would add exact zeros to its sums: no bit changes.
struct MaskView {
  int64_t full = 0, TP = 0;
  std::vector<float> add;
  std::vector<int64_t> end;
  int64_t keys(int64_t t0, int64_t t1, int64_t N) const {  // keys rows [t0, t1] read
    if (end.empty()) return N;
    return *std::max_element(end.begin() + t0, end.begin() + t1 + 1);
  }
};

template <class M>
MaskView mask_view(const at::Tensor& mask, int64_t b, int64_t Tn, int64_t N) {
  MaskView mv;
  mv.TP = Tn + 16;
  if (!mask.defined()) { mv.full = N; return mv; }
  const M* base = mask.data_ptr<M>() + (mask.size(0) > 1 ? b * mask.stride(0) : 0);
  const int64_t mt = mask.stride(2), mn = mask.stride(3);
  int64_t full = N;
  for (int64_t t = 0; t < Tn; ++t) {
    const M* row = base + t * mt;
    int64_t j = 0;
    while (j < full && plain(row[j * mn])) ++j;
    full = j;
  }
  mv.full = full;
  mv.add.assign((size_t)(N - full) * mv.TP, 0.0f);
  mv.end.assign(Tn, full);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t j = full; j < N; ++j) {
      const float a = additive(base[t * mt + j * mn]);
      mv.add[(j - full) * mv.TP + t] = a;
      if (a != -INFINITY) mv.end[t] = j + 1;
    }
  return mv;
}

}  // namespace

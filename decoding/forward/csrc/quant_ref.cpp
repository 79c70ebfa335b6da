// The reference dequantization of the quantized kernels' blocks (decoding/forward/quant.py
// QuantWeight.dequant): float32 [N, K], exactly the weights csrc/quant.cpp multiplies by and
// exactly gguf's own dequantizer's numbers (tests/forward/test_quantized_blocks.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "quant.h"

#include <cmath>
#include <cstring>

namespace {
using namespace specstop_quant;

// one block -> 32 floats at dst (the reference; scalar, exact as the vector paths)
void dequant_block_ref(const uint8_t* b, int64_t kind, float* dst) {
  float d, m = 0.0f;
  if (f32_scales(kind)) {
    std::memcpy(&d, b, 4);
    std::memcpy(&m, b + 4, 4);  // KQ6: the second half's scale
  } else {
    d = half_at(b);
    if (kind == Q4_1) m = half_at(b + 2);
  }
  if (byte_quants(kind)) {
    for (int i = 0; i < 32; ++i) dst[i] = (float)gguf_quant(b, kind, i) * (kind == KQ6 && i >= 16 ? m : d);
    return;
  }
  const uint8_t* qs = b + quants_at(kind);
  for (int i = 0; i < 16; ++i) {
    const int lo = qs[i] & 15, hi = qs[i] >> 4;
    if (has_min(kind)) {
      dst[i] = std::fma((float)lo, d, m);
      dst[i + 16] = std::fma((float)hi, d, m);
    } else {
      dst[i] = (float)(lo - 8) * d;
      dst[i + 16] = (float)(hi - 8) * d;
    }
  }
}

// w's blocks -> float32 [N, K], exactly the weights quant_linear multiplies by
at::Tensor quant_dequant(const at::Tensor& w, int64_t kind, int64_t K) {
  const int64_t bb = block_bytes(kind);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / QK * bb && K % QK == 0,
              "quant_dequant: w [N, K / 32 * block bytes] uint8");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), nb = K / QK;
  at::Tensor out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* W = wc.data_ptr<uint8_t>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 4096, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) dequant_block_ref(W + i * bb, kind, O + i * QK);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specstop_quant, m) { m.def("dequant(Tensor w, int kind, int k) -> Tensor"); }
TORCH_LIBRARY_IMPL(specstop_quant, CPU, m) { m.impl("dequant", &quant_dequant); }

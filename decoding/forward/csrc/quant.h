// What the quantized kernels share (quant.cpp: float32 activations; quant_q8.cpp: activations
// quantized to 8 bits a block, as llama.cpp's dot products): ggml's block types, the panel of
// 16 outputs, fp16 scales, and the instruction-set checks. Each vector path carries its own
// target attribute, so the extension builds and loads on any x86-64 CPU.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace specstop_quant {

// ggml type ids; KQ4 / KQ6: Q4_K / Q6_K re-laid into blocks of 32 with fp32 scales
// (decoding/forward/kquants.py): KQ4 d, m (f32), 16 nibble bytes as Q4_1's; KQ6 the scales of its
// two halves (f32), 32 int8 q
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, KQ4 = 12, KQ6 = 14;
constexpr int64_t QK = 32;    // weights per block
constexpr int64_t P = 16;     // outputs per panel
// bytes of lookahead in a panel stream (the hardware prefetcher stops at pages): 16 KiB over 8 took the
// q8 kernel's 121 linears 1.10 / 1.13 / 1.08x faster at 4 / 8 / 16 rows, 0.99x at 1 (medians of 5 runs
// alternating, 2-core Zen 5, 2026-11-28), as decoding.forward.kernels' panels read theirs
constexpr int64_t PF = 16384;

inline int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case KQ4: return 24;
    case KQ6: return 40;
  }
  TORCH_CHECK(false, "quant: unsupported block kind ", kind, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, KQ4 = 12, KQ6 = 14)");
}

constexpr bool has_min(int64_t kind) { return kind == Q4_1 || kind == KQ4; }     // w = d q + m
constexpr bool f32_scales(int64_t kind) { return kind == KQ4 || kind == KQ6; }
constexpr bool byte_quants(int64_t kind) { return kind == Q8_0 || kind == KQ6; }  // else 4 bits

// a panel block: the 16 outputs' scales d (fp16, or f32 for the re-laid kinds), their offsets m
// (Q4_1, KQ4) or second-half scales (KQ6) after them, then the quants
inline int64_t scale_bytes(int64_t kind) { return f32_scales(kind) ? 128 : has_min(kind) ? 64 : 32; }
inline int64_t panel_block_bytes(int64_t kind) { return scale_bytes(kind) + (byte_quants(kind) ? 512 : 256); }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// where a block's quants start
inline int64_t quants_at(int64_t kind) { return f32_scales(kind) ? 8 : kind == Q4_1 ? 4 : 2; }

// quant k (0..31) of a block: Q4 0..15 (weights k < 16 in the low nibbles), Q8 -128..127, KQ6 -32..31
inline int gguf_quant(const uint8_t* b, int64_t kind, int k) {
  if (byte_quants(kind)) return (int8_t)b[quants_at(kind) + k];
  const uint8_t* qs = b + quants_at(kind);
  return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4;
}

// GGUF blocks [N, K / 32 * block bytes] -> panels [N / 16, K / 32 * panel bytes]: each block of
// 16 outputs keeps their d (and m) as fp16, and `place(quants, o, k, q)` puts quant k of output o
// where the kernel reading them wants it (quant.cpp and quant_q8.cpp order them differently)
template <typename Place>
at::Tensor pack_panels(const at::Tensor& w, int64_t kind, int64_t K, Place place) {
  const int64_t bb = block_bytes(kind), pbb = panel_block_bytes(kind), so = scale_bytes(kind);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / QK * bb && K % QK == 0 &&
              w.size(0) % P == 0, "quant pack: w [N, K / 32 * block bytes] uint8 with N a multiple of 16");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), nb = K / QK;
  at::Tensor out = at::zeros({N / P, nb * pbb}, wc.options());
  const uint8_t* W = wc.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / P, 1, [&](int64_t a, int64_t e) {
    for (int64_t pi = a; pi < e; ++pi)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* dst = O + pi * nb * pbb + b * pbb;
        for (int64_t o = 0; o < P; ++o) {
          const uint8_t* src = W + (pi * P + o) * nb * bb + b * bb;
          if (f32_scales(kind)) {
            std::memcpy(dst + 4 * o, src, 4);            // d (KQ6: first half's)
            std::memcpy(dst + 64 + 4 * o, src + 4, 4);   // m (KQ6: second half's d)
          } else {
            std::memcpy(dst + 2 * o, src, 2);                           // d
            if (kind == Q4_1) std::memcpy(dst + 32 + 2 * o, src + 2, 2);  // m
          }
          for (int k = 0; k < 32; ++k) place(dst + so, o, k, gguf_quant(src, kind, k));
        }
      }
  });
  return out;
}

// x [T, K] float32 and w as a pack makes it, [N / 16, K / 32 * panel bytes] uint8
inline void check_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K && K % QK == 0,
              op, ": float32 x [T, K] with K a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / QK * panel_block_bytes(kind) &&
              w.is_contiguous(), op, ": w as its pack makes it, [N / 16, K / 32 * panel bytes] uint8");
}

inline bool has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}
inline bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// isa: 0 auto, 1 AVX2, 2 AVX512 (with VNNI) (decoding/forward/quant.py: $SPECSTOP_QUANT_ISA)
inline int64_t resolve_isa(int64_t isa) {
  if (isa == 0) return has_avx512() ? 2 : 1;
  TORCH_CHECK(isa == 1 || isa == 2, "quant: isa must be 0 (auto), 1 (avx2) or 2 (avx512)");
  TORCH_CHECK(has_avx2(), "quant: the CPU lacks AVX2 / FMA / F16C");
  TORCH_CHECK(isa == 1 || has_avx512(), "quant: the CPU lacks AVX512 with VNNI");
  return isa;
}

}  // namespace specstop_quant

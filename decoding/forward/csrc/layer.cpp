// One Llama-family decoder layer of a step or a verify, on the kernels, in one call.
//
// The lean layer (decoding/forward/lean.py) calls eleven kernels a layer from Python; between
// them the interpreter and the dispatcher cost ~25-40 us a layer (a 30-layer step of tiny
// matrices takes ~2 ms), during which the weight stream stands still. Here the same kernels run
// in the same order on the same inputs, so the result is the lean layer's bit for bit:
// RMSNorm -> q/k/v (one linear) -> rotary -> the new keys and values written into the cache's
// buffer -> attention over the cached and new keys -> o -> residual + RMSNorm -> gate/up ->
// SiLU gate -> down -> residual.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops.h"
#include "segments.h"

namespace {

// A GGUF target's linear (uint8 panels, decoding/forward/quant.py): its op in the specstop_quant extension,
// through the dispatcher (built apart: it needs no AVX512). q: ggml kind, activations (1: q8), isa.
struct Quant {
  int64_t kind = 0, q8 = 0, isa = 0;
};

at::Tensor quant_lin(const at::Tensor& x, const at::Tensor& w, const Quant& q, const c10::optional<at::Tensor>& b) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const c10::optional<at::Tensor>&, int64_t);
  static const auto f32 = c10::Dispatcher::singleton().findSchemaOrThrow("specstop_quant::linear", "").typed<Sig>();
  static const auto q8 = c10::Dispatcher::singleton().findSchemaOrThrow("specstop_quant::linear_q8", "").typed<Sig>();
  return (q.q8 ? q8 : f32).call(x, w, q.kind, x.size(1), b, q.isa);
}

// bf16 on AMX tiles, fp32 on panels, a GGUF's blocks: the weight was packed for the one it runs on
at::Tensor lin(const at::Tensor& x, const at::Tensor& w, int64_t n, const Quant& q,
               const c10::optional<at::Tensor>& b = c10::nullopt) {
  if (w.scalar_type() == at::kByte) return quant_lin(x, w, q, b);
  return x.scalar_type() == at::kBFloat16 ? specstop::amx_linear(x, w, n, b) : specstop::panel_linear(x, w, n, b);
}

}  // namespace

namespace specstop {

// The layer around its attention: RMSNorm -> q/k/v -> rotary -> attend(q, k, v) -> o -> residual +
// RMSNorm -> gate/up -> SiLU gate -> down -> residual. B sequences of T rows each.
template <class Attend>
at::Tensor layer_around(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t B,
                        at::TensorList w, const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims,
                        double eps1, double eps2, Attend attend) {
  TORCH_CHECK(w.size() == 6 && (dims.size() == 7 || dims.size() == 13) && x.dim() == 2,
              "decoder_layer: 6 weights, 7 or 13 dims, x [B*T, C]");
  Quant q[4];
  if (dims.size() == 13)
    for (int i = 0; i < 4; ++i) q[i] = {dims[7 + i], dims[11], dims[12]};
  auto [x0, h] = add_rms_norm(x, c10::nullopt, w[0], eps1);
  auto [qs, k, v] = rope_qkv(lin(h, w[1], dims[3], q[0], qkv_bias), cos, sin, B, dims[1], dims[2]);
  const at::Tensor att = attend(qs, k, v);
  auto [x1, h1] = add_rms_norm(x, lin(att, w[2], dims[4], q[1]), w[3], eps2);
  return lin(silu_mul(lin(h1, w[4], dims[5], q[2])), w[5], dims[6], q[3]).add_(x1);
}

// x [B * T, C]; cos / sin [B * T, D]; kbuf / vbuf [B, KV, cap, D], the cached keys and values at
// [start, start + n) along cap, the T new ones written after them; mask [1 or B, 1, T, >= n + T]
// or none (a 1-token step); w: norm1, qkv, o, norm2, gate_up, down (the linears packed for their
// kernel); dims: B, H, KV, and the four linears' output widths (for GGUF blocks then their four
// ggml kinds, the activations' form (1: q8) and the instruction set: decoding/forward/quant.py).
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kbuf,
                         const at::Tensor& vbuf, int64_t start, int64_t n, const c10::optional<at::Tensor>& mask,
                         at::TensorList w, const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims,
                         double eps1, double eps2, double scale) {
  auto attend = [&](auto&&... a) { return row_attention(a..., scale); };
  return layer_around(x, cos, sin, dims[0], w, qkv_bias, dims, eps1, eps2, [&](auto& qs, auto& k, auto& v) {
    return attend_cached(qs, k, v, kbuf, vbuf, start, n, mask, attend);
  });
}

// Several requests' rows in one layer (decoding/batch/forward.py): x [R, C] stacked, request i's
// rows[i] rows in turn, its own buffers kbufs[i] / vbufs[i] [1, KV, cap, D] with ns[i] cached rows
// from starts[i], its own mask or none; dims as decoder_layer's with B = 1. The linears run once over
// all R rows (the weights read once a round); rotary and attention are per row, so request i's rows
// are decoder_layer's on its rows and buffers bit for bit.
at::Tensor decoder_layer_segments(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  at::TensorList kbufs, at::TensorList vbufs, at::IntArrayRef starts,
                                  at::IntArrayRef ns, at::IntArrayRef rows,
                                  const c10::List<c10::optional<at::Tensor>>& masks, at::TensorList w,
                                  const c10::optional<at::Tensor>& qkv_bias, at::IntArrayRef dims, double eps1,
                                  double eps2, double scale) {
  TORCH_CHECK(dims[0] == 1, "decoder_layer_segments: dims with B = 1");
  return layer_around(x, cos, sin, 1, w, qkv_bias, dims, eps1, eps2, [&](auto& qs, auto& k, auto& v) {
    return attend_segments(qs, k, v, kbufs, vbufs, starts, ns, rows, masks, x.size(0), [&](auto&&... a) {
      return row_attention(a..., scale);
    });
  });
}

}  // namespace specstop

TORCH_LIBRARY_FRAGMENT(specstop, m) {
  m.def("decoder_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kbuf, Tensor(b!) vbuf, int start, int n, "
        "Tensor? mask, Tensor[] w, Tensor? qkv_bias, int[] dims, float eps1, float eps2, float scale) -> Tensor");
  m.def("decoder_layer_segments(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "int[] starts, int[] ns, int[] rows, Tensor?[] masks, Tensor[] w, Tensor? qkv_bias, int[] dims, "
        "float eps1, float eps2, float scale) -> Tensor");
  m.def("decoder_stack_segments(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "int[] starts, int[] ns, int[] rows, Tensor?[] masks, Tensor[] w, Tensor?[] qkv_bias, int[] dims, "
        "float[] eps1, float[] eps2, float scale, int[] capture) -> (Tensor, Tensor[])");
  m.def("keep_rows(Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, int[] starts, int s, int[] kept) -> ()");
}
TORCH_LIBRARY_IMPL(specstop, CPU, m) {
  m.impl("decoder_layer", &specstop::decoder_layer);
  m.impl("decoder_layer_segments", &specstop::decoder_layer_segments);
  m.impl("decoder_stack_segments", &decoder_stack_segments<&specstop::decoder_layer_segments>);
  m.impl("keep_rows", &keep_rows);
}

// The kernels' entry points, for the ops that chain them (layer.cpp) without a trip through the
// dispatcher. Each is registered as a torch op too (specstop::<name>), documented where defined.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace specstop {

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                                const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& y, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t B, int64_t H, int64_t KV);
at::Tensor silu_mul(const at::Tensor& g);
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale);

}  // namespace specstop

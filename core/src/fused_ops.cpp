// flashdraft/ops.hpp: drafter building blocks on the engine's CUDA kernels or ATen.
#include <flashdraft/ops.hpp>

#include "cuda_ops.hpp"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include <ATen/CPUGeneratorImpl.h>

namespace flashdraft {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// silu(g) * u saving g and u only (the product and silu(g) are recomputed in the
// backward: two [tokens, ffn] tensors fewer than autograd's composite keeps).
struct SwiGLU : public torch::autograd::Function<SwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    if (cuda_ops::runs_on(g)) return cuda_ops::swiglu_forward(g, u);
    return at::silu(g) * u;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    const at::Tensor& dy = grads[0];
    if (cuda_ops::runs_on(g)) {
      auto [dg, du] = cuda_ops::swiglu_backward(g, u, dy);
      return {dg, du};
    }
    const at::Tensor sig = at::sigmoid(g);
    // d silu(g) / dg = sig * (1 + g * (1 - sig))
    return {dy * u * (sig * (1 + g * (1 - sig))), dy * (g * sig)};
  }
};

// RoPE saving only the tables. Forward halves y1 = x1 c - x2 s, y2 = x2 c + x1 s; so
// dx1 = dy1 c + dy2 s and dx2 = dy2 c - dy1 s, i.e. dy * cos + rotate_half^T(dy * sin)
// with rotate_half^T(v) = [v2, -v1].
struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    if (cuda_ops::rope_runs(x, cos, sin)) return cuda_ops::rope(x, cos, sin, /*transpose=*/false);
    const int64_t half = x.size(-1) / 2;
    return x * cos + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& cos = saved[0];
    const at::Tensor& sin = saved[1];
    const at::Tensor& dy = grads[0];
    if (cuda_ops::rope_runs(dy, cos, sin))
      return {cuda_ops::rope(dy, cos, sin, /*transpose=*/true), at::Tensor(), at::Tensor()};
    const at::Tensor ds = dy * sin;
    const int64_t half = ds.size(-1) / 2;
    return {dy * cos + at::cat({ds.narrow(-1, half, half), -ds.narrow(-1, 0, half)}, -1), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return Rope::apply(x, cos, sin); }

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, double theta, int64_t head_dim,
                                              at::ScalarType dtype) {
  const auto dopts = at::TensorOptions().dtype(at::kDouble).device(positions.device());
  const at::Tensor inv = at::pow(theta, -at::arange(0, head_dim, 2, dopts) / double(head_dim));
  const at::Tensor ang = positions.to(at::kDouble).unsqueeze(-1) * inv;  // [..., D/2]
  const at::Tensor full = at::cat({ang, ang}, -1);                       // [..., D]
  return {full.cos().to(dtype), full.sin().to(dtype)};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return SwiGLU::apply(gate, up); }

ParamMaker::ParamMaker(std::vector<std::pair<std::string, at::Tensor>>& params, uint64_t seed, uint64_t salt,
                       c10::Device device, c10::ScalarType dtype, double init_std)
    : params_(params),
      gen_(at::make_generator<at::CPUGeneratorImpl>(seed * 0x9E3779B97F4A7C15ULL + salt)),
      device_(device),
      dtype_(dtype),
      init_std_(init_std) {}

at::Tensor ParamMaker::linear(const std::string& name, int64_t out, int64_t in) {
  at::Tensor w = at::randn({out, in}, gen_, at::TensorOptions().dtype(at::kFloat)).mul_(init_std_);
  w = w.to(device_, dtype_).set_requires_grad(true);
  params_.emplace_back(name, w);
  return w;
}

at::Tensor ParamMaker::norm(const std::string& name, int64_t n) {
  at::Tensor w = at::ones({n}, at::TensorOptions().dtype(dtype_).device(device_)).set_requires_grad(true);
  params_.emplace_back(name, w);
  return w;
}

}  // namespace flashdraft

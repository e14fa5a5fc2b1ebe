// The unary logits of each row's selector candidates, h_r . W[c_rk], as one autograd op that
// takes their values from the top-Kc pass (computed there without a gradient) and gives the
// gradient with respect to h as sum_k g_rk W[c_rk]: an embedding bag over the LM head's rows,
// so no [R, Kc, H] tensor is made or saved. Header-only (the plugin and its test include it).
// Served logits (the drafter's output_multiplier s and final_logit_softcapping c): the values
// are c tanh(s h.W / c), and the gradient takes their slope s (1 - (value / c)^2) first.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

namespace flashdraft::dflash2 {

class CandidateLogits : public torch::autograd::Function<CandidateLogits> {
 public:
  // hidden [R, H] (differentiable), values [R, Kc] = hidden W[candidates]^T as served (scale,
  // cap), weight [V, H] (frozen), candidates [R, Kc] int64: returns values, with the gradient
  // of hidden.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& values,
                            const at::Tensor& weight, const at::Tensor& candidates, double scale, double cap) {
    (void)hidden;
    ctx->save_for_backward({weight, candidates, cap > 0 ? values : at::Tensor()});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cap"] = cap;
    return values.clone();
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[0];
    const at::Tensor& candidates = saved[1];
    const int64_t K = candidates.size(1);
    const double scale = ctx->saved_data["scale"].toDouble(), cap = ctx->saved_data["cap"].toDouble();
    at::Tensor slope = grads[0].to(at::kFloat);
    if (cap > 0) {
      const at::Tensor t = saved[2].to(at::kFloat) / cap;
      slope = slope * (1 - t * t);
    }
    if (scale != 1.0) slope = slope * scale;
    const at::Tensor g = slope.to(weight.scalar_type()).reshape({-1}).contiguous();
    const at::Tensor offsets = at::arange(0, candidates.numel(), K, candidates.options());
    const at::Tensor grad_hidden =
        std::get<0>(at::embedding_bag(weight, candidates.reshape({-1}), offsets, false, /*mode sum*/ 0, false, g));
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The op: candidate_logits(hidden, values, weight, candidates[, scale, cap]).
inline at::Tensor candidate_logits(const at::Tensor& hidden, const at::Tensor& values, const at::Tensor& weight,
                                   const at::Tensor& candidates, double scale = 1.0, double cap = 0.0) {
  return CandidateLogits::apply(hidden, values, weight, candidates, scale, cap);
}

}  // namespace flashdraft::dflash2

// Qwen3.5's Gated DeltaNet token mixer (transformers' Qwen3_5GatedDeltaNet), frozen: the hf target's
// linear-attention layers of Qwen3.5 and Qwen3-Next (recurrent.hpp: the forward, verification and served cache
// written over these hooks). ATen's ops, on the CPU and on CUDA alike, with transformers' roundings:
//   [qkv | z | b | a] = h W_in^T                       (one product; the checkpoint's four projections)
//   qkv = silu(causal depthwise conv1d(qkv, conv))      (linear_conv_kernel_dim taps, zero history)
//   q, k = l2norm per head (float32), q / sqrt(d_k); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
//   S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t^T k_t))^T,  o_t = S_t^T q_t    (the gated delta rule,
//         S' = exp(g_t) S_{t-1}; computed in chunks of 64 positions as transformers' torch path does)
//   o = RMSNorm(o) w * silu(z) per value head; out = o W_out^T (by the caller: the layer's o_proj)
// Its state's keys are the l2-normed k, its values the delta rule's new values beta (v - S'^T k).
#pragma once

#include "recurrent.hpp"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace flashdraft::hf {

class GatedDeltaNet final : public Recurrent {
 public:
  at::Tensor in_proj;  // [2 Hk Dk + Hv Dv + Hv Dv + 2 Hv, H]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  at::Tensor neg_A;    // [Hv] float32: -exp(A_log)
  at::Tensor dt_bias;  // [Hv], the model's dtype
  at::Tensor norm;     // [Dv], the model's dtype (the gated RMSNorm's weight, applied as w, not 1 + w)
  int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  double eps = 1e-6;

  // (recurrent.hpp) rest: z, b, a; the run's out [B, T, Hv, Dv]
  Projected project(const at::Tensor& h) const override;
  RuleRun rule(const at::Tensor& u, const Projected& p, const at::Tensor& initial, const at::Tensor& capture,
               bool every_chunk) const override;
  at::Tensor finish(const at::Tensor& out, const Projected& p) const override;
  std::vector<int64_t> state_shape() const override { return {v_heads, k_dim, v_dim}; }
  int64_t width() const override { return v_heads * v_dim; }
  const char* name() const override { return "Gated DeltaNet"; }
};

}  // namespace flashdraft::hf

// Qwen3.5's Gated DeltaNet token mixer (transformers' Qwen3_5GatedDeltaNet), frozen: the hf target's
// linear-attention layers. ATen's ops, on the CPU and on CUDA alike, with transformers' roundings:
//   [qkv | z | b | a] = h W_in^T                       (one product; the checkpoint's four projections)
//   qkv = silu(causal depthwise conv1d(qkv, conv))      (linear_conv_kernel_dim taps, zero history)
//   q, k = l2norm per head (float32), q / sqrt(d_k); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
//   S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t^T k_t))^T,  o_t = S_t^T q_t    (the gated delta rule,
//         S' = exp(g_t) S_{t-1}; computed in chunks of 64 positions as transformers' torch path does)
//   o = RMSNorm(o) w * silu(z) per value head; out = o W_out^T (by the caller: the layer's o_proj)
// The recurrence runs over each document of a row on its own (a packed row's conversations, then its
// padding), so no state or convolution history crosses a document's start.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace flashdraft::hf {

struct GatedDeltaNet {
  at::Tensor in_proj;   // [2 Hk Dk + Hv Dv + Hv Dv + 2 Hv, H]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  at::Tensor conv;      // [2 Hk Dk + Hv Dv, taps], the model's dtype
  at::Tensor neg_A;     // [Hv] float32: -exp(A_log)
  at::Tensor dt_bias;   // [Hv], the model's dtype
  at::Tensor norm;      // [Dv], the model's dtype (the gated RMSNorm's weight, applied as w, not 1 + w)
  int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  double eps = 1e-6;
  bool defined() const { return in_proj.defined(); }
};

// The mixer's output before out_proj, [B, S, Hv Dv] in h's dtype, for h [B, S, H] (the layer's
// normed input); documents[b]: the lengths of row b's documents in order (positions past their sum
// run as one more document).
at::Tensor gated_delta_mix(const GatedDeltaNet& w, const at::Tensor& h,
                           const std::vector<std::vector<int64_t>>& documents);

// The gated delta rule over q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] (one document a
// row, from a zero state): [B, T, Hv, Dv] in v's dtype. In float32, in chunks of 64 positions.
at::Tensor chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta);

}  // namespace flashdraft::hf

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

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace flashdraft::hf {

struct GatedDeltaNet {
  at::Tensor in_proj;  // [2 Hk Dk + Hv Dv + Hv Dv + 2 Hv, H]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  at::Tensor conv;     // [2 Hk Dk + Hv Dv, taps], the model's dtype
  at::Tensor neg_A;    // [Hv] float32: -exp(A_log)
  at::Tensor dt_bias;  // [Hv], the model's dtype
  at::Tensor norm;     // [Dv], the model's dtype (the gated RMSNorm's weight, applied as w, not 1 + w)
  int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  double eps = 1e-6;
  bool fused = true;  // the rule on the engine's kernels where they run ([target] kernels = "engine")
  bool defined() const { return in_proj.defined(); }
};

// The mixer's output before out_proj, [B, S, Hv Dv] in h's dtype, for h [B, S, H] (the layer's
// normed input); documents[b]: the lengths of row b's documents in order (positions past their sum
// run as one more document).
at::Tensor gated_delta_mix(const GatedDeltaNet& w, const at::Tensor& h,
                           const std::vector<std::vector<int64_t>>& documents);

// Target verification's mixer (model.hpp Target::verify): over the context hc [B, S, H] (the layer's normed input;
// documents as gated_delta_mix) and over blocks hb [B, N BS, H], block n of row b continuing its document from
// position anchors[b][n] ([B, N] int64, host; its first token at that position) from the state and convolution
// inputs after the tokens before it, each block alone. Returns the context's and the blocks' outputs before
// out_proj, [B, S, Hv Dv] and [B, N BS, Hv Dv].
std::pair<at::Tensor, at::Tensor> gated_delta_verify(const GatedDeltaNet& w, const at::Tensor& hc,
                                                     const std::vector<std::vector<int64_t>>& documents,
                                                     const at::Tensor& anchors, const at::Tensor& hb, int64_t BS);

// One Gated DeltaNet layer's state in served decoding, per row: the recurrent state and the
// convolution's last inputs at the row's committed position, and what rolls them forward to any
// position the last call ran (its start state of the chunk holding the row's last real token, that
// chunk's keys, new values and log decays, and the convolution's inputs around it). Each call first
// commits every row to its start (a position the last call ran for it, up to its real tokens; 0: a
// new sequence), so that a verification's rejected tokens never enter the state: what a server does,
// and what transformers' cache does not (DynamicCache's crop leaves the recurrent state as the last
// forward left it).
class GatedDeltaCache {
 public:
  GatedDeltaCache(const GatedDeltaNet& w, int64_t batch, c10::ScalarType dtype, c10::Device device);
  // The mixer's output before out_proj [B, T, Hv Dv] for h [B, T, H] (the layer's normed input) at
  // positions start[b] + t; row b's real tokens its first real[b].
  at::Tensor forward(const at::Tensor& h, const std::vector<int64_t>& start, const std::vector<int64_t>& real);

 private:
  void commit(const std::vector<int64_t>& start);
  const GatedDeltaNet& w_;
  int64_t batch_, taps_;
  at::Tensor state_, history_;        // committed: [B, Hv, Dk, Dv] float32, [B, taps - 1, C]
  std::vector<int64_t> base_, real_;  // the last call's start and real tokens per row (-1: none yet)
  at::Tensor chunk_state_, keys_, new_values_, log_decay_, inputs_;  // what rolls a row forward (see above)
  std::vector<int64_t> chunk_start_;  // per row: its captured chunk's first position in the last call
};

}  // namespace flashdraft::hf

// Mamba-2's token mixer (transformers' GraniteMoeHybridMambaLayer, its torch path), frozen: the hf target's Mamba-2
// layers of Granite 4.0-H (recurrent.hpp: the forward, verification and served cache written over these hooks).
// ATen's ops, on the CPU and on CUDA alike, with transformers' roundings:
//   [z | xBC | dt] = h W_in^T (+ bias)                  (d_inner, d_inner + 2 G N, heads)
//   xBC = silu(causal depthwise conv1d(xBC) + conv bias)   (mamba_d_conv taps, zero history); x, B, C its parts
//   dt = clamp(softplus(dt + dt_bias), time_step_limit)    (the model's dtype), then float32
//   S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,  y_t = S_t^T C_t + D x_t      (per head: a state [N, P];
//         A = -exp(A_log); B, C shared by the heads of a group; float32, in chunks of mamba_chunk_size)
//   o = w * RMSNorm_per_group(y * silu(z)) in float32, rounded; out = o W_out^T (by the caller: the layer's o_proj)
// Its state's keys are B (a head's group's), its values dt x, its log decays the cumulative dt A.
#pragma once

#include "recurrent.hpp"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace flashdraft::hf {

class Mamba2 final : public Recurrent {
 public:
  at::Tensor in_proj, in_bias;  // [d_inner + d_inner + 2 G N + heads, H] ([z | xBC | dt] rows), its bias (or none)
  at::Tensor neg_A;             // [heads] float32: -exp(A_log)
  at::Tensor dt_bias, D, norm;  // [heads], [heads], [d_inner], the model's dtype
  int64_t heads = 0, head_dim = 0, groups = 0, state = 0;
  double dt_min = 0, dt_max = std::numeric_limits<double>::infinity(), eps = 1e-6;

  // (recurrent.hpp) rest: z, dt; the run's out [B, T, heads head_dim] float32
  Projected project(const at::Tensor& h) const override;
  RuleRun rule(const at::Tensor& u, const Projected& p, const at::Tensor& initial, const at::Tensor& capture,
               bool every_chunk) const override;
  at::Tensor finish(const at::Tensor& out, const Projected& p) const override;
  std::vector<int64_t> state_shape() const override { return {heads, state, head_dim}; }
  int64_t width() const override { return heads * head_dim; }
  const char* name() const override { return "Mamba-2"; }
};

}  // namespace flashdraft::hf

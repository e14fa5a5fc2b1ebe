// The decoder blocks of the Llama / Qwen3 family as drafters build them: the attention
// block's projections (q/k/v with Qwen3's optional per-head q/k RMSNorm and rotate-half RoPE,
// GQA heads, the output projection) and the SwiGLU MLP. The attention itself runs through the
// engine (AttentionContext::attention), so a drafter keeps its own keys and values: DFlash
// puts the context's before its block's, EAGLE-3 its earlier unroll steps', a served decoder
// its cache's. Differentiable ATen ops and the engine's fused ones (ops.hpp: rope, swiglu).
#pragma once

#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace flashdraft::layers {

// RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * w, normalised in float32 for
// 16-bit types, the weight applied in x's dtype (ATen's rms_norm: one fused kernel each way
// on CUDA).
FLASHDRAFT_API at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// [B, T, heads * D] -> [B, heads, T, D] (a view).
FLASHDRAFT_API at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim);
// [B, heads, T, D] -> [B, T, heads * D].
FLASHDRAFT_API at::Tensor merge_heads(const at::Tensor& a);

struct FLASHDRAFT_API SelfAttention {
  at::Tensor q_proj, k_proj, v_proj, o_proj;  // [heads D, in], [kv_heads D, in] x 2, [out, heads D]
  at::Tensor q_norm, k_norm;                  // [D] (Qwen3); undefined: no per-head norm (Llama)
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6;
  // x [B, T, in] with RoPE tables cos, sin broadcasting against [B, heads, T, D]:
  at::Tensor queries(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;  // [B, heads, T, D]
  at::Tensor keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;     // [B, kv_heads, T, D]
  at::Tensor values(const at::Tensor& x) const;                                                 // [B, kv_heads, T, D]
  // The attention's output a [B, heads, T, D] through o_proj: [B, T, out].
  at::Tensor output(const at::Tensor& a) const;
};

struct FLASHDRAFT_API SwiGluMlp {
  at::Tensor gate_proj, up_proj, down_proj;  // [I, H] x 2, [H, I]
  // down(silu(gate x) * up x), the product through ops.hpp's swiglu.
  at::Tensor operator()(const at::Tensor& x) const;
};

}  // namespace flashdraft::layers

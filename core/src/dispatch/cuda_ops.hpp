// Tensor-level entry points of the engine's CUDA kernels (core/cuda/engine_ops.cuh): shapes,
// dtypes and devices checked here, the kernels launched on the current stream of the
// tensors' device. Where the engine was built without them (no CUDA in LibTorch, no nvcc),
// cuda_ops_built() is false and every other call throws a sentence saying so; callers
// choose the plain ATen version first.
#pragma once

#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>

#include <string>

namespace flashdraft::cuda_ops {

// Whether this engine was built with its CUDA kernels.
FLASHDRAFT_API bool cuda_ops_built();
// Whether the kernels can run on `t` (built, CUDA tensor, float32/bfloat16/float16).
FLASHDRAFT_API bool runs_on(const at::Tensor& t);
// Whether the frozen decoder kernels launch with programmatic dependent launch on `device`
// (a CUDA device of compute capability 9.0 or later, FLASHDRAFT_PDL not 0; engine_ops.cuh).
FLASHDRAFT_API bool programmatic_launch(const c10::Device& device);

// The LM-head cross-entropy row pass over `logits` [rows, V] (modified in place when
// write_grad): see engine_ops.cuh. Returns nll [rows] float32 and argmax [rows] int64.
struct CeRows {
  at::Tensor nll, argmax;
};
FLASHDRAFT_API CeRows ce_rows(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_weights,
                              double grad_scale, bool write_grad);
// The soft-label loss's row pass (engine_ops.cuh kl_rows): per row KL(softmax(target / T) ||
// softmax(draft)), both argmaxes, and (write_grad) the gradient written over `draft`.
struct KlRows {
  at::Tensor kl, argmax, target_argmax;
};
// target_rows (optional [rows] int64): row r's target logits are target[target_rows[r]].
FLASHDRAFT_API KlRows kl_rows(at::Tensor& draft, const at::Tensor& target, const at::Tensor& target_rows,
                              double temperature, const at::Tensor& row_weights, double grad_scale, bool write_grad);

// The loss against given distributions (engine_ops.cuh prob_rows): per row -sum p log
// softmax(draft), both argmaxes (p's: target_argmax), and (write_grad) the gradient written
// over `draft`. probs float32 [rows or indexed, V]; prob_rows as target_rows above.
struct ProbRows {
  at::Tensor ce, argmax, target_argmax;
};
FLASHDRAFT_API ProbRows prob_rows(at::Tensor& draft, const at::Tensor& probs, const at::Tensor& prob_rows,
                                  const at::Tensor& row_weights, double grad_scale, bool write_grad);

FLASHDRAFT_API at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
// Returns {d_gate, d_up}.
FLASHDRAFT_API std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate, const at::Tensor& up,
                                                                 const at::Tensor& dy);

// RoPE (rotate-half) of x [B, H, T, D] with tables cos, sin [Bt, 1, T, D] (Bt = 1 or B,
// contiguous, x's dtype); transpose: the backward. rope_runs: whether the kernel takes them.
FLASHDRAFT_API bool rope_runs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
FLASHDRAFT_API at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transpose);

// A frozen decoder layer's steps with transformers' rounding (engine_ops.cuh). x [..., H] and
// sum with rows at one stride (row_stride: a slice of a wider buffer will do), delta
// contiguous; returns out (contiguous), and writes x + delta into `sum` (may be x) when delta
// is defined.
FLASHDRAFT_API int64_t row_stride(const at::Tensor& t);  // -1: t is not rows at one stride
FLASHDRAFT_API at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& sum,
                                       const at::Tensor& w, double eps);
// qkv [B, T, (Hq + 2 Hkv) D] -> {q [B, Hq, T, D], k, v [B, Hkv, T, D]}; norms [D] or undefined;
// tables [Bt, T, R] or [Bt, 1, T, R] (Bt = 1 or B, R even, R <= D: the first R dimensions of a
// head rotate) in qkv's dtype.
struct Qkv {
  at::Tensor q, k, v;
};
FLASHDRAFT_API Qkv qkv_rope(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm,
                            const at::Tensor& k_norm, double eps, const at::Tensor& cos, const at::Tensor& sin);
// gate_up [..., 2 I] -> [..., I].
FLASHDRAFT_API at::Tensor swiglu_packed(const at::Tensor& gate_up);
FLASHDRAFT_API at::Tensor gelu_tanh_packed(const at::Tensor& gate_up);
// rows [T k, H] contiguous, weights [T, k] in rows' dtype or float32, slot [T, k] int64 -> [T, H]
// (engine_ops.cuh's combine_experts).
FLASHDRAFT_API at::Tensor combine_experts(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& slot);
// gate_up [rows, 2 I] contiguous, bias [E, 2 I] of its dtype and expert [rows] int64 (or both
// undefined) -> [rows, I] (engine_ops.cuh's clamped_glu).
FLASHDRAFT_API at::Tensor clamped_glu(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert,
                                      double alpha, double limit);
// blocks [..., G, 16] uint8 and scales [..., G] uint8 on CUDA, contiguous -> [..., 32 G] in `dtype`
// (engine_ops.cuh's dequantize_mxfp4).
FLASHDRAFT_API at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, c10::ScalarType dtype);
// swiglu_packed(x w^T) in one Hopper kernel, the [..., 2 I] product never written (x [..., K]
// contiguous, w [2 I, K] contiguous, gate rows first); linear_swiglu_applies says whether it
// runs here: a compute capability 9.0 device, bf16, K % 64 == 0, I % 128 == 0, 16-byte aligned.
FLASHDRAFT_API bool linear_swiglu_applies(const at::Tensor& x, const at::Tensor& w);
FLASHDRAFT_API bool linear_swiglu_device(const c10::Device& device);  // a device where the kernel runs (some shapes)
// major * 10 + minor of a CUDA device (0: not a CUDA device, or none here)
FLASHDRAFT_API int compute_capability(const c10::Device& device);
FLASHDRAFT_API at::Tensor linear_swiglu(const at::Tensor& x, const at::Tensor& w);

// The gated delta rule in chunks of 64 (engine_ops.cuh's gated_delta_chunks): q, k [N, T, 128], v [N, T,
// 128], g, beta [N, T], initial [N, 128, 128] or undefined, float32 contiguous CUDA, T % 64 == 0 -> out
// [N, T, 128] and the final state [N, 128, 128]; gated_delta_runs says whether the widths are the
// kernels' (and the tensors on CUDA).
struct GatedDelta {
  at::Tensor out, state;
};
FLASHDRAFT_API bool gated_delta_runs(const at::Tensor& k, const at::Tensor& v);
FLASHDRAFT_API GatedDelta gated_delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial);

// Mamba-2's state-space rule in chunks of 64 (engine_ops.cuh's ssd_chunks): q, k [B, T, G, 128], v [B, T, H, P]
// (P a multiple of 32, H a multiple of G), g [B, T, H], initial [B, H, 128, P] or undefined, float32 contiguous CUDA
// -> out [B, T, H, P]; ssd_runs says whether the widths are the kernels' (and the tensors on CUDA).
FLASHDRAFT_API bool ssd_runs(const at::Tensor& k, const at::Tensor& v);
FLASHDRAFT_API at::Tensor ssd_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                     const at::Tensor& initial);

// One AdamW update of `param` (16-bit or float32) from its gradient, with float32 master
// weights and moments (master may be param itself for float32), see engine_ops.cuh.
// step: float32 device scalar counting this update; grad_scale, skip: float32 device
// scalars or undefined.
struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
};
FLASHDRAFT_API void adamw_mixed(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& master,
                                const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const AdamWHyper& h,
                                const at::Tensor& step, const at::Tensor& grad_scale, const at::Tensor& skip);

}  // namespace flashdraft::cuda_ops

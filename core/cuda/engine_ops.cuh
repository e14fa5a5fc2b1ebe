// The engine's own CUDA kernels (not attention: that is the flash_cuda plugin's): the
// LM-head cross-entropy's row pass, SwiGLU forward and backward, and the mixed-precision
// AdamW update. This header is the host API, plain C++ (no LibTorch, no device code), so
// core/src/dispatch/cuda_ops.cpp includes it from a .cpp; the launchers take raw pointers and the
// stream, and every launch is checked (a failed launch throws std::runtime_error naming
// the kernel and CUDA's error string).
//
// Built into the static library flashdraft_cuda_ops (core/cuda/CMakeLists.txt) for sm_80,
// sm_90 and sm_120 SASS plus compute_120 PTX, when LibTorch has CUDA and nvcc exists.
// Checked against plain ATen references on fresh random inputs by tests/test_cuda_ops.cpp
// (on a GPU; the tests skip elsewhere).
#pragma once

#include <cstdint>

namespace flashdraft::cuda_ops {

enum class DType { f32 = 0, bf16 = 1, f16 = 2 };

// ---- LM-head cross-entropy, one pass per row over logits already in memory ----------
// For each row r of logits [rows, vocab] (row stride `ld` elements, 16-bit or float32):
//   lse_r    = log sum_v exp(x_rv)                         (float32, natural log)
//   nll_r    = lse_r - x_r,label_r                         (NaN for a label outside 0..V-1)
//   argmax_r = the first v with the largest x_rv           (int64, as at::argmax)
// and, when `write_grad`, overwrites the row IN PLACE with the gradient of
//   sum_r w_r nll_r * grad_scale   with respect to the logits:
//   (softmax_rv - [v == label_r]) * w_r * grad_scale, rounded to the logits' dtype.
// One CTA per row; the row is read twice (statistics, then the gradient), the second time
// mostly from L2, and written once. `row_weight` may be null when !write_grad.
void ce_rows(DType dtype, void* logits, int64_t rows, int64_t vocab, int64_t ld, const int64_t* labels,
             const float* row_weight, float grad_scale, bool write_grad, float* nll, int64_t* argmax, void* stream);

// ---- The soft-label loss (labels from a target's distribution), one pass per row pair ----
// For each row r of draft logits [rows, vocab] (stride ld) and its target logits (row
// target_rows[r] of `target`, stride ld_target; target_rows null: row r),
// p = softmax(target / temperature), q = softmax(draft):
//   kl_r            = sum_v p_v (log p_v - log q_v)          (float32, nats)
//   argmax_r        = the first v with the largest draft logit
//   target_argmax_r = the first v with the largest target logit
// and, when `write_grad`, overwrites the DRAFT row in place with the gradient of
// sum_r w_r kl_r * grad_scale with respect to the draft logits: (q_v - p_v) w_r grad_scale.
void kl_rows(DType dtype, void* draft, const void* target, const int64_t* target_rows, int64_t rows, int64_t vocab,
             int64_t ld, int64_t ld_target, float temperature, const float* row_weight, float grad_scale,
             bool write_grad, float* kl, int64_t* argmax, int64_t* target_argmax, void* stream);

// ---- The loss against given distributions (soft labels over the LM head's vocabulary) ----
// For each row r of draft logits [rows, vocab] (stride ld) and its distribution (row
// prob_rows[r] of the float32 `probs`, stride ld_probs; prob_rows null: row r), q = softmax(draft):
//   ce_r            = -sum_v p_v log q_v                     (float32, nats)
//   argmax_r        = the first v with the largest draft logit
//   target_argmax_r = the first v with the largest p_v
// and, when `write_grad`, overwrites the DRAFT row in place with the gradient of
// sum_r w_r ce_r * grad_scale with respect to the draft logits: (q_v sum(p) - p_v) w_r grad_scale.
void prob_rows(DType dtype, void* draft, const float* probs, const int64_t* prob_rows, int64_t rows, int64_t vocab,
               int64_t ld, int64_t ld_probs, const float* row_weight, float grad_scale, bool write_grad, float* ce,
               int64_t* argmax, int64_t* target_argmax, void* stream);

// ---- SwiGLU: y = silu(g) * u, elementwise over n values (contiguous), in float32 math ----
void swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n, void* stream);
// d_gate = dy * u * sig * (1 + g * (1 - sig)),  d_up = dy * g * sig,  sig = sigmoid(g).
void swiglu_backward(DType dtype, const void* gate, const void* up, const void* dy, void* d_gate, void* d_up, int64_t n,
                     void* stream);

// ---- RoPE (rotate-half layout) over x [B, H, T, D] (contiguous), tables [Bt, T, D] with
// Bt = 1 (shared by the batch) or B, in x's dtype; float32 math, one rounding per value:
//   forward    y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2     (halves 1 = j < D/2, 2 = j >= D/2)
//   transpose  x1 = y1 c1 + y2 s2,   x2 = y2 c2 - y1 s1     (the backward: dx from dy)
// D must be a multiple of 2 x (16 / element size) and every pointer 16-byte aligned
// (rope_supported); `out` must not alias `x`.
bool rope_supported(DType dtype, int64_t D, const void* x, const void* cos, const void* sin, const void* out);
void rope(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t B, int64_t H, int64_t T,
          int64_t D, int64_t table_batch, bool transpose, void* stream);

// ---- Frozen decoder layers (an online target's forward), with transformers' rounding --------
// (decoder_ops.cu.) add_rms_norm, per row of x [rows, H] (row r at x + r * x_ld; delta and
// out contiguous, as every other tensor here):
//   s = round(x + delta) written to `sum` (row r at sum + r * sum_ld; it may alias x; delta
//   null: s = x, nothing written)
//   out = round(w * round(s * rsqrt(mean(s^2) + eps))), w of x's dtype; w_float (w float32, x
//   narrower: gpt-oss's norms): out = round(w * s * rsqrt(mean(s^2) + eps)), the product in float32
// Whether the kernels of this section launch with programmatic dependent launch on `device`
// (flashdraft/launch.cuh: compute capability 9.0 or later, FLASHDRAFT_PDL not 0).
bool programmatic_launch(int device);
int compute_capability(int device);  // major * 10 + minor (0: no such device)
void add_rms_norm(DType dtype, const void* x, int64_t x_ld, const void* delta, void* sum, int64_t sum_ld, const void* w,
                  bool w_float, void* out, int64_t rows, int64_t H, float eps, void* stream);
// The packed projection qkv [B, T, (Hq + 2 Hkv) D] (q heads, k heads, v heads) into q [B, Hq,
// T, D], k and v [B, Hkv, T, D]; q and k RMSNormed per head (as add_rms_norm, weights [D];
// null: no norm) and rotated: y_j = round(round(x_j c_j) + round(r_j s_j)), r = (-x2, x1)
// over the halves of each head's first R dimensions (R even, R <= D; R < D: a partial rotary
// factor, columns R..D-1 passed on, normed); tables cos, sin [Bt, T, R] (Bt = table_batch, 1 or
// B) in the dtype.
void qkv_rope(DType dtype, const void* qkv, const void* q_norm, const void* k_norm, float eps, const void* cos,
              const void* sin, int64_t table_batch, void* q, void* k, void* v, int64_t B, int64_t T, int64_t Hq,
              int64_t Hkv, int64_t D, int64_t R, void* stream);
// The packed projection gate_up [rows, 2 I] (gate, then up) into round(round(silu(g)) * u) [rows, I].
void swiglu_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream);
// The same GLU with GELU's tanh approximation of the gate (Gemma 3), ATen's gelu(gate, "tanh") * up roundings.
void gelu_tanh_packed(DType dtype, const void* gate_up, void* out, int64_t rows, int64_t I, void* stream);
// gpt-oss's clamped GLU: gate_up [rows, 2 I] (gate, then up), plus, where bias is not null, row r's
// expert's bias (bias [E, 2 I], expert [rows] int64) rounded in; g clamped above at limit, u within
// +-limit; out [rows, I] = round(round(u + 1) * round(g * round(sigmoid(round(g * alpha))))).
void clamped_glu(DType dtype, const void* gate_up, const void* bias, const int64_t* expert, void* out, int64_t rows,
                 int64_t I, float alpha, float limit, void* stream);
// A mixture of experts' rows [N, H] (in the experts' order) back to tokens: out[t] [tokens, H] =
// round(sum over j < k, in order, of round(rows[slot[t k + j]] * weights[t k + j])), the sum in
// float32, each product rounded to the dtype (transformers' weighted rows, then its sum over k);
// with float_weights the weights are float32 and the products are not rounded.
void combine_experts(DType dtype, const void* rows, const void* weights, bool float_weights, const int64_t* slot,
                     void* out, int64_t tokens, int64_t k, int64_t H, void* stream);
// MXFP4 (gpt-oss's experts) to the dtype: `groups` groups of 32 values, group g's 16 bytes at
// blocks + 16 g (two e2m1 codes a byte, the first value in the low nibble) and its power of two
// 2^(scales[g] - 127): out[32 g + j] = e2m1(code j) * 2^(scales[g] - 127) (exact in bf16 and float32).
void dequantize_mxfp4(DType dtype, const uint8_t* blocks, const uint8_t* scales, void* out, int64_t groups,
                      void* stream);

// ---- The gated delta rule in chunks of 64 (gated_delta.cu), float32 --------------------------
// Over `sequences` independent sequences of `chunks` chunks of 64 positions: q, k [sequences, 64
// chunks, 128] (l2-normed, q scaled), v [.., 128], g (log decays) and beta [sequences, 64 chunks],
// contiguous; from `initial` [sequences, 128, 128] (null: zeros), out [sequences, 64 chunks, 128]
// and, when not null, the state after the last chunk into final_state [sequences, 128, 128]. `work`:
// gated_delta_work_floats(sequences, chunks) floats of scratch (the chunks' systems and products).
bool gated_delta_supported(int64_t dk, int64_t dv);  // the key / value head widths the kernels take: 128, 128
size_t gated_delta_work_floats(int64_t sequences, int64_t chunks);
void gated_delta_chunks(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const float* initial, int64_t sequences, int64_t chunks, float* work, float* out,
                        float* final_state, void* stream);

// ---- Mamba-2's state-space rule in chunks of 64 (ssd.cu), float32 -------------------------------
// Over `rows` rows of T positions and `heads` heads in `groups` groups (heads / groups consecutive heads a group):
// q, k [rows, T, groups, 128] (a group's C and B), v [rows, T, heads, P] (dt x), g [rows, T, heads] (the log decays
// dt A), contiguous; from `initial` [rows, heads, 128, P] (null: zeros): out [rows, T, heads, P] with
// S_t = exp(g_t) S_{t-1} + k_t v_t^T, out_t = S_t^T q_t. `work`: ssd_work_floats(rows, groups, T) floats of scratch
// (each chunk's Q K^T).
bool ssd_supported(int64_t n, int64_t p);  // the state's width 128, value widths a multiple of 32
size_t ssd_work_floats(int64_t rows, int64_t groups, int64_t T);
void ssd_chunks(const float* q, const float* k, const float* v, const float* g, const float* initial, int64_t rows,
                int64_t T, int64_t heads, int64_t groups, int64_t P, float* work, float* out, void* stream);

// ---- The gate / up product with SwiGLU in its epilogue, on Hopper (gemm_sm90a.cu) ------------
// out [M, I] = round(round(silu(round(x Wg^T))) * round(x Wu^T)), x [M, K], W = [Wg; Wu] [2 I, K]
// (gate rows first; swiglu_packed(x W^T) with the product never written), bf16, float32
// accumulation, every pointer 16-byte aligned. Applies on compute capability 9.0 devices to bf16
// with K % 64 == 0 and I % 128 == 0; elsewhere the caller runs the product and swiglu_packed.
bool gate_up_swiglu_device(int device);  // a compute capability 9.0 device (and the driver's TMA encoder)
bool gate_up_swiglu_applies(DType dtype, int64_t M, int64_t K, int64_t I, int device);
void gate_up_swiglu(const void* x, const void* w, void* out, int64_t M, int64_t K, int64_t I, void* stream);

// ---- AdamW over one tensor with float32 master weights and moments -------------------
// The update of ATen's fused AdamW (torch.optim.AdamW(fused=True)), reading the 16-bit
// (or float32) gradient directly and writing the master and its rounded copy `param`:
//   g = grad / grad_scale (grad_scale null: 1);  w = master
//   w -= lr * weight_decay * w;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps);  master = w; param = w
// t = *step (float32 on the device, already counting this update). When `skip` is not
// null and *skip != 0 nothing is written (a non-finite loss or gradient norm, found on the
// device without a host read). `param` may alias `master` only when dtype is f32 (then
// pass param = master). n values, all contiguous.
struct AdamWArgs {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  const float* step = nullptr;        // device scalar
  const float* grad_scale = nullptr;  // device scalar or null
  const float* skip = nullptr;        // device scalar or null
};
void adamw_mixed(DType dtype, void* param, const void* grad, float* master, float* exp_avg, float* exp_avg_sq,
                 int64_t n, const AdamWArgs& args, void* stream);

}  // namespace flashdraft::cuda_ops

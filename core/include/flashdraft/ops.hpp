// Building blocks a drafter may use, with the engine's fused CUDA kernels behind them on
// CUDA tensors and plain ATen elsewhere (same function, so a drafter is written once).
// Each is differentiable and saves only its inputs for the backward.
#pragma once

#include <flashdraft/export.hpp>
#include <flashdraft/rope_scaling.hpp>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

// silu(gate) * up (SwiGLU's product), gate and up of one shape and dtype.
// CUDA (float32/bfloat16/float16): one fused kernel forward, one backward, float32
// arithmetic per value; elsewhere ATen's silu and products. The backward recomputes
// silu(gate) from the saved gate and up.
FLASHDRAFT_API at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// RoPE in the rotate-half layout: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
// for the halves x1, x2 of the last axis; cos/sin broadcast against x (rope_tables). The
// backward is the rotation by -angle (only the tables are saved). CUDA, x [B, H, T, D] with
// tables [1 or B, 1, T, D] in x's dtype: one fused kernel each way (float32 math); other
// shapes and devices: ATen's products and a cat.
FLASHDRAFT_API at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// cos and sin of the angles pos * theta^(-2i/D), i < D/2, duplicated over both halves:
// [*positions.sizes(), D] in `dtype`, on positions' device. Angles in float64, so large
// positions stay exact before the rounding to `dtype`.
FLASHDRAFT_API std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, double theta,
                                                             int64_t head_dim, at::ScalarType dtype);
// The inverse frequencies [dim / 2] of base theta over `dim` rotated dimensions, scaled by `s` (default, linear,
// llama3, yarn; longrope's two sets are the hf target's own), in float32 on the CPU as transformers computes them:
// 1 / theta^(2i / dim), then the scaling.
FLASHDRAFT_API at::Tensor rope_inv_freq(double theta, int64_t dim, const RopeScaling& s);
// rope_tables() of those frequencies: cos and sin of positions * inv_freq (in float64), duplicated over both halves,
// times `attention_factor`, in `dtype` on positions' device.
FLASHDRAFT_API std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                             double attention_factor, at::ScalarType dtype);

// Frozen decoder layers: an online target's forward (no gradient), the function of
// transformers' Llama / Qwen modules with the roundings of its separate ops. With `fused`
// (and CUDA tensors of float32 / bfloat16 / float16 that the kernels take) each is one engine
// kernel; otherwise the ATen ops transformers runs (the reference the kernels are checked
// against, on the CPU the only path).
namespace frozen {
// s = x + delta (delta undefined: s = x) and RMSNorm(s) = w * round(s * rsqrt(mean(s^2) + eps))
// normalised in float32: returns {s, normed}. s goes into `sum_into` when it is defined (x's
// shape; e.g. a slice of a wider buffer, rows at one stride; needs a delta), else into a new
// tensor. x may be such a slice too. A float32 w with a narrower x (gpt-oss's norms) is applied in
// float32, rounded once after it.
FLASHDRAFT_API std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                              const at::Tensor& w, double eps, bool fused = true,
                                                              const at::Tensor& sum_into = at::Tensor());
struct Qkv {
  at::Tensor q, k, v;  // [B, heads, T, D], [B, kv_heads, T, D] x 2, contiguous
};
// The packed projection qkv [B, T, (heads + 2 kv_heads) D] split into heads; q and k RMSNormed
// per head when q_norm / k_norm [D] are defined (Qwen3), then rotated (rotate-half RoPE,
// x cos + rotate_half(x) sin) with tables cos, sin [T, D], [Bt, T, D] or [Bt, 1, T, D] (Bt = 1
// or B) in qkv's dtype. Tables of R < D columns (a partial rotary factor: GLM-4.5) rotate each
// head's first R dimensions and pass the rest (normed, when the norms are defined). Norm weights in
// float32 on a narrower qkv (Qwen3.5's 1 + w) are applied in float32 and rounded once (ATen's ops).
FLASHDRAFT_API Qkv qkv_rope(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm,
                            const at::Tensor& k_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                            bool fused = true);
// x += a w^T (x [..., N] contiguous, a [..., K], w [N, K]) in place: the matrix product adds x in
// its epilogue (cuBLAS, beta = 1) instead of writing a w^T for a separate add pass. At the hf
// target's shapes cuBLAS rounds the product to x's dtype and then the sum, as transformers does
// (bf16, 3072 x 4096 x 4096 and x 12288 x 4096 on an H100: every value equal to x + linear(a, w));
// at some shapes its kernel rounds the sum once (closer to the exact sum). Returns false, touching
// nothing, where the engine's path does not take it (not fused, not CUDA, a dtype the kernels do
// not take, x not contiguous, or FLASHDRAFT_GEMM_ADD=0): the caller then adds the transformers way.
FLASHDRAFT_API bool add_linear_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& w, bool fused = true);
// The packed projection gate_up [..., 2 I] (gate first): silu(gate) * up, [..., I].
FLASHDRAFT_API at::Tensor swiglu_packed(const at::Tensor& gate_up, bool fused = true);
// The same with GELU's tanh approximation of the gate (Gemma 3's gelu_pytorch_tanh): gelu(gate, "tanh") * up.
FLASHDRAFT_API at::Tensor gelu_tanh_packed(const at::Tensor& gate_up, bool fused = true);
// swiglu_packed(linear(x, gate_up)) with gate_up [2 I, K] (gate rows first): cuBLAS's product and
// the separate pass. With FLASHDRAFT_GEMM_SWIGLU=1, on the engine's path on a compute capability
// 9.0 device (bf16, K % 64 == 0, I % 128 == 0), one kernel of the engine's runs the product with
// SwiGLU in its epilogue and never writes the [..., 2 I] product (the same roundings after the
// product; its summation order is its own). Off by default: on an H100 at Qwen3-8B's shape it is
// level with cuBLAS's product and the pass at best (1.01-1.04x their time in two calls), not
// faster.
FLASHDRAFT_API at::Tensor linear_swiglu(const at::Tensor& x, const at::Tensor& gate_up, bool fused = true);
// A product per group (the experts of a mixture of experts): rows [N, K] sorted by group, group g
// the rows ends[g - 1] .. ends[g] - 1 (ends: int32 [G], cumulative counts), times w[g]^T (w [G, N',
// K]): [N, N']. One grouped product (at::_grouped_mm, as transformers' default) where it runs: the
// CPU, and CUDA in bf16 on compute capability 8.0 and later, for rows of whole 16-byte multiples;
// elsewhere one product per group (reading ends on the host).
FLASHDRAFT_API at::Tensor grouped_linear(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& ends);
// A mixture of experts' output rows back to their tokens: rows [T k, H] in the experts' order,
// weights [T, k] (the router's, in rows' dtype or in float32), slot [T, k] int64 (the row of token
// t's j-th expert): [T, H] = the sum over j of rows[slot[t, j]] * weights[t, j] (each product
// rounded to rows' dtype where the weights are in it, kept in float32 where they are float32), in
// float32, rounded once (transformers' weighted rows, then its sum over k). On the engine's path
// one pass (the sum in the order j = 0 .. k - 1), else ATen's gather, product and sum.
FLASHDRAFT_API at::Tensor combine_experts(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& slot,
                                          bool fused = true);
// gpt-oss's experts' GLU: gate_up [rows, 2 I] (gate first), plus row r's expert's bias where bias
// [E, 2 I] and expert [rows] (int64) are defined (rounded to the dtype); gate clamped above at
// limit, up within +-limit: (up + 1) * gate * sigmoid(alpha gate), [rows, I], each op rounded as
// transformers' separate ops round it. On the engine's path one pass, else ATen's ops.
FLASHDRAFT_API at::Tensor clamped_glu(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert,
                                      double alpha, double limit, bool fused = true);
// MXFP4 (gpt-oss's published experts) to `dtype`: blocks [..., G, 16] uint8 (two e2m1 codes a byte,
// the first value in the low nibble), scales [..., G] uint8 (each group of 32 values' power of two,
// biased by 127) -> [..., 32 G], every value e2m1 x 2^(scale - 127) (exact in bf16 and float32;
// transformers' convert_moe_packed_tensors). On the engine's path (CUDA) one kernel, else ATen's
// ops a leading index at a time.
FLASHDRAFT_API at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, c10::ScalarType dtype,
                                           bool fused = true);
// The gated delta rule in its chunked form (Qwen3.5's / Qwen3-Next's Gated DeltaNet, chunks of 64
// positions), on the engine's path: q, k [N, T, 128] (l2-normed, q scaled), v [N, T, 128], g (the log
// decays) and beta [N, T], float32 contiguous on CUDA, T a multiple of 64, from `initial` [N, 128, 128]
// (undefined: zeros): {out [N, T, 128], the state after position T - 1}, float32, in two kernels
// (each chunk's triangular system and products at once, then the scan over the chunks), the
// arithmetic of transformers' torch_chunk_gated_delta_rule with float32 products and the kernels'
// own summation orders. Where it does not run (not fused, not CUDA, other widths or T) both are
// undefined: the caller runs ATen's ops, the reference.
FLASHDRAFT_API std::pair<at::Tensor, at::Tensor> gated_delta_chunks(const at::Tensor& q, const at::Tensor& k,
                                                                    const at::Tensor& v, const at::Tensor& g,
                                                                    const at::Tensor& beta,
                                                                    const at::Tensor& initial = at::Tensor(),
                                                                    bool fused = true);
// Mamba-2's state-space rule (the hf target's Mamba-2 layers) on the engine's path: per head h of each row, over
// positions t, S_t = exp(g_t) S_{t-1} + k_t v_t^T and out_t = S_t^T q_t, for q, k [B, T, G, 128] (a group's C and
// B, shared by H / G consecutive heads), v [B, T, H, P] (dt x; P a multiple of 32), g [B, T, H] (dt A) on CUDA, from
// `initial` [B, H, 128, P] (undefined: zeros): out [B, T, H, P] float32, in two kernels (each chunk's Q K^T once a
// group, then the scan over chunks of 64 positions) with float32 products and the kernels' own summation orders.
// Where it does not run (not fused, not CUDA, other widths; FLASHDRAFT_SSD=0, for measuring one against the other)
// undefined: the caller runs ATen's ops, the reference.
FLASHDRAFT_API at::Tensor ssd_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                     const at::Tensor& initial = at::Tensor(), bool fused = true);
// What runs these on `device` with `fused`, for logs: "the engine's CUDA kernels" (", launched
// with programmatic dependent launch" on sm_90 and later unless FLASHDRAFT_PDL=0; "; residual
// adds in the matrix products" unless FLASHDRAFT_GEMM_ADD=0; "; SwiGLU in the gate / up product" on
// compute capability 9.0 with FLASHDRAFT_GEMM_SWIGLU=1), or "transformers' ATen ops" (the
// CPU, a build without the kernels, or not fused).
FLASHDRAFT_API std::string kernels_on(const c10::Device& device, bool fused = true);
}  // namespace frozen

// A drafter's trainable tensors, made in order and appended to `params` under their names,
// each requiring grad: linear weights N(0, init_std^2), drawn in float32 from a generator of
// the drafter's own (seeded with seed * 0x9E3779B97F4A7C15 + salt, so the same run seed gives
// the same drafter whatever else drew from the global generator) and then cast; norm
// weights ones.
class FLASHDRAFT_API ParamMaker {
 public:
  ParamMaker(std::vector<std::pair<std::string, at::Tensor>>& params, uint64_t seed, uint64_t salt, c10::Device device,
             c10::ScalarType dtype, double init_std);
  at::Tensor linear(const std::string& name, int64_t out, int64_t in);
  at::Tensor norm(const std::string& name, int64_t n);

 private:
  std::vector<std::pair<std::string, at::Tensor>>& params_;
  at::Generator gen_;
  c10::Device device_;
  c10::ScalarType dtype_;
  double init_std_;
};

}  // namespace flashdraft

// dense_ref: the reference attention kernel. Every other kernel is checked against it.
//
// What it computes, per (batch b, query head h), with kv head g = h / (Hq / Hkv):
//   S = scale * Q_bh K_bg^T          [Lq, Lkv]  fp32 (inputs upcast)
//   S[q, k] = -inf where dense(mask)[b', h', q, k] is false (b' = 0 if the mask batch
//            is 1, else b; h' likewise for heads: a shared mask broadcasts)
//   m = rowmax(S) (0 for rows with no visible key), P~ = exp(S - m), l = rowsum(P~)
//   out = (P~ / l) V_bg (0 where l = 0), lse = m + log(l) (= -inf where l = 0)
// The whole Lq x Lkv score matrix is materialised: memory is O(B Hq Lq Lkv). That is
// the point: it is plain enough to trust, not fast.
//
// Backward: the forward above is recomputed under autograd from copies of q, k, v that
// require grad, and torch::autograd::grad gives dq, dk, dv (GQA sums over the heads of
// a group through the expand). Rows with no visible key have P = 0, so their gradients
// are 0: the masked scores never enter exp with a finite shift of -inf, hence no NaN.
//
// Runs on any device and dtype (math in fp32, results in the input dtype). Variant:
// "dense_ref" for both phases. Its check: tests/test_kernels_cpu.cpp compares it with a
// per-element loop (tiny case) and flash_cpu with it.
#include "common/attention_inputs.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <limits>
#include <optional>
#include <string>

namespace flashdraft {
namespace {

// Any device, dtype and head dim: the reference checks only the shape contract.
const kernel_inputs::Accepted kAccepted{"dense_ref", std::nullopt, {}, {}, ""};

// GQA: kv head g serves query heads g * group .. (g + 1) * group - 1.
at::Tensor expand_heads(const at::Tensor& t, int64_t heads_q) {
  const int64_t group = heads_q / t.size(1);
  if (group == 1) return t;
  return t.unsqueeze(2)
      .expand({t.size(0), t.size(1), group, t.size(2), t.size(3)})
      .reshape({t.size(0), heads_q, t.size(2), t.size(3)});
}

struct DenseResult {
  at::Tensor out, lse;  // fp32
};

// The forward of the header, in fp32, differentiable in qf, kf, vf.
DenseResult dense_attention(const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& vf,
                            const flashdraft::BlockMask& mask, double scale) {
  const int64_t hq = qf.size(1);
  const at::Tensor visible = flashdraft::dense(mask, qf.device());  // [mb, mh, Lq, Lkv], broadcasts
  at::Tensor s = at::matmul(qf, expand_heads(kf, hq).transpose(-2, -1)) * scale;
  s = s.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity());
  // The shift only stabilises exp; it carries no gradient (softmax is shift invariant).
  at::Tensor m = std::get<0>(s.max(-1, /*keepdim=*/true)).detach();
  m = m.masked_fill(at::isinf(m), 0.0);  // empty rows: all -inf, shift by 0 -> P~ = 0
  const at::Tensor p = at::exp(s - m);
  const at::Tensor l = p.sum(-1, /*keepdim=*/true);
  const at::Tensor empty = l.eq(0.0);
  const at::Tensor out = at::matmul(p / l.masked_fill(empty, 1.0), expand_heads(vf, hq));
  const at::Tensor lse = (m + at::log(l)).squeeze(-1);  // log(0) = -inf on empty rows
  return {out, lse};
}

class DenseRef : public flashdraft::AttentionKernel {
 public:
  explicit DenseRef(const flashdraft::Config&) {}
  static void declare(flashdraft::Schema&) {}

  Support supports(const AttentionProblem&) const override { return Support::yes(); }
  BlockSize block_size(const AttentionProblem&) const override { return {128, 128}; }

  AttentionForward forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMaskTensors& mask,
                           double scale) override {
    kernel_inputs::check_inputs(kAccepted, q, k, v, mask);
    if (k.size(2) == 0)  // no keys at all: every row is empty (a row max over nothing is undefined)
      return {at::zeros_like(q),
              at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(),
                       q.options().dtype(at::kFloat)),
              "dense_ref"};
    at::NoGradGuard no_grad;
    DenseResult r = dense_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), *mask.host, scale);
    return {r.out.to(q.scalar_type()).contiguous(), r.lse.contiguous(), "dense_ref"};
  }

  AttentionBackward backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const BlockMaskTensors& mask,
                             double scale) override {
    kernel_inputs::check_inputs(kAccepted, q, k, v, mask);
    kernel_inputs::check_backward_inputs(kAccepted, dout, out, lse, q);  // out and lse are checked, not read
    if (k.size(2) == 0) return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v), "dense_ref"};
    // The engine may call this from inside an autograd backward, where grad mode is off.
    at::AutoGradMode grad_on(true);
    const at::Tensor qf = q.detach().to(at::kFloat).requires_grad_(true);
    const at::Tensor kf = k.detach().to(at::kFloat).requires_grad_(true);
    const at::Tensor vf = v.detach().to(at::kFloat).requires_grad_(true);
    DenseResult r = dense_attention(qf, kf, vf, *mask.host, scale);
    const std::vector<at::Tensor> g = torch::autograd::grad({r.out}, {qf, kf, vf}, {dout.detach().to(at::kFloat)});
    return {g[0].to(q.scalar_type()).contiguous(), g[1].to(k.scalar_type()).contiguous(),
            g[2].to(v.scalar_type()).contiguous(), "dense_ref"};
  }
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(kernel, "dense_ref", "0.1.0",
                  "reference attention: dense fp32 scores, masked softmax, autograd backward", flashdraft::DenseRef)

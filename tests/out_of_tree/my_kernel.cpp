// A minimal attention kernel plugin: dense attention in a few LibTorch calls.
// It shows the whole contract: a table of options, supports() with a reason,
// the block size it wants its BlockMask at, forward with lse, backward, variants.
#include <flashdraft/attention.hpp>

// The ATen operators it calls, one header each (a plugin that includes <torch/torch.h> or
// <ATen/ATen.h> parses the whole API: 6-7 s per file on 2 cores instead of 3).
#include <ATen/TensorOperators.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

namespace {

using namespace flashdraft;

class MyKernel final : public AttentionKernel {
 public:
  explicit MyKernel(const Config& config) : max_len_(config.integer("max_len")) {}

  // Keys of [kernels.my_kernel] in the experiment file.
  static void declare(Schema& s) {
    s.integer("max_len", "longest key sequence accepted").def(int64_t(65536)).at_least(1);
  }

  Support supports(const AttentionProblem& p) const override {
    if (p.kv_len > max_len_)
      return Support::no("kv_len " + std::to_string(p.kv_len) + " exceeds max_len " + std::to_string(max_len_));
    return Support::yes();
  }
  BlockSize block_size(const AttentionProblem&) const override { return {64, 64}; }

  AttentionForward forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMaskTensors& mask,
                           double scale) override {
    auto [p, lse] = probabilities(q, k, mask, scale);
    return {at::matmul(p, widen(v, q)).to(q.scalar_type()), lse, "my_kernel/dense"};
  }

  AttentionBackward backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor&, const at::Tensor&, const BlockMaskTensors& mask,
                             double scale) override {
    auto [p, lse] = probabilities(q, k, mask, scale);
    const at::Tensor g = dout.to(at::kFloat), dp = at::matmul(g, widen(v, q).transpose(-1, -2));
    const at::Tensor ds = p * (dp - (dp * p).sum(-1, true)) * scale;  // softmax backward
    const int64_t groups = q.size(1) / k.size(1);
    auto fold = [&](const at::Tensor& t) {  // GQA: sum the query heads of each kv head
      return t.view({t.size(0), k.size(1), groups, t.size(2), t.size(3)}).sum(2).to(k.scalar_type());
    };
    return {at::matmul(ds, widen(k, q)).to(q.scalar_type()), fold(at::matmul(ds.transpose(-1, -2), q.to(at::kFloat))),
            fold(at::matmul(p.transpose(-1, -2), g)), "my_kernel/dense"};
  }

 private:
  static at::Tensor widen(const at::Tensor& kv, const at::Tensor& q) {
    return kv.to(at::kFloat).repeat_interleave(q.size(1) / kv.size(1), 1);
  }
  static std::pair<at::Tensor, at::Tensor> probabilities(const at::Tensor& q, const at::Tensor& k,
                                                         const BlockMaskTensors& mask, double scale) {
    const at::Tensor visible = dense(*mask.host).to(q.device());
    const at::Tensor s = (at::matmul(q.to(at::kFloat), widen(k, q).transpose(-1, -2)) * scale)
                             .masked_fill(visible.logical_not(), -INFINITY);
    const at::Tensor lse = at::logsumexp(s, -1);  // -inf for rows that see nothing
    const at::Tensor p = at::exp(s - at::where(at::isfinite(lse), lse, at::zeros_like(lse)).unsqueeze(-1));
    return {p, lse};
  }
  int64_t max_len_;
};

}  // namespace

FLASHDRAFT_PLUGIN(kernel, "my_kernel", "0.1.0", "example out-of-tree kernel: dense attention", MyKernel)

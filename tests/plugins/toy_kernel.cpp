// A test kernel: plain dense attention written out, nothing shared with dense_ref.
// Keys let tests provoke what the engine must catch:
//   backward_variant  a variant name the backward reports (e.g. "other/bwd": a fallback)
//   fallback_after    ... but only after this many backward calls with its own name
//   sleep_ms          a pause per forward call (to catch a run mid-way)
//   refuse_head_dim   head dim it refuses (to test selection)
#include <flashdraft/attention.hpp>

#include <torch/types.h>

#include <chrono>
#include <thread>

#ifndef TOY_KERNEL_NAME
#define TOY_KERNEL_NAME "toy_kernel"
#endif

namespace {

using namespace flashdraft;

class ToyKernel final : public AttentionKernel {
 public:
  explicit ToyKernel(const Config& c)
      : backward_variant_(c.string("backward_variant")),
        fallback_after_(c.integer("fallback_after")),
        sleep_ms_(c.integer("sleep_ms")),
        refuse_head_dim_(c.integer("refuse_head_dim")) {}
  static void declare(Schema& s) {
    s.string("backward_variant", "variant the backward reports (empty: its own)").def(std::string(""));
    s.integer("fallback_after", "backward calls before backward_variant is reported").def(int64_t(0)).at_least(0);
    s.integer("sleep_ms", "pause per forward call, milliseconds").def(int64_t(0)).range(0, 60000);
    s.integer("refuse_head_dim", "head dim to refuse (0: none)").def(int64_t(0)).at_least(0);
  }
  Support supports(const AttentionProblem& p) const override {
    if (refuse_head_dim_ && p.head_dim == refuse_head_dim_)
      return Support::no("head_dim " + std::to_string(p.head_dim) + " unsupported (configured to refuse it)");
    return Support::yes();
  }
  BlockSize block_size(const AttentionProblem&) const override { return {16, 16}; }

  AttentionForward forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMaskTensors& m,
                           double scale) override {
    if (sleep_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    auto [p, lse] = probs(q, k, m, scale);
    return {torch::matmul(p, expand(v, q)).to(q.scalar_type()), lse, std::string(TOY_KERNEL_NAME) + "/fwd"};
  }
  AttentionBackward backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor&, const at::Tensor&, const BlockMaskTensors& m, double scale) override {
    auto [p, lse] = probs(q, k, m, scale);
    const at::Tensor ve = expand(v, q), ke = expand(k, q), g = dout.to(torch::kFloat);
    const at::Tensor dp = torch::matmul(g, ve.transpose(-1, -2));
    const at::Tensor ds = p * (dp - (dp * p).sum(-1, true)) * scale;
    at::Tensor dq = torch::matmul(ds, ke), dk = torch::matmul(ds.transpose(-1, -2), q.to(torch::kFloat)),
               dv = torch::matmul(p.transpose(-1, -2), g);
    const int64_t groups = q.size(1) / k.size(1);
    auto fold = [&](const at::Tensor& t) {
      return t.view({t.size(0), k.size(1), groups, t.size(2), t.size(3)}).sum(2).to(k.scalar_type());
    };
    return {dq.to(q.scalar_type()), fold(dk), fold(dv),
            backward_variant_.empty() || backward_calls_++ < fallback_after_ ? std::string(TOY_KERNEL_NAME) + "/bwd"
                                                                             : backward_variant_};
  }

 private:
  static at::Tensor expand(const at::Tensor& kv, const at::Tensor& q) {
    return kv.to(torch::kFloat).repeat_interleave(q.size(1) / kv.size(1), 1);
  }
  std::pair<at::Tensor, at::Tensor> probs(const at::Tensor& q, const at::Tensor& k, const BlockMaskTensors& m,
                                          double scale) {
    const at::Tensor s = torch::matmul(q.to(torch::kFloat), expand(k, q).transpose(-1, -2)) * scale;
    const at::Tensor vis = dense(*m.host).to(q.device());
    const at::Tensor masked = s.masked_fill(vis.logical_not(), -std::numeric_limits<float>::infinity());
    const at::Tensor lse = torch::logsumexp(masked, -1);
    const at::Tensor safe = torch::where(torch::isfinite(lse), lse, torch::zeros_like(lse));
    const at::Tensor p = torch::exp(masked - safe.unsqueeze(-1));
    return {p, lse};
  }
  std::string backward_variant_;
  int64_t fallback_after_, backward_calls_ = 0, sleep_ms_, refuse_head_dim_;
};

}  // namespace

FLASHDRAFT_PLUGIN(kernel, TOY_KERNEL_NAME, "0.1.0", "test kernel: plain dense attention", ToyKernel)

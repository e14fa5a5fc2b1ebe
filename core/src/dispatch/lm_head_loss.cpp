// The LM-head cross-entropy variants (lm_head_loss.hpp).
#include "dispatch/lm_head_loss.hpp"

#include "dispatch/cuda_ops.hpp"
#include "dispatch/dtype_name.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/types.h>

#include <flashdraft/decoding.hpp>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>

namespace flashdraft {

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

std::string shape_of(const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("(undefined)"); }

// The chunked variant's backward: the gradients with respect to hidden (and a trained LM
// head) were computed in the forward (the loss is a scalar), so backward scales them by the
// incoming gradient.
struct ChunkedLossBackward final : public torch::autograd::Node {
  at::Tensor grad_hidden;  // [R, H], for a unit incoming gradient
  at::Tensor grad_weight;  // [V, H], when the LM head is trained (its edge is the second)
  std::function<void()> on_backward;
  bool released = false;

  std::string name() const override { return "flashdraft::ChunkedLmHeadLossBackward"; }
  void release_variables() override {
    grad_hidden.reset();
    grad_weight.reset();
    released = true;
  }

  variable_list apply(variable_list&& grads) override {
    if (released)
      throw std::runtime_error(
          "LM-head loss: backward ran a second time after its saved gradient was freed (pass "
          "retain_graph = true to the first backward to run it twice)");
    if (on_backward) on_backward();
    variable_list out;
    for (const at::Tensor* g : {&grad_hidden, &grad_weight})
      if (g->defined()) out.push_back(grads[0].defined() ? *g * grads[0].to(g->scalar_type()) : at::Tensor());
    return out;
  }
};

// One chunk of rows: the weighted loss sum, the argmaxes and (grad) the gradient of
// sum_r w_r loss_r / weight_sum with respect to the chunk's rows (grad_weight: and to the LM
// head). Labels are `labels`; or the soft targets softmax(target logits / temperature) with
// the target's logits rows `target.index_select(0, target_rows)` (loss_r = KL(p_r || q_r)); or
// given distributions, rows `probs.index_select(0, target_rows)` (loss_r = -sum p_r log q_r).
struct ChunkInput {
  at::Tensor h, weight, labels, w, target, probs, target_rows;
  double temperature = 1.0, inv_sum = 0.0;
  double scale = 1.0, cap = 0.0;  // LmHeadLossInput::logit_scale / logit_softcap
  bool grad = false, grad_weight = false;
  int64_t top_k = 0;
};
struct ChunkResult {
  at::Tensor loss_sum, argmax, target_argmax, grad, grad_weight, top_values, top_indices;
};

// The chunk's top-k logits and tokens (LmHeadLossInput::top_k), before anything reuses them.
void take_top_k(const at::Tensor& logits, int64_t k, ChunkResult& r) {
  if (k > 0) std::tie(r.top_values, r.top_indices) = at::topk(logits, k, -1, /*largest=*/true, /*sorted=*/true);
}
using ChunkFn = ChunkResult (*)(const ChunkInput& c);

// LmHeadLossInput's logit scale and cap on a chunk's LM-head products, in place: the logits as
// served_logits() makes them (the same ops in the products' dtype), and with a cap, t = tanh of
// the scaled products / cap (where the products were), which the gradient's slope needs.
at::Tensor serve_products(at::Tensor products, double scale, double cap, at::Tensor& t) {
  if (scale != 1.0) products.mul_(scale);
  if (!(cap > 0)) return products;
  t = products.div_(cap).tanh_();
  return t * cap;
}
// The gradient with respect to the products from that with respect to the served logits, in
// place: times scale (1 - t^2) (t: serve_products'; consumed).
void unserve_gradient(at::Tensor& g, double scale, double cap, at::Tensor& t) {
  if (cap > 0) g.mul_(t.mul_(t).neg_().add_(1));
  if (scale != 1.0) g.mul_(scale);
  t.reset();
}

// float32 log-softmax of 16-bit logits (ATen converts the input; its half_to_float path takes
// Half only).
at::Tensor log_softmax32(const at::Tensor& x) {
  const bool wide = x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble;
  return wide ? at::_log_softmax(x, -1, false) : at::log_softmax(x, -1, at::kFloat);
}

// chunked: logits, float32 log-softmax, gather, exp, scatter and scale in ATen.
ChunkResult chunk_loss_aten(const ChunkInput& c) {
  ChunkResult r;
  at::Tensor t;
  at::Tensor logits = serve_products(at::mm(c.h, c.weight.t()), c.scale, c.cap, t);  // [c, V], compute dtype
  take_top_k(logits, c.top_k, r);
  r.argmax = logits.argmax(-1);
  at::Tensor logp = log_softmax32(logits);
  logits.reset();
  at::Tensor p, lab, p_sum;
  if (c.probs.defined()) {
    p = c.probs.index_select(0, c.target_rows);
    r.target_argmax = p.argmax(-1);
    p_sum = p.sum(-1, /*keepdim=*/true);
    const at::Tensor ce = -(p * logp).sum(-1);
    r.loss_sum = (ce * c.w.to(ce.scalar_type())).sum();
  } else if (c.target.defined()) {
    const at::Tensor target = c.target.index_select(0, c.target_rows);
    r.target_argmax = target.argmax(-1);
    const at::Tensor logp_t =
        log_softmax32(c.temperature == 1.0 ? target : target.to(logp.scalar_type()) / c.temperature);
    p = logp_t.exp();
    const at::Tensor kl = (p * (logp_t - logp)).sum(-1);
    r.loss_sum = (kl * c.w.to(kl.scalar_type())).sum();
  } else {
    lab = c.labels.unsqueeze(1);
    const at::Tensor nll = -logp.gather(1, lab).squeeze(1);
    r.loss_sum = (nll * c.w.to(nll.scalar_type())).sum();
  }
  if (c.grad) {
    at::Tensor g = logp.exp_();  // softmax, in place
    logp.reset();
    if (p_sum.defined())
      g.mul_(p_sum).sub_(p);  // d(-sum p log q)/dz = q sum(p) - p
    else if (p.defined())
      g.sub_(p);
    else
      g.scatter_add_(1, lab, at::full({lab.size(0), 1}, -1.0, g.options()));
    g.mul_(c.w.to(g.scalar_type()).mul(c.inv_sum).unsqueeze(1));
    unserve_gradient(g, c.scale, c.cap, t);
    const at::Tensor gc = g.to(c.h.scalar_type());
    r.grad = at::mm(gc, c.weight);
    if (c.grad_weight) r.grad_weight = at::mm(gc.t(), c.h);
  }
  return r;
}

// fused: the logits in the compute dtype (one GEMM), then one CUDA kernel per chunk for
// the row statistics, the loss, the argmax and the gradient written over the logits in
// place (cuda_ops::ce_rows; soft targets: cuda_ops::kl_rows, reading each row's target
// logits where they are); the gradient GEMM reads it from there.
ChunkResult chunk_loss_fused(const ChunkInput& c) {
  ChunkResult r;
  at::Tensor t;
  at::Tensor logits = serve_products(at::mm(c.h, c.weight.t()), c.scale, c.cap, t);
  take_top_k(logits, c.top_k, r);  // before the row kernel writes the gradient over them
  const at::Tensor wf = c.w.to(at::kFloat).contiguous();
  if (c.probs.defined()) {
    const cuda_ops::ProbRows rows =
        cuda_ops::prob_rows(logits, c.probs, c.target_rows.contiguous(), wf, c.inv_sum, c.grad);
    r.argmax = rows.argmax;
    r.target_argmax = rows.target_argmax;
    r.loss_sum = (rows.ce * wf).sum();
  } else if (c.target.defined()) {
    const cuda_ops::KlRows rows =
        cuda_ops::kl_rows(logits, c.target, c.target_rows.contiguous(), c.temperature, wf, c.inv_sum, c.grad);
    r.argmax = rows.argmax;
    r.target_argmax = rows.target_argmax;
    r.loss_sum = (rows.kl * wf).sum();
  } else {
    const cuda_ops::CeRows rows = cuda_ops::ce_rows(logits, c.labels.contiguous(), wf, c.inv_sum, c.grad);
    r.argmax = rows.argmax;
    r.loss_sum = (rows.nll * wf).sum();
  }
  if (c.grad) unserve_gradient(logits, c.scale, c.cap, t);  // (the row kernel wrote the gradient over them)
  if (c.grad) r.grad = at::mm(logits, c.weight);
  if (c.grad && c.grad_weight) r.grad_weight = at::mm(logits.t(), c.h);
  return r;
}

// The target's logits (as it serves them: its scale and cap) of every row of target_hidden, at
// most `chunk` rows at a time: their argmax (hard labels), or (soft) the logits themselves in
// the compute dtype when they fit in `budget` bytes (undefined otherwise: the chunks then
// compute their own rows').
struct TargetLogits {
  at::Tensor argmax;  // [U] int64
  at::Tensor logits;  // [U, V] or undefined
};
TargetLogits target_logits(const LmHeadLossInput& in, const at::Tensor& weight, int64_t chunk, int64_t budget) {
  const at::Tensor th = in.target_hidden.detach();
  const bool soft = in.target_soft;
  TargetLogits t;
  const int64_t U = th.size(0), V = weight.size(0);
  t.argmax = at::empty({U}, th.options().dtype(at::kLong));
  const bool keep = soft && U * V * th.element_size() <= budget;
  if (keep) t.logits = at::empty({U, V}, th.options());
  for (int64_t u0 = 0; u0 < U; u0 += chunk) {
    const int64_t n = std::min(chunk, U - u0);
    const at::Tensor l =
        served_logits(at::mm(th.narrow(0, u0, n), weight.t()), in.target_logit_scale, in.target_logit_softcap);
    t.argmax.narrow(0, u0, n).copy_(l.argmax(-1));
    if (keep) t.logits.narrow(0, u0, n).copy_(l);
  }
  return t;
}

// Where each row's label comes from, prepared once per call: hard labels (the data's or the
// target's argmax), the target's logits (kept when they fit in about 2 GiB), or distributions.
struct RowLabels {
  at::Tensor labels, index, probs;
  TargetLogits target;
  bool from_target = false, from_probs = false, soft_target = false;
};

RowLabels row_labels(const LmHeadLossInput& in, const at::Tensor& weight, int64_t c, LmHeadLossOutput& out) {
  RowLabels l;
  const auto long_opts = in.hidden.options().dtype(at::kLong);
  l.labels = in.labels;
  l.from_target = in.target_hidden.defined();
  l.from_probs = in.soft_labels.defined();
  l.soft_target = l.from_target && in.target_soft;
  if (l.from_target || l.from_probs)
    l.index = in.target_index.defined() ? in.target_index : at::arange(in.hidden.size(0), long_opts);
  if (l.from_probs) {
    l.probs = in.soft_labels.detach().contiguous();
    out.target_argmax = at::empty({in.hidden.size(0)}, long_opts);
  }
  if (l.from_target) {
    l.target = target_logits(in, weight, c, int64_t(1) << 31);
    out.target_argmax = l.target.argmax.index_select(0, l.index);
    if (!in.target_soft) l.labels = out.target_argmax;
  }
  return l;
}

// Rows [r0, r0 + n) of the call as one chunk's input.
ChunkInput chunk_input(const LmHeadLossInput& in, const RowLabels& l, const at::Tensor& h, const at::Tensor& weight,
                       int64_t r0, int64_t n) {
  ChunkInput ci;
  ci.h = h.narrow(0, r0, n);
  ci.weight = weight;
  ci.w = in.row_weights.narrow(0, r0, n);
  ci.temperature = in.target_temperature;
  ci.top_k = in.top_k;
  ci.scale = in.logit_scale;
  ci.cap = in.logit_softcap;
  if (l.from_probs) {
    ci.probs = l.probs;
    ci.target_rows = l.index.narrow(0, r0, n);
  } else if (l.soft_target && l.target.logits.defined()) {
    ci.target = l.target.logits;
    ci.target_rows = l.index.narrow(0, r0, n);
  } else if (l.soft_target) {  // too large to keep: this chunk's target rows only
    ci.target = served_logits(at::mm(in.target_hidden.detach().index_select(0, l.index.narrow(0, r0, n)), weight.t()),
                              in.target_logit_scale, in.target_logit_softcap);
    ci.target_rows = at::arange(n, h.options().dtype(at::kLong));
  } else {
    ci.labels = l.labels.narrow(0, r0, n);
  }
  return ci;
}

// The loss's autograd node: edges for what needs a gradient, in the order apply() returns
// them (hidden, then the LM head).
void attach_backward(const LmHeadLossInput& in, LmHeadLossOutput& out, at::Tensor grad_hidden, at::Tensor grad_weight,
                     std::function<void()> on_backward) {
  auto node = std::shared_ptr<ChunkedLossBackward>(new ChunkedLossBackward(), torch::autograd::deleteNode);
  torch::autograd::edge_list edges;
  if (grad_hidden.defined()) edges.push_back(torch::autograd::impl::gradient_edge(in.hidden));
  if (grad_weight.defined()) edges.push_back(torch::autograd::impl::gradient_edge(in.weight));
  node->set_next_edges(std::move(edges));
  node->grad_hidden = std::move(grad_hidden);
  node->grad_weight = std::move(grad_weight);
  node->on_backward = std::move(on_backward);
  torch::autograd::set_history(out.loss, node);
}

// The rows in chunks of c: per chunk `fn`, the chunk's logits freed before the next; the
// gradients with respect to hidden (and a trained head, summed over the chunks in float32
// past the first) kept for the backward node.
LmHeadLossOutput chunked_loss(const LmHeadLossInput& in, int64_t c, ChunkFn fn, std::function<void()> on_backward) {
  check_lm_head_loss_input(in);
  const int64_t R = in.hidden.size(0);
  const bool grad_h = at::GradMode::is_enabled() && in.hidden.requires_grad();
  const bool grad_w = at::GradMode::is_enabled() && in.weight.requires_grad();
  const at::Tensor h = in.hidden.detach(), weight = in.weight.detach();
  const double inv_sum = R > 0 ? 1.0 / in.weight_sum : 0.0;  // no row: a zero loss (and gradient)
  LmHeadLossOutput out;
  at::Tensor total =
      at::zeros({}, in.hidden.options().dtype(in.hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  out.argmax = at::empty({R}, in.hidden.options().dtype(at::kLong));
  if (in.top_k > 0) {
    out.top_values = at::empty({R, in.top_k}, h.options());
    out.top_indices = at::empty({R, in.top_k}, out.argmax.options());
  }
  at::Tensor grad_hidden = grad_h ? at::empty_like(h) : at::Tensor(), grad_weight;
  {
    at::NoGradGuard no_grad;
    const RowLabels labels = row_labels(in, weight, c, out);
    for (int64_t r0 = 0; r0 < R; r0 += c) {
      const int64_t n = std::min(c, R - r0);
      ChunkInput ci = chunk_input(in, labels, h, weight, r0, n);
      ci.inv_sum = inv_sum;
      ci.grad = grad_h || grad_w;
      ci.grad_weight = grad_w;
      ChunkResult cr = fn(ci);
      total.add_(cr.loss_sum);
      out.argmax.narrow(0, r0, n).copy_(cr.argmax);
      if (in.top_k > 0) {
        out.top_values.narrow(0, r0, n).copy_(cr.top_values);
        out.top_indices.narrow(0, r0, n).copy_(cr.top_indices);
      }
      if (labels.from_probs) out.target_argmax.narrow(0, r0, n).copy_(cr.target_argmax);
      if (grad_h) grad_hidden.narrow(0, r0, n).copy_(cr.grad);
      if (grad_w && !grad_weight.defined())
        grad_weight = cr.grad_weight;
      else if (grad_w)
        grad_weight = (at::isFloatingType(grad_weight.scalar_type()) && grad_weight.element_size() >= 4
                           ? grad_weight
                           : grad_weight.to(at::kFloat))
                          .add_(cr.grad_weight);
    }
    total.mul_(inv_sum);
    if (grad_w) grad_weight = grad_weight.defined() ? grad_weight.to(weight.scalar_type()) : at::zeros_like(weight);
  }
  out.loss = total;
  if (grad_h || grad_w)
    attach_backward(in, out, std::move(grad_hidden), std::move(grad_weight), std::move(on_backward));
  return out;
}

}  // namespace

int64_t auto_chunk_rows(int64_t vocab, int64_t budget_bytes, int64_t bytes_per_logit) {
  const int64_t rows = budget_bytes / (std::max<int64_t>(bytes_per_logit, 1) * std::max<int64_t>(vocab, 1));
  return std::max<int64_t>(16, rows / 16 * 16);
}

void check_lm_head_loss_input(const LmHeadLossInput& in) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument("LM-head loss: " + what); };
  if (!in.hidden.defined() || in.hidden.dim() != 2) fail("hidden must be [rows, H], got " + shape_of(in.hidden));
  if (!in.weight.defined() || in.weight.dim() != 2 || in.weight.size(1) != in.hidden.size(1))
    fail("the LM head must be [V, " + std::to_string(in.hidden.size(1)) + "], got " + shape_of(in.weight));
  if (in.soft_labels.defined()) {
    const int64_t R = in.hidden.size(0), V = in.weight.size(0);
    if (in.target_hidden.defined()) fail("give soft_labels or target_hidden, not both");
    if (in.soft_labels.dim() != 2 || in.soft_labels.size(1) != V || in.soft_labels.scalar_type() != at::kFloat ||
        (!in.target_index.defined() && in.soft_labels.size(0) != R))
      fail("soft_labels must be float32 [" + (in.target_index.defined() ? std::string("U") : std::to_string(R)) + ", " +
           std::to_string(V) + "] (a distribution over the LM head's " + std::to_string(V) + " tokens per row), got " +
           shape_of(in.soft_labels) + " (" + c10::toString(in.soft_labels.scalar_type()) + ")");
    if (in.target_index.defined() &&
        (in.target_index.dim() != 1 || in.target_index.size(0) != R || in.target_index.scalar_type() != at::kLong))
      fail("target_index must be int64 [" + std::to_string(R) + "], got " + shape_of(in.target_index));
  } else if (in.target_hidden.defined()) {
    const int64_t R = in.hidden.size(0);
    if (in.target_hidden.dim() != 2 || in.target_hidden.size(1) != in.hidden.size(1) ||
        in.target_hidden.scalar_type() != in.hidden.scalar_type() ||
        (!in.target_index.defined() && in.target_hidden.size(0) != R))
      fail("target_hidden must be [" + (in.target_index.defined() ? std::string("U") : std::to_string(R)) + ", " +
           std::to_string(in.hidden.size(1)) + "] in hidden's dtype " + c10::toString(in.hidden.scalar_type()) +
           ", got " + shape_of(in.target_hidden) + " (" + c10::toString(in.target_hidden.scalar_type()) + ")");
    if (in.target_index.defined() &&
        (in.target_index.dim() != 1 || in.target_index.size(0) != R || in.target_index.scalar_type() != at::kLong))
      fail("target_index must be int64 [" + std::to_string(R) + "], got " + shape_of(in.target_index));
    if (in.target_soft && !(in.target_temperature > 0))
      fail("target_temperature must be positive, got " + std::to_string(in.target_temperature));
  } else if (!in.labels.defined() || in.labels.dim() != 1 || in.labels.size(0) != in.hidden.size(0) ||
             in.labels.scalar_type() != at::kLong) {
    fail("labels must be int64 [" + std::to_string(in.hidden.size(0)) + "], got " + shape_of(in.labels));
  }
  if (!in.row_weights.defined() || in.row_weights.dim() != 1 || in.row_weights.size(0) != in.hidden.size(0))
    fail("row_weights must be [" + std::to_string(in.hidden.size(0)) + "], got " + shape_of(in.row_weights));
  if (in.weight.scalar_type() != in.hidden.scalar_type())
    fail(std::string("hidden is ") + c10::toString(in.hidden.scalar_type()) + " but the LM head is " +
         c10::toString(in.weight.scalar_type()) + " (give both in the compute dtype)");
  if (in.top_k < 0 || in.top_k > in.weight.size(0))
    fail("top_k must be 0..V = " + std::to_string(in.weight.size(0)) + ", got " + std::to_string(in.top_k));
  if (in.hidden.size(0) > 0 && !(in.weight_sum > 0))
    fail("weight_sum must be positive, got " + std::to_string(in.weight_sum));
  for (const auto& [name, scale, cap] : {std::tuple<const char*, double, double>{"", in.logit_scale, in.logit_softcap},
                                         {"target_", in.target_logit_scale, in.target_logit_softcap}})
    if (!(scale > 0) || !std::isfinite(scale) || !(cap >= 0) || !std::isfinite(cap))
      fail(std::string(name) + "logit_scale must be positive and " + name + "logit_softcap 0 (none) or positive, got " +
           std::to_string(scale) + " and " + std::to_string(cap));
}

LmHeadLossOutput lm_head_loss_reference(const LmHeadLossInput& in) {
  check_lm_head_loss_input(in);
  const int64_t R = in.hidden.size(0);
  at::Tensor logits = served_logits(at::linear(in.hidden, in.weight), in.logit_scale, in.logit_softcap);
  LmHeadLossOutput out;
  out.argmax = logits.detach().argmax(-1);
  if (in.top_k > 0) std::tie(out.top_values, out.top_indices) = at::topk(logits.detach(), in.top_k, -1, true, true);
  if (logits.scalar_type() != at::kDouble) logits = logits.to(at::kFloat);
  const at::Tensor logq = at::log_softmax(logits, -1);
  at::Tensor per_row;
  if (in.soft_labels.defined()) {
    const at::Tensor p = in.target_index.defined() ? in.soft_labels.index_select(0, in.target_index) : in.soft_labels;
    out.target_argmax = p.argmax(-1);
    per_row = -(p * logq).sum(-1);
  } else if (in.target_hidden.defined()) {
    at::Tensor target = served_logits(at::linear(in.target_hidden.detach(), in.weight.detach()), in.target_logit_scale,
                                      in.target_logit_softcap);
    if (in.target_index.defined()) target = target.index_select(0, in.target_index);
    out.target_argmax = target.argmax(-1);
    if (in.target_soft) {
      const at::Tensor logp = at::log_softmax(target.to(logq.scalar_type()) / in.target_temperature, -1);
      per_row = (logp.exp() * (logp - logq)).sum(-1);  // KL(p || q)
    } else {
      per_row = -logq.gather(1, out.target_argmax.unsqueeze(1)).squeeze(1);
    }
  } else {
    per_row = -logq.gather(1, in.labels.unsqueeze(1)).squeeze(1);
  }
  // No row: a zero loss, still connected to hidden (every rank of a data-parallel step
  // runs the same ops, even one whose batch has no label).
  out.loss = (per_row * in.row_weights.to(per_row.scalar_type())).sum() / (R > 0 ? in.weight_sum : 1.0);
  return out;
}

LmHeadLossOutput lm_head_loss_chunked(const LmHeadLossInput& in, int64_t chunk_rows,
                                      std::function<void()> on_backward) {
  const int64_t c = chunk_rows > 0 ? chunk_rows : auto_chunk_rows(in.weight.size(0));
  return chunked_loss(in, c, chunk_loss_aten, std::move(on_backward));
}

LmHeadLossOutput lm_head_loss_fused(const LmHeadLossInput& in, int64_t chunk_rows, std::function<void()> on_backward) {
  if (!cuda_ops::runs_on(in.hidden))
    throw std::invalid_argument(
        std::string("LM-head loss: the fused variant runs on CUDA tensors of float32, bfloat16 "
                    "or float16") +
        (cuda_ops::cuda_ops_built() ? "" : " (and this engine was built without its CUDA kernels)") + "; hidden is " +
        c10::toString(in.hidden.scalar_type()) + " on " + in.hidden.device().str() +
        " (accepted elsewhere: chunked, reference)");
  const int64_t c =
      chunk_rows > 0 ? chunk_rows : auto_chunk_rows(in.weight.size(0), int64_t(1) << 29, in.weight.element_size());
  return chunked_loss(in, c, chunk_loss_fused, std::move(on_backward));
}

std::string LossProblem::str() const {
  return "LM-head loss on " + device.str() + " (" + dtype_name(dtype) + ")" +
         (vocab > 0 ? ", the target's vocabulary " + std::to_string(vocab) : std::string());
}

Support loss_supports(const std::string& name, const LossProblem& p) {
  const bool built = cuda_ops::cuda_ops_built();
  const bool float_dtype = p.dtype == at::kFloat || p.dtype == at::kBFloat16 || p.dtype == at::kHalf;
  const bool fused_here = p.device.is_cuda() && built && float_dtype;
  if (name == "reference" || name == "chunked") return Support::yes();
  if (name == "fused") {
    if (fused_here) return Support::yes();
    if (!p.device.is_cuda()) return Support::no("runs on CUDA, and this run is on " + p.device.str());
    if (!built)
      return Support::no("this engine was built without its CUDA kernels (no CUDA LibTorch or no nvcc at build time)");
    return Support::no(std::string("runs in float32, bfloat16 or float16, not ") + c10::toString(p.dtype));
  }
  if (name == "auto") {
    if (fused_here) return {true, "auto: fused (CUDA)"};
    if (p.device.is_cuda()) return {true, "auto: chunked (the fused variant " + loss_supports("fused", p).reason + ")"};
    return {true, "auto: chunked (" + p.device.str() + ")"};
  }
  throw std::invalid_argument("LM-head loss variant '" + name + "' is not one of: " + kLossNames);
}

LmHeadLoss::LmHeadLoss(const std::string& name, int64_t chunk_rows, Note note, const LossProblem& problem)
    : chunk_rows_(chunk_rows),
      note_(std::move(note)),
      logit_bytes_(c10::elementSize(problem.dtype)),
      vocab_(problem.vocab) {
  const Support s = loss_supports(name, problem);
  if (!s.ok)
    throw std::invalid_argument("\"" + name + "\" " + s.reason + "; accepted here: " +
                                (loss_supports("fused", problem).ok ? kLossNames : "auto, chunked, reference"));
  if (name == "auto") {
    why_ = s.reason;
    variant_ = loss_supports("fused", problem).ok ? kLossFused : kLossChunked;
  } else {
    variant_ = name == "fused" ? kLossFused : name == "chunked" ? kLossChunked : kLossReference;
  }
}

LmHeadLossOutput LmHeadLoss::operator()(const LmHeadLossInput& in) {
  if (variant_ == kLossReference) {
    LmHeadLossOutput out = lm_head_loss_reference(in);
    if (note_) note_(false, kLossReference);
    if (out.loss.requires_grad() && in.hidden.requires_grad()) {
      // The reference's backward is ATen's: note it when the gradient reaches hidden.
      Note note = note_;
      at::Tensor h = in.hidden;
      if (note) h.register_hook([note](const at::Tensor&) { note(true, kLossReference); });
    }
    return out;
  }
  Note note = note_;
  const std::string variant = variant_;
  auto on_backward = [note, variant] {
    if (note) note(true, variant);
  };
  LmHeadLossOutput out = variant_ == kLossFused ? lm_head_loss_fused(in, chunk_rows_, on_backward)
                                                : lm_head_loss_chunked(in, chunk_rows_, on_backward);
  if (note_) note_(false, variant_);
  return out;
}

std::string LmHeadLoss::describe() const {
  const int64_t vocab = vocab_;
  const std::string why = why_.empty() ? "" : why_ + "; ";
  if (variant_ == kLossReference) return std::string(kLossReference) + " (full logits, float32 log-softmax)";
  const bool fused = variant_ == kLossFused;
  const int64_t c = chunk_rows_ > 0 ? chunk_rows_
                    : fused         ? auto_chunk_rows(vocab, int64_t(1) << 29, logit_bytes_)
                                    : auto_chunk_rows(vocab);
  const std::string rows = std::to_string(c) + " rows per chunk" + (chunk_rows_ > 0 ? "" : ", auto");
  if (fused)
    return variant_ + " (" + why + rows +
           "; one CUDA kernel per chunk: softmax statistics, NLL, argmax and the "
           "gradient written over the logits in place; no float32 [rows, vocab] tensor)";
  return variant_ + " (" + why + rows + "; gradient in the forward, no [rows, vocab] float32 tensor)";
}

}  // namespace flashdraft

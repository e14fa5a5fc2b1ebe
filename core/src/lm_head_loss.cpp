// The LM-head cross-entropy variants (lm_head_loss.hpp).
#include "lm_head_loss.hpp"

#include "cuda_ops.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>

namespace flashdraft {

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

std::string shape_of(const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("(undefined)"); }

// The chunked variant's backward: the gradient with respect to hidden was computed in
// the forward (the loss is a scalar), so backward scales it by the incoming gradient.
struct ChunkedLossBackward final : public torch::autograd::Node {
  at::Tensor grad_hidden;  // [R, H], for a unit incoming gradient
  std::function<void()> on_backward;

  std::string name() const override { return "flashdraft::ChunkedLmHeadLossBackward"; }
  void release_variables() override { grad_hidden.reset(); }

  variable_list apply(variable_list&& grads) override {
    if (!grad_hidden.defined())
      throw std::runtime_error("LM-head loss: backward ran a second time after its saved gradient was freed (pass "
                               "retain_graph = true to the first backward to run it twice)");
    if (on_backward) on_backward();
    if (!grads[0].defined()) return {at::Tensor()};
    return {grad_hidden * grads[0].to(grad_hidden.scalar_type())};
  }
};

// One chunk: the weighted NLL sum, the argmax and (grad) the gradient of
// sum_r w_r NLL_r / weight_sum with respect to the chunk's rows.
struct ChunkResult {
  at::Tensor nll_sum, argmax, grad;
};
using ChunkFn = ChunkResult (*)(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& labels,
                                const at::Tensor& w, double inv_sum, bool grad);

// chunked: logits, float32 log-softmax, gather, exp, scatter and scale in ATen.
ChunkResult chunk_loss_aten(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& labels,
                            const at::Tensor& w, double inv_sum, bool grad) {
  ChunkResult r;
  at::Tensor logits = at::mm(h, weight.t());  // [c, V], compute dtype
  r.argmax = logits.argmax(-1);
  // float32 log-softmax of 16-bit logits (ATen converts the input; its half_to_float path
  // takes Half only).
  const bool wide = logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble;
  at::Tensor logp = wide ? at::_log_softmax(logits, -1, false) : at::log_softmax(logits, -1, at::kFloat);
  logits.reset();
  const at::Tensor lab = labels.unsqueeze(1);
  const at::Tensor nll = -logp.gather(1, lab).squeeze(1);
  r.nll_sum = (nll * w.to(nll.scalar_type())).sum();
  if (grad) {
    at::Tensor g = logp.exp_();  // softmax, in place
    logp.reset();
    g.scatter_add_(1, lab, at::full({lab.size(0), 1}, -1.0, g.options()));
    g.mul_(w.to(g.scalar_type()).mul(inv_sum).unsqueeze(1));
    r.grad = at::mm(g.to(h.scalar_type()), weight);
  }
  return r;
}

// fused: the logits in the compute dtype (one GEMM), then one CUDA kernel per chunk for
// the row statistics, the NLL, the argmax and the gradient written over the logits in
// place (cuda_ops::ce_rows); the gradient GEMM reads it from there.
ChunkResult chunk_loss_fused(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& labels,
                             const at::Tensor& w, double inv_sum, bool grad) {
  ChunkResult r;
  at::Tensor logits = at::mm(h, weight.t());
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  const cuda_ops::CeRows rows = cuda_ops::ce_rows(logits, labels.contiguous(), wf, inv_sum, grad);
  r.argmax = rows.argmax;
  r.nll_sum = (rows.nll * wf).sum();
  if (grad) r.grad = at::mm(logits, weight);
  return r;
}

// The rows in chunks of c: per chunk `fn`, the chunk's logits freed before the next; the
// gradient with respect to hidden kept for the backward node.
LmHeadLossOutput chunked_loss(const LmHeadLossInput& in, int64_t c, ChunkFn fn, std::function<void()> on_backward) {
  check_lm_head_loss_input(in);
  const int64_t R = in.hidden.size(0);
  const bool grad = at::GradMode::is_enabled() && in.hidden.requires_grad();
  const at::Tensor h = in.hidden.detach(), weight = in.weight.detach();
  const double inv_sum = R > 0 ? 1.0 / in.weight_sum : 0.0;  // no row: a zero loss (and gradient)
  LmHeadLossOutput out;
  at::Tensor total = at::zeros({}, in.hidden.options().dtype(in.hidden.scalar_type() == at::kDouble ? at::kDouble
                                                                                                     : at::kFloat));
  out.argmax = at::empty({R}, in.labels.options());
  at::Tensor grad_hidden = grad ? at::empty_like(h) : at::Tensor();
  {
    at::NoGradGuard no_grad;
    for (int64_t r0 = 0; r0 < R; r0 += c) {
      const int64_t n = std::min(c, R - r0);
      ChunkResult cr = fn(h.narrow(0, r0, n), weight, in.labels.narrow(0, r0, n), in.row_weights.narrow(0, r0, n),
                          inv_sum, grad);
      total.add_(cr.nll_sum);
      out.argmax.narrow(0, r0, n).copy_(cr.argmax);
      if (grad) grad_hidden.narrow(0, r0, n).copy_(cr.grad);
    }
    total.mul_(inv_sum);
  }
  out.loss = total;
  if (grad) {
    auto node = std::shared_ptr<ChunkedLossBackward>(new ChunkedLossBackward(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(in.hidden));
    node->grad_hidden = std::move(grad_hidden);
    node->on_backward = std::move(on_backward);
    torch::autograd::set_history(out.loss, node);
  }
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
  if (!in.labels.defined() || in.labels.dim() != 1 || in.labels.size(0) != in.hidden.size(0) ||
      in.labels.scalar_type() != at::kLong)
    fail("labels must be int64 [" + std::to_string(in.hidden.size(0)) + "], got " + shape_of(in.labels));
  if (!in.row_weights.defined() || in.row_weights.dim() != 1 || in.row_weights.size(0) != in.hidden.size(0))
    fail("row_weights must be [" + std::to_string(in.hidden.size(0)) + "], got " + shape_of(in.row_weights));
  if (in.weight.scalar_type() != in.hidden.scalar_type())
    fail(std::string("hidden is ") + c10::toString(in.hidden.scalar_type()) + " but the LM head is " +
         c10::toString(in.weight.scalar_type()) + " (give both in the compute dtype)");
  if (in.hidden.size(0) > 0 && !(in.weight_sum > 0))
    fail("weight_sum must be positive, got " + std::to_string(in.weight_sum));
}

LmHeadLossOutput lm_head_loss_reference(const LmHeadLossInput& in) {
  check_lm_head_loss_input(in);
  const int64_t R = in.hidden.size(0);
  at::Tensor logits = at::linear(in.hidden, in.weight);
  LmHeadLossOutput out;
  out.argmax = logits.detach().argmax(-1);
  if (logits.scalar_type() != at::kDouble) logits = logits.to(at::kFloat);
  const at::Tensor nll = -at::log_softmax(logits, -1).gather(1, in.labels.unsqueeze(1)).squeeze(1);
  // No row: a zero loss, still connected to hidden (every rank of a data-parallel step
  // runs the same ops, even one whose batch has no label).
  out.loss = (nll * in.row_weights.to(nll.scalar_type())).sum() / (R > 0 ? in.weight_sum : 1.0);
  return out;
}

LmHeadLossOutput lm_head_loss_chunked(const LmHeadLossInput& in, int64_t chunk_rows, std::function<void()> on_backward) {
  const int64_t c = chunk_rows > 0 ? chunk_rows : auto_chunk_rows(in.weight.size(0));
  return chunked_loss(in, c, chunk_loss_aten, std::move(on_backward));
}

LmHeadLossOutput lm_head_loss_fused(const LmHeadLossInput& in, int64_t chunk_rows, std::function<void()> on_backward) {
  if (!cuda_ops::runs_on(in.hidden))
    throw std::invalid_argument(std::string("LM-head loss: the fused variant runs on CUDA tensors of float32, bfloat16 "
                                            "or float16") +
                                (cuda_ops::cuda_ops_built() ? "" : " (and this engine was built without its CUDA kernels)") +
                                "; hidden is " + c10::toString(in.hidden.scalar_type()) + " on " +
                                in.hidden.device().str() + " (accepted elsewhere: chunked, reference)");
  const int64_t c = chunk_rows > 0 ? chunk_rows : auto_chunk_rows(in.weight.size(0), int64_t(1) << 29,
                                                                   in.weight.element_size());
  return chunked_loss(in, c, chunk_loss_fused, std::move(on_backward));
}

namespace {

const char* resolve_variant(const std::string& variant, c10::Device device, std::string& why) {
  const bool fused_here = device.is_cuda() && cuda_ops::cuda_ops_built();
  if (variant == "reference") return kLossReference;
  if (variant == "chunked") return kLossChunked;
  if (variant == "fused") {
    if (!fused_here)
      throw std::invalid_argument(
          std::string("\"fused\" runs on CUDA with the engine's CUDA kernels, but this run is on ") +
          device.str() +
          (cuda_ops::cuda_ops_built() ? "" : " and this engine was built without them (no CUDA LibTorch or no nvcc)") +
          "; accepted here: auto, chunked, reference");
    return kLossFused;
  }
  if (variant == "auto") {
    why = fused_here ? "auto: CUDA" : device.is_cuda() ? "auto: engine built without its CUDA kernels" : "auto: " + device.str();
    return fused_here ? kLossFused : kLossChunked;
  }
  throw std::invalid_argument("LM-head loss variant '" + variant + "' is not one of: auto, fused, chunked, reference");
}

}  // namespace

LmHeadLoss::LmHeadLoss(std::string variant, int64_t chunk_rows, Note note, c10::Device device, at::ScalarType dtype)
    : chunk_rows_(chunk_rows), note_(std::move(note)), logit_bytes_(c10::elementSize(dtype)) {
  variant_ = resolve_variant(variant, device, why_);
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

std::string LmHeadLoss::describe(int64_t vocab) const {
  const std::string why = why_.empty() ? "" : why_ + "; ";
  if (variant_ == kLossReference) return std::string(kLossReference) + " (full logits, float32 log-softmax)";
  const bool fused = variant_ == kLossFused;
  const int64_t c = chunk_rows_ > 0 ? chunk_rows_ : fused ? auto_chunk_rows(vocab, int64_t(1) << 29, logit_bytes_)
                                                          : auto_chunk_rows(vocab);
  const std::string rows = std::to_string(c) + " rows per chunk" + (chunk_rows_ > 0 ? "" : ", auto");
  if (fused)
    return variant_ + " (" + why + rows + "; one CUDA kernel per chunk: softmax statistics, NLL, argmax and the "
           "gradient written over the logits in place; no float32 [rows, vocab] tensor)";
  return variant_ + " (" + why + rows + "; gradient in the forward, no [rows, vocab] float32 tensor)";
}

}  // namespace flashdraft

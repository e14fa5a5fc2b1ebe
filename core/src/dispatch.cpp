// Kernel selection, per-step masks, and the autograd function around the kernel.
#include "dispatch.hpp"

#include <torch/torch.h>

#include <sstream>

namespace flashdraft {

std::string KernelChoice::report() const {
  std::ostringstream os;
  os << "attention: " << problem.str() << "\n";
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    os << "  " << c.name << ": ";
    if (i == selected)
      os << "selected" << (fallback ? " (FALLBACK: not the first preference)" : "");
    else if (!c.support.ok)
      os << "refused: " << c.support.reason;
    else
      os << "supported, not needed (an earlier preference was selected)";
    os << "\n";
  }
  return os.str();
}

KernelChoice choose_kernel(const AttentionProblem& problem, std::vector<KernelCandidate> candidates,
                           const std::string& on_fallback) {
  KernelChoice choice;
  choice.problem = problem;
  choice.candidates = std::move(candidates);
  bool found = false;
  for (size_t i = 0; i < choice.candidates.size(); ++i) {
    auto& c = choice.candidates[i];
    if (!c.kernel) continue;  // the reason was filled by the caller (plugin missing)
    c.support = c.kernel->supports(problem);
    if (c.support.ok && !found) {
      choice.selected = i;
      found = true;
    }
  }
  if (!found) {
    choice.selected = choice.candidates.size();  // none
    std::string msg = "no attention kernel in [attention].kernels supports the problem.\n" + choice.report();
    msg += "Add a kernel that supports it (e.g. \"dense_ref\", which accepts every problem) or change the problem.";
    throw FallbackError(msg);
  }
  choice.fallback = choice.selected != 0;
  if (choice.fallback && on_fallback == "error") {
    std::string msg = "attention kernel '" + choice.candidates[0].name + "' (first preference) refused the problem: " +
                      choice.candidates[0].support.reason + ".\n" + choice.report() +
                      "The run stops before step 0 because [attention].on_fallback = \"error\"; set it to \"warn\" to "
                      "run on '" + choice.candidates[choice.selected].name + "' instead (recorded in the log).";
    throw FallbackError(msg);
  }
  return choice;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The engine's autograd node around a kernel. The dispatcher is passed by address
// (it outlives every graph of the run); its current mask is the step's mask, which
// stays set until the step's backward has run.
struct KernelAttention : public torch::autograd::Function<KernelAttention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               int64_t dispatcher, int64_t layer, double scale) {
    auto* d = reinterpret_cast<AttentionDispatcher*>(dispatcher);
    AttentionForward r = d->kernel().forward(q, k, v, d->mask_tensors(), scale);
    if (!r.out.defined() || r.out.sizes() != q.sizes())
      throw std::runtime_error("attention kernel '" + d->kernel_name() + "' returned an output of shape " +
                               (r.out.defined() ? c10::str(r.out.sizes()) : std::string("(none)")) + ", expected " +
                               c10::str(q.sizes()));
    d->note(layer, Phase::forward, r.variant);
    ctx->save_for_backward({q, k, v, r.out, r.lse});
    ctx->saved_data["dispatcher"] = dispatcher;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["scale"] = scale;
    return {r.out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* d = reinterpret_cast<AttentionDispatcher*>(ctx->saved_data["dispatcher"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto saved = ctx->get_saved_variables();
    at::Tensor dout = grads[0].contiguous();
    AttentionBackward r = d->kernel().backward(dout, saved[0], saved[1], saved[2], saved[3], saved[4],
                                               d->mask_tensors(), scale);
    for (const auto& [t, ref, name] : {std::tuple{r.dq, saved[0], "dq"}, std::tuple{r.dk, saved[1], "dk"},
                                       std::tuple{r.dv, saved[2], "dv"}})
      if (!t.defined() || t.sizes() != ref.sizes())
        throw std::runtime_error("attention kernel '" + d->kernel_name() + "' backward returned " + name +
                                 " of shape " + (t.defined() ? c10::str(t.sizes()) : std::string("(none)")) +
                                 ", expected " + c10::str(ref.sizes()));
    d->note(layer, Phase::backward, r.variant);
    return {r.dq, r.dk, r.dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

AttentionDispatcher::AttentionDispatcher(KernelChoice choice, const MaskGenerator* generator, std::string on_fallback,
                                         KernelLedger* ledger, EventSink events)
    : choice_(std::move(choice)),
      generator_(generator),
      on_fallback_(std::move(on_fallback)),
      ledger_(ledger),
      events_(std::move(events)) {
  block_ = kernel().block_size(choice_.problem);
}

void AttentionDispatcher::set_mask(const MaskInput& input) {
  mask_ = generator_->build(input, block_.q, block_.kv);
  tensors_ = to_tensors(mask_, choice_.problem.device);
  tensors_.host = &mask_;
  mask_set_ = true;
}

at::Tensor AttentionDispatcher::attention(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, double scale) {
  if (!mask_set_) throw std::logic_error("attention called before set_mask() in this run (the drafter must set the mask)");
  if (q.size(2) != mask_.q_len || k.size(2) != mask_.kv_len)
    throw std::invalid_argument("attention layer " + std::to_string(layer) + ": q has " + std::to_string(q.size(2)) +
                                " rows and k " + std::to_string(k.size(2)) + ", but the mask is " +
                                std::to_string(mask_.q_len) + " x " + std::to_string(mask_.kv_len));
  return KernelAttention::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                reinterpret_cast<int64_t>(this), layer, scale)[0];
}

void AttentionDispatcher::note(int64_t layer, Phase phase, const std::string& variant) {
  if (ledger_) ledger_->record(layer, phase, variant);
  if (variant_belongs_to(variant, kernel_name())) return;
  const std::string msg = std::string(phase == Phase::forward ? "forward" : "backward") + " of layer " +
                          std::to_string(layer) + " ran '" + variant + "', not a variant of the selected kernel '" +
                          kernel_name() + "'";
  if (events_) events_("fallback", msg);
  if (on_fallback_ == "error")
    throw FallbackError("kernel fallback: " + msg + ". The run stops because [attention].on_fallback = \"error\".");
}

}  // namespace flashdraft

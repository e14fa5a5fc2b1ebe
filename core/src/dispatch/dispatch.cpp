// Kernel selection, per-step masks, and the autograd function around the kernel.
#include "dispatch/dispatch.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/types.h>

#include <sstream>

namespace flashdraft {

std::string KernelChoice::report() const {
  std::ostringstream os;
  if (problems.size() <= 1) {
    os << "attention: " << problem.str() << "\n";
  } else {
    os << "attention: " << problems.size() << " distinct problems in one step, each checked\n";
    for (size_t p = 0; p < problems.size(); ++p) {
      os << "  call" << (problem_calls[p].size() > 1 ? "s " : " ");
      for (size_t c = 0; c < problem_calls[p].size(); ++c) os << (c ? "," : "") << problem_calls[p][c];
      os << ": " << problems[p].str() << "\n";
    }
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    os << "  " << c.name << ": ";
    if (i == selected) {
      os << "selected" << (fallback ? " (FALLBACK: not the first preference)" : "");
      if (!c.support.reason.empty()) os << ": " << c.support.reason;  // e.g. the configuration it runs
    } else if (!c.support.ok)
      os << "refused: " << c.support.reason;
    else
      os << "supported, not needed (an earlier preference was selected)";
    os << "\n";
  }
  return os.str();
}

KernelChoice choose_kernel(const AttentionProblem& problem, std::vector<KernelCandidate> candidates,
                           const std::string& on_fallback) {
  return choose_kernel(std::vector<AttentionProblem>{problem}, std::move(candidates), on_fallback);
}

KernelChoice choose_kernel(const std::vector<AttentionProblem>& problems, std::vector<KernelCandidate> candidates,
                           const std::string& on_fallback) {
  if (problems.empty()) throw std::logic_error("choose_kernel: no attention problem to choose a kernel for");
  KernelChoice choice;
  choice.problem = problems[0];
  for (size_t call = 0; call < problems.size(); ++call) {
    const std::string key = problems[call].str();
    size_t p = 0;
    while (p < choice.problems.size() && choice.problems[p].str() != key) ++p;
    if (p == choice.problems.size()) {
      choice.problems.push_back(problems[call]);
      choice.problem_calls.emplace_back();
    }
    choice.problem_calls[p].push_back(static_cast<int64_t>(call));
  }
  choice.candidates = std::move(candidates);
  bool found = false;
  for (size_t i = 0; i < choice.candidates.size(); ++i) {
    auto& c = choice.candidates[i];
    if (!c.kernel) continue;  // the reason was filled by the caller (plugin missing)
    c.support = c.kernel->supports(choice.problems[0]);
    for (size_t p = 1; p < choice.problems.size() && c.support.ok; ++p) {
      Support s = c.kernel->supports(choice.problems[p]);
      if (!s.ok)
        c.support = Support::no(s.reason + " (for the problem of call " + std::to_string(choice.problem_calls[p][0]) +
                                ": " + choice.problems[p].str() + ")");
      else if (c.kernel->block_size(choice.problems[p]).q != c.kernel->block_size(choice.problems[0]).q ||
               c.kernel->block_size(choice.problems[p]).kv != c.kernel->block_size(choice.problems[0]).kv)
        c.support = Support::no(c.name + " asks for another mask block size for call " +
                                std::to_string(choice.problem_calls[p][0]) + " than for call 0 (a step's masks are " +
                                "built at one block size)");
    }
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
    std::string msg = "attention kernel '" + choice.candidates[0].name +
                      "' (first preference) refused the problem: " + choice.candidates[0].support.reason + ".\n" +
                      choice.report() +
                      "The run stops before step 0 because [attention].on_fallback = \"error\"; set it to \"warn\" to "
                      "run on '" +
                      choice.candidates[choice.selected].name + "' instead (recorded in the log).";
    throw FallbackError(msg);
  }
  return choice;
}

std::string LossChoice::report() const {
  std::ostringstream os;
  os << "loss: " << problem.str() << "\n";
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    os << "  " << c.name << ": ";
    if (i == selected)
      os << "selected" << (fallback ? " (FALLBACK: not the first preference)" : "") << ": "
         << LmHeadLoss(c.name, chunk_rows, {}, problem).describe();
    else if (!c.support.ok)
      os << "refused: " << c.support.reason;
    else
      os << "supported, not needed (an earlier preference was selected)";
    os << "\n";
  }
  return os.str();
}

LossChoice choose_loss(const std::vector<std::string>& preference, int64_t chunk_rows, const LossProblem& problem,
                       const std::string& on_fallback) {
  if (preference.empty())
    throw std::invalid_argument(std::string("the list of LM-head loss variants is empty; name at least one of: ") +
                                kLossNames);
  LossChoice choice;
  choice.problem = problem;
  choice.chunk_rows = chunk_rows;
  choice.on_fallback = on_fallback;
  choice.selected = preference.size();
  for (size_t i = 0; i < preference.size(); ++i) {
    choice.candidates.push_back({preference[i], loss_supports(preference[i], problem)});
    if (choice.candidates.back().support.ok && choice.selected == preference.size()) choice.selected = i;
  }
  if (choice.selected == preference.size()) {
    choice.selected = 0;
    std::string msg = "no LM-head loss variant in [loss].kernels supports the problem.\n";
    for (const auto& c : choice.candidates) msg += "  " + c.name + ": refused: " + c.support.reason + "\n";
    throw FallbackError(msg + "Add \"chunked\" (runs everywhere) or \"auto\" to [loss].kernels.");
  }
  choice.fallback = choice.selected != 0;
  if (choice.fallback && on_fallback == "error")
    throw FallbackError("LM-head loss variant '" + choice.candidates[0].name +
                        "' (first preference) refused the problem: " + choice.candidates[0].support.reason + ".\n" +
                        choice.report() +
                        "The run stops before step 0 because [loss].on_fallback = \"error\"; set it to \"warn\" to "
                        "run '" +
                        choice.name() + "' instead (recorded in the log).");
  return choice;
}

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

void check_shape(const AttentionDispatcher& d, const char* what, const at::Tensor& t, const at::Tensor& like) {
  if (!t.defined() || t.sizes() != like.sizes())
    throw std::runtime_error("attention kernel '" + d.kernel_name() + "' returned " + what + " of shape " +
                             (t.defined() ? c10::str(t.sizes()) : std::string("(none)")) + ", expected " +
                             c10::str(like.sizes()));
}

// The backward of one attention call. It owns what its forward used: the inputs, the
// output and lse, and the StepMask (never the dispatcher's current mask, which a later
// set_mask() may have replaced). The dispatcher outlives every graph of the run.
struct KernelAttentionBackward final : public torch::autograd::Node {
  AttentionDispatcher* dispatcher = nullptr;
  int64_t layer = 0;
  double scale = 1.0;
  std::shared_ptr<const StepMask> mask;
  SavedVariable q, k, v, out;
  at::Tensor lse;  // float32, no autograd history

  std::string name() const override { return "flashdraft::KernelAttentionBackward"; }

  void release_variables() override {
    q.reset_data();
    k.reset_data();
    v.reset_data();
    out.reset_data();
    lse.reset();
    mask.reset();
  }

  variable_list apply(variable_list&& grads) override {
    if (!mask)
      throw std::runtime_error("attention layer " + std::to_string(layer) +
                               ": backward ran a second time after its saved tensors were freed (pass "
                               "retain_graph = true to the first backward to run it twice)");
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor qs = q.unpack(), ks = k.unpack(), vs = v.unpack();
    const at::Tensor os = out.unpack(shared_from_this());
    // dout contiguous, or as it comes when it has the output's strides (a kernel that wrote its
    // output in another layout, e.g. flash_cuda's [B, L, H, D], reads that layout).
    const at::Tensor dout = grads[0].strides() == os.strides() ? grads[0] : grads[0].contiguous();
    AttentionBackward r = dispatcher->kernel().backward(dout, qs, ks, vs, os, lse, mask->tensors, scale);
    check_shape(*dispatcher, "dq", r.dq, qs);
    check_shape(*dispatcher, "dk", r.dk, ks);
    check_shape(*dispatcher, "dv", r.dv, vs);
    dispatcher->note(layer, Phase::backward, r.variant);
    return {r.dq, r.dk, r.dv};
  }
};

}  // namespace

namespace {

// One forward of the chosen kernel under the current mask, without autograd (attention() and attention_lse()):
// the lengths checked against the mask before, the output's shape after.
AttentionForward kernel_forward(AttentionDispatcher& d, int64_t layer, const at::Tensor& qc, const at::Tensor& kc,
                                const at::Tensor& vc, double scale) {
  const BlockMask& bm = d.mask();
  if (qc.size(2) != bm.q_len || kc.size(2) != bm.kv_len)
    throw std::invalid_argument("attention layer " + std::to_string(layer) + ": q has " + std::to_string(qc.size(2)) +
                                " rows and k " + std::to_string(kc.size(2)) + ", but the mask is " +
                                std::to_string(bm.q_len) + " x " + std::to_string(bm.kv_len));
  AttentionForward r;
  {
    at::NoGradGuard no_grad;
    r = d.kernel().forward(qc, kc, vc, d.mask_tensors(), scale);
  }
  check_shape(d, "an output", r.out, qc);
  return r;
}

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

const StepMask& AttentionDispatcher::current() const {
  if (!current_)
    throw std::logic_error("attention called before set_mask() in this run (the drafter must set the mask)");
  return *current_;
}

void AttentionDispatcher::set_mask(const MaskInput& input) {
  // A new StepMask every time: nodes of earlier forwards keep theirs.
  auto m = std::make_shared<StepMask>();
  m->mask = generator_->build(input, block_.q, block_.kv);
  m->tensors = to_tensors(m->mask, choice_.problem.device);
  m->tensors.host = &m->mask;
  current_ = std::move(m);
}

at::Tensor AttentionDispatcher::attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          double scale) {
  std::shared_ptr<const StepMask> mask = current_;
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  // (the kernel's own ops are not recorded: the node below is their gradient)
  const AttentionForward r = kernel_forward(*this, layer, qc, kc, vc, scale);
  note(layer, Phase::forward, r.variant);
  at::Tensor out = r.out.is_view() ? r.out.clone() : r.out;  // the node's output owns its storage
  if (at::GradMode::is_enabled() && (qc.requires_grad() || kc.requires_grad() || vc.requires_grad())) {
    auto node = std::shared_ptr<KernelAttentionBackward>(new KernelAttentionBackward(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(qc, kc, vc));
    node->dispatcher = this;
    node->layer = layer;
    node->scale = scale;
    node->mask = std::move(mask);
    node->q = SavedVariable(qc, /*is_output=*/false);
    node->k = SavedVariable(kc, /*is_output=*/false);
    node->v = SavedVariable(vc, /*is_output=*/false);
    node->lse = r.lse;
    torch::autograd::set_history(out, node);
    node->out = SavedVariable(out, /*is_output=*/true);
  }
  return out;
}
std::pair<at::Tensor, at::Tensor> AttentionDispatcher::attention_lse(int64_t layer, const at::Tensor& q,
                                                                     const at::Tensor& k, const at::Tensor& v,
                                                                     double scale) {
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad()))
    throw std::logic_error("attention layer " + std::to_string(layer) +
                           ": attention_lse is frozen attention (no gradient), called with inputs that require one");
  const AttentionForward r = kernel_forward(*this, layer, q.contiguous(), k.contiguous(), v.contiguous(), scale);
  if (!r.lse.defined() || r.lse.dim() != 3 || r.lse.size(0) != q.size(0) || r.lse.size(1) != q.size(1) ||
      r.lse.size(2) != q.size(2) || r.lse.scalar_type() != at::kFloat)
    throw std::runtime_error("attention kernel '" + kernel_name() + "' returned no float32 log-sum-exp of shape [" +
                             std::to_string(q.size(0)) + ", " + std::to_string(q.size(1)) + ", " +
                             std::to_string(q.size(2)) + "] (the kernel ABI's lse)");
  note(layer, Phase::forward, r.variant);
  return {r.out, r.lse};
}

void AttentionDispatcher::set_loss(const LossChoice& choice, int64_t column) {
  loss_column_ = column;
  loss_on_fallback_ = choice.on_fallback;
  loss_ = std::make_unique<LmHeadLoss>(
      choice.name(), choice.chunk_rows, [this](bool backward, const std::string& v) { note_loss(backward, v); },
      choice.problem);
}

LmHeadLossOutput AttentionDispatcher::lm_head_loss(const LmHeadLossInput& input) {
  if (!loss_) throw std::logic_error("lm_head_loss called on an attention context without a loss (set_loss)");
  return (*loss_)(input);
}

// Like note(), for the loss: the variant that ran against the one chosen from [loss].
void AttentionDispatcher::note_loss(bool backward, const std::string& variant) {
  const Phase phase = backward ? Phase::backward : Phase::forward;
  if (ledger_) ledger_->record(loss_column_, phase, variant);
  if (variant == loss_->variant()) return;
  const std::string msg = std::string(backward ? "backward" : "forward") + " of the LM-head loss ran '" + variant +
                          "', not the selected '" + loss_->variant() + "'";
  if (events_) events_("fallback", msg);
  if (loss_on_fallback_ == "error")
    throw FallbackError("loss fallback: " + msg + ". The run stops because [loss].on_fallback = \"error\".");
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

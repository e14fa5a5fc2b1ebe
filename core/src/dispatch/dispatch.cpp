// Kernel selection, per-step masks, and the autograd function around the kernel.
#include "dispatch/dispatch.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/types.h>

#include <algorithm>
#include <sstream>

namespace flashdraft {

namespace {

// "0-3,5,7-8": the calls as ranges.
std::string call_ranges(std::vector<int64_t> calls) {
  std::sort(calls.begin(), calls.end());
  std::string out;
  for (size_t i = 0; i < calls.size();) {
    size_t j = i;
    while (j + 1 < calls.size() && calls[j + 1] == calls[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(calls[i]) + (j > i ? "-" + std::to_string(calls[j]) : "");
    i = j + 1;
  }
  return out;
}

bool same_route(const AttentionProblem& a, const AttentionProblem& b) {
  return a.head_dim == b.head_dim && a.heads_q == b.heads_q && a.heads_kv == b.heads_kv;
}

// The calls whose problems run on candidate i.
std::vector<int64_t> calls_on(const KernelChoice& c, size_t i) {
  std::vector<int64_t> calls;
  for (size_t p = 0; p < c.problems.size(); ++p)
    if (c.problem_selected[p] == i) calls.insert(calls.end(), c.problem_calls[p].begin(), c.problem_calls[p].end());
  return calls;
}

}  // namespace

bool KernelChoice::mixed() const {
  bool other = false;
  for (size_t s : problem_selected) {
    if (s >= candidates.size()) return false;  // (no kernel for some problem: nothing runs)
    other = other || s != selected;
  }
  return other;
}

std::vector<std::string> KernelChoice::call_kernels() const {
  std::vector<std::string> out;
  for (size_t p = 0; p < problems.size(); ++p)
    for (int64_t call : problem_calls[p]) {
      if (static_cast<size_t>(call) >= out.size()) out.resize(static_cast<size_t>(call) + 1);
      out[static_cast<size_t>(call)] = candidates[problem_selected[p]].name;
    }
  return out;
}

std::string KernelChoice::fallback_note() const {
  std::string out = "kernel '" + candidates[0].name + "' refused the problem (" + candidates[0].support.reason + "); ";
  if (!mixed()) return out + "running on '" + candidates[selected].name + "' ([attention].on_fallback = \"warn\")";
  std::string runs;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::vector<int64_t> calls = calls_on(*this, i);
    if (!calls.empty())
      runs += (runs.empty() ? "" : ", ") + ("calls " + call_ranges(calls) + " on '") + candidates[i].name + "'";
  }
  return out + "running " + runs + " ([attention].on_fallback = \"warn\")";
}

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
  const bool split = mixed();
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& c = candidates[i];
    os << "  " << c.name << ": ";
    const std::vector<int64_t> calls = split ? calls_on(*this, i) : std::vector<int64_t>{};
    if (split && !calls.empty()) {
      os << "selected" << (i != 0 ? " (FALLBACK: not the first preference)" : "") << " for calls "
         << call_ranges(calls);
      if (!c.support.ok) os << "; refused for the others: " << c.support.reason;
    } else if (!split && i == selected) {
      os << "selected" << (fallback ? " (FALLBACK: not the first preference)" : "");
      if (!c.support.reason.empty()) os << ": " << c.support.reason;  // e.g. the configuration it runs
    } else if (!c.support.ok) {
      os << "refused: " << c.support.reason;
    } else {
      os << "supported, not needed (an earlier preference was selected)";
    }
    os << "\n";
  }
  return os.str();
}

KernelChoice choose_kernel(const AttentionProblem& problem, std::vector<KernelCandidate> candidates,
                           const std::string& on_fallback) {
  return choose_kernel(std::vector<AttentionProblem>{problem}, std::move(candidates), on_fallback);
}

namespace {

// Candidate c's support for the problems of route r (indices into choice.problems): every one supported, at one
// block size.
Support route_support(const KernelChoice& choice, const KernelCandidate& c, const std::vector<size_t>& r) {
  const AttentionProblem& first = choice.problems[r[0]];
  const BlockSize b = c.kernel->block_size(first);
  Support first_support;  // (problem 0's, with its reason: the configuration it runs)
  for (size_t p : r) {
    Support s = c.kernel->supports(choice.problems[p]);
    if (p == 0) first_support = s;
    if (!s.ok) {
      if (p != 0)
        s.reason += " (for the problem of call " + std::to_string(choice.problem_calls[p][0]) + ": " +
                    choice.problems[p].str() + ")";
      return s;
    }
    const BlockSize a = c.kernel->block_size(choice.problems[p]);
    if (a.q != b.q || a.kv != b.kv)
      return Support::no(c.name + " asks for another mask block size for call " +
                         std::to_string(choice.problem_calls[p][0]) + " than for call " +
                         std::to_string(choice.problem_calls[r[0]][0]) +
                         " (the calls of one head shape read one mask)");
  }
  return r[0] == 0 ? first_support : Support::yes();
}

}  // namespace

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
  // The routes: the distinct problems grouped by head shape, problem 0's first.
  std::vector<std::vector<size_t>> routes;
  for (size_t p = 0; p < choice.problems.size(); ++p) {
    size_t r = 0;
    while (r < routes.size() && !same_route(choice.problems[routes[r][0]], choice.problems[p])) ++r;
    if (r == routes.size()) routes.emplace_back();
    routes[r].push_back(p);
  }
  choice.candidates = std::move(candidates);
  const size_t none = choice.candidates.size();
  choice.problem_selected.assign(choice.problems.size(), none);
  for (size_t i = 0; i < choice.candidates.size(); ++i) {
    auto& c = choice.candidates[i];
    if (!c.kernel) continue;  // the reason was filled by the caller (plugin missing)
    bool all = true;
    for (const std::vector<size_t>& r : routes) {
      const Support s = route_support(choice, c, r);
      if (!s.ok && all) c.support = s, all = false;
      if (all && r[0] == 0) c.support = s;
      if (s.ok && choice.problem_selected[r[0]] == none)
        for (size_t p : r) choice.problem_selected[p] = i;
    }
  }
  choice.selected = choice.problem_selected[0];
  bool found = true;
  for (size_t s : choice.problem_selected) found = found && s != none;
  if (!found) {
    choice.selected = none;
    std::string msg = "no attention kernel in [attention].kernels supports the problem.\n" + choice.report();
    msg += "Add a kernel that supports it (e.g. \"dense_ref\", which accepts every problem) or change the problem.";
    throw FallbackError(msg);
  }
  for (size_t s : choice.problem_selected) choice.fallback = choice.fallback || s != 0;
  if (choice.fallback && on_fallback == "error") {
    std::string msg =
        "attention kernel '" + choice.candidates[0].name +
        "' (first preference) refused the problem: " + choice.candidates[0].support.reason + ".\n" + choice.report() +
        "The run stops before step 0 because [attention].on_fallback = \"error\"; set it to \"warn\" to " +
        std::string(choice.mixed() ? "run the calls it refuses on '" : "run on '") +
        choice.candidates[*std::max_element(choice.problem_selected.begin(), choice.problem_selected.end())].name +
        "' instead (recorded in the log).";
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

void check_shape(const std::string& kernel, const char* what, const at::Tensor& t, const at::Tensor& like) {
  if (!t.defined() || t.sizes() != like.sizes())
    throw std::runtime_error("attention kernel '" + kernel + "' returned " + what + " of shape " +
                             (t.defined() ? c10::str(t.sizes()) : std::string("(none)")) + ", expected " +
                             c10::str(like.sizes()));
}

// The backward of one attention call. It owns what its forward used: the inputs, the
// output and lse, and the StepMask (never the dispatcher's current mask, which a later
// set_mask() may have replaced). The dispatcher outlives every graph of the run.
struct KernelAttentionBackward final : public torch::autograd::Node {
  AttentionDispatcher* dispatcher = nullptr;
  AttentionDispatcher::Route route;  // the kernel that ran the forward, and its mask's block size
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
    AttentionBackward r =
        dispatcher->kernel_of(route).backward(dout, qs, ks, vs, os, lse, mask->at[route.block].tensors, scale);
    const std::string& kernel = dispatcher->name_of(route);
    check_shape(kernel, "dq", r.dq, qs);
    check_shape(kernel, "dk", r.dk, ks);
    check_shape(kernel, "dv", r.dv, vs);
    dispatcher->note(layer, Phase::backward, r.variant, route);
    return {r.dq, r.dk, r.dv};
  }
};

}  // namespace

namespace {

// One forward of the call's kernel under the current mask at its block size, without autograd (attention() and
// attention_lse()): the lengths checked against the mask before, the output's shape after.
AttentionForward kernel_forward(const AttentionDispatcher& d, const AttentionDispatcher::Route& route,
                                const StepMask& mask, int64_t layer, const at::Tensor& qc, const at::Tensor& kc,
                                const at::Tensor& vc, double scale) {
  const BlockMask& bm = mask.at[route.block].mask;
  if (qc.size(2) != bm.q_len || kc.size(2) != bm.kv_len)
    throw std::invalid_argument("attention layer " + std::to_string(layer) + ": q has " + std::to_string(qc.size(2)) +
                                " rows and k " + std::to_string(kc.size(2)) + ", but the mask is " +
                                std::to_string(bm.q_len) + " x " + std::to_string(bm.kv_len));
  AttentionForward r;
  {
    at::NoGradGuard no_grad;
    r = d.kernel_of(route).forward(qc, kc, vc, mask.at[route.block].tensors, scale);
  }
  check_shape(d.name_of(route), "an output", r.out, qc);
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
  const KernelChoice& c = choice_;
  for (size_t p = 0; p < c.problems.size(); ++p) {
    const AttentionProblem& problem = c.problems[p];
    Route r{problem.head_dim, problem.heads_q, problem.heads_kv, c.problem_selected[p]};
    bool known = false;
    for (const Route& o : routes_)
      known = known || (o.head_dim == r.head_dim && o.heads_q == r.heads_q && o.heads_kv == r.heads_kv);
    if (known) continue;
    const BlockSize b = kernel_of(r).block_size(problem);
    r.block = 0;
    while (r.block < blocks_.size() && (blocks_[r.block].q != b.q || blocks_[r.block].kv != b.kv)) ++r.block;
    if (r.block == blocks_.size()) blocks_.push_back(b);
    routes_.push_back(r);
  }
}

const AttentionDispatcher::Route& AttentionDispatcher::route(const at::Tensor& q, const at::Tensor& k) const {
  for (const Route& r : routes_)
    if (q.size(3) == r.head_dim && q.size(1) == r.heads_q && k.size(1) == r.heads_kv) return r;
  return routes_[0];
}

const StepMask& AttentionDispatcher::current() const {
  if (!current_)
    throw std::logic_error("attention called before set_mask() in this run (the drafter must set the mask)");
  return *current_;
}

void AttentionDispatcher::set_mask(const MaskInput& input) {
  // A new StepMask every time: nodes of earlier forwards keep theirs.
  auto m = std::make_shared<StepMask>();
  m->at.resize(blocks_.size());  // (not resized again: tensors.host points into it)
  for (size_t i = 0; i < blocks_.size(); ++i) {
    StepMask::AtBlockSize& at = m->at[i];
    at.mask = generator_->build(input, blocks_[i].q, blocks_[i].kv);
    at.tensors = to_tensors(at.mask, choice_.problem.device);
    at.tensors.host = &at.mask;
  }
  current_ = std::move(m);
}

at::Tensor AttentionDispatcher::attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          double scale) {
  std::shared_ptr<const StepMask> mask = current_;
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Route& via = route(qc, kc);
  // (the kernel's own ops are not recorded: the node below is their gradient)
  const AttentionForward r = kernel_forward(*this, via, current(), layer, qc, kc, vc, scale);
  note(layer, Phase::forward, r.variant, via);
  at::Tensor out = r.out.is_view() ? r.out.clone() : r.out;  // the node's output owns its storage
  if (at::GradMode::is_enabled() && (qc.requires_grad() || kc.requires_grad() || vc.requires_grad())) {
    auto node = std::shared_ptr<KernelAttentionBackward>(new KernelAttentionBackward(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(qc, kc, vc));
    node->dispatcher = this;
    node->route = via;
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
  const Route& via = route(q, k);
  const AttentionForward r =
      kernel_forward(*this, via, current(), layer, q.contiguous(), k.contiguous(), v.contiguous(), scale);
  if (!r.lse.defined() || r.lse.dim() != 3 || r.lse.size(0) != q.size(0) || r.lse.size(1) != q.size(1) ||
      r.lse.size(2) != q.size(2) || r.lse.scalar_type() != at::kFloat)
    throw std::runtime_error("attention kernel '" + name_of(via) + "' returned no float32 log-sum-exp of shape [" +
                             std::to_string(q.size(0)) + ", " + std::to_string(q.size(1)) + ", " +
                             std::to_string(q.size(2)) + "] (the kernel ABI's lse)");
  note(layer, Phase::forward, r.variant, via);
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

void AttentionDispatcher::note(int64_t layer, Phase phase, const std::string& variant, const Route& route) {
  if (ledger_) ledger_->record(layer, phase, variant);
  if (variant_belongs_to(variant, name_of(route))) return;
  const std::string msg = std::string(phase == Phase::forward ? "forward" : "backward") + " of layer " +
                          std::to_string(layer) + " ran '" + variant + "', not a variant of the selected kernel '" +
                          name_of(route) + "'";
  if (events_) events_("fallback", msg);
  if (on_fallback_ == "error")
    throw FallbackError("kernel fallback: " + msg + ". The run stops because [attention].on_fallback = \"error\".");
}

}  // namespace flashdraft

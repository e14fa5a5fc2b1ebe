// Validation on the held-out batches.
#include "eval/eval.hpp"

#include "eval/target_verify.hpp"

#include <flashdraft/acceptance.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include <cmath>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>

namespace flashdraft {

namespace {

// Counts over every draft of the held-out set: the acceptance and, per position, the
// correct and counted proposals (pooled, not a mean of batch ratios).
struct EvalTally {
  Acceptance acceptance;
  std::vector<int64_t> correct, count;
  explicit EvalTally(int64_t positions)
      : correct(static_cast<size_t>(positions), 0), count(static_cast<size_t>(positions), 0) {}

  // Acceptance of the drafts in `r` against `labels` ([D, K]).
  static Acceptance accepted(const StepResult& r, const at::Tensor& labels) {
    const at::Tensor tok = r.drafts.tokens.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor lab = labels.to(at::kCPU, at::kLong).contiguous();
    return greedy_acceptance(tok.data_ptr<int64_t>(), lab.data_ptr<int64_t>(), tok.size(0), tok.size(1));
  }

  void add(const StepResult& r) {
    const at::Tensor tok = r.drafts.tokens.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor lab = r.drafts.labels.to(at::kCPU, at::kLong).contiguous();
    const int64_t drafts = tok.size(0), width = tok.size(1);
    const int64_t* t = tok.data_ptr<int64_t>();
    const int64_t* l = lab.data_ptr<int64_t>();
    const Acceptance a = greedy_acceptance(t, l, drafts, width);
    acceptance.drafts += a.drafts;
    acceptance.accepted += a.accepted;
    const int64_t positions = static_cast<int64_t>(count.size());
    for (int64_t d = 0; d < drafts; ++d)
      for (int64_t j = 0; j < width && j < positions; ++j)
        if (l[d * width + j] >= 0) {
          ++count[static_cast<size_t>(j)];
          correct[static_cast<size_t>(j)] += t[d * width + j] == l[d * width + j];
        }
  }
};

std::string shape_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

}  // namespace

void check_drafts(const Drafts& d, int64_t rows, int64_t seq_len, int64_t positions) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("validation: the drafter's drafts (StepResult::drafts) " + why +
                                "; expected rows and starts [D], tokens and labels [D, K] of integers with K <= " +
                                std::to_string(positions) + " (its metric columns), rows in 0.." +
                                std::to_string(rows - 1) + " and starts in 0.." + std::to_string(seq_len - 1));
  };
  const at::Tensor* all[] = {&d.rows, &d.starts, &d.tokens, &d.labels};
  for (const at::Tensor* t : all)
    if (!at::isIntegralType(t->scalar_type(), /*includeBool=*/false))
      fail("hold a " + shape_of(*t) + " tensor that is not of integers");
  if (d.tokens.dim() != 2 || !d.labels.sizes().equals(d.tokens.sizes()))
    fail("have tokens " + shape_of(d.tokens) + " and labels " + shape_of(d.labels));
  const int64_t D = d.tokens.size(0);
  if (d.rows.dim() != 1 || d.rows.size(0) != D || d.starts.dim() != 1 || d.starts.size(0) != D)
    fail("have rows " + shape_of(d.rows) + " and starts " + shape_of(d.starts) + " for " + std::to_string(D) +
         " drafts");
  if (d.tokens.size(1) > positions)
    fail("have " + std::to_string(d.tokens.size(1)) + " columns for " + std::to_string(positions) + " metric columns");
  if (D == 0) return;
  const at::Tensor r = d.rows.to(at::kCPU, at::kLong), s = d.starts.to(at::kCPU, at::kLong);
  const int64_t rmin = r.min().item<int64_t>(), rmax = r.max().item<int64_t>();
  const int64_t smin = s.min().item<int64_t>(), smax = s.max().item<int64_t>();
  if (rmin < 0 || rmax >= rows) fail("name rows " + std::to_string(rmin) + ".." + std::to_string(rmax));
  if (smin < 0 || smax >= seq_len) fail("start at " + std::to_string(smin) + ".." + std::to_string(smax));
}

ServedValidation::ServedValidation(BoundPlugins& b, const Config& eval, uint64_t seed, const std::string& on_fallback,
                                   AttentionDispatcher::EventSink events)
    : temperature_(eval.real("temperature")),
      top_p_(eval.real("top_p")),
      seed_(seed),
      responses_(eval.integer("served_responses")),
      by_target_(b.served_by_target),
      device_(b.ctx.device) {
  const MaskGenerator* mask = b.served_mask ? b.served_mask.get() : b.mask.get();
  draft_ = std::make_unique<AttentionDispatcher>(b.served_choice, mask, on_fallback, &ledger_, events);
  const int64_t draft_calls = static_cast<int64_t>(b.drafter->decoder_problems(1, b.served_capacity).size());
  columns_ = draft_calls;
  if (by_target_) {
    target_ = std::make_unique<AttentionDispatcher>(b.served_target_choice, b.served_target_mask.get(), on_fallback,
                                                    &ledger_, events);
    target_offset_ = std::make_unique<OffsetAttention>(*target_, draft_calls);
    columns_ += b.target_model.layers;
  }
  context_ = std::make_unique<ServedContext>(ServedContext{
      *b.drafter, *draft_, by_target_ ? b.target.get() : nullptr, target_offset_.get(), b.target_model, b.target_layers,
      b.target ? b.target->stop_tokens() : std::vector<int64_t>{}, b.served_batch, b.ctx.device});
}

namespace {

// A generator of served sampling's own on the run's device, seeded the same way every
// validation (the same draws for the same drafter).
at::Generator sampling_generator(c10::Device device, uint64_t seed) {
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) {
    at::Generator g = at::cuda::detail::createCUDAGenerator(device.index());
    g.set_current_seed(seed);
    return g;
  }
#endif
  (void)device;
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

std::string served_method(const ServedTally& t, double temperature, double top_p) {
  if (t.method != "target") return "data tokens (greedy)";
  if (temperature <= 0) return "target (greedy)";
  std::ostringstream os;
  os << "target (temperature " << temperature << ", top_p " << top_p << ", rejection sampling)";
  return os.str();
}

}  // namespace

void ServedValidation::run(const std::vector<ServedSequence>& all, int64_t step, EvalResult& out) {
  std::vector<ServedSequence> sequences(all.begin(), responses_ > 0 && static_cast<int64_t>(all.size()) > responses_
                                                         ? all.begin() + responses_
                                                         : all.end());
  if (sequences.empty()) {
    out.served_method = "none (no held-out response: no run of loss-carrying tokens after a prompt)";
    return;
  }
  ledger_.begin_step(step, columns_);
  const bool features = sequences[0].features.defined();
  if (features) out.served_data = serve(*context_, sequences, false, Sampling{});
  if (by_target_) {
    at::Generator gen = sampling_generator(device_, seed_ * 0x9E3779B97F4A7C15ULL + 0x5e7d);
    Sampling sampling{temperature_, top_p_, &gen};
    out.served = serve(*context_, sequences, true, sampling);
  } else {
    out.served = out.served_data;
  }
  const ServedTally& t = out.served;
  out.tau_served = t.tau();
  out.tau_served_se = t.standard_error();
  out.tau_served_data = features ? out.served_data.tau() : std::nan("");
  out.served_method = t.method.empty() ? "none (the batches carry no hidden states and the target cannot decode)"
                                       : served_method(t, temperature_, top_p_);
  out.served_responses = t.sequences;
  out.served_steps = t.steps;
  out.served_seconds = t.seconds + (by_target_ && features ? out.served_data.seconds : 0.0);
  out.served_target_seconds = t.target_seconds;
  out.served_histogram = t.histogram;
  out.served_kernels = ledger_.summary(Phase::forward);
}

std::optional<EvalResult> evaluate(const EvalContext& c, int64_t done) {
  const int64_t available = c.batches.eval_batches();
  const int64_t n = c.eval.integer("batches") > 0 ? std::min(c.eval.integer("batches"), available) : available;
  if (n == 0) return std::nullopt;
  at::Generator eval_rng = at::make_generator<at::CPUGeneratorImpl>(c.seed * 0x9E3779B97F4A7C15ULL + 0xe7a1);
  double loss_sum = 0.0;
  std::vector<double> acc_sum(static_cast<size_t>(c.positions), 0.0);
  EvalTally tally(c.positions);
  bool exact = true;                    // every batch came with block proposals
  bool verified = c.target != nullptr;  // ... and the target verified every one
  Acceptance by_target;
  std::vector<ServedSequence> responses;
  int64_t rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    c.ledger.begin_step(done, c.layers);
    Batch batch = c.batches.eval(i);
    if (c.served) {
      std::vector<ServedSequence> more = served_sequences(batch, rows);
      responses.insert(responses.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
      rows += batch.tokens.size(0);
    }
    StepResult r = c.drafter.step(batch, c.dispatcher, eval_rng, /*training=*/false);
    loss_sum += r.loss.item<double>();
    for (size_t j = 0; j < acc_sum.size() && j < r.position_accuracy.size(); ++j) acc_sum[j] += r.position_accuracy[j];
    if (!r.drafts.defined()) {
      exact = false;
      continue;
    }
    check_drafts(r.drafts, batch.tokens.size(0), batch.tokens.size(1), c.positions);
    tally.add(r);
    const at::Tensor labels = verified ? target_verified_labels(*c.target, batch, r) : at::Tensor();
    verified = verified && labels.defined();
    if (verified) {
      const Acceptance a = EvalTally::accepted(r, labels);
      by_target.drafts += a.drafts;
      by_target.accepted += a.accepted;
    }
    if (c.observer) c.observer(batch, r, labels);
  }
  EvalResult out;
  out.step = done;
  out.position_accuracy.resize(static_cast<size_t>(c.positions));
  for (size_t j = 0; j < out.position_accuracy.size(); ++j)
    out.position_accuracy[j] =
        exact ? (tally.count[j] > 0 ? double(tally.correct[j]) / double(tally.count[j]) : 0.0) : acc_sum[j] / double(n);
  out.loss = loss_sum / double(n);
  out.blocks = tally.acceptance.drafts;
  out.tau_data = exact && out.blocks > 0 ? tally.acceptance.tau() : std::nan("");
  verified = verified && exact && by_target.drafts == out.blocks;
  out.tau_anchor = verified ? (out.blocks > 0 ? by_target.tau() : std::nan("")) : out.tau_data;
  out.tau_anchor_method = verified   ? "target verification"
                          : c.target ? "data tokens (the target or the drafter cannot verify)"
                                     : "data tokens (no online target to verify)";
  out.tau_sim = simulated_tau(out.position_accuracy);
  if (c.served)
    c.served->run(responses, done, out);
  else
    out.served_method =
        "none (" + (c.served_off.empty() ? std::string("served validation is off") : c.served_off) + ")";
  return out;
}

void record_eval(RunLog& log, const EvalResult& r) {
  log.append("eval/step", r.step);
  log.append("eval/loss", r.loss);
  log.append("eval/tau_served", r.tau_served);
  log.append("eval/tau_served_se", r.tau_served_se);
  log.append("eval/tau_served_method", r.served_method);
  log.append("eval/tau_served_data", r.tau_served_data);
  log.append("eval/served_responses", r.served_responses);
  log.append("eval/served_steps", r.served_steps);
  log.append("eval/served_seconds", r.served_seconds);
  log.append("eval/served_target_seconds", r.served_target_seconds);
  log.append("eval/served_kernels", r.served_kernels);
  if (log.has("eval/served_histogram")) {
    std::vector<int64_t> h = r.served_histogram;
    h.resize(static_cast<size_t>(log.width("eval/served_histogram")), 0);
    log.append("eval/served_histogram", h);
  }
  log.append("eval/tau_anchor", r.tau_anchor);
  log.append("eval/tau_data", r.tau_data);
  log.append("eval/tau_anchor_method", r.tau_anchor_method);
  log.append("eval/tau_sim", r.tau_sim);
  log.append("eval/blocks", r.blocks);
  log.append("eval/position_accuracy", r.position_accuracy);
  log.flush();
}

std::string eval_line(const EvalResult& r) {
  std::ostringstream os;
  os << "eval  after step " << r.step << ": loss " << std::fixed << std::setprecision(4) << r.loss;
  if (!std::isnan(r.tau_served))
    os << "  tau_served " << std::setprecision(3) << r.tau_served << " +- " << r.tau_served_se << " ("
       << r.served_method << ", " << r.served_responses << " responses, " << r.served_steps << " steps, "
       << std::setprecision(2) << r.served_seconds << " s)";
  else
    os << "  tau_served -- (" << r.served_method << ")";
  if (r.served.method == "target" && !std::isnan(r.tau_served_data))
    os << "  on the data's tokens " << std::setprecision(3) << r.tau_served_data;
  os << "  | tau_anchor " << std::setprecision(3) << r.tau_anchor << " (" << r.tau_anchor_method << ", " << r.blocks
     << " blocks)";
  if (r.tau_anchor_method == "target verification")
    os << "  tau_data " << r.tau_data
       << (r.tau_data == r.tau_anchor ? " (equal)" : " (differs: the data is not the target's greedy output)");
  os << "  tau_sim " << r.tau_sim << "  acc[1..]";
  const auto& acc = r.position_accuracy;
  for (size_t j = 0; j < acc.size() && j < 6; ++j) os << " " << std::setprecision(2) << acc[j];
  if (acc.size() > 6) os << " ...";
  return os.str();
}

}  // namespace flashdraft

// Validation on the held-out batches.
#include "eval.hpp"

#include "target_verify.hpp"

#include <flashdraft/acceptance.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <iomanip>
#include <sstream>

namespace flashdraft {

namespace {

// Counts over every block of the held-out set: the acceptance and, per position, the
// correct and counted predictions (pooled, not a mean of batch ratios).
struct EvalTally {
  Acceptance acceptance;
  std::vector<int64_t> correct, count;
  explicit EvalTally(int64_t positions)
      : correct(static_cast<size_t>(positions), 0), count(static_cast<size_t>(positions), 0) {}

  // Acceptance of the block proposals in `r` against `labels` ([B, N, BS]).
  static Acceptance accepted(const StepResult& r, const at::Tensor& labels) {
    const at::Tensor pred = r.predictions.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor lab = labels.to(at::kCPU, at::kLong).contiguous();
    const int64_t bs = pred.size(-1), blocks = pred.numel() / bs;
    const at::Tensor valid = r.block_valid.defined() ? r.block_valid.to(at::kCPU, at::kByte).contiguous().view({-1})
                                                     : at::ones({blocks}, at::kByte);
    return greedy_acceptance(pred.data_ptr<int64_t>(), lab.data_ptr<int64_t>(), valid.data_ptr<uint8_t>(), blocks, bs);
  }

  void add(const StepResult& r) {
    const at::Tensor pred = r.predictions.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor lab = r.labels.to(at::kCPU, at::kLong).contiguous();
    const int64_t bs = pred.size(-1), blocks = pred.numel() / bs;
    const at::Tensor valid = r.block_valid.defined() ? r.block_valid.to(at::kCPU, at::kByte).contiguous().view({-1})
                                                     : at::ones({blocks}, at::kByte);
    const int64_t* p = pred.data_ptr<int64_t>();
    const int64_t* l = lab.data_ptr<int64_t>();
    const uint8_t* v = valid.data_ptr<uint8_t>();
    const Acceptance a = greedy_acceptance(p, l, v, blocks, bs);
    acceptance.blocks += a.blocks;
    acceptance.accepted += a.accepted;
    const int64_t positions = static_cast<int64_t>(count.size());
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t j = 1; j < bs && j - 1 < positions; ++j)
        if (v[b] && l[b * bs + j] >= 0) {
          ++count[static_cast<size_t>(j - 1)];
          correct[static_cast<size_t>(j - 1)] += p[b * bs + j] == l[b * bs + j];
        }
  }
};

}  // namespace

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
  for (int64_t i = 0; i < n; ++i) {
    c.ledger.begin_step(done, c.layers);
    Batch batch = c.batches.eval(i);
    StepResult r = c.drafter.step(batch, c.dispatcher, eval_rng, /*training=*/false);
    loss_sum += r.loss.item<double>();
    for (size_t j = 0; j < acc_sum.size() && j < r.position_accuracy.size(); ++j) acc_sum[j] += r.position_accuracy[j];
    if (!r.predictions.defined() || !r.labels.defined()) {
      exact = false;
      continue;
    }
    tally.add(r);
    const at::Tensor labels = verified ? target_verified_labels(*c.target, batch, r) : at::Tensor();
    verified = verified && labels.defined();
    if (verified) {
      const Acceptance a = EvalTally::accepted(r, labels);
      by_target.blocks += a.blocks;
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
  out.blocks = tally.acceptance.blocks;
  out.tau_data = exact && out.blocks > 0 ? tally.acceptance.tau() : std::nan("");
  verified = verified && exact && by_target.blocks == out.blocks;
  out.tau = verified ? (out.blocks > 0 ? by_target.tau() : std::nan("")) : out.tau_data;
  out.tau_method = verified   ? "target verification"
                   : c.target ? "data tokens (the target or the drafter cannot verify)"
                              : "data tokens (no online target to verify)";
  out.tau_sim = simulated_tau(out.position_accuracy);
  return out;
}

void record_eval(RunLog& log, const EvalResult& r) {
  log.append("eval/step", r.step);
  log.append("eval/loss", r.loss);
  log.append("eval/tau", r.tau);
  log.append("eval/tau_data", r.tau_data);
  log.append("eval/tau_method", r.tau_method);
  log.append("eval/tau_sim", r.tau_sim);
  log.append("eval/blocks", r.blocks);
  log.append("eval/position_accuracy", r.position_accuracy);
  log.flush();
}

std::string eval_line(const EvalResult& r) {
  std::ostringstream os;
  os << "eval  after step " << r.step << ": loss " << std::fixed << std::setprecision(4) << r.loss << "  tau "
     << std::setprecision(3) << r.tau << " (" << r.tau_method << ", " << r.blocks << " blocks)";
  if (r.tau_method == "target verification")
    os << "  tau_data " << r.tau_data
       << (r.tau_data == r.tau ? " (equal)" : " (differs: the data is not the target's greedy output)");
  os << "  tau_sim " << r.tau_sim << "  acc[1..]";
  const auto& acc = r.position_accuracy;
  for (size_t j = 0; j < acc.size() && j < 6; ++j) os << " " << std::setprecision(2) << acc[j];
  if (acc.size() > 6) os << " ...";
  return os.str();
}

}  // namespace flashdraft

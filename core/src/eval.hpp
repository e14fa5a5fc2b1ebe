// Validation: the held-out batches through the drafter in evaluation mode (no gradient),
// with anchors from a generator of its own seeded the same way every time (every
// validation sees the same blocks; training's generators are not touched, so enabling
// validation does not change training). Measures the loss, per-position accuracy pooled
// over every block, tau_sim from it, and the exact greedy acceptance length of the
// drafter's block proposals (acceptance.hpp): tau by target verification (target_verify.hpp)
// when the run has an online target, and tau_data against the data's tokens.
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/model.hpp>

#include "batches.hpp"
#include "dispatch.hpp"
#include "ledger.hpp"
#include "run_log.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace flashdraft {

struct EvalResult {
  int64_t step = 0;  // optimizer steps completed
  // tau: the acceptance length by target verification when the run has an online target
  // that verifies (tau_method says which); tau_data: leading matches with the data's tokens
  // (equal to tau when the data is the target's own greedy output).
  double loss = 0, tau = 0, tau_data = 0, tau_sim = 0;
  std::string tau_method;
  int64_t blocks = 0;
  std::vector<double> position_accuracy;
};

// Per held-out batch, for tools and tests: the batch, the drafter's result and the labels
// of the target's verification (undefined without one).
using EvalObserver = std::function<void(const Batch&, const StepResult&, const at::Tensor& verified)>;

struct EvalContext {
  Drafter& drafter;
  BatchSource& batches;
  AttentionDispatcher& dispatcher;
  KernelLedger& ledger;
  const Config& eval;  // [eval]
  uint64_t seed;       // [run].seed
  int64_t layers, positions;
  Target* target = nullptr;  // an online target: tau by target verification
  EvalObserver observer = nullptr;
};

// nullopt when the dataset has no held-out batch.
FLASHDRAFT_API std::optional<EvalResult> evaluate(const EvalContext& c, int64_t done);
void record_eval(RunLog& log, const EvalResult& r);
std::string eval_line(const EvalResult& r);

}  // namespace flashdraft

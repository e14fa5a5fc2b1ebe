// Validation: the held-out batches through the drafter in evaluation mode (no gradient),
// with anchors from a generator of its own seeded the same way every time (every
// validation sees the same blocks; training's generators are not touched, so enabling
// validation does not change training). Measures the loss, per-position accuracy pooled
// over every block, tau_sim from it, and the exact greedy acceptance length tau from the
// drafter's block proposals (acceptance.hpp).
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/model.hpp>

#include "batches.hpp"
#include "dispatch.hpp"
#include "ledger.hpp"
#include "run_log.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flashdraft {

struct EvalResult {
  int64_t step = 0;  // optimizer steps completed
  double loss = 0, tau = 0, tau_sim = 0;
  int64_t blocks = 0;
  std::vector<double> position_accuracy;
};

struct EvalContext {
  Drafter& drafter;
  BatchSource& batches;
  AttentionDispatcher& dispatcher;
  KernelLedger& ledger;
  const Config& eval;  // [eval]
  uint64_t seed;       // [run].seed
  int64_t layers, positions;
};

// nullopt when the dataset has no held-out batch.
std::optional<EvalResult> evaluate(const EvalContext& c, int64_t done);
void record_eval(RunLog& log, const EvalResult& r);
std::string eval_line(const EvalResult& r);

}  // namespace flashdraft

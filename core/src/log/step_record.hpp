// Recording a step: its row in every /steps, /memory and /kernels column of the log
// (flushed: a crash keeps it), and its progress line on the console. The kernel columns
// come from the step's own copy of the ledger (StepOutcome::kernels), so a step recorded
// after the next one was queued still reports what it ran.
#pragma once

#include "dispatch/ledger.hpp"
#include "log/log_schema.hpp"
#include "log/run_log.hpp"
#include "train/train_step.hpp"

#include <string>

namespace flashdraft {

class StepRecorder {
 public:
  // `names_written`: variant names the log already holds (a resumed log's).
  StepRecorder(RunLog& log, LogShape shape, int64_t names_written)
      : log_(log), shape_(std::move(shape)), names_written_(names_written) {}
  void record(const StepOutcome& o);
  std::string line(const StepOutcome& o, int64_t steps) const;

 private:
  RunLog& log_;
  LogShape shape_;
  int64_t names_written_;
};

}  // namespace flashdraft

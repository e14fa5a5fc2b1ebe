// How a run reports a failure: one sentence on stderr ("error: ..."), an event in the
// log when there is one, and the exit code. `run` and `validate` share it, so a defect
// found before step 0 reads and exits the same in both.
#pragma once

#include "log/run_log_setup.hpp"

#include <cstdint>
#include <exception>
#include <string>

namespace flashdraft {

enum ExitCode : int { kFinished = 0, kFailed = 1, kBadExperiment = 2, kInterrupted = 130 };

// A failure while reading the experiment (setup.cpp): always a bad experiment.
int report_setup_error(const std::exception& e);
// A failure after set-up. `step` is the step in flight (-1: before step 0); `events`
// and `log_path` are where it is recorded, when the log exists.
int report_run_error(const std::exception& e, int64_t step, EventLog* events, const std::string& log_path);

}  // namespace flashdraft

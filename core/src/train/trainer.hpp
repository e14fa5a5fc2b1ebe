// The training run and `flashdraft validate`. A run is a list of stages, each in a file
// named for it:
//   setup.cpp          the experiment, the registry, the plugins and their tables
//   bind.cpp           plugins instantiated, the data opened, the drafter bound, the kernel chosen
//   resume.cpp         where the run starts (fresh, or a checkpoint and its log)
//   run_log_setup.cpp  the log created or reopened; its columns (log_schema.cpp); /events
//   optimizer.cpp      AdamW and the learning-rate schedule
//   rng_state.cpp      generator states into and out of checkpoints
//   eval.cpp           validation on the held-out batches (loss, accuracy, tau, tau_sim)
//   checkpointing.cpp  the run's checkpoints
//   train_step.cpp     one optimizer step
//   step_record.cpp    a step's row in the log and its console line
//   run_errors.cpp     how failures are reported (message, event, exit code)
// trainer.cpp puts them in order.
#pragma once

#include "config/run_options.hpp"

#include <flashdraft/export.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

// Exit codes: 0 finished; 1 error before or during the run (the log keeps every
// finished step); 2 bad experiment; 130 interrupted.
FLASHDRAFT_API int run_experiment(const RunOptions& options);
// A dry run: every stage `run` goes through before step 0 that can refuse the
// experiment (setup and bind: plugins instantiated, data opened, drafter bound, kernel
// chosen), without training or writing a log. Reports what `run` would report before
// step 0, with the same message and exit code; prints what would run.
FLASHDRAFT_API int validate_experiment(const RunOptions& options);

}  // namespace flashdraft

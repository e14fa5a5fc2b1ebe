// The training run: set-up (registry, plugins, kernel choice, log) and the loop.
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct RunOptions {
  std::string experiment;                // path of the TOML file
  std::string out;                       // overrides [run].out
  int64_t steps = -1;                    // overrides [run].steps
  std::vector<std::string> plugin_paths; // --plugin-path
  std::string resume;                    // "", "latest" or a checkpoint folder
};

// Exit codes: 0 finished; 1 error before or during the run (the log keeps every
// finished step); 2 bad experiment; 130 interrupted.
FLASHDRAFT_API int run_experiment(const RunOptions& options);
// Checks the experiment and every plugin table without running; prints what would run.
FLASHDRAFT_API int validate_experiment(const RunOptions& options);

}  // namespace flashdraft

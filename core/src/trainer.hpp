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

// Exact greedy acceptance of block proposals, as speculative decoding with greedy
// verification measures it: in each valid block (block_valid[b] != 0, labels[b][1] >= 0)
// the target accepts drafted tokens j = 1, 2, ... while predictions[b][j] == labels[b][j]
// (labels < 0 end the block: no target token to verify against). Returns the number of
// blocks counted and the sum of accepted tokens; tau = 1 + accepted / blocks (the +1 is
// the token the target emits itself after the last accepted one).
// predictions, labels: [blocks, block_size]; block_valid: [blocks] (null: all valid).
struct Acceptance {
  int64_t blocks = 0;
  int64_t accepted = 0;
};
FLASHDRAFT_API Acceptance greedy_acceptance(const int64_t* predictions, const int64_t* labels,
                                            const uint8_t* block_valid, int64_t blocks, int64_t block_size);

}  // namespace flashdraft

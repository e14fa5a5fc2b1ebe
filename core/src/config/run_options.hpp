// What the command line gives a run or a validation (`flashdraft run` / `validate`): the
// experiment file and the flags that override or extend it. Read by setup (the registry's
// search path), resume and the trainer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct RunOptions {
  std::string experiment;                 // path of the TOML file
  std::string out;                        // overrides [run].out
  int64_t steps = -1;                     // overrides [run].steps
  std::vector<std::string> plugin_paths;  // --plugin-path
  std::string resume;                     // "", "latest" or a checkpoint folder
  std::string profile;                    // --profile A:B ("" = none)
};

}  // namespace flashdraft

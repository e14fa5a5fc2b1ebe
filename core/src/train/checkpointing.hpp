// The checkpoint stage of a run: what a checkpoint of this run holds (weights,
// optimizer, generators, data position, the log's row counts) written through
// checkpoint.hpp, and the drafter's table as it is recorded with checkpoints and exports.
#pragma once

#include <flashdraft/config.hpp>

#include "log/run_log.hpp"
#include "train/checkpoint.hpp"

#include <ATen/core/Generator.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {
class TrainOptimizer;
}

namespace flashdraft {

// The plugin's table as TOML with every declared key resolved (defaults filled in).
std::string table_toml(const std::string& table, const std::string& plugin, const Schema& schema, const Config& c);

struct RunCheckpoint {
  std::filesystem::path root;  // <run folder>/checkpoints
  int64_t keep = 2;
  std::string log_path;
  std::string drafter_plugin, drafter_toml;
};

// Writes <root>/step_<done> (atomic; older ones beyond `keep` removed) and returns it.
std::filesystem::path save_checkpoint(const RunCheckpoint& what, int64_t done, const RunLog& log,
                                      const std::vector<std::pair<std::string, at::Tensor>>& weights,
                                      TrainOptimizer& optimizer, const at::Generator& anchors, c10::Device device);

}  // namespace flashdraft

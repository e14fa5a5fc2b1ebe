// Where a run starts: a fresh run (a new log <out>/<name>.h5) or a resumed one (the
// checkpoint to load, and the log of the run it continues).
#pragma once

#include "config/run_options.hpp"
#include "train/checkpoint.hpp"

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

struct ResumePoint {
  std::filesystem::path dir;              // the checkpoint folder; empty for a fresh run
  checkpoint::Manifest manifest;          // its manifest (resumed runs)
  std::filesystem::path checkpoint_root;  // where this run's checkpoints go
  std::string log_path;                   // the log this run writes (a resumed run appends)
  bool resumed() const { return !dir.empty(); }
};

// --resume latest: the newest usable checkpoint under <out>/checkpoints (each skipped
// one reported through `say`); --resume DIR: that folder, checked. A resumed run
// continues in the folder of its checkpoint and appends to the log named in the manifest.
// Throws checkpoint::Error with the reason.
ResumePoint find_resume_point(const RunOptions& options, const std::filesystem::path& out_dir,
                              const std::string& run_name,
                              const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                              const std::function<void(const std::string&)>& say);

// A run resumes with the world size and accumulation of the run it continues (their
// product and order fix which training batches each step reads); otherwise a sentence
// (checkpoint::Error) says what to launch. Logs without these attributes: 1 and 1.
void check_same_world(const ResumePoint& resume, int64_t world, int64_t accumulate);

// Checkpoints past the resumed one belong to the abandoned continuation: set aside
// (renamed abandoned_step_<n>), not deleted, so that `latest` and `keep` never pick them.
void set_aside_later_checkpoints(const ResumePoint& resume);

}  // namespace flashdraft

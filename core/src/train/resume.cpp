// Finding the point a run starts from.
#include "train/resume.hpp"

#include "log/run_log.hpp"

#include <map>

#include <iostream>

namespace fs = std::filesystem;

namespace flashdraft {

namespace {

std::string unique_log_path(const fs::path& dir, const std::string& name) {
  fs::path p = dir / (name + ".h5");
  for (int i = 1; fs::exists(p); ++i) p = dir / (name + "-" + std::to_string(i) + ".h5");
  return p.string();
}

}  // namespace

ResumePoint find_resume_point(const RunOptions& options, const fs::path& out_dir, const std::string& run_name,
                              const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                              const std::function<void(const std::string&)>& say) {
  ResumePoint r;
  r.checkpoint_root = out_dir / "checkpoints";
  if (options.resume.empty()) {
    r.log_path = unique_log_path(out_dir, run_name);
    return r;
  }
  if (options.resume == "latest") {
    r.dir = checkpoint::latest(r.checkpoint_root, parameters, say);
  } else {
    r.dir = options.resume;
    const std::string why = checkpoint::check(r.dir, parameters);
    if (!why.empty()) throw checkpoint::Error("cannot resume: " + why);
  }
  r.manifest = checkpoint::read_manifest(r.dir);
  // <run folder>/checkpoints/step_<n>: the run continues in the checkpoint's folder, and
  // its log is <run folder>/<log_file>.
  r.checkpoint_root = fs::absolute(r.dir).parent_path();
  r.log_path = (r.checkpoint_root.parent_path() / r.manifest.log_file).string();
  if (!fs::exists(r.log_path))
    throw checkpoint::Error("cannot resume from " + r.dir.string() + ": its run log " + r.log_path +
                            " does not exist (the log is appended to; it must stay next to checkpoints/)");
  return r;
}

void check_same_world(const ResumePoint& resume, int64_t world, int64_t accumulate) {
  std::map<std::string, std::string> attrs;
  {
    LogReader reader(resume.log_path);
    if (reader.exists("steps/step")) attrs = reader.attributes("steps");
  }
  auto value = [&](const char* key) { return attrs.count(key) ? std::stoll(attrs[key]) : int64_t{1}; };
  const int64_t was_world = value("world_size"), was_accumulate = value("accumulate");
  if (was_world == world && was_accumulate == accumulate) return;
  throw checkpoint::Error(
      "cannot resume from " + resume.dir.string() + ": it was trained by " + std::to_string(was_world) + " process" +
      (was_world == 1 ? "" : "es") + " with [optimizer] accumulate = " + std::to_string(was_accumulate) +
      ", this run has " + std::to_string(world) + " with accumulate = " + std::to_string(accumulate) +
      " (resuming with another world size is not supported: launch " +
      (was_world == 1 ? std::string("a single process") : "torchrun --nproc-per-node " + std::to_string(was_world)) +
      " and the same accumulate)");
}

void set_aside_later_checkpoints(const ResumePoint& resume) {
  for (const auto& dir : checkpoint::list(resume.checkpoint_root)) {
    if (fs::equivalent(dir, resume.dir)) continue;
    const int64_t other = std::stoll(dir.filename().string().substr(5));  // list() only returns step_<digits>
    if (other > resume.manifest.step) {
      const fs::path aside = resume.checkpoint_root / ("abandoned_" + dir.filename().string());
      checkpoint::remove_tree(aside);
      fs::rename(dir, aside);
      std::cout << "resume: " << dir.string() << " is past the resumed step; moved to " << aside.string() << std::endl;
    }
  }
}

}  // namespace flashdraft

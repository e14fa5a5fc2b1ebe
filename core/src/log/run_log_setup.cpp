// Creating, reopening and describing the run log.
#include "log/run_log_setup.hpp"

#include "dispatch/lm_head_loss.hpp"

#include <ATen/ATen.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace fs = std::filesystem;

namespace flashdraft {

namespace detail {
const char* git_revision();  // generated at build time (cmake/FlashdraftRevision.cmake)
}  // namespace detail

namespace {

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "cpu";
}

std::string device_name(c10::Device device) {
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) return at::cuda::getCurrentDeviceProperties()->name;
#endif
  return cpu_name();
}

// Root attributes: what ran, on what, from which files.
std::map<std::string, std::string> run_attributes(const Setup& s, const BoundPlugins& b) {
  const Experiment& ex = s.experiment;
  std::map<std::string, std::string> attrs;
  attrs["experiment"] = ex.text();
  attrs["experiment_path"] = fs::absolute(ex.path()).string();
  attrs["flashdraft_version"] = FLASHDRAFT_VERSION;
  attrs["git_revision"] = detail::git_revision();
  attrs["torch_version"] = FLASHDRAFT_TORCH_VERSION;
  attrs["torch_cuda"] = FLASHDRAFT_WITH_CUDA ? "yes" : "no";
  attrs["device"] = b.ctx.device.str();
  attrs["device_name"] = device_name(b.ctx.device);
  attrs["start_time"] = now_iso();
  attrs["dtype"] = dtype_name(b.ctx.dtype);
  attrs["precision"] = b.precision.describe();
  // The variant [loss] resolves to on this device (what /kernels/loss records every step).
  attrs["loss_kernel"] =
      LmHeadLoss(b.loss_choice.name(), b.loss_choice.chunk_rows, {}, b.loss_choice.problem).describe() +
      (b.loss_choice.fallback ? " (FALLBACK: not the first preference)" : "");
  attrs["data_source"] = b.dataset->source();
  if (b.target) attrs["target"] = b.target_model.source;
  std::string plugins;
  auto plugin_line = [&](const std::string& role, const FoundPlugin& p) {
    attrs["plugin." + role] = p.name + " " + p.version + " " + p.path;
    plugins += role + " " + p.name + " " + p.version + " " + p.path + "\n";
  };
  for (const PluginKind kind : {PluginKind::drafter, PluginKind::dataset, PluginKind::mask})
    plugin_line(to_string(kind), *s.use(kind).plugin);
  for (const auto& [kind, use] : s.named)
    if (kind != PluginKind::drafter && kind != PluginKind::dataset && kind != PluginKind::mask)
      plugin_line(to_string(kind), *use.plugin);
  for (const PluginUse& k : s.kernels)
    if (k.plugin) plugin_line("kernel", *k.plugin);
  attrs["plugins"] = plugins;
  return attrs;
}

// The kernel each ledger column's calls are to run, one line per column (drafter calls, the target's, the LM-head
// loss): where a choice is mixed (KernelChoice::problem_selected), the columns of one run differ. A variant belongs to
// its column's line as the engine checks it (variant_belongs_to); notebooks judge fallbacks by it.
std::string column_kernels(const BoundPlugins& b) {
  std::string out;
  const auto add = [&out](const KernelChoice& choice, int64_t calls) {
    const std::vector<std::string> kernels = choice.call_kernels();
    for (int64_t c = 0; c < calls; ++c)
      out += (static_cast<size_t>(c) < kernels.size() ? kernels[static_cast<size_t>(c)]
                                                      : choice.candidates[choice.selected].name) +
             "\n";
  };
  add(b.choice, b.drafter->attention_layers());
  if (b.target_attends()) add(b.target_choice, b.target_calls);
  const LossChoice& loss = b.loss_choice;
  return out + LmHeadLoss(loss.name(), loss.chunk_rows, {}, loss.problem).variant();
}

}  // namespace

void EventLog::attach(RunLog* log) {
  log_ = log;
  for (const auto& [step, kind, message] : pending_) {
    log_->append("events/step", step);
    log_->append("events/kind", kind);
    log_->append("events/message", message);
  }
  pending_.clear();
  log_->flush();
}

void EventLog::add(int64_t step, const std::string& kind, const std::string& message) {
  if (!log_) {
    pending_.emplace_back(step, kind, message);
    return;
  }
  log_->append("events/step", step);
  log_->append("events/kind", kind);
  log_->append("events/message", message);
  log_->flush();
}

OpenedLog open_run_log(const Setup& s, const BoundPlugins& b, const ResumePoint& resume, const LogShape& shape,
                       EventLog& events) {
  OpenedLog out;
  if (!resume.resumed()) {
    out.log = std::make_unique<RunLog>(resume.log_path, run_attributes(s, b));
  } else {
    {
      LogReader reader(resume.log_path);
      if (reader.exists("kernels/names")) out.kernel_names = reader.strings("kernels/names");
    }
    out.log = RunLog::reopen(resume.log_path);
  }
  RunLog& log = *out.log;
  declare_log_columns(log, shape);
  const c10::Device device = b.ctx.device;
  // Which training batches the steps read: a resumed run must keep them (resume.hpp).
  log.set_group_attribute("steps", "world_size", std::to_string(shape.ranks));
  log.set_group_attribute("steps", "accumulate", std::to_string(shape.accumulate));
  // The per-position metric's columns by name, one per line (steps/ and eval/position_accuracy).
  std::string names;
  for (const std::string& n : shape.position_names) names += (names.empty() ? "" : "\n") + n;
  log.set_group_attribute("steps", "position_names", names);
  log.set_group_attribute("eval", "position_names", names);
  log.set_group_attribute("memory", "device", device.str());
  log.set_group_attribute("memory", "method",
                          device.is_cpu() ? "tracking CPU allocator (live tensor bytes)"
                                          : "CUDA caching allocator statistics (allocated bytes)");
  const KernelChoice& choice = b.choice;
  log.set_group_attribute("kernels", "selected", choice.candidates[choice.selected].name);
  log.set_group_attribute("kernels", "problem", choice.problem.str());
  log.set_group_attribute("kernels", "selection", choice.report());
  log.set_group_attribute("kernels", "on_fallback", s.experiment.attention().string("on_fallback"));
  log.set_group_attribute("kernels", "loss_on_fallback", s.experiment.loss().string("on_fallback"));
  log.set_group_attribute(
      "kernels", "columns",
      "drafter " + std::string(b.choice.problems.size() > 1 ? "attention calls" : "layers") + " 0.." +
          std::to_string(b.drafter->attention_layers() - 1) +
          (b.target ? ", then the target's attention calls 0.." + std::to_string(b.target_calls - 1) : std::string()));
  if (b.target_attends()) {
    log.set_group_attribute("kernels", "target_selected", b.target_choice.candidates[b.target_choice.selected].name);
    log.set_group_attribute("kernels", "target_selection", b.target_choice.report());
  }
  log.set_group_attribute("kernels", "column_kernels", column_kernels(b));
  if (resume.resumed()) {
    // Cut every dataset back to its rows at the checkpoint, so the resumed steps follow
    // the checkpoint's exactly. /events is history and is kept whole.
    const auto& rows = resume.manifest.log_rows;
    for (const auto& name : log.names())
      if (name.rfind("events/", 0) != 0) {
        const auto it = rows.find(name);
        log.truncate(name, it == rows.end() ? 0 : it->second);
      }
    const auto it = rows.find("kernels/names");
    out.kernel_names.resize(std::min(out.kernel_names.size(), static_cast<size_t>(it == rows.end() ? 0 : it->second)));
  }
  log.start();
  events.attach(&log);
  std::cout << "log: " << resume.log_path << std::endl;
  return out;
}

}  // namespace flashdraft

// The run log before step 0: created with the run's attributes (or reopened and cut back
// to the checkpoint's rows on resume), its columns declared (log_schema.hpp), the kernel
// selection attached; and /events, which also takes events from before the log exists.
#pragma once

#include "config/setup.hpp"
#include "log/log_schema.hpp"
#include "log/run_log.hpp"
#include "registry/bind.hpp"
#include "train/resume.hpp"

#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace flashdraft {

// /events of the log. Events before attach() wait and are written in order by it.
class EventLog {
 public:
  void attach(RunLog* log);
  void add(int64_t step, const std::string& kind, const std::string& message);
  bool attached() const { return log_ != nullptr; }

 private:
  RunLog* log_ = nullptr;
  std::vector<std::tuple<int64_t, std::string, std::string>> pending_;
};

struct OpenedLog {
  std::unique_ptr<RunLog> log;
  // Variant names a resumed log already holds (cut back to the checkpoint), in id order.
  std::vector<std::string> kernel_names;
};

// Creates or reopens the log (in SWMR mode on return) and attaches `events` to it.
OpenedLog open_run_log(const Setup& setup, const BoundPlugins& plugins, const ResumePoint& resume,
                       const LogShape& shape, EventLog& events);

}  // namespace flashdraft

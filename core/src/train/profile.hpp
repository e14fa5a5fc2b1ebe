// `flashdraft run --profile A:B`: LibTorch's profiler (Kineto) over steps A..B-1. Writes
// a Chrome trace next to the log and prints where the device time went, per op family
// (matrix products, attention, LM-head loss parts, norms, elementwise, copies, optimizer),
// as milliseconds per step and shares of the device's busy time, and where the device sat idle
// waiting for the host (device_idle).
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

struct ProfileWindow {
  int64_t first = -1, last = -1;  // steps [first, last); first < 0: no profiling
  bool on() const { return first >= 0 && last > first; }
};

// Parses "A:B" (0-based steps, B exclusive) or "A" (one step); throws
// std::invalid_argument with a sentence.
FLASHDRAFT_API ProfileWindow parse_profile_window(const std::string& text);

// Where the device waited for the host: the gaps between its kernels (kernels of every stream
// merged) inside the profiled window, and for each gap of at least `min_gap_ns` the host op
// that overlapped it most, named "outermost > that op" (deeper ops win ties: a synchronize
// inside a copy names both). Times in one clock, nanoseconds.
struct TimedSpan {
  int64_t start = 0, end = 0;
  std::string name;
  uint64_t thread = 0;  // host spans nest within their thread
};
struct DeviceIdle {
  double idle_ns = 0;                                  // every gap between the first and last kernel
  int64_t long_gaps = 0;                               // gaps of at least min_gap_ns
  std::vector<std::pair<double, std::string>> causes;  // ns of long gaps per host op, longest first
};
FLASHDRAFT_API DeviceIdle device_idle(std::vector<TimedSpan> kernels, std::vector<TimedSpan> host, int64_t min_gap_ns);

// The device time of each named part of a step: the engine marks the online target's forward,
// the drafter's forward, the backward and the optimizer as host ranges ("flashdraft/target_forward"
// ...); a kernel belongs to the range that holds the start of the host op that launched it
// (`launched_at`, host ns; < 0: no known launching op). Per part: the kernels' time, and the span
// from its first kernel's start to its last kernel's end summed over the part's occurrences
// (span - kernels: the device idle, or running another part's kernels, inside the part).
struct LaunchedKernel {
  int64_t start = 0, end = 0;  // device ns
  std::string name;
  int64_t launched_at = -1;  // host ns
};
struct PartTime {
  std::string part;  // the range's name; "(outside the named parts)" for the rest
  double kernel_ns = 0, span_ns = 0;
  int64_t occurrences = 0;
  std::vector<std::pair<double, std::string>> kernels;  // ns per kernel name (with its calls), longest first
};
FLASHDRAFT_API std::vector<PartTime> device_parts(const std::vector<LaunchedKernel>& kernels,
                                                  const std::vector<TimedSpan>& ranges);

class FLASHDRAFT_API StepProfiler {
 public:
  StepProfiler(ProfileWindow window, std::string trace_path);
  ~StepProfiler();
  void before_step(int64_t step);
  // Stops after the window's last step: saves the trace and prints the table.
  void after_step(int64_t step);
  // Host seconds of a step's phases (while profiling), printed per step with the table.
  void note_host(const std::vector<std::pair<std::string, double>>& phases);

 private:
  ProfileWindow window_;
  std::string trace_path_;
  bool active_ = false;
  double wall_ms_ = 0;
  int64_t wall_start_ns_ = 0;
  std::vector<std::pair<std::string, double>> host_phases_;
};

}  // namespace flashdraft

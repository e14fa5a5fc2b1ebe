// The step profiler (profile.hpp).
#include "train/profile.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <map>
#include <regex>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace flashdraft {

namespace {

namespace prof = torch::profiler::impl;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The family of a device kernel, from its name (first match wins).
std::string family_of(const std::string& name) {
  static const std::vector<std::pair<std::regex, std::string>> families = {
      {std::regex("flash_cuda|flash_(fwd|bwd)|wg_(fwd|bwd)", std::regex::icase), "attention (flash kernels)"},
      {std::regex("cuda_ops::.*adamw_kernel"), "optimizer (fused AdamW, norms)"},
      {std::regex("cuda_ops::.*ce_rows_kernel"), "LM-head loss (softmax, gather, argmax)"},
      {std::regex("cuda_ops::.*gate_up_swiglu"), "matrix products"},
      {std::regex("cuda_ops::.*swiglu"), "elementwise (RoPE, SiLU, adds, casts)"},
      {std::regex("fused_adam|FusedAdam|multi_tensor_apply|foreach", std::regex::icase),
       "optimizer (fused AdamW, norms)"},
      {std::regex("gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_", std::regex::icase), "matrix products"},
      {std::regex("softmax|nll|cross_entropy|argmax|scatter|gather", std::regex::icase),
       "LM-head loss (softmax, gather, argmax)"},
      {std::regex("rms_norm|RmsNorm|rmsnorm|layer_norm", std::regex::icase), "RMSNorm"},
      {std::regex("memcpy|memset|copy|cat|index|Indexing", std::regex::icase), "copies, cat, index"},
      {std::regex("reduce", std::regex::icase), "reductions"},
      {std::regex("elementwise|vectorized|unrolled", std::regex::icase), "elementwise (RoPE, SiLU, adds, casts)"},
  };
  for (const auto& [re, fam] : families)
    if (std::regex_search(name, re)) return fam;
  return "other";
}

// The 15 longest entries of `totals` (name -> (ms, calls)), as ms per step.
void print_longest(std::ostream& os, const std::string& title,
                   const std::map<std::string, std::pair<double, int64_t>>& totals, double steps) {
  std::vector<std::pair<double, std::string>> top;
  for (const auto& [n, k] : totals) top.emplace_back(k.first, n + " (" + std::to_string(k.second) + " calls)");
  std::sort(top.rbegin(), top.rend());
  os << "  " << title << ":\n";
  for (size_t i = 0; i < top.size() && i < 15; ++i)
    os << "    " << std::setw(8) << top[i].first / steps << "  " << top[i].second << "\n";
}

// The device time of the step's parts (device_parts), ms per step, with each part's longest kernels.
void print_parts(std::ostream& os, const std::vector<PartTime>& parts, double steps) {
  os << "  device time by part of the step (ms/step; span: its first kernel's start to its last kernel's end):\n";
  for (const PartTime& p : parts) {
    os << "    " << std::left << std::setw(26) << p.part << std::right << " kernels " << std::setw(8)
       << p.kernel_ns / 1e6 / steps << "  span " << std::setw(8) << p.span_ns / 1e6 / steps << "  span - kernels "
       << std::setw(7) << (p.span_ns - p.kernel_ns) / 1e6 / steps << "\n";
    for (size_t i = 0; i < p.kernels.size() && i < 8; ++i)
      os << "      " << std::setw(8) << p.kernels[i].first / 1e6 / steps << "  " << p.kernels[i].second << "\n";
  }
}

// For each host span, its depth and outermost ancestor within its thread.
struct Nesting {
  std::vector<int> depth;
  std::vector<size_t> root;
};
Nesting nest(const std::vector<TimedSpan>& host) {  // host sorted by (thread, start, -end)
  Nesting n{std::vector<int>(host.size()), std::vector<size_t>(host.size())};
  std::vector<size_t> open;
  for (size_t i = 0; i < host.size(); ++i) {
    const TimedSpan& h = host[i];
    while (!open.empty() && (host[open.back()].thread != h.thread || host[open.back()].end < h.end)) open.pop_back();
    n.depth[i] = static_cast<int>(open.size());
    n.root[i] = open.empty() ? i : n.root[open.front()];
    open.push_back(i);
  }
  return n;
}

}  // namespace

DeviceIdle device_idle(std::vector<TimedSpan> kernels, std::vector<TimedSpan> host, int64_t min_gap_ns) {
  DeviceIdle r;
  if (kernels.empty()) return r;
  std::sort(kernels.begin(), kernels.end(), [](const TimedSpan& a, const TimedSpan& b) { return a.start < b.start; });
  std::sort(host.begin(), host.end(), [](const TimedSpan& a, const TimedSpan& b) {
    return std::tie(a.thread, a.start, b.end) < std::tie(b.thread, b.start, a.end);
  });
  const Nesting n = nest(host);
  std::map<std::string, double> by_cause;
  int64_t busy_until = kernels.front().end;
  for (const TimedSpan& k : kernels) {
    const int64_t a = busy_until, b = k.start;
    busy_until = std::max(busy_until, k.end);
    if (b <= a) continue;
    r.idle_ns += double(b - a);
    if (b - a < min_gap_ns) continue;
    ++r.long_gaps;
    size_t best = host.size();
    int64_t best_overlap = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      const int64_t overlap = std::min(b, host[i].end) - std::max(a, host[i].start);
      if (overlap > best_overlap || (overlap > 0 && overlap == best_overlap && n.depth[i] > n.depth[best]))
        best = i, best_overlap = overlap;
    }
    std::string cause = "(no host op)";
    if (best < host.size())
      cause = n.root[best] == best ? host[best].name : host[n.root[best]].name + " > " + host[best].name;
    by_cause[cause] += double(b - a);
  }
  for (const auto& [cause, ns] : by_cause) r.causes.emplace_back(ns, cause);
  std::sort(r.causes.rbegin(), r.causes.rend());
  return r;
}

std::vector<PartTime> device_parts(const std::vector<LaunchedKernel>& kernels, const std::vector<TimedSpan>& ranges) {
  const std::string outside = "(outside the named parts)";
  struct Occurrence {
    int64_t first = INT64_MAX, last = INT64_MIN;
  };
  std::vector<Occurrence> occurrence(ranges.size() + 1);  // per range, then the rest
  std::map<std::string, size_t> index;                    // part name -> row
  std::vector<PartTime> parts;
  std::vector<std::map<std::string, std::pair<double, int64_t>>> by_name;
  auto row = [&](const std::string& part) {
    const auto [it, fresh] = index.emplace(part, parts.size());
    if (fresh) {
      parts.push_back(PartTime{part, 0, 0, 0, {}});
      by_name.emplace_back();
    }
    return it->second;
  };
  for (const TimedSpan& r : ranges) row(r.name);
  for (const LaunchedKernel& k : kernels) {
    size_t in = ranges.size();  // the innermost (latest-starting) range holding the launch
    for (size_t i = 0; i < ranges.size(); ++i)
      if (k.launched_at >= ranges[i].start && k.launched_at <= ranges[i].end &&
          (in == ranges.size() || ranges[i].start >= ranges[in].start))
        in = i;
    const size_t r = row(in < ranges.size() ? ranges[in].name : outside);
    parts[r].kernel_ns += double(k.end - k.start);
    auto& n = by_name[r][k.name];
    n.first += double(k.end - k.start);
    ++n.second;
    occurrence[in].first = std::min(occurrence[in].first, k.start);
    occurrence[in].last = std::max(occurrence[in].last, k.end);
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (occurrence[i].last < occurrence[i].first) continue;
    PartTime& p = parts[row(ranges[i].name)];
    p.span_ns += double(occurrence[i].last - occurrence[i].first);
    ++p.occurrences;
  }
  if (occurrence[ranges.size()].last >= occurrence[ranges.size()].first) {  // no span: kernels only
    PartTime& p = parts[row(outside)];
    p.span_ns = p.kernel_ns;
    p.occurrences = 1;
  }
  for (size_t r = 0; r < parts.size(); ++r) {
    for (const auto& [name, t] : by_name[r])
      parts[r].kernels.emplace_back(t.first, name + " (" + std::to_string(t.second) + " calls)");
    std::sort(parts[r].kernels.rbegin(), parts[r].kernels.rend());
  }
  parts.erase(std::remove_if(parts.begin(), parts.end(), [](const PartTime& p) { return p.occurrences == 0; }),
              parts.end());
  return parts;
}

ProfileWindow parse_profile_window(const std::string& text) {
  ProfileWindow w;
  const auto colon = text.find(':');
  try {
    size_t used = 0;
    w.first = std::stoll(text.substr(0, colon), &used);
    if (used != text.substr(0, colon).size()) throw std::invalid_argument("");
    w.last = colon == std::string::npos ? w.first + 1 : std::stoll(text.substr(colon + 1), &used);
    if (colon != std::string::npos && used != text.substr(colon + 1).size()) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw std::invalid_argument("--profile " + text +
                                ": expected A:B (0-based steps A..B-1) or A, e.g. --profile 5:10");
  }
  if (w.first < 0 || w.last <= w.first)
    throw std::invalid_argument("--profile " + text + ": expected 0 <= A < B, e.g. --profile 5:10");
  return w;
}

StepProfiler::StepProfiler(ProfileWindow window, std::string trace_path)
    : window_(window), trace_path_(std::move(trace_path)) {}

StepProfiler::~StepProfiler() {
  if (active_) torch::autograd::profiler::disableProfiler();
}

void StepProfiler::before_step(int64_t step) {
  if (!window_.on() || step != window_.first) return;
  const std::set<prof::ActivityType> activities =
      torch::cuda::is_available() ? std::set<prof::ActivityType>{prof::ActivityType::CPU, prof::ActivityType::CUDA}
                                  : std::set<prof::ActivityType>{prof::ActivityType::CPU};
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  active_ = true;
  wall_start_ns_ = now_ns();
}

void StepProfiler::note_host(const std::vector<std::pair<std::string, double>>& phases) {
  if (!active_) return;
  for (const auto& [name, s] : phases) {
    auto it = std::find_if(host_phases_.begin(), host_phases_.end(), [&](const auto& p) { return p.first == name; });
    if (it == host_phases_.end())
      host_phases_.emplace_back(name, s);
    else
      it->second += s;
  }
}

void StepProfiler::after_step(int64_t step) {
  if (!active_ || step + 1 != window_.last) return;
  wall_ms_ = double(now_ns() - wall_start_ns_) / 1e6;
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  active_ = false;
  const double steps = double(window_.last - window_.first);
  std::map<std::string, double> ms;
  std::map<std::string, std::pair<double, int64_t>> kernels;   // name -> (ms, calls)
  std::map<std::string, std::pair<double, int64_t>> host_ops;  // CPU-side ops, inclusive ms
  double busy = 0;
  std::vector<TimedSpan> device_spans, host_spans, ranges;
  std::vector<LaunchedKernel> launched;
  std::map<uint64_t, int64_t> api_start, op_start;  // correlation id -> start: CUDA API calls, ops
  const std::string kPartPrefix = "flashdraft/";    // the engine's named parts of a step
  // Where kernels were launched from: host ops by their own correlation ids (a kernel's linked
  // id), CUDA API calls by CUPTI's (the id of the kernel each launched).
  for (const auto& e : result->events())
    if (e.deviceType() == c10::DeviceType::CPU && e.correlationId() != 0)
      (e.name().rfind("cu", 0) == 0 ? api_start : op_start)[e.correlationId()] = static_cast<int64_t>(e.startNs());
  for (const auto& e : result->events()) {
    const auto start = static_cast<int64_t>(e.startNs()), end = static_cast<int64_t>(e.endNs());
    if (e.deviceType() == c10::DeviceType::CPU) {
      if (e.name().rfind(kPartPrefix, 0) == 0) ranges.push_back({start, end, e.name().substr(kPartPrefix.size()), 0});
      auto& h = host_ops[e.name().substr(0, 90)];
      h.first += double(e.durationNs()) / 1e6;
      ++h.second;
      host_spans.push_back({start, end, e.name().substr(0, 60), e.startThreadId()});
      continue;
    }
    // The named ranges' device-side copies (GPU user annotations) are not kernels.
    if (e.deviceType() != c10::DeviceType::CUDA || e.name().rfind(kPartPrefix, 0) == 0) continue;
    device_spans.push_back({start, end, std::string(), 0});
    // The op the kernel is linked to, where it has one; else its CUDA API call (kernels that
    // plugins launch themselves), which must have started before the kernel did.
    const auto op = op_start.find(e.linkedCorrelationId());
    const auto api = api_start.find(e.correlationId());
    int64_t launched_at = -1;
    if (e.linkedCorrelationId() != 0 && op != op_start.end())
      launched_at = op->second;
    else if (e.correlationId() != 0 && api != api_start.end() && api->second <= start)
      launched_at = api->second;
    launched.push_back({start, end, e.name().substr(0, 90), launched_at});
    const double d = double(e.durationNs()) / 1e6;
    const std::string name = e.name();
    ms[family_of(name)] += d;
    auto& k = kernels[name.substr(0, 90)];
    k.first += d;
    ++k.second;
    busy += d;
  }
  result->save(trace_path_);
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [f, t] : ms) rows.emplace_back(t, f);
  std::sort(rows.rbegin(), rows.rend());
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  os << "profile: steps " << window_.first << ".." << window_.last - 1 << ", wall " << wall_ms_ / steps
     << " ms/step, device busy " << busy / steps << " ms/step; trace " << trace_path_ << "\n";
  os << "  op family                                  ms/step   share\n";
  for (const auto& [t, f] : rows)
    os << "  " << std::left << std::setw(42) << f << std::right << std::setw(8) << t / steps << std::setw(7)
       << std::setprecision(1) << (busy > 0 ? 100.0 * t / busy : 0.0) << "%" << std::setprecision(2) << "\n";
  print_longest(os, "longest kernels (ms/step)", kernels, steps);
  if (!ranges.empty() && !launched.empty()) print_parts(os, device_parts(launched, ranges), steps);
  // The host's side: where the time between the device's kernels can go.
  if (!host_phases_.empty()) {
    os << "  host time per step by phase (ms):";
    for (const auto& [name, s] : host_phases_) os << " " << name << " " << 1e3 * s / steps;
    os << "\n";
  }
  print_longest(os, "longest host ops (ms/step, inclusive of the ops they call)", host_ops, steps);
  if (!device_spans.empty()) {
    constexpr int64_t kLongGapNs = 20000;
    const DeviceIdle idle = device_idle(std::move(device_spans), std::move(host_spans), kLongGapNs);
    os << "  device idle between its kernels: " << idle.idle_ns / 1e6 / steps << " ms/step; "
       << double(idle.long_gaps) / steps << " gaps of " << kLongGapNs / 1000
       << " us or more per step, by the host op overlapping each most"
       << " (ms/step):\n";
    for (size_t i = 0; i < idle.causes.size() && i < 12; ++i)
      os << "    " << std::setw(8) << idle.causes[i].first / 1e6 / steps << "  " << idle.causes[i].second << "\n";
  }
  std::cout << os.str() << std::flush;
}

}  // namespace flashdraft

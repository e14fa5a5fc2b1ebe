#include "log/inspect.hpp"

#include "log/log_schema.hpp"
#include "log/run_log.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace flashdraft {

namespace {
std::string gib(double bytes) {
  std::ostringstream os;
  if (bytes >= double(1 << 30))
    os << std::fixed << std::setprecision(3) << bytes / double(1 << 30) << " GiB";
  else
    os << std::fixed << std::setprecision(2) << bytes / double(1 << 20) << " MiB";
  return os.str();
}
// The last validation's acceptance lengths side by side: how each was measured, and how far
// the anchor and simulated figures sit from the served one. Logs written before served
// validation existed call the anchor figure eval/tau and its method eval/tau_method.
void tau_lines(const LogReader& r, std::ostream& out) {
  const std::string anchor = r.exists("eval/tau_anchor") ? "eval/tau_anchor" : "eval/tau";
  const std::string anchor_method = r.exists("eval/tau_anchor_method") ? "eval/tau_anchor_method" : "eval/tau_method";
  out << std::setprecision(4);
  double served = NAN;
  if (r.exists("eval/tau_served")) {
    const auto tau = r.f64("eval/tau_served"), se = r.f64("eval/tau_served_se");
    const auto method = r.strings("eval/tau_served_method");
    if (!tau.empty() && !method.empty()) {
      served = tau.back();
      out << "  tau_served " << served;
      if (!se.empty() && !std::isnan(se.back())) out << " +- " << se.back();
      out << ": " << method.back();
      const auto responses = r.f64("eval/served_responses"), steps = r.f64("eval/served_steps");
      const auto seconds = r.f64("eval/served_seconds"), target = r.f64("eval/served_target_seconds");
      if (!responses.empty() && !steps.empty() && !seconds.empty() && !target.empty()) {
        out << "; " << int64_t(responses.back()) << " responses, " << int64_t(steps.back()) << " verification steps, "
            << std::setprecision(3) << seconds.back() << " s";
        if (target.back() > 0) out << " (target forwards " << target.back() << " s)";
        out << std::setprecision(4);
      }
      const auto data = r.f64("eval/tau_served_data");
      if (method.back().rfind("target", 0) == 0 && !data.empty() && !std::isnan(data.back()))
        out << "; on the data's tokens " << data.back()
            << (data.back() == served ? " (equal: the data is the target's greedy text)" : "");
      out << "\n";
    }
  }
  if (r.exists(anchor_method) && r.exists("eval/tau_data") && r.exists(anchor)) {
    const auto methods = r.strings(anchor_method);
    const auto tau = r.f64(anchor), data = r.f64("eval/tau_data");
    if (!methods.empty() && !tau.empty() && !data.empty()) {
      out << "  tau_anchor " << tau.back() << " (" << methods.back() << ")";
      if (methods.back() == "target verification") {
        const double t = tau.back(), d = data.back();
        out << "; tau_data " << d;
        if (t == d)
          out << " equals it (the data is the target's own greedy output)";
        else
          out << " differs by " << d - t << " (the data is not the target's greedy output)";
      }
      out << "\n";
      if (!std::isnan(served) && served > 0) {
        const auto sim = r.f64("eval/tau_sim");
        out << "  which tau to trust: tau_served (what a server measures); against it tau_anchor is " << std::fixed
            << std::showpos << std::setprecision(1) << 100.0 * (tau.back() / served - 1.0) << "%";
        if (!sim.empty()) out << ", tau_sim " << 100.0 * (sim.back() / served - 1.0) << "%";
        out << std::noshowpos << std::defaultfloat << std::setprecision(4) << "\n";
      }
    }
  }
}

}  // namespace

namespace {

// The ranks/* columns of a data-parallel run: per rank, its tokens, memory peak and the
// variants it ran; whether the weights stayed identical.
void inspect_ranks(const LogReader& r, std::ostream& out) {
  const auto shape = r.shape("ranks/tokens");
  if (shape.size() != 2 || shape[0] == 0) return;
  const size_t steps = size_t(shape[0]), world = size_t(shape[1]);
  const auto tokens = r.f64("ranks/tokens"), memory = r.f64("ranks/memory_step"), seconds = r.f64("ranks/step_time_s");
  const auto sum = r.f64("ranks/weights_sum"), sumsq = r.f64("ranks/weights_sumsq");
  bool same = true;
  for (size_t i = 0; i < steps; ++i)
    for (size_t k = 1; k < world; ++k)
      same = same && sum[i * world + k] == sum[i * world] && sumsq[i * world + k] == sumsq[i * world];
  const auto steps_attr = r.attributes("/steps");
  out << "ranks     " << world << " (accumulate "
      << (steps_attr.count("accumulate") ? steps_attr.at("accumulate") : "?")
      << "); weights identical on every rank after every step: " << (same ? "yes" : "NO") << "\n";
  const auto names = r.strings("kernels/names");
  for (size_t k = 0; k < world; ++k) {
    double t = 0, m = 0;
    for (size_t i = 0; i < steps; ++i) t += tokens[i * world + k], m = std::max(m, memory[i * world + k]);
    std::set<std::string> ran;
    for (const char* ph : {"ranks/kernels_forward", "ranks/kernels_backward"}) {
      const auto ids = r.f64(ph);
      const size_t per = ids.size() / (steps * world);
      for (size_t i = 0; i < steps; ++i)
        for (size_t l = 0; l < per; ++l) {
          const auto id = int64_t(ids[(i * world + k) * per + l]);
          if (id >= 0 && id < int64_t(names.size())) ran.insert(names[size_t(id)]);
        }
    }
    out << "  rank " << k << "  tokens " << int64_t(t) << "  last step " << std::setprecision(4)
        << seconds[(steps - 1) * world + k] << " s  peak " << gib(m) << "  kernels";
    for (const auto& v : ran) out << " " << v;
    out << "\n";
  }
}

// Where and how the run ran: its start, device, software versions, experiment and plugins.
void run_lines(const LogReader& r, const std::string& path, std::ostream& out) {
  const auto a = r.attributes("/");
  auto attr = [&](const char* k) {
    auto it = a.find(k);
    return it == a.end() ? std::string("?") : it->second;
  };
  out << "run log   " << path << "\n";
  out << "started   " << attr("start_time") << " on " << attr("device") << " (" << attr("device_name") << "), dtype "
      << attr("dtype") << "\n";
  out << "software  flashdraft " << attr("flashdraft_version") << " (" << attr("git_revision") << "), LibTorch "
      << attr("torch_version") << " (CUDA " << attr("torch_cuda") << ")\n";
  out << "experiment " << attr("experiment_path") << "\n";
  out << "plugins\n";
  std::istringstream pl(attr("plugins"));
  for (std::string line; std::getline(pl, line);) out << "  " << line << "\n";
}

// The last step's accuracy per block position (steps/position_accuracy), if the log has it.
void position_accuracy_line(const LogReader& r, std::ostream& out) {
  const auto shape = r.shape("steps/position_accuracy");
  if (shape.size() == 2 && shape[0] > 0) {
    const auto acc = r.f64("steps/position_accuracy");
    const int64_t w = shape[1];
    out << "accuracy per block position (last step):";
    for (int64_t j = 0; j < w; ++j) out << " " << std::setprecision(2) << acc[size_t((shape[0] - 1) * w + j)];
    out << "\n";
  }
}

// The memory/* columns: each phase's peak over the steps.
void memory_lines(const LogReader& r, std::ostream& out) {
  out << "memory peaks (max over steps; " << r.attributes("/memory")["device"] << ")\n";
  for (const auto& column : log_columns("memory")) {
    const auto v = r.f64(column.name);
    const std::string phase = column.name.substr(column.name.find('/') + 1);
    if (!v.empty())
      out << "  " << std::left << std::setw(10) << phase << std::right << gib(*std::max_element(v.begin(), v.end()))
          << "\n";
  }
}

// The steps/* columns: how many steps, the loss and every other scalar first and last,
// then the accuracy per position and the memory peaks.
void steps_lines(const LogReader& r, std::ostream& out) {
  const auto loss = r.f64("steps/loss");
  const auto step = r.f64("steps/step");
  const size_t n = std::min(loss.size(), step.size());
  out << "steps     " << n << " recorded";
  if (n) out << " (step " << int64_t(step.front()) << " .. " << int64_t(step[n - 1]) << ")";
  out << "\n";
  if (n) {
    const double best = *std::min_element(loss.begin(), loss.begin() + long(n));
    out << std::fixed << std::setprecision(4) << "loss      first " << loss.front() << "  last " << loss[n - 1]
        << "  min " << best << "\n";
    for (const auto& m : r.members("/steps")) {
      if (m == "loss" || m == "step" || m == "position_accuracy") continue;
      const auto v = r.f64("steps/" + m);
      if (v.empty()) continue;
      out << std::left << std::setw(14) << m << std::right << "first " << std::setprecision(4) << v.front() << "  last "
          << v.back() << "\n";
    }
    position_accuracy_line(r, out);
    memory_lines(r, out);
  }
}

// The eval/* columns: one row per validation, headline measures first, then the last
// validation's acceptance lengths side by side.
void eval_lines(const LogReader& r, std::ostream& out) {
  const auto es = r.f64("eval/step");
  out << "eval      " << es.size() << " validations (held-out sequences)\n";
  std::vector<std::pair<std::string, std::vector<double>>> cols;
  // The measures, headline first (eval/tau: the anchor figure of logs older than served validation).
  for (const char* name : {"loss", "tau_served", "tau_served_se", "tau_anchor", "tau", "tau_data", "tau_sim"}) {
    const std::string column = std::string("eval/") + name;
    if (r.exists(column) && r.shape(column).size() == 1)
      cols.push_back({std::string(name) == "tau_served_se" ? "+-" : name, r.f64(column)});
  }
  out << "  " << std::setw(8) << "step";
  for (const auto& c : cols) out << std::setw(c.first == "+-" ? 7 : 11) << c.first;
  out << "\n";
  for (size_t i = 0; i < es.size(); ++i) {
    out << "  " << std::setw(8) << int64_t(es[i]);
    for (const auto& c : cols)
      out << std::setw(c.first == "+-" ? 7 : 11) << std::setprecision(3) << (i < c.second.size() ? c.second[i] : NAN);
    out << "\n";
  }
  tau_lines(r, out);
}

// The kernels/* columns: the selected variant, and how often each variant ran per phase.
void kernel_lines(const LogReader& r, std::ostream& out) {
  const auto ka = r.attributes("/kernels");
  out << "kernels   selected " << (ka.count("selected") ? ka.at("selected") : "?") << " for "
      << (ka.count("problem") ? ka.at("problem") : "?") << "\n";
  if (ka.count("target_selected")) out << "          target's attention: " << ka.at("target_selected") << "\n";
  if (ka.count("column_kernels")) {  // (the kernel each column was chosen to run, where more than one)
    std::map<std::string, std::string> columns;
    std::istringstream lines(ka.at("column_kernels"));
    int64_t c = 0;
    for (std::string k; std::getline(lines, k); ++c) columns[k] += (columns[k].empty() ? "" : ",") + std::to_string(c);
    if (columns.size() > 2) {  // (more than one attention kernel beside the loss's variant)
      out << "  chosen per column:";
      for (const auto& [k, cs] : columns) out << "  " << k << " (" << cs << ")";
      out << "\n";
    }
  }
  const auto names = r.strings("kernels/names");
  for (const char* ph : {"forward", "backward"}) {
    const auto ids = r.f64(std::string("kernels/") + ph);
    std::map<int64_t, int64_t> count;
    for (double id : ids) ++count[int64_t(id)];
    out << "  " << ph << ":";
    for (const auto& [id, c] : count)
      out << "  " << (id < 0 || id >= int64_t(names.size()) ? std::string("(no call)") : names[size_t(id)]) << " x"
          << c;
    out << "  (calls = steps x layers)\n";
  }
}

// The events/* columns, one line each, and whether the run finished.
void event_lines(const LogReader& r, std::ostream& out) {
  const auto ev_step = r.f64("events/step");
  const auto ev_kind = r.strings("events/kind");
  const auto ev_msg = r.strings("events/message");
  out << "events    " << ev_step.size() << "\n";
  for (size_t i = 0; i < ev_step.size() && i < ev_kind.size() && i < ev_msg.size(); ++i)
    out << "  step " << int64_t(ev_step[i]) << "  " << ev_kind[i] << ": " << ev_msg[i] << "\n";
  const bool finished = std::find(ev_kind.begin(), ev_kind.end(), "finished") != ev_kind.end();
  out << "status    " << (finished ? "finished" : "not finished (running, interrupted or crashed)") << "\n";
}

}  // namespace

void inspect_log(const std::string& path, std::ostream& out) {
  LogReader r(path);
  if (!r.exists("steps/loss")) throw std::runtime_error(path + ": not a flashdraft run log (no /steps/loss)");
  run_lines(r, path, out);
  steps_lines(r, out);
  if (r.exists("ranks/tokens")) inspect_ranks(r, out);
  if (r.exists("eval/step")) eval_lines(r, out);
  kernel_lines(r, out);
  event_lines(r, out);
}

}  // namespace flashdraft

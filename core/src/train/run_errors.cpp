// Failure reports and exit codes.
#include "train/run_errors.hpp"

#include <flashdraft/config.hpp>

#include "dispatch/dispatch.hpp"

#include <iostream>

namespace flashdraft {

int report_setup_error(const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return kBadExperiment;
}

int report_run_error(const std::exception& e, int64_t step, EventLog* events, const std::string& log_path) {
  const bool logged = events && events->attached();
  auto log_line = [&] {
    if (logged) std::cerr << "log (every finished step kept): " << log_path << std::endl;
  };
  if (dynamic_cast<const ConfigError*>(&e)) {
    std::cerr << "error: " << e.what() << std::endl;
    if (logged) events->add(step, "error", e.what());
    return kBadExperiment;
  }
  if (dynamic_cast<const FallbackError*>(&e)) {
    std::cerr << "error: " << e.what() << std::endl;
    if (logged) events->add(step, "fallback_error", e.what());
    log_line();
    return kFailed;
  }
  const std::string what = e.what();
  const bool oom = what.find("out of memory") != std::string::npos;
  std::cerr << "error" << (step >= 0 ? " at step " + std::to_string(step) : std::string()) << ": " << what << std::endl;
  if (logged) events->add(step, oom ? "oom" : "error", what.substr(0, 2000));
  log_line();
  return kFailed;
}

}  // namespace flashdraft

// A step's row in the log and its console line.
#include "log/step_record.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>

namespace flashdraft {

namespace {

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < (int64_t(10) << 20) ? 2 : 1) << double(bytes) / (1 << 20) << " MiB";
  return os.str();
}

}  // namespace

void StepRecorder::record(const StepOutcome& o) {
  const KernelLedger& ledger = o.kernels;
  for (; names_written_ < static_cast<int64_t>(ledger.names().size()); ++names_written_)
    log_.append("kernels/names", ledger.names()[static_cast<size_t>(names_written_)]);
  const LedgerColumns& columns = shape_.columns;
  auto attention = [&](Phase ph) {
    const std::vector<int32_t>& ids = ledger.ids(ph);
    return std::vector<int32_t>(ids.begin(), ids.begin() + std::min<int64_t>(columns.attention(), ids.size()));
  };
  auto loss = [&](Phase ph) {
    const std::vector<int32_t>& ids = ledger.ids(ph);
    return static_cast<int64_t>(ids.size()) > columns.loss() ? ids[static_cast<size_t>(columns.loss())] : -1;
  };
  log_.append("kernels/forward", attention(Phase::forward));
  log_.append("kernels/backward", attention(Phase::backward));
  log_.append("kernels/loss", std::vector<int32_t>{loss(Phase::forward), loss(Phase::backward)});
  log_.append("steps/step", o.step);
  log_.append("steps/loss", o.loss);
  log_.append("steps/lr", o.lr);
  log_.append("steps/grad_norm", o.grad_norm);
  log_.append("steps/step_time_s", o.seconds);
  log_.append("steps/tokens_per_s", o.seconds > 0 ? double(o.tokens) / o.seconds : 0.0);
  log_.append("steps/input_tokens_per_s", o.seconds > 0 ? double(o.input_tokens) / o.seconds : 0.0);
  std::vector<double> acc = o.position_accuracy;
  acc.resize(shape_.position_names.size(), std::nan(""));
  log_.append("steps/position_accuracy", acc);
  const std::map<std::string, double> scalars(o.scalars.begin(), o.scalars.end());
  for (const auto& n : shape_.scalar_names) {
    const auto it = scalars.find(n);
    log_.append("steps/" + n, it != scalars.end() ? it->second : std::nan(""));
  }
  if (shape_.target) log_.append("steps/target_time_s", o.target_seconds);
  log_.append("memory/forward", o.peak_forward);
  log_.append("memory/backward", o.peak_backward);
  log_.append("memory/optimizer", o.peak_optimizer);
  log_.append("memory/step", std::max({o.peak_forward, o.peak_backward, o.peak_optimizer}));
  log_.flush();
}

std::string StepRecorder::line(const StepOutcome& o, int64_t steps) const {
  const std::map<std::string, double> scalars(o.scalars.begin(), o.scalars.end());
  std::ostringstream os;
  os << "step " << std::setw(5) << o.step + 1 << "/" << steps << "  loss " << std::fixed << std::setprecision(4)
     << o.loss;
  for (const auto& n : shape_.scalar_names) {
    const auto it = scalars.find(n);
    os << "  " << n << " " << std::setprecision(3) << (it != scalars.end() ? it->second : 0.0);
  }
  os << "  lr " << std::scientific << std::setprecision(2) << o.lr << std::fixed << "  |g| " << std::setprecision(3)
     << o.grad_norm << "  " << std::setprecision(3) << o.seconds << " s"
     << "  peak fwd " << mib(o.peak_forward) << " bwd " << mib(o.peak_backward) << "  kernels fwd "
     << o.kernels.summary(Phase::forward, shape_.columns.attention()) << " bwd "
     << o.kernels.summary(Phase::backward, shape_.columns.attention());
  return os.str();
}

}  // namespace flashdraft

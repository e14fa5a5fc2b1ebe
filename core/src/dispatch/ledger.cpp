#include "dispatch/ledger.hpp"

#include <algorithm>
#include <stdexcept>

namespace flashdraft {

void KernelLedger::begin_step(int64_t step, int64_t layers) {
  step_ = step;
  forward_.assign(static_cast<size_t>(layers), -1);
  backward_.assign(static_cast<size_t>(layers), -1);
  forward_calls_ = backward_calls_ = 0;
}

int32_t KernelLedger::id(const std::string& variant) {
  auto it = std::find(names_.begin(), names_.end(), variant);
  if (it != names_.end()) return static_cast<int32_t>(it - names_.begin());
  names_.push_back(variant);
  return static_cast<int32_t>(names_.size() - 1);
}

void KernelLedger::record(int64_t layer, Phase phase, const std::string& variant) {
  auto& row = phase == Phase::forward ? forward_ : backward_;
  if (layer < 0 || layer >= static_cast<int64_t>(row.size()))
    throw std::out_of_range("kernel ledger: attention call for layer " + std::to_string(layer) +
                            ", but the drafter declared " + std::to_string(row.size()) + " attention layers");
  row[static_cast<size_t>(layer)] = id(variant);
  ++(phase == Phase::forward ? forward_calls_ : backward_calls_);
}

std::string KernelLedger::summary(Phase phase, int64_t columns) const {
  std::vector<int32_t> seen;
  const std::vector<int32_t>& row = ids(phase);
  for (size_t c = 0; c < row.size(); ++c) {
    const int32_t i = row[c];
    if (columns >= 0 && static_cast<int64_t>(c) >= columns && i < 0) continue;
    if (std::find(seen.begin(), seen.end(), i) == seen.end()) seen.push_back(i);
  }
  std::string out;
  for (int32_t i : seen)
    out += (out.empty() ? "" : ",") + (i < 0 ? std::string("none") : names_[static_cast<size_t>(i)]);
  return out;
}

}  // namespace flashdraft

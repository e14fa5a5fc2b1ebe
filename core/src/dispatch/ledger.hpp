// The kernel ledger: which kernel variant ran, per attention call, layer and phase.
// A step never reports a kernel it did not run: cells start at -1 ("no call") and
// only a call that returned fills them.
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

enum class Phase { forward = 0, backward = 1 };

// The ledger's columns by group: the drafter's attention calls, then the online target's, then
// the LM-head loss's one column. Every reader of a step's kernel ids takes its group from here.
struct LedgerColumns {
  int64_t drafter = 0;  // the drafter's attention calls per step (Drafter::attention_layers())
  int64_t target = 0;   // the online target's (0 without one)
  int64_t target_begin() const { return drafter; }
  int64_t attention() const { return drafter + target; }  // every attention call: /kernels/forward's width
  int64_t loss() const { return drafter + target; }       // the LM-head loss's column
  int64_t count() const { return drafter + target + 1; }  // the ledger's width
};

class FLASHDRAFT_API KernelLedger {
 public:
  void begin_step(int64_t step, int64_t layers);
  // Records the variant of one call. Several calls of one layer and phase in a step
  // keep the last; the count of calls is kept too.
  void record(int64_t layer, Phase phase, const std::string& variant);
  int32_t id(const std::string& variant);  // stable id, added on first sight
  const std::vector<std::string>& names() const { return names_; }
  // Per layer ids for the current step (-1: no call).
  const std::vector<int32_t>& ids(Phase phase) const { return phase == Phase::forward ? forward_ : backward_; }
  int64_t calls(Phase phase) const { return phase == Phase::forward ? forward_calls_ : backward_calls_; }
  int64_t step() const { return step_; }
  // Distinct variants of this step and phase, for the console: over the first `columns`
  // columns ("none" for a column without a call), then the variants of the columns after
  // them that had a call (-1: every column).
  std::string summary(Phase phase, int64_t columns = -1) const;

 private:
  int64_t step_ = -1;
  std::vector<std::string> names_;
  std::vector<int32_t> forward_, backward_;
  int64_t forward_calls_ = 0, backward_calls_ = 0;
};

}  // namespace flashdraft

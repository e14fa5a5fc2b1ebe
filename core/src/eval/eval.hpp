// Validation: the held-out batches through the drafter in evaluation mode (no gradient),
// with anchors from a generator of its own seeded the same way every time (every
// validation sees the same blocks; training's generators are not touched, so enabling
// validation does not change training). Three acceptance lengths, one headline:
//   - tau_served (served.hpp): the held-out responses decoded speculatively as a server
//     does it, block after block; by the target when the run has an online target that
//     decodes, else on the data's tokens. The number a server will measure.
//   - tau_anchor: the exact greedy acceptance of blocks at uniformly drawn anchors (by
//     target verification with an online target, target_verify.hpp; else on the data's
//     tokens), averaged per block. It counts a long accepted run once per position it
//     covers instead of once per block, so it overstates tau_served when acceptance is
//     uneven. A diagnostic; tau_data is the same against the data's tokens.
//   - tau_sim: 1 + sum_k prod_{j<=k} acc_j from the pooled per-position accuracies.
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/model.hpp>

#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"
#include "eval/served.hpp"
#include "log/run_log.hpp"
#include "registry/bind.hpp"
#include "train/batches.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace flashdraft {

struct EvalResult {
  int64_t step = 0;  // optimizer steps completed
  // tau_anchor: the acceptance length at uniform anchors, by target verification when the
  // run has an online target that verifies (tau_anchor_method says which); tau_data: leading
  // matches with the data's tokens (equal to tau_anchor when the data is the target's own
  // greedy output).
  double loss = 0, tau_anchor = 0, tau_data = 0, tau_sim = 0;
  std::string tau_anchor_method;
  int64_t blocks = 0;
  std::vector<double> position_accuracy;
  // Served validation (NaN / empty when it is off; served_method then says why).
  double tau_served = std::nan(""), tau_served_se = std::nan(""), tau_served_data = std::nan("");
  std::string served_method, served_kernels;
  int64_t served_responses = 0, served_steps = 0;
  double served_seconds = 0, served_target_seconds = 0;
  std::vector<int64_t> served_histogram;  // [max_proposals + 2]: steps that produced n tokens
  ServedTally served, served_data;        // the tallies themselves (tools and tests)
};

// Served validation's engine side, made once before step 0 from the bound plugins: the
// decoders' dispatchers (kernels chosen in bind, policy applied, variants recorded in a
// ledger of their own), the sampling settings and the target's stop tokens.
class FLASHDRAFT_API ServedValidation {
 public:
  ServedValidation(BoundPlugins& b, const Config& eval, uint64_t seed, const std::string& on_fallback,
                   AttentionDispatcher::EventSink events);
  // Decodes the responses of the held-out set: by the target when it decodes (with the
  // run's sampling), and on the data's tokens (greedy) when the batches carry hidden states.
  void run(const std::vector<ServedSequence>& sequences, int64_t step, EvalResult& out);
  int64_t responses() const { return responses_; }
  ServedContext& context() { return *context_; }  // benchmarks drive serve() themselves
  KernelLedger& ledger() { return ledger_; }
  int64_t ledger_columns() const { return columns_; }
  bool by_target() const { return by_target_; }

 private:
  KernelLedger ledger_;
  std::unique_ptr<AttentionDispatcher> draft_, target_;
  std::unique_ptr<AttentionContext> target_offset_;
  std::unique_ptr<ServedContext> context_;
  double temperature_, top_p_;
  uint64_t seed_;
  int64_t responses_, columns_;
  bool by_target_;
  c10::Device device_;
};

// Per held-out batch, for tools and tests: the batch, the drafter's result and the labels
// of the target's verification (undefined without one).
using EvalObserver = std::function<void(const Batch&, const StepResult&, const at::Tensor& verified)>;

struct EvalContext {
  Drafter& drafter;
  BatchSource& batches;
  AttentionDispatcher& dispatcher;
  KernelLedger& ledger;
  const Config& eval;  // [eval]
  uint64_t seed;       // [run].seed
  int64_t layers, positions;
  Target* target = nullptr;  // an online target: tau by target verification
  EvalObserver observer = nullptr;
  ServedValidation* served = nullptr;  // null: no served validation
  std::string served_off;              // why (for the log and the console)
};

// Throws std::invalid_argument with a sentence when a drafter's validation drafts do not
// fit a batch of `rows` x `seq_len` tokens and its `positions` metric columns (model.hpp's
// Drafts: rows and starts [D], tokens and labels [D, K] integer, K <= positions, every row in
// 0 .. rows - 1 and every start in 0 .. seq_len - 1).
FLASHDRAFT_API void check_drafts(const Drafts& d, int64_t rows, int64_t seq_len, int64_t positions);

// nullopt when the dataset has no held-out batch.
FLASHDRAFT_API std::optional<EvalResult> evaluate(const EvalContext& c, int64_t done);
FLASHDRAFT_API void record_eval(RunLog& log, const EvalResult& r);
FLASHDRAFT_API std::string eval_line(const EvalResult& r);

}  // namespace flashdraft

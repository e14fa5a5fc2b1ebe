// A finished step seen from every rank: each rank's share gathered (one all-gather per
// step), the step's metrics made global on every rank, and the per-rank columns of the
// log (`ranks/*`, declared when the world has more than one rank): step time, tokens,
// loss, memory peak, weight checksums, and the kernel variants each rank ran.
//
// Global metrics: loss as GradientSync computes it (the union of every rank's
// micro-batches); tokens summed; per-position accuracy and drafter scalars averaged
// over ranks weighted by their loss-carrying tokens; memory peaks the largest of any
// rank (ranks/memory_step has each). A rank that ran another kernel variant than rank 0
// is an event ("fallback", with on_fallback = "warn") or stops every rank (FallbackError,
// with on_fallback = "error"): every rank sees the same gathered data and decides alike.
// Weights must stay identical: a checksum that differs between ranks stops the run.
#pragma once

#include "dispatch/ledger.hpp"
#include "distributed/distributed.hpp"
#include "log/log_schema.hpp"
#include "log/run_log.hpp"
#include "train/grad_sync.hpp"
#include "train/train_step.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct RankStep {
  std::vector<double> seconds, tokens, loss, weights_sum, weights_sumsq;
  std::vector<int64_t> memory;                             // peak bytes of the step, per rank
  std::vector<int32_t> kernels_forward, kernels_backward;  // [rank][layer], ids of rank 0's ledger
  int signal = 0;                                          // a signal one of the ranks received (0: none)
  std::string kernel_difference;                           // "" or a sentence: which rank ran which other variant
};

// Two checksums of the weights (sum and sum of squares, in float64).
std::pair<double, double> weight_checksums(const std::vector<at::Tensor>& params);

// Gathers the step from every rank (a collective) and makes `o` global. `ledger` is this
// rank's; on rank 0 the variants other ranks ran are added to it.
RankStep gather_step(Distributed& dist, StepOutcome& o, const GradientSync& grads, KernelLedger& ledger,
                     const std::vector<at::Tensor>& params, int signal, const std::string& on_fallback);

// Appends the step's `ranks/*` rows (log_schema.cpp declares them when world > 1).
void record_ranks(RunLog& log, const RankStep& r);

}  // namespace flashdraft

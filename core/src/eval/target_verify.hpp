// Validation by the target: the drafter's drafts verified by the target model itself, as
// speculative decoding with greedy verification does it. For each held-out draft the target
// reads the context up to the draft's start and the drafted tokens (one forward for every
// draft of the batch: Target::verify, the drafts of a row as its blocks), and a drafted token
// is accepted while it equals the target's greedy choice given the tokens before it. The
// result is returned as labels, so that acceptance.hpp's greedy_acceptance counts it: the
// target's choice at every drafted position, -1 where the data has no label (past the
// sequence, outside the loss mask), so that both acceptance lengths count the same
// positions.
#pragma once

#include <flashdraft/model.hpp>

#include <ATen/core/Tensor.h>

namespace flashdraft {

// [D, K] int64 labels from the target's greedy choices for the drafts in `r` (r.drafts,
// already checked against the batch by check_drafts); undefined when the target cannot
// verify or the drafter gave no drafts.
at::Tensor target_verified_labels(Target& target, const Batch& batch, const StepResult& r);

}  // namespace flashdraft

// Validation by the target: the drafter's block proposals verified by the target model
// itself, as speculative decoding with greedy verification does it. For each held-out
// block the target reads the context before the anchor, the anchor token and the drafted
// tokens (one forward for every block of the batch: Target::verify), and a drafted token
// is accepted while it equals the target's greedy choice given the tokens before it. The
// result is returned as labels, so that acceptance.hpp's greedy_acceptance counts it: the
// target's choice at every block position, -1 where the data has no label (past the
// sequence, outside the loss mask), so that both acceptance lengths count the same
// positions.
#pragma once

#include <flashdraft/model.hpp>

#include <ATen/core/Tensor.h>

namespace flashdraft {

// [B, N, BS] int64 labels from the target's greedy choices for the proposals in `r`
// (r.predictions, r.anchors, r.labels); undefined when the target cannot verify or the
// drafter gave no anchors.
at::Tensor target_verified_labels(Target& target, const Batch& batch, const StepResult& r);

}  // namespace flashdraft

// Validation by the target (see target_verify.hpp).
#include "eval/target_verify.hpp"

#include <ATen/ATen.h>

namespace flashdraft {

at::Tensor target_verified_labels(Target& target, const Batch& batch, const StepResult& r) {
  if (!r.predictions.defined() || !r.anchors.defined() || !r.labels.defined()) return {};
  const at::Tensor tokens = batch.tokens.to(at::kCPU, at::kLong);
  const at::Tensor anchors = r.anchors.to(at::kCPU, at::kLong).clamp(0, tokens.size(1) - 1);
  // The block as the target reads it: the anchor's own token, then the drafted tokens. A
  // position without a label (a masked token, past the sequence) has no proposal (-1); the
  // acceptance ends there (its label is -1 too), so any valid id stands in for it: the
  // target must never look up row -1 of its embedding.
  at::Tensor blocks = r.predictions.to(at::kCPU, at::kLong).clamp_min(0);
  blocks.select(2, 0).copy_(tokens.gather(1, anchors));
  at::Tensor choices;
  {
    at::NoGradGuard frozen;
    choices = target.verify(batch, anchors, blocks);
  }
  if (!choices.defined()) return {};
  const at::Tensor labels = r.labels.to(at::kCPU, at::kLong);
  return at::where(labels.lt(0), at::full_like(labels, -1), choices.to(at::kCPU, at::kLong));
}

}  // namespace flashdraft

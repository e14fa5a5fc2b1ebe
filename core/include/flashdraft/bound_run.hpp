// What a drafter keeps of Drafter::bind(): the run's device and dtype, the batch shape, the
// target's vocabulary, and detached copies of the target's frozen embedding and LM head on
// that device and dtype (no gradient can reach the target's tensors), and the scale of its logits. A drafter derives
// from it (protected) and calls bind_run() in its bind(), once its own sizes are checked.
#pragma once

#include <flashdraft/model.hpp>

#include <ATen/ATen.h>

#include <cstdint>

namespace flashdraft {

class BoundRun {
 protected:
  void bind_run(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) {
    device_ = ctx.device;
    dtype_ = ctx.dtype;
    batch_ = batch_size;
    seq_len_ = seq_len;
    vocab_ = target.vocab;
    embedding_ = target.embedding.detach().to(device_, dtype_);
    target_head_ = target.lm_head.detach().to(device_, dtype_);
    target_logit_scale_ = target.logit_scale;
    target_logit_softcap_ = target.logit_softcap;
  }

  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = c10::kFloat;
  int64_t batch_ = 1, seq_len_ = 0, vocab_ = 0;
  at::Tensor embedding_, target_head_;  // [vocab, hidden] each
  double target_logit_scale_ = 1.0;     // the target's logits: states target_head_^T times this (TargetModel)
  double target_logit_softcap_ = 0;     // ... then soft-capped where > 0 (TargetModel::logit_softcap)
};

}  // namespace flashdraft

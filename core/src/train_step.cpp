// One optimizer step.
#include "train_step.hpp"

#include "grad_sync.hpp"
#include "memory.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace flashdraft {

NonFiniteLoss::NonFiniteLoss(double loss_value, int64_t step)
    : std::runtime_error("loss is not finite (" + std::to_string(loss_value) + ") at step " + std::to_string(step) +
                         "; the run stops (the log keeps every step before it)"),
      loss(loss_value) {}

StepOutcome train_step(StepContext& c, int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  StepOutcome o;
  o.step = step;
  o.lr = c.schedule.at(step);
  c.ledger.begin_step(step, c.layers);
  GradientSync& grads = *c.grads;
  for (int64_t micro = 0; micro < grads.micro_batches(); ++micro) {
    grads.seed_anchors(c.anchors, step, micro);
    Batch batch = c.batches.train(grads.batch_index(step, micro));
    o.target_seconds += c.batches.target_seconds();

    MemoryTracker::reset_peak(c.device);
    StepResult result = c.drafter.step(batch, c.dispatcher, c.anchors, /*training=*/true);
    o.peak_forward = std::max(o.peak_forward, MemoryTracker::peak_bytes(c.device));

    // A single process reads the loss after the backward has been queued (reading it
    // earlier would stall the device between the passes); a non-finite loss still stops
    // before the update.
    MemoryTracker::reset_peak(c.device);
    const double loss = grads.backward(result, micro);
    o.peak_backward = std::max(o.peak_backward, MemoryTracker::peak_bytes(c.device));
    result.loss = at::Tensor();
    if (!std::isfinite(loss)) {
      c.optimizer.zero_grad();
      throw NonFiniteLoss(loss, step);
    }
  }
  grads.synchronize(o);

  MemoryTracker::reset_peak(c.device);
  const at::Tensor norm = c.optimizer.step(o.lr, c.grad_clip);
  c.optimizer.zero_grad();
  o.peak_optimizer = MemoryTracker::peak_bytes(c.device);
  o.grad_norm = norm.item<double>();
  if (c.device.is_cuda()) torch::cuda::synchronize();
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

}  // namespace flashdraft

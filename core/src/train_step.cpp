// One optimizer step.
#include "train_step.hpp"

#include "memory.hpp"

#include <torch/torch.h>

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
  Batch batch = c.batches.train(step);
  o.target_seconds = c.batches.target_seconds();

  MemoryTracker::reset_peak(c.device);
  StepResult result = c.drafter.step(batch, c.dispatcher, c.anchors, /*training=*/true);
  o.peak_forward = MemoryTracker::peak_bytes(c.device);

  // The loss is read after the backward (reading it earlier would stall the device's
  // queue between the passes); a non-finite loss still stops before the update.
  MemoryTracker::reset_peak(c.device);
  const at::Tensor loss = result.loss.detach();
  result.loss.backward();
  o.peak_backward = MemoryTracker::peak_bytes(c.device);
  result.loss = at::Tensor();
  o.loss = loss.item<double>();
  if (!std::isfinite(o.loss)) {
    c.optimizer.zero_grad();
    throw NonFiniteLoss(o.loss, step);
  }

  MemoryTracker::reset_peak(c.device);
  const at::Tensor norm = c.optimizer.step(o.lr, c.grad_clip);
  c.optimizer.zero_grad();
  o.peak_optimizer = MemoryTracker::peak_bytes(c.device);
  if (result.deferred) result.deferred(result);  // metrics read from the device now
  o.grad_norm = norm.item<double>();
  if (c.device.is_cuda()) torch::cuda::synchronize();
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  o.tokens = result.tokens;
  o.position_accuracy = std::move(result.position_accuracy);
  o.scalars = std::move(result.scalars);
  return o;
}

}  // namespace flashdraft

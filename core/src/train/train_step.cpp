// One optimizer step.
#include "train/train_step.hpp"

#include "train/grad_sync.hpp"
#include "train/memory.hpp"

#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace flashdraft {

NonFiniteLoss::NonFiniteLoss(double loss_value, int64_t step, const std::string& what)
    : std::runtime_error(what + " is not finite (" + std::to_string(loss_value) + ") at step " + std::to_string(step) +
                         "; the run stops before its update (the log keeps every step before it)"),
      loss(loss_value),
      quantity(what) {}

bool can_queue_steps(const StepContext& c) { return c.device.is_cuda() && c.grads->single() && c.optimizer.guards(); }

namespace {

// A batch's real input tokens: each row's length (padding after it not counted), or every
// position when the batch has no lengths.
int64_t real_tokens(const Batch& batch) {
  if (!batch.lengths.defined()) return batch.tokens.numel();
  const int64_t S = batch.tokens.size(1);
  return batch.lengths.to(at::kCPU, at::kLong).clamp(0, S).sum().item<int64_t>();
}

// Host seconds since `t`, and `t` moved to now.
double lap(std::chrono::steady_clock::time_point& t) {
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

// The queued path: forward, backward and update queued; nothing read.
StepOutcome queue_step(StepContext& c, StepOutcome o, std::chrono::steady_clock::time_point t0) {
  GradientSync& grads = *c.grads;
  auto t = t0;
  grads.seed_anchors(c.anchors, o.step, 0);
  Batch batch = c.batches.train(grads.batch_index(o.step, 0));
  o.input_tokens = real_tokens(batch);
  std::shared_ptr<const BatchSource::TargetTiming> target = c.batches.target_timing();
  o.host.emplace_back("batch", lap(t));

  MemoryTracker::reset_peak(c.device);
  StepResult result = c.drafter.step(batch, c.dispatcher, c.anchors, /*training=*/true);
  o.peak_forward = MemoryTracker::peak_bytes(c.device);
  o.host.emplace_back("forward", lap(t));

  MemoryTracker::reset_peak(c.device);
  result.loss.backward();
  o.peak_backward = MemoryTracker::peak_bytes(c.device);
  const at::Tensor loss = result.loss.detach();
  result.loss = at::Tensor();
  o.host.emplace_back("backward", lap(t));

  MemoryTracker::reset_peak(c.device);
  const at::Tensor norm = c.optimizer.step(o.lr, c.grad_clip, loss);
  c.optimizer.zero_grad();
  o.peak_optimizer = MemoryTracker::peak_bytes(c.device);
  o.host.emplace_back("optimizer", lap(t));
  o.kernels = c.ledger;
  o.queued = std::make_shared<QueuedStep>(
      QueuedStep{loss, norm, std::move(result), std::move(target), t0, std::make_shared<const DeviceMark>(c.device)});
  o.end = o.queued->done;
  return o;
}

}  // namespace

StepOutcome train_step(StepContext& c, int64_t step, bool queue) {
  const auto t0 = std::chrono::steady_clock::now();
  StepOutcome o;
  o.step = step;
  o.lr = c.schedule.at(step);
  c.ledger.begin_step(step, c.layers);
  if (queue) {
    if (!can_queue_steps(c)) throw std::logic_error("train_step: this run cannot queue steps");
    return queue_step(c, std::move(o), t0);
  }
  GradientSync& grads = *c.grads;
  Batch batch;
  int64_t batch_at = -1;
  for (int64_t micro = 0; micro < grads.micro_batches(); ++micro) {
    grads.seed_anchors(c.anchors, step, micro);
    // The parts of a step in parts read one batch (the online target runs once for them).
    if (grads.batch_index(step, micro) != batch_at) {
      batch_at = grads.batch_index(step, micro);
      batch = c.batches.train(batch_at);
      o.input_tokens += real_tokens(batch);
      o.target_seconds += c.batches.target_seconds();
    }
    batch.part = grads.part(micro);

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
  // The loss was finite; the guard (where the optimizer has one) keeps a non-finite norm
  // from reaching the weights.
  const at::Tensor guard = c.optimizer.guards()
                               ? at::scalar_tensor(o.loss, at::TensorOptions().dtype(at::kFloat).device(c.device))
                               : at::Tensor();
  const at::Tensor norm = c.optimizer.step(o.lr, c.grad_clip, guard);
  c.optimizer.zero_grad();
  o.peak_optimizer = MemoryTracker::peak_bytes(c.device);
  o.grad_norm = norm.item<double>();
  if (c.device.is_cuda()) torch::cuda::synchronize();
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  o.kernels = c.ledger;
  // With a guard the update was skipped on the device: stop here, the weights are clean.
  // (torch::optim's update has run; the next step's loss stops the run, as always.)
  if (!std::isfinite(o.grad_norm) && c.optimizer.guards()) throw NonFiniteLoss(o.grad_norm, step, "gradient norm");
  return o;
}

void finish_step(StepOutcome& o, const DeviceMark* previous) {
  if (!o.queued) return;
  const std::shared_ptr<QueuedStep> q = std::move(o.queued);
  auto t = std::chrono::steady_clock::now();
  q->done->wait();
  o.host.emplace_back("wait", lap(t));
  // Step t+1 is queued behind it on the main stream: read on a side stream (ReadAside).
  const ReadAside aside(q->loss.device());
  const double loss = q->loss.item<double>();
  if (!std::isfinite(loss)) throw NonFiniteLoss(loss, o.step);
  StepResult& r = q->result;
  if (r.deferred) {
    r.deferred(r);
    r.deferred = nullptr;
  }
  o.loss = loss;
  o.tokens = r.tokens;
  o.position_accuracy = r.position_accuracy;
  o.scalars = r.scalars;
  o.grad_norm = q->norm.item<double>();
  if (!std::isfinite(o.grad_norm)) throw NonFiniteLoss(o.grad_norm, o.step, "gradient norm");
  o.seconds = previous ? q->done->seconds_since(*previous) : q->done->host_seconds_since(q->start);
  if (q->target) o.target_seconds = q->target->seconds();
  o.host.emplace_back("read", lap(t));
}

}  // namespace flashdraft

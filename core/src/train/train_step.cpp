// One optimizer step.
#include "train/train_step.hpp"

#include "train/grad_sync.hpp"
#include "train/memory.hpp"

#include <ATen/record_function.h>
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

}  // namespace

// One path for every step: per micro-batch (and part) the batch, the forward and the
// backward through GradientSync, then the update. A queued step (one process, one
// micro-batch) reads nothing: its loss, metrics and norm stay on the device for
// finish_step(); otherwise the micro-batches' losses are read as their backwards are queued,
// the gradients synchronised, and the norm read after the update.
StepOutcome train_step(StepContext& c, int64_t step, bool queue) {
  const auto t0 = std::chrono::steady_clock::now();
  auto t = t0;
  StepOutcome o;
  o.step = step;
  o.lr = c.schedule.at(step);
  c.ledger.begin_step(step, c.layers);
  if (queue && !can_queue_steps(c)) throw std::logic_error("train_step: this run cannot queue steps");
  GradientSync& grads = *c.grads;
  Batch batch;
  int64_t batch_at = -1;
  at::Tensor queued_loss;  // queued: the step's loss on the device
  StepResult queued_result;
  std::shared_ptr<const BatchSource::TargetTiming> target;
  for (int64_t micro = 0; micro < grads.micro_batches(); ++micro) {
    grads.seed_anchors(c.anchors, step, micro);
    // The parts of a step in parts read one batch (the online target runs once for them).
    if (grads.batch_index(step, micro) != batch_at) {
      batch_at = grads.batch_index(step, micro);
      batch = c.batches.train(batch_at);
      o.input_tokens += real_tokens(batch);
      if (queue)
        target = c.batches.target_timing();
      else
        o.target_seconds += c.batches.target_seconds();
    }
    batch.part = grads.part(micro);
    o.host.emplace_back("batch", lap(t));

    MemoryTracker::reset_peak(c.device);
    StepResult result = [&] {
      RECORD_USER_SCOPE("flashdraft/drafter_forward");  // named ranges in --profile's trace
      return c.drafter.step(batch, c.dispatcher, c.anchors, /*training=*/true);
    }();
    o.peak_forward = std::max(o.peak_forward, MemoryTracker::peak_bytes(c.device));
    o.host.emplace_back("forward", lap(t));

    MemoryTracker::reset_peak(c.device);
    if (queue) {
      RECORD_USER_SCOPE("flashdraft/backward");
      queued_loss = grads.queue_backward(result);
      queued_result = std::move(result);
    } else {
      // The loss is read after the backward has been queued (reading it earlier would stall
      // the device between the passes); a non-finite loss still stops before the update.
      RECORD_USER_SCOPE("flashdraft/backward");
      const double loss = grads.backward(result, micro);
      if (!std::isfinite(loss)) {
        c.optimizer.zero_grad();
        throw NonFiniteLoss(loss, step);
      }
    }
    o.peak_backward = std::max(o.peak_backward, MemoryTracker::peak_bytes(c.device));
    o.host.emplace_back("backward", lap(t));
  }
  if (!queue) grads.synchronize(o);

  MemoryTracker::reset_peak(c.device);
  // The optimizer's guard (where it has one) keeps a non-finite loss or norm from reaching
  // the weights: the queued loss on the device, or the read (finite) one.
  const at::Tensor guard = queue ? queued_loss
                           : c.optimizer.guards()
                               ? at::scalar_tensor(o.loss, at::TensorOptions().dtype(at::kFloat).device(c.device))
                               : at::Tensor();
  const at::Tensor norm = [&](const at::Tensor& finite) {
    RECORD_USER_SCOPE("flashdraft/optimizer");  // (the macro declares a variable named guard)
    at::Tensor n = c.optimizer.step(o.lr, c.grad_clip, finite);
    c.optimizer.zero_grad();
    return n;
  }(guard);
  o.peak_optimizer = MemoryTracker::peak_bytes(c.device);
  o.host.emplace_back("optimizer", lap(t));
  o.kernels = c.ledger;
  if (queue) {
    o.queued = std::make_shared<QueuedStep>(QueuedStep{queued_loss, norm, std::move(queued_result), std::move(target),
                                                       t0, std::make_shared<const DeviceMark>(c.device)});
    o.end = o.queued->done;
    return o;
  }
  o.grad_norm = norm.item<double>();
  if (c.device.is_cuda()) torch::cuda::synchronize();
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

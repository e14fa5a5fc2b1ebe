// One training step: the batch, the drafter's forward with loss, the backward, gradient
// clipping and the optimizer, with the peak memory of each phase and the wall time.
//
// Queued steps (CUDA, one process, one micro-batch, an optimizer with device guards):
// train_step(..., queue = true) queues the whole step on the device and returns with its
// loss, metrics and gradient norm still unread; finish_step() reads them later, normally
// after the next step has been queued, so the device never waits for the host between
// steps (the host prepares step t+1 - batch, anchors, mask, launches - while the device
// runs step t). A non-finite loss or gradient norm found then stops the run exactly as
// before: the optimizer's guard skipped that update and every later one on the device.
#pragma once

#include <flashdraft/model.hpp>

#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"
#include "train/batches.hpp"
#include "train/device_mark.hpp"
#include "train/optimizer.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

class GradientSync;

struct StepContext {
  Drafter& drafter;
  BatchSource& batches;
  AttentionDispatcher& dispatcher;
  KernelLedger& ledger;
  TrainOptimizer& optimizer;
  std::vector<at::Tensor>& params;
  at::Generator& anchors;  // the trainer's generator for anchors and the like
  Schedule schedule;
  double grad_clip = 0;  // 0: no clipping
  c10::Device device = c10::kCPU;
  int64_t layers = 0;
  GradientSync* grads = nullptr;  // micro-batches, data shards and the gradient all-reduce
};

// What a queued step still has to read from the device.
struct QueuedStep {
  at::Tensor loss, norm;  // device scalars
  StepResult result;      // the drafter's metrics (its deferred reads not yet run)
  std::shared_ptr<const BatchSource::TargetTiming> target;
  std::chrono::steady_clock::time_point start;
  std::shared_ptr<const DeviceMark> done;  // after the update
};

struct StepOutcome {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  int64_t peak_forward = 0, peak_backward = 0, peak_optimizer = 0;
  double target_seconds = 0;  // the online target's forward (0 without one)
  int64_t tokens = 0;         // loss-carrying (labelled) positions, every micro-batch and rank
  int64_t input_tokens = 0;   // the batches' real input tokens (not padding), every micro-batch and rank
  std::vector<double> position_accuracy;
  std::vector<std::pair<std::string, double>> scalars;
  // Host seconds spent queueing each phase (batch, forward, backward, optimizer; and the
  // trainer's read and record), for the profiler's report.
  std::vector<std::pair<std::string, double>> host;
  KernelLedger kernels;                   // the ledger's rows of this step (what ran)
  std::shared_ptr<QueuedStep> queued;     // set until finish_step() has read the device
  std::shared_ptr<const DeviceMark> end;  // a queued step's end in the device's queue
};

// A loss (or gradient norm) that is not finite: the step's update is not taken; the run
// stops.
class FLASHDRAFT_API NonFiniteLoss : public std::runtime_error {
 public:
  NonFiniteLoss(double loss, int64_t step, const std::string& quantity = "loss");
  double loss;
  std::string quantity;
};

// Whether steps can be queued ahead of their reads in this run (see above).
bool can_queue_steps(const StepContext& c);

// One step. queue = true (only where can_queue_steps): returns with outcome.queued set.
StepOutcome train_step(StepContext& c, int64_t step, bool queue = false);

// Reads a queued step's loss, metrics and norm (waiting for the device to reach its end)
// and its time: from `previous` (the end of the step queued just before it, when nothing
// waited in between) to its end on the device, else the host time from its start. Throws
// NonFiniteLoss for a non-finite loss or norm.
void finish_step(StepOutcome& o, const DeviceMark* previous);

}  // namespace flashdraft

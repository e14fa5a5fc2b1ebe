// One training step: the batch, the drafter's forward with loss, the backward, gradient
// clipping and the optimizer, with the peak memory of each phase and the wall time.
#pragma once

#include <flashdraft/model.hpp>

#include "batches.hpp"
#include "dispatch.hpp"
#include "ledger.hpp"
#include "optimizer.hpp"

#include <cstdint>
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

struct StepOutcome {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  int64_t peak_forward = 0, peak_backward = 0, peak_optimizer = 0;
  double target_seconds = 0;  // the online target's forward (0 without one)
  int64_t tokens = 0;
  std::vector<double> position_accuracy;
  std::vector<std::pair<std::string, double>> scalars;
};

// A loss that is not finite: the step is not taken; the run stops.
class FLASHDRAFT_API NonFiniteLoss : public std::runtime_error {
 public:
  NonFiniteLoss(double loss, int64_t step);
  double loss;
};

StepOutcome train_step(StepContext& c, int64_t step);

}  // namespace flashdraft

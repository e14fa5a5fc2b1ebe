// The optimizer stage: AdamW over the drafter's trainable tensors, and the learning-rate
// schedule (linear warm-up, then cosine decay to min_lr_ratio x lr).
#pragma once

#include <flashdraft/config.hpp>

#include <torch/optim/adamw.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace flashdraft {

struct Schedule {
  double lr = 0, min_ratio = 0;
  int64_t warmup = 0, steps = 0;
  double at(int64_t step) const;
};

// From [optimizer] and the run's step count.
Schedule make_schedule(const Config& optimizer, int64_t steps);
std::unique_ptr<torch::optim::AdamW> make_optimizer(const std::vector<at::Tensor>& params, const Config& optimizer);
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace flashdraft

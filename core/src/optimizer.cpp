// AdamW and the learning-rate schedule.
#include "optimizer.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace flashdraft {

double Schedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  const int64_t span = std::max<int64_t>(1, steps - warmup);
  const double t = std::min(1.0, double(step - warmup) / double(span));
  return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * t)));
}

Schedule make_schedule(const Config& oc, int64_t steps) {
  return Schedule{oc.real("lr"), oc.real("min_lr_ratio"), oc.integer("warmup_steps"), steps};
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(const std::vector<at::Tensor>& params, const Config& oc) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(oc.real("lr"))
                                                           .betas({oc.real("beta1"), oc.real("beta2")})
                                                           .eps(oc.real("eps"))
                                                           .weight_decay(oc.real("weight_decay")));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
}

}  // namespace flashdraft

// The optimizer stage: AdamW over the drafter's trainable tensors, with global-norm
// gradient clipping, and the learning-rate schedule (linear warm-up, then cosine decay
// to min_lr_ratio x lr).
//
// Two implementations behind one interface ([optimizer] implementation):
//   fused  ATen's multi-tensor fused AdamW kernel (_fused_adamw_). With 16-bit compute
//          and float32 master weights ([run] master_weights) it keeps a float32 copy of
//          every weight and float32 moments; each step the 16-bit gradients are cast in
//          groups (a bounded temporary), the update runs on the masters and the 16-bit
//          weights are refreshed from them. On CUDA with the engine's kernels, 16-bit
//          weights with float32 masters are updated instead by one kernel per tensor
//          (core/cuda/adamw.cu: the same arithmetic) that reads the 16-bit gradient and
//          writes master and weight at once: no cast, no copy. Clipping is sync-free: the
//          global norm is a device scalar from _foreach_norm, and the clip factor enters
//          the update as its grad_scale; nothing waits for the host.
//          A guard (step()'s `guard`, the step's loss) makes a non-finite loss or gradient
//          norm skip this update and every later one on the device, so a caller may read
//          the loss only after queueing further steps and still stop before any update
//          that a non-finite value would have poisoned.
//   torch  torch::optim::AdamW and torch::nn::utils::clip_grad_norm_ (weights and moments
//          in the weights' own dtype).
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace flashdraft {

struct Schedule {
  double lr = 0, min_ratio = 0;
  int64_t warmup = 0, steps = 0;
  double at(int64_t step) const;
};

// From [optimizer] and the run's step count.
FLASHDRAFT_API Schedule make_schedule(const Config& optimizer, int64_t steps);

struct AdamWSettings {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
};

class FLASHDRAFT_API TrainOptimizer {
 public:
  virtual ~TrainOptimizer() = default;
  // One update at learning rate `lr` with the gradients' global norm clipped to `clip`
  // (<= 0: no clipping). Returns the norm before clipping as a float32 scalar tensor on
  // the weights' device (reading it is the caller's one host sync). `guard` (a scalar on
  // the device, or undefined): when it or the norm is not finite, this update and every
  // later one are skipped (implementations with guards() only).
  virtual at::Tensor step(double lr, double clip, const at::Tensor& guard = {}) = 0;
  // Whether step() honours `guard` on the device (without reading it on the host).
  virtual bool guards() const { return false; }
  virtual void zero_grad() = 0;
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  // Throws std::runtime_error (a sentence) when the archive does not fit these weights.
  virtual void load(torch::serialize::InputArchive& archive) = 0;
  virtual std::string name() const = 0;
};

// `master`: the dtype the update runs in (a float32 master copy is kept when it differs
// from the weights' dtype); `fused`: the fused implementation.
FLASHDRAFT_API std::unique_ptr<TrainOptimizer> make_optimizer(const std::vector<at::Tensor>& params,
                                                              const Config& optimizer, c10::ScalarType master,
                                                              bool fused);
FLASHDRAFT_API std::unique_ptr<TrainOptimizer> make_fused_adamw(const std::vector<at::Tensor>& params,
                                                                AdamWSettings settings, c10::ScalarType master);
FLASHDRAFT_API std::unique_ptr<TrainOptimizer> make_torch_adamw(const std::vector<at::Tensor>& params,
                                                                AdamWSettings settings);

}  // namespace flashdraft

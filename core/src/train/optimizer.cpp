// AdamW (fused and torch::optim) and the learning-rate schedule.
#include "train/optimizer.hpp"

#include "dispatch/cuda_ops.hpp"

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>

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

namespace {

std::string shape_of(const at::Tensor& t) { return c10::str(t.sizes()); }

// Reads tensor `key` of the archive, checking its shape and dtype against `like`.
at::Tensor read_like(torch::serialize::InputArchive& archive, const std::string& key, const at::Tensor& like) {
  at::Tensor t;
  if (!archive.try_read(key, t, /*is_buffer=*/true))
    throw std::runtime_error("the optimizer state lacks \"" + key + "\" (it was written for fewer weights)");
  if (t.sizes() != like.sizes() || t.scalar_type() != like.scalar_type())
    throw std::runtime_error("optimizer state \"" + key + "\" is " + c10::toString(t.scalar_type()) + " " +
                             shape_of(t) + ", the run's is " + c10::toString(like.scalar_type()) + " " +
                             shape_of(like));
  return t;
}

class FusedAdamW final : public TrainOptimizer {
 public:
  FusedAdamW(std::vector<at::Tensor> params, AdamWSettings s, c10::ScalarType master)
      : params_(std::move(params)), s_(s) {
    at::NoGradGuard no_grad;
    for (const at::Tensor& p : params_) {
      const bool copy = p.scalar_type() != master;
      master_.push_back(copy ? p.detach().to(master).contiguous() : p.detach());
      exp_avg_.push_back(at::zeros_like(master_.back()));
      exp_avg_sq_.push_back(at::zeros_like(master_.back()));
      copies_ = copies_ || copy;
    }
    const c10::Device device = params_.empty() ? c10::Device(c10::kCPU) : params_[0].device();
    step_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    skip_ = at::zeros({}, step_.options());
    // 16-bit weights with float32 masters on CUDA: the engine's kernel, no cast or copy.
    mixed_kernel_ = copies_ && master == at::kFloat && cuda_ops::cuda_ops_built() && !params_.empty();
    for (const at::Tensor& p : params_) mixed_kernel_ = mixed_kernel_ && cuda_ops::runs_on(p) && p.is_contiguous();
  }

  bool guards() const override { return true; }

  at::Tensor step(double lr, double clip, const at::Tensor& guard) override {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    std::vector<size_t> with_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].grad().defined()) {
        grads.push_back(params_[i].grad());
        with_grad.push_back(i);
      }
    if (grads.empty()) return at::zeros({}, step_.options());
    const at::Tensor norm = global_norm(grads);
    std::optional<at::Tensor> scale;
    // torch's clip: g *= min(1, clip / (norm + 1e-6)); the fused kernel divides by
    // grad_scale, so grad_scale = max(1, (norm + 1e-6) / clip).
    if (clip > 0) scale = at::clamp_min((norm + 1e-6) / clip, 1.0);
    std::optional<at::Tensor> skip;
    if (guard.defined()) {
      // Sticky on the device: once set, no later update runs (skip_ is 0 or exactly 1, as
      // the fused kernel's found_inf must be).
      const at::Tensor bad =
          at::logical_or(at::logical_not(at::isfinite(guard.to(at::kFloat))), at::logical_not(at::isfinite(norm)));
      skip_.copy_(at::maximum(skip_, bad.to(at::kFloat)));
      skip = skip_;
      step_.sub_(skip_ - 1);  // + 1 unless skipped
    } else {
      step_.add_(1);
    }
    if (mixed_kernel_) {
      const cuda_ops::AdamWHyper h{lr, s_.beta1, s_.beta2, s_.eps, s_.weight_decay};
      for (size_t j = 0; j < with_grad.size(); ++j) {
        const size_t i = with_grad[j];
        at::Tensor g =
            grads[j].scalar_type() == params_[i].scalar_type() ? grads[j] : grads[j].to(params_[i].scalar_type());
        cuda_ops::adamw_mixed(params_[i].detach(), g.contiguous(), master_[i], exp_avg_[i], exp_avg_sq_[i], h, step_,
                              scale ? *scale : at::Tensor(), skip ? *skip : at::Tensor());
        // Written through a raw pointer: tell autograd the weight changed (as copy_ would),
        // so a graph that saved it refuses a backward instead of using the new values.
        torch::autograd::impl::bump_version(params_[i]);
      }
      return norm;
    }
    // Groups of about 256 MiB of float32 gradients: the cast's temporary stays bounded.
    const int64_t budget = int64_t(64) << 20;
    for (size_t g0 = 0; g0 < with_grad.size();) {
      size_t g1 = g0;
      int64_t n = 0;
      do n += grads[g1++].numel();
      while (g1 < with_grad.size() && n + grads[g1].numel() <= budget);
      update(with_grad, grads, g0, g1, lr, scale, skip);
      g0 = g1;
    }
    return norm;
  }

  void zero_grad() override {
    for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("fused_adamw/step", step_.to(at::kCPU).clone(), /*is_buffer=*/true);
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::string k = std::to_string(i);
      archive.write("exp_avg/" + k, exp_avg_[i].to(at::kCPU).clone(), true);
      archive.write("exp_avg_sq/" + k, exp_avg_sq_[i].to(at::kCPU).clone(), true);
      if (copies_) archive.write("master/" + k, master_[i].to(at::kCPU).clone(), true);
    }
  }

  void load(torch::serialize::InputArchive& archive) override {
    at::Tensor step;
    if (!archive.try_read("fused_adamw/step", step, true))
      throw std::runtime_error(
          "it holds no fused AdamW state (written by another optimizer implementation; set "
          "[optimizer] implementation to the one the run was started with)");
    std::vector<at::Tensor> m, v, w;
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::string k = std::to_string(i);
      m.push_back(read_like(archive, "exp_avg/" + k, exp_avg_[i].to(at::kCPU)));
      v.push_back(read_like(archive, "exp_avg_sq/" + k, exp_avg_sq_[i].to(at::kCPU)));
      if (copies_) w.push_back(read_like(archive, "master/" + k, master_[i].to(at::kCPU)));
    }
    at::NoGradGuard no_grad;
    step_.copy_(step);
    for (size_t i = 0; i < params_.size(); ++i) {
      exp_avg_[i].copy_(m[i]);
      exp_avg_sq_[i].copy_(v[i]);
      if (copies_) {
        master_[i].copy_(w[i]);
        params_[i].detach().copy_(master_[i]);
      }
    }
  }

  std::string name() const override {
    if (mixed_kernel_)
      return "fused AdamW, float32 master weights (flashdraft CUDA kernel: 16-bit gradients read directly)";
    return copies_ ? "fused AdamW, float32 master weights" : "fused AdamW";
  }

 private:
  // Global L2 norm of the gradients, in float32, as a device scalar.
  static at::Tensor global_norm(const std::vector<at::Tensor>& grads) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kFloat);
    return at::stack(norms).norm();
  }

  void update(const std::vector<size_t>& idx, const std::vector<at::Tensor>& grads, size_t g0, size_t g1, double lr,
              const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& skip) {
    std::vector<at::Tensor> w, g, m, v, steps;
    for (size_t j = g0; j < g1; ++j) {
      const size_t i = idx[j];
      w.push_back(master_[i]);
      g.push_back(grads[j].scalar_type() == master_[i].scalar_type() ? grads[j]
                                                                     : grads[j].to(master_[i].scalar_type()));
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
      steps.push_back(step_);
    }
    at::_fused_adamw_(w, g, m, v, {}, steps, lr, s_.beta1, s_.beta2, s_.weight_decay, s_.eps, /*amsgrad=*/false,
                      /*maximize=*/false, scale, skip);
    if (copies_)
      for (size_t j = g0; j < g1; ++j) params_[idx[j]].detach().copy_(master_[idx[j]]);
  }

  std::vector<at::Tensor> params_, master_, exp_avg_, exp_avg_sq_;
  at::Tensor step_;  // float32 scalar on the weights' device (the fused kernel reads it)
  at::Tensor skip_;  // float32 scalar, 1 once a guarded step saw a non-finite loss or norm
  AdamWSettings s_;
  bool copies_ = false, mixed_kernel_ = false;
};

class TorchAdamW final : public TrainOptimizer {
 public:
  TorchAdamW(std::vector<at::Tensor> params, AdamWSettings s)
      : params_(params),
        opt_(params,
             torch::optim::AdamWOptions(1e-3).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay)) {}

  at::Tensor step(double lr, double clip, const at::Tensor&) override {
    for (auto& group : opt_.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    const double c = clip > 0 ? clip : std::numeric_limits<double>::infinity();
    const double norm = torch::nn::utils::clip_grad_norm_(params_, c);
    opt_.step();
    return at::scalar_tensor(norm, at::TensorOptions().dtype(at::kFloat));
  }

  void zero_grad() override { opt_.zero_grad(/*set_to_none=*/true); }
  void save(torch::serialize::OutputArchive& archive) const override { opt_.save(archive); }

  void load(torch::serialize::InputArchive& archive) override {
    at::Tensor probe;
    if (archive.try_read("fused_adamw/step", probe, true))
      throw std::runtime_error(
          "it holds a fused AdamW state, the run uses torch::optim::AdamW (set [optimizer] "
          "implementation to the one the run was started with)");
    opt_.load(archive);
    // The optimizer matched its state to the parameters by position: check the moments'
    // shapes so that a reordered drafter cannot silently pair the wrong state.
    for (const auto& group : opt_.param_groups())
      for (const auto& p : group.params()) {
        auto it = opt_.state().find(p.unsafeGetTensorImpl());
        if (it == opt_.state().end()) continue;
        if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get()))
          if (s->exp_avg().defined() && s->exp_avg().sizes() != p.sizes())
            throw std::runtime_error("an AdamW moment has shape " + shape_of(s->exp_avg()) +
                                     " for a parameter of shape " + shape_of(p));
      }
  }

  std::string name() const override { return "torch::optim::AdamW"; }

 private:
  std::vector<at::Tensor> params_;
  mutable torch::optim::AdamW opt_;
};

}  // namespace

std::unique_ptr<TrainOptimizer> make_fused_adamw(const std::vector<at::Tensor>& params, AdamWSettings settings,
                                                 c10::ScalarType master) {
  return std::make_unique<FusedAdamW>(params, settings, master);
}

std::unique_ptr<TrainOptimizer> make_torch_adamw(const std::vector<at::Tensor>& params, AdamWSettings settings) {
  return std::make_unique<TorchAdamW>(params, settings);
}

std::unique_ptr<TrainOptimizer> make_optimizer(const std::vector<at::Tensor>& params, const Config& oc,
                                               c10::ScalarType master, bool fused) {
  const AdamWSettings s{oc.real("beta1"), oc.real("beta2"), oc.real("eps"), oc.real("weight_decay")};
  if (fused) return make_fused_adamw(params, s, master);
  return make_torch_adamw(params, s);
}

}  // namespace flashdraft

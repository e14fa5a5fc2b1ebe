// Gradient accumulation and the bucketed, overlapped gradient all-reduce.
#include "train/grad_sync.hpp"

#include <flashdraft/acceptance.hpp>

#include "train/train_step.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <algorithm>
#include <mutex>

namespace flashdraft {

struct GradientSync::Bucket {
  std::vector<size_t> params;  // indices into params_
  at::Tensor flat;             // the bucket's gradients, concatenated (fp32 like the masters)
  size_t pending = 0;          // gradients not yet copied in this step
  std::unique_ptr<PendingReduce> reduce;
};

// Runs after the autograd engine accumulated a tensor's gradient (.grad is final for
// this backward).
class GradientSync::Hook final : public torch::autograd::PostAccumulateGradHook {
 public:
  Hook(GradientSync& sync, size_t param) : sync_(sync), param_(param) {}
  void operator()(const torch::autograd::Variable&) override { sync_.on_gradient(param_); }

 private:
  GradientSync& sync_;
  size_t param_;
};

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

GradientSync::GradientSync(Distributed& dist, std::vector<at::Tensor> params, int64_t accumulate, double bucket_mb,
                           uint64_t seed, int64_t parts)
    : dist_(dist),
      params_(std::move(params)),
      accumulate_(accumulate),
      parts_(std::max<int64_t>(parts, 1)),
      seed_(seed) {
  if (!dist_.active()) return;
  build_buckets(bucket_mb);
  for (size_t i = 0; i < params_.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::make_unique<Hook>(*this, i));
}

GradientSync::~GradientSync() {
  if (!dist_.active()) return;
  for (const auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void GradientSync::build_buckets(double bucket_mb) {
  const double cap = bucket_mb * double(1 << 20);
  bucket_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  double bytes = cap;  // the first tensor opens a bucket
  for (size_t k = params_.size(); k-- > 0;) {
    if (bytes >= cap) {
      buckets_.push_back(std::make_unique<Bucket>());
      bytes = 0;
    }
    Bucket& b = *buckets_.back();
    bucket_of_[k] = buckets_.size() - 1;
    offset_of_[k] = 0;
    for (size_t j : b.params) offset_of_[k] += static_cast<size_t>(params_[j].numel());
    b.params.push_back(k);
    bytes += double(params_[k].numel()) * double(params_[k].element_size());
  }
  for (auto& b : buckets_) {
    int64_t n = 0;
    for (size_t j : b->params) n += params_[j].numel();
    b->flat = at::zeros({n}, params_[b->params[0]].options().dtype(at::kFloat));
  }
}

int64_t GradientSync::batch_index(int64_t step, int64_t micro) const {
  return (step * accumulate_ + micro / parts_) * dist_.world() + dist_.rank();
}

void GradientSync::seed_anchors(at::Generator& anchors, int64_t step, int64_t micro) const {
  // Every run, a single process with accumulate = 1 included: the anchors of a micro-batch
  // are a function of (seed, global micro-batch number) alone, whatever was drawn before,
  // so N ranks draw what one process with accumulate = N draws, and a resumed run draws
  // what the uninterrupted run would have drawn.
  seed_anchor_stream(anchors, seed_, static_cast<uint64_t>(batch_index(step, micro)));
}

void seed_anchor_stream(at::Generator& generator, uint64_t seed, uint64_t micro_batch) {
  // The key mixes all 64 bits of (seed, micro-batch). set_current_seed(key) would keep only
  // key & 0xffffffff (mt19937's seeding fills its state from one 32-bit word), and among n
  // micro-batches about n^2 / 2^33 pairs would share every anchor they draw (one pair by
  // ~93,000 micro-batches, ~120 pairs in a million).
  // Instead every word of the 624-word state comes from the splitmix64 sequence started
  // at the key; left_ = 1 makes the first draw regenerate the state (as after seeding).
  const uint64_t key = splitmix64(splitmix64(seed ^ 0xa5c5ULL) + micro_batch);
  at::mt19937_data_pod data{};
  data.seed_ = key;
  data.seeded_ = true;
  data.left_ = 1;
  data.next_ = 0;
  for (size_t k = 0; k < data.state_.size(); k += 2) {
    const uint64_t word = splitmix64(key + k / 2 * 0x9e3779b97f4a7c15ULL);
    data.state_[k] = static_cast<uint32_t>(word);
    if (k + 1 < data.state_.size()) data.state_[k + 1] = static_cast<uint32_t>(word >> 32);
  }
  at::mt19937 engine;
  engine.set_data(data);
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(generator);
  cpu->set_engine(engine);
  // What set_current_seed also forgets: the cached second value of a normal pair.
  cpu->set_next_float_normal_sample(std::nullopt);
  cpu->set_next_double_normal_sample(std::nullopt);
}

void GradientSync::reset_step() {
  weight_ = loss_sum_ = tokens_ = 0;
  accuracy_sum_.clear();
  scalar_sum_.clear();
  scalars_.clear();
  accuracy_.clear();
  next_launch_ = sent_during_backward_ = 0;
  copied_.assign(params_.size(), 0);
  for (auto& b : buckets_) {
    b->pending = b->params.size();
    b->reduce.reset();
  }
}

double GradientSync::backward(StepResult& r, int64_t micro) {
  if (micro == 0) reset_step();
  const at::Tensor loss_value = r.loss.detach();
  double loss = 0;
  if (plain()) {
    // One process, one micro-batch: the loss and the metrics are read once the backward
    // is queued (reading them first would stall the device between the passes).
    flashdraft::backward(r);
    loss = loss_value.item<double>();
  } else {
    loss = loss_value.item<double>();
  }
  if (r.deferred) {
    r.deferred(r);
    r.deferred = nullptr;
  }
  if (!std::isfinite(loss)) return loss;  // the caller stops the run
  const double weight = r.loss_weight >= 0 ? r.loss_weight : double(r.tokens);
  weight_ += weight;
  loss_sum_ += loss * weight;
  last_loss_ = loss;
  // Metrics: this rank's micro-batches, weighted by their loss-carrying positions.
  const double t = double(r.tokens);
  tokens_ += t;
  accuracy_sum_.resize(r.position_accuracy.size(), 0.0);
  for (size_t j = 0; j < r.position_accuracy.size(); ++j) accuracy_sum_[j] += t * r.position_accuracy[j];
  accuracy_ = r.position_accuracy;
  scalar_sum_.resize(r.scalars.size(), 0.0);
  for (size_t j = 0; j < r.scalars.size(); ++j) scalar_sum_[j] += t * r.scalars[j].second;
  scalars_ = r.scalars;
  if (plain()) return loss;
  const bool last = micro + 1 == micro_batches();
  if (last && dist_.active()) {
    // The step's loss weight and weighted loss, summed over ranks while the backward runs.
    weights_ = at::tensor(std::vector<double>{weight_, loss_sum_}, at::TensorOptions().dtype(at::kDouble))
                   .to(params_[0].device());
    weights_reduce_ = dist_.all_reduce_async(weights_, "the all-reduce of the loss weights");
  }
  armed_ = last && dist_.active();
  flashdraft::backward(r, weight);
  armed_ = false;
  return loss;
}

at::Tensor GradientSync::queue_backward(StepResult& r) {
  if (!plain()) throw std::logic_error("GradientSync::queue_backward: only a single process with one micro-batch");
  flashdraft::backward(r);
  const at::Tensor loss = r.loss.detach();
  r.loss = at::Tensor();
  return loss;
}

void GradientSync::on_gradient(size_t param) {
  if (!armed_) return;
  Bucket& b = *buckets_[bucket_of_[param]];
  const at::Tensor& grad = params_[param].grad();
  const int64_t n = params_[param].numel();
  copied_[param] = 1;
  b.flat.narrow(0, static_cast<int64_t>(offset_of_[param]), n).copy_(grad.reshape({n}));
  --b.pending;
  launch_ready();
}

void GradientSync::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) {
    Bucket& b = *buckets_[next_launch_];
    b.reduce = dist_.all_reduce_async(b.flat, "the gradient all-reduce (bucket " + std::to_string(next_launch_) +
                                                  " of " + std::to_string(buckets_.size()) + ")");
    ++next_launch_;
    if (armed_) ++sent_during_backward_;
  }
}

void GradientSync::synchronize(StepOutcome& o) {
  double weight = weight_, loss_sum = loss_sum_;
  if (dist_.active()) {
    // Tensors the last backward did not reach: their gradient so far, or zeros (every
    // rank sends every bucket).
    for (size_t k = 0; k < params_.size(); ++k) {
      if (copied_[k]) continue;
      Bucket& b = *buckets_[bucket_of_[k]];
      at::Tensor slice = b.flat.narrow(0, static_cast<int64_t>(offset_of_[k]), params_[k].numel());
      if (params_[k].grad().defined())
        slice.copy_(params_[k].grad().reshape({-1}));
      else
        slice.zero_();
      --b.pending;
    }
    launch_ready();
    weights_reduce_->wait();
    const at::Tensor w = weights_.to(at::kCPU);
    weight = w[0].item<double>();
    loss_sum = w[1].item<double>();
  }
  const double divisor = weight > 0 ? weight : 1.0;
  if (!plain()) {
    for (auto& b : buckets_) {
      b->reduce->wait();
      b->flat.div_(divisor);
      for (size_t k : b->params) {
        const at::Tensor slice = b->flat.narrow(0, static_cast<int64_t>(offset_of_[k]), params_[k].numel());
        if (params_[k].grad().defined())
          params_[k].mutable_grad().copy_(slice.view_as(params_[k]));
        else
          params_[k].mutable_grad() = slice.view_as(params_[k]).clone();
      }
    }
    if (!dist_.active())
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().div_(divisor);
  }
  o.loss = plain() ? last_loss_ : weight > 0 ? loss_sum / weight : 0.0;
  o.tokens = static_cast<int64_t>(tokens_);
  o.position_accuracy = accuracy_;
  o.scalars = scalars_;
  if (micro_batches() == 1 || tokens_ == 0) return;  // one micro-batch: its metrics as they are
  for (size_t j = 0; j < accuracy_.size(); ++j) o.position_accuracy[j] = accuracy_sum_[j] / tokens_;
  for (size_t j = 0; j < scalars_.size(); ++j) o.scalars[j].second = scalar_sum_[j] / tokens_;
  // tau_sim is a function of the accuracies, not an average: from the merged ones.
  for (auto& [name, value] : o.scalars)
    if (name == "tau_sim") value = simulated_tau(o.position_accuracy);
}

}  // namespace flashdraft

// Where a step's batch comes from: the dataset's tokens and, with an online target, the
// target's hidden states computed for them (no-grad, through the target's own attention
// dispatcher; its calls are recorded in the step's ledger after the drafter's layers).
#pragma once

#include <flashdraft/model.hpp>

#include "dispatch/dispatch.hpp"
#include "train/device_mark.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

class FLASHDRAFT_API BatchSource {
 public:
  // Without a target (target == null) batches are the dataset's own.
  BatchSource(Dataset& dataset, Target* target, std::vector<int64_t> layers, AttentionContext* target_attention,
              c10::Device device);
  Batch train(int64_t index);
  Batch eval(int64_t index);
  int64_t eval_batches() const { return dataset_.eval_batches(); }
  // The device time of the last target forward (0 without a target). On CUDA the first
  // read waits for that forward to have run; nothing waits before (the forward is timed
  // by marks in the device's queue, so the step that follows is queued at once).
  double target_seconds() const { return target_ ? target_timing_->seconds() : 0.0; }

  // The last target forward's marks, to be read later (a step queued ahead of its read).
  struct TargetTiming {
    DeviceMark start, end;
    double seconds() const { return end.seconds_since(start); }
  };
  std::shared_ptr<const TargetTiming> target_timing() const { return target_timing_; }

 private:
  Batch with_hidden_states(Batch batch);
  Dataset& dataset_;
  Target* target_;
  std::vector<int64_t> layers_;
  AttentionContext* attention_;
  c10::Device device_;
  std::shared_ptr<const TargetTiming> target_timing_;
};

// Before step 0, for a target that reads its hidden states from disk (Target::reads_states()): the training batches
// first, first + stride, ... below end (the ones this process reads) and, with `held_out`, every held-out batch, put
// to Target::missing_states(). Throws std::runtime_error naming the first batch and document the target cannot give;
// says how many it checked and how long that took.
FLASHDRAFT_API void check_states_read(Dataset& data, Target& target, int64_t first, int64_t end, int64_t stride,
                                      bool held_out, const std::function<void(const std::string&)>& say);

// An AttentionContext that records its calls at layer + offset (the target's calls sit
// after the drafter's layers in the ledger).
// The attention of a target that makes no call (its hidden states read from a cache): a call is a logic error.
class NoAttention : public AttentionContext {
 public:
  explicit NoAttention(std::string who) : who_(std::move(who)) {}
  void set_mask(const MaskInput&) override {}
  at::Tensor attention(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) override { fail(); }
  std::pair<at::Tensor, at::Tensor> attention_lse(int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  double) override {
    fail();
  }

 private:
  std::string who_;
  [[noreturn]] void fail() const {
    throw std::logic_error(who_ + " made an attention call after prepare() said it makes none");
  }
};

class OffsetAttention : public AttentionContext {
 public:
  OffsetAttention(AttentionContext& inner, int64_t offset) : inner_(inner), offset_(offset) {}
  void set_mask(const MaskInput& input) override { inner_.set_mask(input); }
  at::Tensor attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale) override {
    return inner_.attention(layer + offset_, q, k, v, scale);
  }
  std::pair<at::Tensor, at::Tensor> attention_lse(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double scale) override {
    return inner_.attention_lse(layer + offset_, q, k, v, scale);
  }

 private:
  AttentionContext& inner_;
  int64_t offset_;
};

}  // namespace flashdraft

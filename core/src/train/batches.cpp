// Batches, with the online target's hidden states.
#include "train/batches.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

namespace flashdraft {

BatchSource::BatchSource(Dataset& dataset, Target* target, std::vector<int64_t> layers,
                         AttentionContext* target_attention, c10::Device device)
    : dataset_(dataset), target_(target), layers_(std::move(layers)), attention_(target_attention), device_(device) {}

Batch BatchSource::train(int64_t index) { return with_hidden_states(dataset_.train_batch(index)); }
Batch BatchSource::eval(int64_t index) { return with_hidden_states(dataset_.eval_batch(index)); }

Batch BatchSource::with_hidden_states(Batch batch) {
  if (!target_) return batch;
  DeviceMark start(device_);
  {
    RECORD_USER_SCOPE("flashdraft/target_forward");  // a named range in --profile's trace
    at::NoGradGuard frozen;                          // the target is frozen: no graph
    batch.hidden = target_->hidden_states(batch, layers_, *attention_);
  }
  target_timing_ = std::make_shared<const TargetTiming>(TargetTiming{std::move(start), DeviceMark(device_)});
  return batch;
}

}  // namespace flashdraft

// Batches, with the online target's hidden states.
#include "train/batches.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <chrono>
#include <stdexcept>

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

void check_states_read(Dataset& data, Target& target, int64_t first, int64_t end, int64_t stride, bool held_out,
                       const std::function<void(const std::string&)>& say) {
  const auto start = std::chrono::steady_clock::now();
  int64_t train = 0, eval = 0;
  for (int64_t i = first; i < end; i += stride, ++train) {
    const std::string why = target.missing_states(data.train_batch(i));
    if (!why.empty())
      throw std::runtime_error("training batch " + std::to_string(i) + " (of the run's first " + std::to_string(end) +
                               "), " + why);
  }
  for (int64_t i = 0; held_out && i < data.eval_batches(); ++i, ++eval) {
    const std::string why = target.missing_states(data.eval_batch(i));
    if (!why.empty()) throw std::runtime_error("held-out batch " + std::to_string(i) + ", " + why);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (say)
    say("target: the states of every document of the run's " + std::to_string(train) + " training and " +
        std::to_string(eval) + " held-out batches are there (checked in " + std::to_string(seconds).substr(0, 4) +
        " s)");
}

}  // namespace flashdraft

// The gradient of one optimizer step over several micro-batches ([optimizer] accumulate)
// and several ranks: which batch and anchors each micro-batch takes, and the gradient
// all-reduce, bucketed and overlapped with the backward.
//
// Semantics: the step's gradient is the gradient of the loss of the union of its
// micro-batches over every rank, L = sum_k S_k / sum_k W_k, where micro-batch k's loss
// is S_k / W_k (W_k: its loss weight, StepResult::loss_weight). Each micro-batch's
// backward therefore runs on W_k * loss_k = S_k; the gradients add up (accumulation
// locally, all-reduce across ranks); the sum is divided by W = sum_k W_k at the end. A
// micro-batch without a valid anchor has W_k = 0: it contributes nothing, yet its rank
// joins every collective. A run of world size N with accumulate k computes the same
// step as a single process with accumulate N*k, bit for bit on CPU: micro-batch m of
// rank r is global micro-batch (step*k + m)*N + r, which fixes both its data and its
// anchors. A step in P parts (Drafter::step_parts()) makes each micro-batch P micro-batches
// here that read one batch and one anchor stream (batch_index() divides by P). A single
// process with accumulate = 1 and one part runs the plain loss.backward().
//
// Buckets: trainable tensors, in reverse order (the order the backward produces their
// gradients), grouped into buckets of about [distributed] bucket_mb. On the step's last
// micro-batch, a hook after each tensor's gradient accumulation copies it into its
// bucket; a full bucket is all-reduced at once (asynchronously) while the backward goes
// on. Buckets are sent in index order only, so every rank issues the same collectives in
// the same order even when its gradients arrive in another order, and a tensor without a
// gradient is sent as zeros.
#pragma once

#include <flashdraft/model.hpp>

#include "distributed/distributed.hpp"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace flashdraft {

struct StepOutcome;

// Sets a CPU generator to the stream of global micro-batch `micro_batch` of a run seeded
// `seed`: the same (seed, micro_batch) always gives the same draws, whatever the generator
// held before; distinct pairs give streams keyed by 64 bits (mt19937's own seeding keeps
// 32), so no two micro-batches of a run share their anchors by a seed collision.
FLASHDRAFT_API void seed_anchor_stream(at::Generator& generator, uint64_t seed, uint64_t micro_batch);

class FLASHDRAFT_API GradientSync {
 public:
  // `parts`: each micro-batch's step in that many parts (Drafter::step_parts()), each a
  // micro-batch of its own here that reads the same batch and anchors.
  GradientSync(Distributed& dist, std::vector<at::Tensor> params, int64_t accumulate, double bucket_mb, uint64_t seed,
               int64_t parts = 1);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  int64_t micro_batches() const { return accumulate_ * parts_; }
  // The drafter's part micro-batch `micro` computes (batch.part).
  int64_t part(int64_t micro) const { return micro % parts_; }
  // One process and one micro-batch per step: the plain loss.backward(), nothing shared.
  bool single() const { return plain(); }
  // The global micro-batch number: the training batch micro-batch `micro` of `step` reads.
  int64_t batch_index(int64_t step, int64_t micro) const;
  // Sets the anchor generator (a CPU generator) to the stream of this micro-batch:
  // seed_anchor_stream(anchors, seed, batch_index(step, micro)), in every run.
  void seed_anchors(at::Generator& anchors, int64_t step, int64_t micro) const;
  // The backward of one micro-batch; returns its loss value (not finite: no backward ran
  // across ranks, and the caller stops the run). Runs the result's deferred metrics.
  double backward(StepResult& result, int64_t micro);
  // A queued step's backward (single() only): the plain loss.backward() with nothing read;
  // returns the loss on the device and drops the result's graph (its deferred metrics are
  // left for the reader).
  at::Tensor queue_backward(StepResult& result);
  // After the last micro-batch's backward: the remaining buckets sent, every all-reduce
  // waited for, the gradients divided by the step's loss weight; fills the outcome's loss
  // (global), tokens, accuracy and scalars (this rank's micro-batches).
  void synchronize(StepOutcome& o);
  // This rank's share of the step: its micro-batches' loss weight and weighted loss.
  double local_weight() const { return weight_; }
  double local_loss() const { return weight_ > 0 ? loss_sum_ / weight_ : 0.0; }
  // Buckets, and how many of them the last step sent while its backward was running.
  size_t buckets() const { return buckets_.size(); }
  size_t sent_during_backward() const { return sent_during_backward_; }

 private:
  struct Bucket;
  class Hook;
  bool plain() const { return dist_.world() == 1 && micro_batches() == 1; }
  void build_buckets(double bucket_mb);
  void on_gradient(size_t param);
  void launch_ready();
  void reset_step();

  Distributed& dist_;
  std::vector<at::Tensor> params_;
  int64_t accumulate_, parts_;
  uint64_t seed_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<size_t> bucket_of_, offset_of_;
  size_t next_launch_ = 0, sent_during_backward_ = 0;
  bool armed_ = false;  // the last micro-batch's backward is running
  std::unique_ptr<PendingReduce> weights_reduce_;
  at::Tensor weights_;        // [W, S]: loss weight and weighted loss, summed over ranks
  std::vector<char> copied_;  // per tensor: its gradient is in its bucket this step
  double weight_ = 0, loss_sum_ = 0, tokens_ = 0, last_loss_ = 0;
  std::vector<double> accuracy_sum_, scalar_sum_;
  std::vector<std::pair<std::string, double>> scalars_;
  std::vector<double> accuracy_;
};

}  // namespace flashdraft

// Attention dispatch: picks the kernel before step 0 (a chain of supports() checks
// over one problem record, with a reason for every refusal), builds each step's
// BlockMask at the kernel's block size, and runs attention through an autograd node
// of its own whose forward and backward both record what ran in the ledger.
//
// Mask ownership: every set_mask() makes a new StepMask; the dispatcher's current mask
// is only what the next forward uses. Each forward's autograd node keeps a reference
// to the StepMask it ran with, and its backward runs with that one. So a step may build
// several masks before any backward (gradient accumulation, unrolled drafters,
// recomputation, validation between training steps) and every gradient stays right.
#pragma once

#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>

#include "dispatch/ledger.hpp"
#include "dispatch/lm_head_loss.hpp"

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft {

// A fallback the policy forbids ("error"): the run stops at this step.
class FLASHDRAFT_API FallbackError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct KernelCandidate {
  std::string name;
  AttentionKernel* kernel = nullptr;  // null when the plugin was not found
  Support support;
};

struct FLASHDRAFT_API KernelChoice {
  AttentionProblem problem;  // the first call's problem (every call's when they are equal)
  // The distinct problems of a step's calls, in call order (one for a drafter whose calls
  // all pose the same problem, e.g. one per layer; one per unroll step of a chain drafter), with the
  // calls that pose each. Every one is checked; a kernel is chosen only if it supports all.
  std::vector<AttentionProblem> problems;
  std::vector<std::vector<int64_t>> problem_calls;
  std::vector<KernelCandidate> candidates;  // in preference order, with reasons
  size_t selected = 0;
  bool fallback = false;       // selected is not the first preference
  std::string report() const;  // the lines printed before step 0
};

// Chooses among `candidates` (preference order); throws FallbackError when the first
// preference refuses and the policy is "error", or when none supports the problem.
FLASHDRAFT_API KernelChoice choose_kernel(const AttentionProblem& problem, std::vector<KernelCandidate> candidates,
                                          const std::string& on_fallback);
// The same over every call of a step (Drafter::attention_problems()): each distinct problem
// is put to every kernel; a kernel that refuses one of them is refused with that problem's
// reason (and which calls pose it). The chosen kernel must ask for one block size for all
// of them (the masks of a step are built at one size), or the choice fails with a sentence.
FLASHDRAFT_API KernelChoice choose_kernel(const std::vector<AttentionProblem>& problems,
                                          std::vector<KernelCandidate> candidates, const std::string& on_fallback);

// The LM-head loss's selection, the same stage for its op: the variants of [loss] kernels in
// preference order, each asked loss_supports() for the run's problem; the first that supports
// it runs; a later one only under [loss] on_fallback = "warn".
struct LossCandidate {
  std::string name;  // as written in [loss] kernels
  Support support;
};
struct FLASHDRAFT_API LossChoice {
  LossProblem problem;
  std::vector<LossCandidate> candidates;  // in preference order, with reasons
  size_t selected = 0;
  bool fallback = false;  // selected is not the first preference
  int64_t chunk_rows = 0;
  std::string on_fallback = "error";
  const std::string& name() const { return candidates[selected].name; }
  std::string report() const;  // the lines printed before step 0
};
// Throws std::invalid_argument for an unknown name or an empty list, FallbackError when no
// variant supports the problem or the first refuses under on_fallback = "error".
FLASHDRAFT_API LossChoice choose_loss(const std::vector<std::string>& preference, int64_t chunk_rows,
                                      const LossProblem& problem, const std::string& on_fallback);

// The mask of one set_mask() call: the host BlockMask and its lists on the kernel's
// device (tensors.host points at mask). Immutable once built; shared by the dispatcher
// and by the autograd nodes of the forwards that used it.
struct StepMask {
  BlockMask mask;
  BlockMaskTensors tensors;
};

class FLASHDRAFT_API AttentionDispatcher : public DrafterContext {
 public:
  using EventSink = std::function<void(const std::string& kind, const std::string& message)>;
  AttentionDispatcher(KernelChoice choice, const MaskGenerator* generator, std::string on_fallback,
                      KernelLedger* ledger, EventSink events);

  void set_mask(const MaskInput& input) override;
  at::Tensor attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale) override;
  std::pair<at::Tensor, at::Tensor> attention_lse(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double scale) override;
  // The LM-head loss through the variant chosen for it (set_loss), recorded in ledger column
  // `column` (after the attention calls), a fallback under the choice's own policy; without
  // set_loss() a drafter's call is an error.
  LmHeadLossOutput lm_head_loss(const LmHeadLossInput& input) override;
  void set_loss(const LossChoice& choice, int64_t column);
  const LmHeadLoss* loss() const { return loss_.get(); }

  const KernelChoice& choice() const { return choice_; }
  const std::string& kernel_name() const { return choice_.candidates[choice_.selected].name; }
  AttentionKernel& kernel() { return *choice_.candidates[choice_.selected].kernel; }
  // The current mask (the one the next forward uses); set_mask() must have run.
  const BlockMask& mask() const { return current().mask; }
  const BlockMaskTensors& mask_tensors() const { return current().tensors; }
  BlockSize block_size() const { return block_; }

  // Records a call in the ledger and applies the fallback policy (the forward and the
  // backward node call it).
  void note(int64_t layer, Phase phase, const std::string& variant);

 private:
  KernelChoice choice_;
  const MaskGenerator* generator_;
  std::string on_fallback_;
  KernelLedger* ledger_;
  EventSink events_;
  BlockSize block_;
  std::shared_ptr<const StepMask> current_;
  std::unique_ptr<LmHeadLoss> loss_;
  std::string loss_on_fallback_;
  int64_t loss_column_ = -1;
  void note_loss(bool backward, const std::string& variant);
  const StepMask& current() const;
};

}  // namespace flashdraft

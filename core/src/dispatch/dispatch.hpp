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
  // calls that pose each. Every one is checked.
  std::vector<AttentionProblem> problems;
  std::vector<std::vector<int64_t>> problem_calls;
  std::vector<KernelCandidate> candidates;  // in preference order, with reasons (support: for every problem)
  // The kernel of each distinct problem (an index into candidates). The problems of one route (the same head_dim,
  // query heads and key/value heads: what a call's tensors tell) share one: the first preference that supports all
  // of them at one mask block size. One route, or every route on one kernel: every call runs that kernel. Gemma 4's
  // full layers (heads 512 wide) and its sliding layers (256) are two routes: a kernel that refuses the full layers'
  // problem still runs the sliding layers'.
  std::vector<size_t> problem_selected;
  size_t selected = 0;         // problem 0's kernel
  bool fallback = false;       // some problem runs on a kernel that is not the first preference
  std::string report() const;  // the lines printed before step 0
  // The /events line of a fallback: what the first preference refused and what runs instead, per call where mixed.
  std::string fallback_note() const;
  bool mixed() const;  // the problems run on more than one kernel
  // The name of the kernel of each call, in call order (the log's expected kernel per ledger column).
  std::vector<std::string> call_kernels() const;
};

// Chooses among `candidates` (preference order); throws FallbackError when the first
// preference refuses and the policy is "error", or when none supports the problem.
FLASHDRAFT_API KernelChoice choose_kernel(const AttentionProblem& problem, std::vector<KernelCandidate> candidates,
                                          const std::string& on_fallback);
// The same over every call of a step (Drafter::attention_problems()): each distinct problem
// is put to every kernel; a kernel that refuses one of them is refused with that problem's
// reason (and which calls pose it). Each route (see KernelChoice) takes the first kernel that
// supports all its problems at one mask block size; a route off the first preference is a
// fallback (the policy applies), and a route no kernel supports fails the choice with a sentence.
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

// The mask of one set_mask() call, at each block size the chosen kernels ask for (one but where
// routes run kernels of different block sizes): the host BlockMask and its lists on the kernels'
// device (tensors.host points at mask). Immutable once built; shared by the dispatcher and by
// the autograd nodes of the forwards that used it.
struct StepMask {
  struct AtBlockSize {
    BlockMask mask;
    BlockMaskTensors tensors;
  };
  std::vector<AtBlockSize> at;  // one per AttentionDispatcher block size, in its order
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

  // A call's route: the kernel its problem was given and the block size of the mask it reads.
  struct Route {
    int64_t head_dim = 0, heads_q = 0, heads_kv = 0;
    size_t candidate = 0;  // index into choice().candidates
    size_t block = 0;      // index into the block sizes (StepMask::at)
  };
  // The route of a call with these tensors (q [B, Hq, L, D], k [B, Hkv, L, D]); a shape no problem posed (a
  // drafter's decoding call) takes problem 0's route, as every call did before routes.
  const Route& route(const at::Tensor& q, const at::Tensor& k) const;

  const KernelChoice& choice() const { return choice_; }
  // Problem 0's kernel (every call's but where the choice is mixed()).
  const std::string& kernel_name() const { return name_of(routes_[0]); }
  AttentionKernel& kernel() { return kernel_of(routes_[0]); }
  const std::string& name_of(const Route& r) const { return choice_.candidates[r.candidate].name; }
  AttentionKernel& kernel_of(const Route& r) const { return *choice_.candidates[r.candidate].kernel; }
  // The current mask (the one the next forward uses) at route 0's block size; set_mask() must have run.
  const BlockMask& mask() const { return current().at[0].mask; }
  const BlockMaskTensors& mask_tensors() const { return current().at[0].tensors; }
  BlockSize block_size() const { return blocks_[0]; }

  // Records a call in the ledger and applies the fallback policy (the forward and the
  // backward node call it): `variant` must belong to the kernel of the call's route.
  void note(int64_t layer, Phase phase, const std::string& variant, const Route& route);

 private:
  KernelChoice choice_;
  const MaskGenerator* generator_;
  std::string on_fallback_;
  KernelLedger* ledger_;
  EventSink events_;
  std::vector<Route> routes_;      // one per distinct (head_dim, heads_q, heads_kv), problem 0's first
  std::vector<BlockSize> blocks_;  // the distinct block sizes of the routes' kernels
  std::shared_ptr<const StepMask> current_;
  std::unique_ptr<LmHeadLoss> loss_;
  std::string loss_on_fallback_;
  int64_t loss_column_ = -1;
  void note_loss(bool backward, const std::string& variant);
  const StepMask& current() const;
};

}  // namespace flashdraft

// The LM-head cross-entropy as a dispatched op (the drafter calls it through its
// LossContext; see LmHeadLossInput in model.hpp): hard labels, a target's logits (KL) or
// given distributions (soft cross-entropy), a frozen or a trained LM head. The variants:
//   reference  the full logits [R, V] in the compute dtype, log-softmax in float32, the
//              weighted NLL; autograd through ordinary ATen ops (R x V floats, several
//              copies: the plain definition, for checks and small runs).
//   chunked    rows in chunks of `chunk_rows`: per chunk the logits, their float32
//              log-softmax, the NLL, the argmax and, when a gradient is wanted, the
//              gradient with respect to the chunk's hidden rows (softmax - onehot, times
//              the row weight over weight_sum, times the LM head) are computed and the
//              chunk's logits freed. Backward scales that saved gradient. Never more than
//              one chunk of logits exists; the logits are computed once (no recompute).
//   fused      (CUDA) the chunked variant's structure with the logits in the compute dtype
//              only: per chunk one GEMM, then one CUDA kernel (core/cuda/lm_head_ce.cu)
//              that computes each row's log-sum-exp, NLL and argmax and overwrites the
//              row with the gradient (softmax - onehot) * w / weight_sum in place; the
//              gradient GEMM reads it there. Chunks of about 512 MiB of 16-bit logits.
//   auto       fused on CUDA (when the engine has its CUDA kernels), chunked elsewhere.
// Selected before step 0 like attention's kernels (choose_loss): [loss] kernels is a
// preference list, each variant's supports() is put the run's problem, the first that
// supports it runs, and [loss] on_fallback says whether a later preference may.
// All compute logits as hidden W^T in the compute dtype and the softmax in float32, so
// they differ by summation order (and, for fused, the gradient's rounding to the compute
// dtype before its GEMM, which chunked does as well).
#pragma once

#include <flashdraft/attention.hpp>
#include <flashdraft/export.hpp>
#include <flashdraft/model.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flashdraft {

// The variant names as the ledger records them.
inline constexpr const char* kLossReference = "lm_head_ce/reference";
inline constexpr const char* kLossChunked = "lm_head_ce/chunked";
inline constexpr const char* kLossFused = "lm_head_ce/fused";

// Rows per chunk when [loss] chunk_rows = 0: one chunk's logits (float32 for chunked,
// `bytes_per_logit` = the compute dtype's size for fused) stay within about
// `budget_bytes`, 512 MiB by default (at least 16 rows, a multiple of 16).
FLASHDRAFT_API int64_t auto_chunk_rows(int64_t vocab, int64_t budget_bytes = int64_t(1) << 29,
                                       int64_t bytes_per_logit = 4);

// The plain definition (also the oracle of the tests).
FLASHDRAFT_API LmHeadLossOutput lm_head_loss_reference(const LmHeadLossInput& in);

// The chunked variant. `on_backward` (optional) runs when its backward runs.
FLASHDRAFT_API LmHeadLossOutput lm_head_loss_chunked(const LmHeadLossInput& in, int64_t chunk_rows,
                                                     std::function<void()> on_backward = {});
// The fused variant (CUDA tensors only; anything else is refused with a sentence).
FLASHDRAFT_API LmHeadLossOutput lm_head_loss_fused(const LmHeadLossInput& in, int64_t chunk_rows,
                                                   std::function<void()> on_backward = {});

// Checks the input's shapes and dtypes; throws std::invalid_argument naming the tensor.
FLASHDRAFT_API void check_lm_head_loss_input(const LmHeadLossInput& in);

// What the loss op is asked to run: the run's device, compute dtype and vocabulary.
struct FLASHDRAFT_API LossProblem {
  c10::Device device = c10::kCPU;
  at::ScalarType dtype = at::kFloat;
  int64_t vocab = 0;  // the LM head's rows (the report's chunk size)
  std::string str() const;
};
// The names [loss] kernels takes, in the order a report lists them.
inline constexpr const char* kLossNames = "auto, fused, chunked, reference";
// Whether variant `name` runs `problem` (fused: CUDA tensors of a float dtype with the
// engine's kernels; chunked, reference and auto: everywhere; auto's reason says what it
// resolves to). An unknown name throws std::invalid_argument naming the accepted ones.
FLASHDRAFT_API Support loss_supports(const std::string& name, const LossProblem& problem);

// The op as the engine runs it: the chosen variant, with every forward and backward
// reported to `note(phase_is_backward, variant)` (the dispatcher records it in the
// ledger and applies the fallback policy).
class FLASHDRAFT_API LmHeadLoss {
 public:
  using Note = std::function<void(bool backward, const std::string& variant)>;
  // Variant `name` of kLossNames for `problem` (one that does not support it is refused with
  // std::invalid_argument and its reason); chunk_rows 0 = auto.
  LmHeadLoss(const std::string& name, int64_t chunk_rows, Note note, const LossProblem& problem = {});
  LmHeadLossOutput operator()(const LmHeadLossInput& in);
  const std::string& variant() const { return variant_; }  // "lm_head_ce/..."
  std::string describe() const;                            // for the selection report

 private:
  std::string variant_;
  std::string why_;  // how "auto" chose (empty when the variant was named)
  int64_t chunk_rows_;
  Note note_;
  int64_t logit_bytes_, vocab_;
};

}  // namespace flashdraft

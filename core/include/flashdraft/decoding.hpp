// Speculative decoding as a server runs it, for validation's served acceptance length
// (core/src/eval/served.hpp walks it): many sequences decoded at once, each with a cache of
// keys/values indexed by position, so that nothing before the current position is
// computed twice.
//
// Both sides keep one row per sequence. Row b's cache holds positions [0, start[b]); a
// call writes the positions it runs at their own index, so whatever a rejected draft left
// beyond the accepted ones is overwritten by the next call before anyone reads it.
//
// Sampling follows the reference loop (z-lab's dflash `_sampling_probs`, `_rejection_sample`):
// probabilities are softmax(logits / temperature) in float32; top_p keeps the tokens, most
// probable first, while the mass before them is below top_p, then renormalises.
#pragma once

#include <flashdraft/export.hpp>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace flashdraft {

struct Sampling {
  double temperature = 0.0;            // 0: greedy (argmax; ties to the lowest token id)
  double top_p = 1.0;                  // in (0, 1]
  at::Generator* generator = nullptr;  // draws of a sampled run (on the tensors' device)
  bool greedy() const { return temperature <= 0.0; }
};

// softmax(logits / temperature) in float32 over the last axis, cut to top_p and
// renormalised. logits [..., V] of any floating dtype.
FLASHDRAFT_API at::Tensor sampling_probs(const at::Tensor& logits, double temperature, double top_p);
// One token per row of probs [..., V] (multinomial with s.generator): [...] int64.
FLASHDRAFT_API at::Tensor sample_tokens(const at::Tensor& probs, at::Generator* generator);
// Greedy (argmax) or sampled tokens from logits [..., V].
FLASHDRAFT_API at::Tensor choose_tokens(const at::Tensor& logits, const Sampling& s);
// A target's logits as it serves them, from the LM head's products (in their dtype, as transformers' ops round them):
// times `scale` (TargetModel::logit_scale), then soft-capped, cap tanh(x / cap), where softcap > 0 (Gemma 4's).
FLASHDRAFT_API at::Tensor served_logits(const at::Tensor& products, double scale, double softcap);

// A drafter's proposals after one position of every row.
struct DraftRequest {
  at::Tensor last;             // [B] int64 on the run's device: the token at position start[b]
  std::vector<int64_t> start;  // [B] its position; the context is every position before it
  std::vector<int64_t> count;  // [B] proposals wanted after it (0: row b is idle this call)
  Sampling sampling;
};

struct DraftProposal {
  // [B, K] int64 on the device, K = max(count): proposal j of row b is for position
  // start[b] + 1 + j (entries at j >= count[b] are padding).
  at::Tensor tokens;
  // [B, K, V] float32 over the target's vocabulary, sampling only: the distribution each
  // token was drawn from (what rejection sampling compares with the target's).
  at::Tensor probs;
};

class FLASHDRAFT_API DraftDecoder {
 public:
  virtual ~DraftDecoder();
  // Row b's context grows by positions start[b] .. start[b] + count[b] - 1: the tokens at
  // those positions (tokens [B, T] int64) and the target's hidden states after them
  // (features [B, T, E, H], E in the order of TargetModel::exported_layers). Entries of a
  // row at t >= count[b] are padding and never read.
  virtual void extend(const at::Tensor& tokens, const at::Tensor& features, const std::vector<int64_t>& start,
                      const std::vector<int64_t>& count) = 0;
  virtual DraftProposal propose(const DraftRequest& request) = 0;
};

class FLASHDRAFT_API TargetDecoder {
 public:
  virtual ~TargetDecoder();
  struct Output {
    at::Tensor last;      // [B, T, H]: the final-normed last hidden state (logits = last x lm_head^T)
    at::Tensor features;  // [B, T, E, H]: the hidden states after the layers the decoder was made for
  };
  // Runs the target over tokens [B, T] (int64, on the device) at positions start[b] + t,
  // causally, with positions [0, start[b]) of row b read from its cache; the keys/values
  // of the new positions enter the cache. Rows whose tokens are padding still run (their
  // outputs are ignored by the caller).
  virtual Output forward(const at::Tensor& tokens, const std::vector<int64_t>& start) = 0;
  // The same, row b's real tokens being its first real[b] (the rest padding). A decoder whose state
  // is not indexed by position (a recurrent layer's: Qwen3.5's Gated DeltaNet) needs them: it keeps
  // what rolls its state back to any position up to start[b] + real[b], and the next call's start[b]
  // must be one of those (or 0, a new sequence). The default ignores them.
  virtual Output forward(const at::Tensor& tokens, const std::vector<int64_t>& start,
                         const std::vector<int64_t>& real) {
    (void)real;
    return forward(tokens, start);
  }
};

}  // namespace flashdraft

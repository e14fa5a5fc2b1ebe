// The served acceptance length: held-out responses decoded speculatively as a server does
// it (the public reference loops), so the number validation reports is the
// number a server then measures.
//
// For each held-out response (an assistant turn: a maximal run of loss-carrying positions
// inside one document; its prompt is every position of the document before it):
//   - the first response token is the target's own (by the target: its choice after the
//     prompt; on the data's tokens: the data's);
//   - from the current position p (its token known), the drafter proposes the next
//     min(K, end - p - 1) tokens from the context before p (K = Drafter::max_proposals());
//   - the target verifies them: the leading proposals equal to its greedy choices are
//     accepted (at temperature > 0: rejection sampling), plus its own next token; the
//     step produces min(accepted + 1, end - p - 1) tokens, cut after a stop token;
//   - p advances by what was produced; the walk ends at the response's end or a stop token.
// tau_served = tokens produced / verification steps, pooled over every step of every
// response (the mean of the reference loop's `acceptance_lengths`, all responses joined).
//
// Two ways, which agree when the data is the target's greedy text:
//   - by the target (an online target that can decode): the target generates the response
//     from the prompt (its tokens, not the data's, from the first response token on), its
//     keys/values cached; the drafter's context is the target's hidden states of what was
//     generated. This is what a server measures.
//   - on the data's tokens: the data's response stands for the target's greedy choices and
//     the data's hidden states for the context (greedy only).
// Sequences are decoded in batches (rows sorted by length), each row with key/value caches
// of its own on both sides (decoding.hpp): nothing is computed twice.
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/decoding.hpp>
#include <flashdraft/model.hpp>

#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

// One held-out response with its prompt: the document's tokens up to the response's end.
struct ServedSequence {
  std::vector<int64_t> tokens;  // positions 0 .. end-1 of the document
  int64_t prompt = 0;           // the first response position (>= 1)
  int64_t end = 0;              // one past the response
  at::Tensor features;          // [end, E, H]: the data's hidden states (undefined: none)
  int64_t source = 0;           // which held-out sequence (row of the held-out set) it came from
};

// The responses of a batch: every maximal run of loss-carrying positions of at least two
// tokens inside a document, after at least one prompt token.
FLASHDRAFT_API std::vector<ServedSequence> served_sequences(const Batch& batch, int64_t first_source);

struct FLASHDRAFT_API ServedTally {
  std::string method;  // "target" or "data tokens"
  int64_t sequences = 0, steps = 0, tokens = 0;
  std::vector<int64_t> histogram;                  // [K + 2]: steps that produced n tokens
  std::vector<std::vector<int64_t>> acceptance;    // per response, the tokens each step produced
  std::vector<std::vector<int64_t>> generated;     // per response, its tokens from the prompt on
  std::vector<int64_t> order;                      // index of each response in the input list
  std::vector<int64_t> source, prompt, end;        // each response's held-out row, prompt length, end
  double seconds = 0, target_seconds = 0;          // the whole walk; the target's forwards in it
  int64_t target_forwards = 0, target_tokens = 0;  // forwards (prefills included) and the positions they ran
  double floor_seconds = 0;                        // ServedContext::replay_floor: those forwards alone
  double tau() const { return steps > 0 ? double(tokens) / double(steps) : 0.0; }
  // Standard error of tau over responses (the ratio estimator's: responses are the
  // independent units, not steps).
  double standard_error() const;
};

// The engine side of one served validation: the drafter's and the target's decoders with
// their attention through dispatchers of their own (kernels chosen before step 0, checked by
// the policy, recorded in `ledger`).
struct ServedContext {
  Drafter& drafter;
  AttentionContext& draft_attention;
  Target* target = nullptr;  // decodes when it can; null: data tokens only
  AttentionContext* target_attention = nullptr;
  const TargetModel& target_model;     // its LM head gives the target's logits
  std::vector<int64_t> target_layers;  // the features the drafter reads (E axis)
  std::vector<int64_t> stop_tokens;
  int64_t batch = 64;  // responses decoded at once
  c10::Device device = c10::kCPU;
  // Benchmarks: after each batch's walk, run the target's forwards of that walk again, alone
  // and back to back on a fresh cache (the floor: every verified token passes through the
  // target once), timed into ServedTally::floor_seconds.
  bool replay_floor = false;
};

// Decodes `sequences` with the target (by_target) or on the data's tokens.
FLASHDRAFT_API ServedTally serve(const ServedContext& c, const std::vector<ServedSequence>& sequences, bool by_target,
                                 const Sampling& sampling);

// Rows in one served batch decode up to this many positions: the longest response's end
// plus one proposal block (its keys sit after the cache).
inline int64_t served_capacity(int64_t longest, int64_t max_proposals) { return longest + max_proposals + 1; }

}  // namespace flashdraft

// The hf target's recurrent token mixers, frozen: a layer that mixes tokens by a state carried along the sequence
// instead of attention. Each kind (Qwen3.5's Gated DeltaNet: gated_delta.hpp; Granite 4.0-H's Mamba-2: mamba2.hpp)
// shares one shape:
//   [x | rest...] = h W_in^T                              (one product; the checkpoint's input projections)
//   u = act(causal depthwise conv1d(x) + bias)            (taps of history, zeros before a document's start)
//   S_t = exp(c_t - c_{t-1}) S_{t-1} + k_t v_t^T          (a state [K, V] per head; k, v, the log decay c from u and
//   o_t = (readout of S_t, the kind's own)                 rest; the Gated DeltaNet's v the delta rule's new values)
//   out = the kind's output norm / gate of o; its out_proj applied by the caller (the layer's o_proj)
// so that its state after any position is S exp(c_r) + sum_{j < r} exp(c_r - c_j) k_j v_j^T from its chunk's start,
// and the training forward, target verification (each block from the state at its anchor) and served decoding (a
// state per row, rolled back to the accepted tokens) are written once, here, over the kind's hooks. The recurrence
// runs over each document of a row on its own (a packed row's conversations, then its padding), so no state or
// convolution history crosses a document's start.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace flashdraft::hf {

// A rule's run over [B, T] positions: its output and, for each row's chunk that `capture` names ([B] int64, chunk
// index), the state at that chunk's start [B, H, K, V], its keys [B, H, C, K], values [B, H, C, V] and log decays
// from the chunk's start [B, H, C] (float32); with every_chunk, those of every chunk (a chunk dimension after the
// heads': [B, H, n, ...]).
struct RuleRun {
  at::Tensor out;  // [B, T, ...] as the kind's finish reads it
  at::Tensor chunk_state, keys, values, log_decay;
};

// A layer's input projection split: the convolution's inputs x [B, T, C] and the kind's other parts ([B, T, ...]).
struct Projected {
  at::Tensor x;
  std::vector<at::Tensor> rest;
};

class Recurrent {
 public:
  virtual ~Recurrent() = default;
  Recurrent() = default;
  Recurrent(const Recurrent&) = delete;
  Recurrent& operator=(const Recurrent&) = delete;

  at::Tensor conv, conv_bias;  // [C, taps] and [C] (undefined: none), the model's dtype
  int64_t chunk = 64;          // positions a chunk of the rule's run; the served cache keeps one chunk a row
  bool fused = true;           // the engine's kernels where the kind has them ([target] kernels = "engine")

  // The mixer's output before out_proj, [B, S, width] in h's dtype, for h [B, S, H] (the layer's normed input);
  // documents[b]: the lengths of row b's documents in order (positions past their sum run as one more document).
  at::Tensor mix(const at::Tensor& h, const std::vector<std::vector<int64_t>>& documents) const;

  // Target verification's mixer (model.hpp Target::verify): over the context hc [B, S, H] (the layer's normed
  // input; documents as mix) and over blocks hb [B, N BS, H], block n of row b continuing its document from position
  // anchors[b][n] ([B, N] int64; its first token at that position) from the state and convolution inputs after the
  // tokens before it, each block alone. Returns the context's and the blocks' outputs before out_proj.
  std::pair<at::Tensor, at::Tensor> verify(const at::Tensor& hc, const std::vector<std::vector<int64_t>>& documents,
                                           const at::Tensor& anchors, const at::Tensor& hb, int64_t BS) const;

  // The kind's hooks. project: h W_in^T split. rule: the recurrence over u [B, T, C] (the convolution's output after
  // its activation) and p's rest from `initial` ([B, H, K, V] float32; undefined: zeros), capturing as RuleRun says.
  // finish: the output before out_proj from the run's out and p's rest. state_shape: {H, K, V}. width: finish's last
  // dimension. name: the kind, for messages.
  virtual Projected project(const at::Tensor& h) const = 0;
  virtual RuleRun rule(const at::Tensor& u, const Projected& p, const at::Tensor& initial, const at::Tensor& capture,
                       bool every_chunk) const = 0;
  virtual at::Tensor finish(const at::Tensor& out, const Projected& p) const = 0;
  virtual std::vector<int64_t> state_shape() const = 0;
  virtual int64_t width() const = 0;
  virtual const char* name() const = 0;

  // The convolution over x [B, T, C] with `zeros` zeros of history before it and its activation (SiLU), in x's
  // dtype: [B, T + zeros - taps + 1, C].
  at::Tensor convolve(const at::Tensor& x, int64_t zeros) const;

 private:
  RuleRun mix_document(const Projected& p, bool every_chunk) const;
};

// A rule's run's captures from its every-chunk tensors (S_all [B, H, n, K, V], keys [B, H, n, C, K], values
// [B, H, n, C, V], log decays [B, H, n, C]): all of them with every_chunk; each row's chunk capture[b] of each where
// capture ([B] int64) is defined (RuleRun says which).
void take_chunks(RuleRun& run, const at::Tensor& S_all, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& log_decay, const at::Tensor& capture, bool every_chunk);

// The state after the first r[m] positions of a chunk ([M] int64, 0..C) from its start state S [M, H, K, V], keys k
// [M, H, C, K], values v [M, H, C, V] and log decays c [M, H, C] (cumulative from the chunk's start):
// S exp(c[r - 1]) + sum_{j < r} exp(c[r - 1] - c[j]) k_j v_j^T (r = 0: S), as the chunk's end update is at r = C.
at::Tensor state_at(const at::Tensor& S, const at::Tensor& k, const at::Tensor& v, const at::Tensor& c,
                    const at::Tensor& r);

// One recurrent layer's state in served decoding, per row: the state and the convolution's last inputs at the row's
// committed position, and what rolls them forward to any position the last call ran (its start state of the chunk
// holding the row's last real token, that chunk's keys, values and log decays, and the convolution's inputs around
// it). Each call first commits every row to its start (a position the last call ran for it, up to its real tokens;
// 0: a new sequence), so that a verification's rejected tokens never enter the state: what a server does, and what
// transformers' cache does not (DynamicCache's crop leaves the recurrent state as the last forward left it).
class RecurrentCache {
 public:
  RecurrentCache(const Recurrent& w, int64_t batch, c10::ScalarType dtype, c10::Device device);
  // The mixer's output before out_proj [B, T, width] for h [B, T, H] (the layer's normed input) at positions
  // start[b] + t; row b's real tokens its first real[b].
  at::Tensor forward(const at::Tensor& h, const std::vector<int64_t>& start, const std::vector<int64_t>& real);

 private:
  void commit(const std::vector<int64_t>& start);
  const Recurrent& w_;
  int64_t batch_, taps_;
  at::Tensor state_, history_;        // committed: [B, H, K, V] float32, [B, taps - 1, C]
  std::vector<int64_t> base_, real_;  // the last call's start and real tokens per row (-1: none yet)
  at::Tensor chunk_state_, keys_, values_, log_decay_, inputs_;  // what rolls a row forward (see above)
  std::vector<int64_t> chunk_start_;  // per row: its captured chunk's first position in the last call
};

}  // namespace flashdraft::hf

// Drafter, Dataset and Target: what a training run is made of, besides attention.
#pragma once

#include <flashdraft/attention.hpp>
#include <flashdraft/decoding.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

class DrafterFormat;

// The frozen parts of the target model a drafter borrows. Layer id L is the output of
// the target's decoder layer L (0-based), i.e. transformers' hidden_states[L + 1]
// (hidden_states[0] is the embedding output).
struct TargetModel {
  at::Tensor embedding;  // [vocab, hidden]; undefined: the dataset carries no target
  at::Tensor lm_head;    // [vocab, hidden] (the embedding itself when the target ties them)
  int64_t vocab = 0, hidden = 0, layers = 0;
  // Layer ids whose hidden states batches carry, in the order of Batch::hidden's E axis.
  // An online target (a Target plugin) computes any layer: the engine asks the drafter
  // which ones (Drafter::target_layers) and sets this list to them before bind().
  std::vector<int64_t> exported_layers;
  // The target's logits are (final state) lm_head^T times logit_scale (Granite: 1 / logits_scaling); what its
  // distributions (EAGLE-3's soft labels) are made of. A drafter borrowing the LM head uses it as stored, as the
  // reference drafters call the target's lm_head module.
  double logit_scale = 1.0;
  // Gemma 4's final_logit_softcapping: the logits above are then cap tanh(logits / cap) (0: none).
  double logit_softcap = 0;
  bool online = false;  // hidden states computed by a Target plugin each step
  std::string source;   // what the target is (checkpoint path, architecture), for the log

  // An online target of `layers` decoder layers (each computable), its sizes from the tensors.
  static TargetModel online_model(at::Tensor embedding, at::Tensor lm_head, int64_t layers, std::string source) {
    TargetModel t;
    t.vocab = lm_head.size(0);
    t.hidden = embedding.size(1);
    t.embedding = std::move(embedding);
    t.lm_head = std::move(lm_head);
    t.layers = layers;
    for (int64_t l = 0; l < layers; ++l) t.exported_layers.push_back(l);
    t.online = true;
    t.source = std::move(source);
    return t;
  }
};

// One batch of target data.
struct Batch {
  at::Tensor tokens;     // [B, S] int64
  at::Tensor hidden;     // [B, S, E, H]: target hidden states at exported_layers
  at::Tensor loss_mask;  // [B, S] bool: positions that may carry loss
  at::Tensor lengths;    // [B] int64: valid length of each sequence
  int64_t index = 0;     // which batch of the epoch (for the record)
  // A training step in parts (Drafter::step_parts()): the part this step() call computes,
  // 0..step_parts() - 1 (always 0 in validation).
  int64_t part = 0;
  // Packed sequences: per sequence, the lengths of its documents (sum = its length);
  // empty = one document per sequence. Attention never crosses a document.
  std::vector<std::vector<int64_t>> documents;
};

// Each row's documents, padding not counted: a packed row's conversations (Batch::documents), else [its length]
// (S where the batch has no lengths; lengths past S count as S).
inline std::vector<std::vector<int64_t>> row_documents(const Batch& batch) {
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
  const at::Tensor lengths =
      batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
  std::vector<std::vector<int64_t>> rows;
  for (int64_t b = 0; b < B; ++b) {
    if (static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[static_cast<size_t>(b)].empty())
      rows.push_back(batch.documents[static_cast<size_t>(b)]);
    else
      rows.push_back({lengths.defined() ? std::min(lengths.data_ptr<int64_t>()[b], S) : S});
  }
  return rows;
}

// What every plugin gets to know about the run.
struct RunContext {
  std::string out_dir;  // the run's output folder (datasets cache here too)
  c10::Device device = c10::kCPU;
  c10::ScalarType dtype = c10::kFloat;  // compute dtype of the drafter
  uint64_t seed = 0;
  // Progress lines on the console; a line that starts with "warning: " is also kept in the
  // run log's events (kind "warning", the rest of the line as the message).
  std::function<void(const std::string&)> say;
  // Batch `index` of the training stream (the dataset's own: tokens, loss mask, lengths,
  // documents; hidden states only where the dataset carries them), for drafters that derive
  // state from the data when they bind (EAGLE-3 counts its draft vocabulary). Empty when the
  // caller has no data (tests may leave it unset).
  std::function<Batch(int64_t index)> train_batch;
};

class FLASHDRAFT_API Dataset : public PluginObject {
 public:
  // Prepares the data (generating or reading a cache under ctx.out_dir).
  virtual void open(const RunContext& ctx) = 0;
  virtual TargetModel target() const = 0;
  virtual int64_t batch_size() const = 0;
  virtual int64_t seq_len() const = 0;
  // Batch number `index` of the training stream (deterministic given the seed).
  virtual Batch train_batch(int64_t index) = 0;
  // Held-out batches for validation: eval_batches() of them.
  virtual int64_t eval_batches() const = 0;
  virtual Batch eval_batch(int64_t index) = 0;
  // Files the data came from, for the log (cache path).
  virtual std::string source() const = 0;
};

// The loss over the target's frozen LM head, for the rows that carry one:
//   loss = sum_r w_r * CE(hidden_r W^T, label_r) / weight_sum
// The engine runs it (a dispatched op, like attention: its variant is chosen before step
// 0 from [loss] and recorded per step in the ledger, forward and backward).
struct LmHeadLossInput {
  at::Tensor hidden;       // [R, H] (differentiable): the rows, after the drafter's final norm
  at::Tensor weight;       // [V, H] the LM head: frozen, or trained (requires_grad: its gradient too)
  at::Tensor labels;       // [R] int64 in [0, V)
  at::Tensor row_weights;  // [R] float32 loss weight of each row
  double weight_sum = 1;   // the normaliser (> 0; with R = 0 rows the loss is 0, still in the graph)
  // Labels from a target model instead of `labels` (then ignored): target_hidden [R, H] are
  // the target's final-normed states whose logits target_hidden W^T (the same LM head) give
  // each row's target. target_soft: the loss is KL(softmax(target logits / target_temperature)
  // || softmax(hidden W^T)) per row (vLLM speculators' DFlash loss); otherwise the
  // cross-entropy against the target logits' argmax.
  at::Tensor target_hidden;
  // Optional [R] int64: row r's target state is target_hidden[target_index[r]] (rows that
  // share a target position share its state: the target's logits are computed once per
  // position). Undefined: target_hidden is [R, H], one state per row.
  at::Tensor target_index;
  bool target_soft = false;
  double target_temperature = 1.0;
  // Soft labels given as distributions instead (then labels and target_hidden are unused):
  // float32 [U, V] rows of probabilities, row r's soft_labels[target_index[r]] (or [R, V]
  // without target_index). The loss of a row is the cross-entropy -sum_v p_v log q_v (torch's
  // cross_entropy with probability targets; EAGLE-3's loss over its draft vocabulary), and
  // target_argmax is each row's most probable token.
  at::Tensor soft_labels;
  // > 0: also each row's top_k logits and their tokens, highest first, taken from the logits
  // the op makes anyway (a drafter that re-ranks candidates needs no second LM-head product).
  int64_t top_k = 0;
  // The logits as served (served_logits() of core/eval/decoding): the rows' logits are
  // hidden W^T times logit_scale, then, with logit_softcap > 0, cap tanh(logits / cap) (a DFlash
  // drafter's output_multiplier and final_logit_softcapping, the reference's compute_logits);
  // target_hidden's logits the same with the target's own scale and cap (Granite's
  // 1 / logits_scaling, Gemma's final_logit_softcapping). argmax, top_k and the loss are of
  // those logits; the gradient goes through the scale and the cap.
  double logit_scale = 1.0, logit_softcap = 0;
  double target_logit_scale = 1.0, target_logit_softcap = 0;
};
struct LmHeadLossOutput {
  at::Tensor loss;           // float32 scalar, differentiable with respect to hidden
  at::Tensor argmax;         // [R] int64: the LM head's greedy token of each row (no gradient)
  at::Tensor target_argmax;  // [R] int64, labels from a target or soft_labels only: its greedy token of each row
  at::Tensor top_values;     // [R, top_k] in the compute dtype (no gradient), top_k > 0 only
  at::Tensor top_indices;    // [R, top_k] int64
};

// The engine's attention: mask building and attention through the selected kernel. A
// drafter's step (DrafterContext), its served decoder and the online target run through one.
class FLASHDRAFT_API AttentionContext {
 public:
  virtual ~AttentionContext() = default;
  // Builds this step's BlockMask with the experiment's mask generator, at the block
  // size of the chosen kernel.
  virtual void set_mask(const MaskInput& input) = 0;
  // Attention through the chosen kernel (autograd-aware; recorded in the ledger).
  // q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lkv, D].
  virtual at::Tensor attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale) = 0;
  // The same call, frozen (no gradient flows through it), also giving each row's log-sum-exp
  // [B, Hq, Lq] float32 of its scaled visible scores (-inf for a row that sees no key): what a
  // softmax with terms of its own needs (gpt-oss's attention sinks: out * sigmoid(lse - sink)).
  // Recorded in the ledger as attention() is. A context that cannot give it refuses.
  virtual std::pair<at::Tensor, at::Tensor> attention_lse(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, double scale) {
    (void)layer, (void)q, (void)k, (void)v, (void)scale;
    throw std::logic_error("this attention context gives no log-sum-exp (attention_lse)");
  }
};

// The engine's LM-head loss: the chosen variant of the dispatched op (see LmHeadLossInput).
class FLASHDRAFT_API LossContext {
 public:
  virtual ~LossContext() = default;
  virtual LmHeadLossOutput lm_head_loss(const LmHeadLossInput& input) = 0;
};

// What a drafter's training or validation step runs through: the engine's attention and
// its LM-head loss (a frozen target's forward gets an AttentionContext alone).
class FLASHDRAFT_API DrafterContext : public AttentionContext, public LossContext {};

// The frozen target model, run online: each step it computes the hidden states the
// drafter learns from for the batch's tokens, under no-grad, through the engine's
// attention dispatcher (the mask it sets is causal within each document).
class FLASHDRAFT_API Target : public PluginObject {
 public:
  // Reads the model (weights to ctx.device in the target's compute dtype).
  virtual void open(const RunContext& ctx) = 0;
  // Embedding, LM head and sizes; online = true, exported_layers = every layer id.
  virtual TargetModel model() const = 0;
  // The attention problem of one forward over [batch, seq_len] (forward only).
  virtual AttentionProblem attention_problem(int64_t batch, int64_t seq_len) const = 0;
  // Every call's problem where they differ (Gemma 4: its full layers' heads are wider), in call order; each is
  // checked before step 0. The default: attention_problem()'s, for every call.
  virtual std::vector<AttentionProblem> attention_problems(int64_t batch, int64_t seq_len) const {
    return {attention_problem(batch, seq_len)};
  }
  // Readies forwards that read `layers` (loads the decoder layers up to the deepest, no
  // more) and returns the attention calls of one such forward. Called once, before step 0.
  virtual int64_t prepare(const std::vector<int64_t>& layers) = 0;
  // Hidden states after each of `layers` (ids as in TargetModel), [B, S, E, H] in the
  // target's dtype, for batch.tokens; runs the decoder only up to the deepest layer.
  virtual at::Tensor hidden_states(const Batch& batch, const std::vector<int64_t>& layers,
                                   AttentionContext& attention) = 0;
  // Target verification of drafted blocks (validation): for block n of row b, the
  // target reads the row's tokens before anchors[b][n] (the context, same document) and
  // then blocks[b][n] = [token at the anchor, drafted 1 .. BS-1] at positions anchor + j,
  // causally, all blocks in one forward (the context's keys/values computed once and
  // shared). Returns [B, N, BS] int64: at j >= 1 the target's greedy token for block
  // position j given the context and blocks[b][n][0 .. j-1]; -1 at j = 0. Runs every
  // decoder layer. Undefined tensor: this target cannot verify.
  virtual at::Tensor verify(const Batch& batch, const at::Tensor& anchors, const at::Tensor& blocks) {
    (void)batch, (void)anchors, (void)blocks;
    return {};
  }
  // Serving (decoding.hpp; validation's served acceptance length). A decoder over `batch`
  // sequences of at most `capacity` positions that runs every decoder layer and also returns
  // the hidden states after `layers`; its attention goes through `attention` with a causal
  // mask whose rows start at the cached positions (MaskInput::q_offsets). Null: this target
  // cannot decode (served τ is then measured on the data's tokens).
  virtual bool decodes() const { return false; }  // true when decoder() makes one
  virtual std::unique_ptr<TargetDecoder> decoder(int64_t batch, int64_t capacity, const std::vector<int64_t>& layers,
                                                 AttentionContext& attention) {
    (void)batch, (void)capacity, (void)layers, (void)attention;
    return nullptr;
  }
  // The attention problem of one decoder call of q_len positions per row (for the kernel
  // choice before step 0).
  virtual AttentionProblem decoder_problem(int64_t batch, int64_t capacity, int64_t q_len) const {
    AttentionProblem p = attention_problem(batch, capacity);
    p.q_len = q_len;
    p.kv_len = capacity;
    p.needs_backward = false;
    return p;
  }
  // The same over every call where they differ (attention_problems()).
  virtual std::vector<AttentionProblem> decoder_problems(int64_t batch, int64_t capacity, int64_t q_len) const {
    std::vector<AttentionProblem> out = attention_problems(batch, capacity);
    for (AttentionProblem& p : out) p.q_len = q_len, p.kv_len = capacity, p.needs_backward = false;
    return out;
  }
  // Token ids that end a response (the checkpoint's eos_token_id); empty: none known.
  virtual std::vector<int64_t> stop_tokens() const { return {}; }
  // A target that reads its hidden states from disk (a cache) rather than computing them: before step 0 the engine
  // puts every batch the run will read to missing_states(), which names the first document the target cannot give
  // ("" = it can give them all), so that a cache lacking some fails `validate` and the run's start, not step N.
  virtual bool reads_states() const { return false; }
  virtual std::string missing_states(const Batch&) { return {}; }
};

// Validation's drafts (StepResult::drafts), in a layout no drafter has to fake: a list of D
// drafts, each continuing row rows[d] of the batch after position starts[d] (whose token is
// the data's): tokens[d][j] is the drafter's greedy proposal for position starts[d] + 1 + j,
// labels[d][j] the data's token there, -1 = none (past the document, outside the loss mask:
// the draft's acceptance ends there). Column j is the per-position metric's column j
// (Drafter::position_names()[j]: DFlash's block position j + 1, EAGLE-3's unroll step j).
// The engine measures the exact greedy acceptance of every draft on the data's tokens and,
// with an online target, by the target's verification (Target::verify).
struct Drafts {
  at::Tensor rows;    // [D] int64
  at::Tensor starts;  // [D] int64
  at::Tensor tokens;  // [D, K] int64
  at::Tensor labels;  // [D, K] int64
  bool defined() const { return tokens.defined() && labels.defined() && rows.defined() && starts.defined(); }
};

// What one drafter step returns. "Positions" are the columns of the drafter's per-position
// metric, named by Drafter::position_names(): DFlash's block positions 1..BS-1, EAGLE-3's
// unroll steps 0..ttt_steps-1.
struct StepResult {
  at::Tensor loss;                                      // scalar, differentiable
  std::vector<double> position_accuracy;                // per position (see above)
  std::vector<std::pair<std::string, double>> scalars;  // extra metrics, e.g. tau_sim
  int64_t tokens = 0;                                   // tokens that carried loss
  // The loss's denominator (DFlash: the sum of the position weights w_j it averages
  // over): the weight of this batch when batches are joined (gradient accumulation, data
  // parallel). -1 = not given: `tokens` stands for it.
  double loss_weight = -1;
  // Optional, for validation (training == false): the drafter's drafts, so that the engine
  // can measure the exact greedy acceptance length. Undefined = not provided.
  Drafts drafts;
  // Optional: fills position_accuracy, scalars and tokens from device tensors. The engine
  // calls it after the backward and the optimizer step have been queued, so that reading
  // the metrics does not stall the device between the passes. Empty: they are filled.
  std::function<void(StepResult&)> deferred;
  // Optional (steps in parts): tensors of this part's graph that earlier parts' backwards
  // reached through detached copies, each with the gradient those copies gathered (weighted
  // as the engine weighs the parts). backward() runs them in the same pass as the loss, so
  // that every parameter's gradient is whole when that pass ends (the data-parallel
  // all-reduce starts from it).
  std::vector<std::pair<at::Tensor, at::Tensor>> more_roots;
};

// The backward of a step's result: d(loss * scale) and, in the same pass, more_roots with
// their gradients (as they are: already weighted).
FLASHDRAFT_API void backward(const StepResult& r, double scale = 1.0);

class FLASHDRAFT_API Drafter : public PluginObject {
 public:
  // Builds the modules against the target; throws ConfigError for sizes that do not
  // fit the target or the data (ids, vocabulary, sequence length).
  virtual void bind(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) = 0;
  // The target layer ids the drafter reads (before bind()); for an online target the
  // engine computes exactly these. Default: every layer the target exports.
  virtual std::vector<int64_t> target_layers(const TargetModel& target) const { return target.exported_layers; }
  // Trainable parameters, named (frozen target parts excluded).
  virtual std::vector<std::pair<std::string, at::Tensor>> parameters() = 0;
  // Named tensors of the model that are not trained (EAGLE-3's vocabulary maps d2t, t2d):
  // saved with the weights in checkpoints, weight files and exports and restored on
  // resume, never given to the optimizer. Default: none.
  virtual std::vector<std::pair<std::string, at::Tensor>> buffers() { return {}; }
  // Attention calls per step: the ledger's and the log's columns, one per call (DFlash:
  // one per layer; EAGLE-3: one per unroll step). The problem of call c is
  // attention_problems()[c]; the default repeats attention_problem() for every call.
  virtual int64_t attention_layers() const = 0;
  virtual AttentionProblem attention_problem() const = 0;
  virtual std::vector<AttentionProblem> attention_problems() const {
    return std::vector<AttentionProblem>(static_cast<size_t>(attention_layers()), attention_problem());
  }
  // The columns of the per-position metric, named (StepResult::position_accuracy holds one
  // value per name, in this order; the log's steps/ and eval/position_accuracy carry the names
  // as their group's attribute "position_names"): DFlash "position 1" .. "position BS-1",
  // EAGLE-3 "step 0" .. "step ttt_steps-1".
  virtual std::vector<std::string> position_names() const = 0;
  // Names of the extra scalars StepResult carries (e.g. "tau_sim"), known before the
  // first step (the log declares one column per name).
  virtual std::vector<std::string> scalar_names() const { return {}; }
  // One forward pass with loss and metrics. `rng` draws anchors and the like.
  virtual StepResult step(const Batch& batch, DrafterContext& context, at::Generator& rng, bool training) = 0;
  // Training steps in parts: the engine calls step() on the same batch step_parts() times
  // (batch.part = 0, 1, ...), with `rng` set to the same stream each time, and runs each
  // part's backward before the next part's forward; the parts' gradients add up weighted
  // by their loss weights, as micro-batches' do. A drafter whose loss is a sum over
  // independent pieces (DFlash's anchor blocks) bounds its activation memory this way.
  virtual int64_t step_parts() const { return 1; }

  // Serving (decoding.hpp): drafting as a server does it, for validation's served acceptance
  // length. max_proposals(): tokens one proposal call drafts at most (DFlash: block_size - 1;
  // EAGLE-3: ttt_steps); 0 = this drafter is not served. decoder_problems(): the attention
  // problems of one proposal call over `batch` sequences of at most `capacity` positions, one
  // per attention call (checked before step 0 like training's). decoder_mask(): the mask
  // generator those calls set and the options that differ from its defaults (empty name: the
  // experiment's [mask] as configured).
  virtual int64_t max_proposals() const { return 0; }
  virtual std::vector<AttentionProblem> decoder_problems(int64_t batch, int64_t capacity) const {
    (void)batch, (void)capacity;
    return {};
  }
  struct DecoderMask {
    std::string generator;
    std::map<std::string, Value> options;
  };
  virtual DecoderMask decoder_mask() const { return {}; }
  virtual std::unique_ptr<DraftDecoder> decoder(int64_t batch, int64_t capacity, AttentionContext& attention) {
    (void)batch, (void)capacity, (void)attention;
    return nullptr;
  }

  // The folder a server loads (drafter_format.hpp): the engine writes its layout next to the
  // run's log before step 0, the folder at the end of the run and on `flashdraft export`, and
  // imports [drafter] init folders through it. Null: the drafter is not exported. The object
  // lives as long as the plugin (a static of the plugin library); format() must not depend on
  // the drafter's table (`flashdraft export` asks a drafter made with its defaults).
  virtual const DrafterFormat* format() const { return nullptr; }
};

}  // namespace flashdraft

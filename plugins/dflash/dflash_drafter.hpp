// DFlash drafter: a block-diffusion drafter conditioned on the target's hidden states.
//
// One training step, for a batch of B sequences of S target positions:
//   context  c = RMSNorm(fc(concat_l h_l))            [B, S, H]   (h_l: target layer l)
//   blocks   N anchors per sequence; block b = [token at anchor_b, MASK x (BS-1)] at
//            positions anchor_b + j; x = target embedding of the block tokens [B, N*BS, H]
//   layers   Qwen3-style pre-norm decoder layers. Queries come from the block tokens
//            only; keys/values are [context | blocks]: the context's k/v are this layer's
//            k/v projections of c (KV injection), at positions 0..S-1. q and k get a
//            per-head RMSNorm and RoPE; GQA (heads % kv_heads == 0); SwiGLU MLP.
//            Which key a query sees is the mask generator's business ("dflash": block b
//            sees context positions < anchor_b and its own block); attention runs
//            through the engine's dispatcher.
//   output   logits = lm_head(RMSNorm(x)) with the target's frozen LM head, for the rows
//            that carry loss only, through the engine's LM-head loss op (chunked or
//            reference, [loss] in the experiment; the logits are never the drafter's).
//   loss     block position j (1..BS-1) predicts the token at anchor_b + j with weight
//            exp(-(j-1)/gamma); sum(w * CE) / sum(w) over the counted positions.
// The target's embedding and LM head are detached copies: never parameters, never a
// gradient. The pure label/anchor logic lives in dflash_labels.hpp.
//
// The class is a library (dflash_drafter, linked by the "dflash" plugin): a drafter of the
// DFlash family (plugins/dflash2) derives from it and changes what its extension points
// below say, keeping the anchors, labels, masks, context, serving loop and format.
#pragma once

#include "dflash_labels.hpp"

#include <flashdraft/bound_run.hpp>
#include <flashdraft/decoding.hpp>
#include <flashdraft/layers.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/ops.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft::dflash {

struct Layer {
  at::Tensor input_norm, post_norm;
  layers::SelfAttention attn;  // Qwen3's: q/k norms per head
  layers::SwiGluMlp mlp;
};

class DFlashDrafter : public Drafter, protected BoundRun {
 public:
  static void declare(Schema& s);
  explicit DFlashDrafter(const Config& config);

  void bind(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) override;
  std::vector<std::pair<std::string, at::Tensor>> parameters() override { return params_; }
  // The layers the context reads (the configured ids, else default_layer_ids), then, for
  // labels from the target, its last layer (whose final-normed states give its logits).
  std::vector<int64_t> target_layers(const TargetModel& target) const override;
  int64_t attention_layers() const override { return layers_n_; }
  std::vector<std::string> position_names() const override;
  std::vector<std::string> scalar_names() const override { return {"tau_sim"}; }
  AttentionProblem attention_problem() const override;

  // Serving (decoding.hpp): a block of BS tokens [the known token, MASK x (BS - 1)] at
  // positions start .. start + BS - 1 sees the context before start and itself, as in
  // training (the [mask] generator with one anchor per row, the block's keys after a cache
  // of `capacity` context positions); a row's shorter last block keeps its first
  // count + 1 tokens (MaskBlocks::lengths).
  const DrafterFormat* format() const override;
  int64_t max_proposals() const override { return block_size_ - 1; }
  std::vector<AttentionProblem> decoder_problems(int64_t batch, int64_t capacity) const override;
  std::unique_ptr<DraftDecoder> decoder(int64_t batch, int64_t capacity, AttentionContext& attention) override;

  StepResult step(const Batch& batch, DrafterContext& context, at::Generator& rng, bool training) override;
  int64_t step_parts() const override { return anchor_parts_; }

 protected:
  // ---- Extension points (a drafter of the family overrides them; DFlash's are below) ----

  // The attention sublayer of layer l: its output (after o_proj) for its input h [B, T, H].
  using Attend = std::function<at::Tensor(const at::Tensor& h)>;
  // Decoder layer l on block states x [B, T, H] (T a whole number of blocks, each block's
  // tokens contiguous). DFlash: x + attend(norm(x)), then x + mlp(norm(x)).
  virtual at::Tensor layer(int64_t l, const at::Tensor& x, const Attend& attend) const;
  // Tensors made after DFlash's own, from the same generator (so DFlash's draw the same).
  virtual void make_more_parameters(ParamMaker& make) { (void)make; }

  // The rows that carry loss in a step, as the LM-head op saw them.
  struct LossRows {
    const LmHeadLossInput& in;    // in.hidden [R, H]: final-normed states; weights, weight_sum
    const LmHeadLossOutput& out;  // the op's loss and argmax
    at::Tensor wanted;            // [R] int64: what each row is trained towards (data or target argmax)
    at::Tensor previous;          // [R] int64: the data's token before each row's (at anchor + j - 1);
                                  // undefined unless wants_previous_tokens()
  };
  // What a drafter of the family adds to the step: a loss term (already normalised as the
  // op's), the token each row proposes when it is not the LM head's argmax, and scalars
  // (0-dim device tensors, read after the backward is queued; names in scalar_names()).
  struct LossExtra {
    at::Tensor loss;
    at::Tensor chosen;
    std::vector<std::pair<std::string, at::Tensor>> scalars;
  };
  // Each row's top-k logits the LM-head op should return with the loss (LmHeadLossInput::top_k).
  virtual int64_t loss_top_k() const { return 0; }
  // Whether extra_loss reads LossRows::previous (the step then sends those tokens to the device).
  virtual bool wants_previous_tokens() const { return false; }
  virtual LossExtra extra_loss(const LossRows& rows, bool training) const {
    (void)rows;
    (void)training;
    return {};
  }
  // Serving: the proposals from the block's final-normed states [B, K, H] at positions
  // 1..K, `last` [B] the block's known token. DFlash: the LM head's argmax, or a draw.
  virtual DraftProposal choose(const at::Tensor& states, const at::Tensor& last, const Sampling& sampling) const;

  // ---- Shared parts ----
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor mlp(int64_t l, const at::Tensor& h) const;
  const Config& config() const { return config_; }

  Config config_;
  int64_t layers_n_, hidden_, heads_, kv_heads_, head_dim_, ffn_, block_size_, mask_token_, anchors_;
  // Training steps in anchor_parts_ parts of part_anchors() blocks per sequence each.
  int64_t anchor_parts_ = 1;
  int64_t part_anchors() const { return anchors_ / anchor_parts_; }
  // Per layer: the sliding window its attention keeps (layer_types "sliding_attention": the
  // [drafter] sliding_window), 0 for "full_attention".
  std::vector<int64_t> windows_;
  std::vector<int64_t> layer_ids_, feature_index_;
  int64_t label_index_ = -1;  // labels from the target: the E index of its last layer
  double rope_theta_, eps_, gamma_, init_std_, label_temperature_;
  // The reference's scaled and capped drafters (z-lab's dflash: input_embedding_scale, output_multiplier,
  // final_logit_softcapping): the block's token embeddings times input_scale_; the logits times output_multiplier_,
  // then capped (softcap_ > 0). The target's own logit scale and cap (its logits as served, for labels from it).
  double input_scale_ = 1.0, output_multiplier_ = 1.0, softcap_ = 0.0;
  // The RoPE's scaling ([drafter] rope_type and its keys) and, where it is not "default", the frequencies on the run's
  // device (rope_inv_freq), their tables times rope_attention_factor().
  RopeScaling rope_;
  at::Tensor inv_freq_;
  double rope_attention_factor() const { return rope_.scales_tables() ? rope_.attention_factor : 1.0; }
  double target_logit_scale_ = 1.0, target_logit_softcap_ = 0.0;
  // The block tokens' embeddings [.., H] (input_scale_ applied).
  at::Tensor embed(const at::Tensor& tokens) const;
  bool by_positions_ = true, separate_documents_ = true;
  dflash::AnchorRule anchor_rule_ = dflash::AnchorRule::response;
  std::string labels_, labels_config_;  // resolved at bind ("auto" -> target_kl or data); as configured
  at::Tensor fc_, hidden_norm_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<std::pair<std::string, at::Tensor>> params_;

 private:
  class Decoder;
  struct StepPlan;

  void resolve_labels(const TargetModel& target, const RunContext& ctx);
  void resolve_features(const TargetModel& target);
  void make_parameters(const TargetModel& target, const RunContext& ctx);
  at::Tensor to_device(const at::Tensor& t) const;
  // The plan of part `part` of the step (its part_anchors() of every row's anchors).
  StepPlan plan_step(const Batch& batch, at::Generator& rng, int64_t part) const;
  StepResult step_part(const Batch& batch, DrafterContext& context, at::Generator& rng, bool training,
                       int64_t part) const;
  // Validation of a run in parts: every part in turn (no gradient), one result.
  StepResult validate_in_parts(const Batch& batch, DrafterContext& context, at::Generator& rng) const;
  void index_target_positions(StepPlan& plan, const std::vector<int64_t>& row_source) const;
  // The block states after every layer; `training` parts share their context (below).
  at::Tensor decoder(const Batch& batch, const StepPlan& plan, AttentionContext& attention, bool training) const;
  StepResult loss_and_metrics(const Batch& batch, const at::Tensor& x, const StepPlan& plan, LossContext& loss,
                              bool training) const;
  std::vector<int64_t> default_layer_ids(const TargetModel& target) const;
  void check_hidden(int64_t hidden) const;
  void read_layer_types(const Config& config);
  // Sets `mask` with layer l's window when it differs from the one set last (`current`).
  static void mask_for_layer(AttentionContext& attention, MaskInput& mask, int64_t window, int64_t& current);
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& pos) const;
  const std::pair<at::Tensor, at::Tensor>& context_rope(int64_t B, int64_t S) const;

  mutable std::pair<at::Tensor, at::Tensor> context_rope_;  // context_rope()'s cache

  // A training step in parts computes the context's keys and values (every layer's, from the
  // fc features) once: part 0 computes them (`real`) and every part before the last reads
  // detached copies (`leaf`) that gather its gradient; the last part reads the real ones and
  // hands the gathered gradients to the engine as more roots of its backward
  // (StepResult::more_roots), so one backward takes them through fc and the projections.
  struct SharedContext {
    const void* tokens = nullptr;  // the batch the keys and values are of
    std::vector<at::Tensor> real_k, real_v, leaf_k, leaf_v;
  };
  mutable SharedContext shared_;
  // Layer l's context keys and values for this part (computed, or shared: see above).
  std::pair<at::Tensor, at::Tensor> context_kv(int64_t l, const at::Tensor& context, const at::Tensor& cos_c,
                                               const at::Tensor& sin_c, const Batch& batch, bool shared) const;
  std::vector<std::pair<at::Tensor, at::Tensor>> take_shared_roots() const;
};

}  // namespace flashdraft::dflash

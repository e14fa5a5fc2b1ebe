// EAGLE-3 drafter: one Llama decoder layer fed with the token embedding and a projection of
// three target hidden states, trained with the training-time test (TTT) unroll.
//
// Model (what vLLM and SGLang load as LlamaForCausalLMEagle3; H = the target's hidden size):
//   fc        Linear(3H -> H) of concat(target states at the low, mid and high layer ids)
//   midlayer  x = concat[input_layernorm(e), hidden_norm(h)]  (2H; e: token embedding, h: hidden)
//             q/k/v = x W^T (2H -> heads*D, kv_heads*D), RoPE (rotate-half), GQA attention
//             through the engine's dispatcher, h' = h + o_proj(attn);
//             out = h' + down(silu(gate(n)) * up(n)), n = post_attention_layernorm(h')
//   norm, lm_head   final RMSNorm, Linear(H -> draft_vocab)
//   The token embedding is the target's, frozen. The draft vocabulary is the draft_vocab most
//   frequent target tokens at loss-carrying positions of the first vocab_batches training
//   batches (ties: lower id first), sorted by target id; d2t[d] = target_id(d) - d and
//   t2d[v] = (v is in it) are buffers, saved with the weights.
// Training-time test, for tokens x_0..x_{S-1} and F = fc(target states) [B, S, H]:
//   step 0:  h_0[t] = F[t], e_0[t] = embed(x_{t+1})
//   step i:  h_i[t] = the midlayer output of step i-1 at t; e_i[t] = embed(x_{t+1+i}) when
//            training (teacher forcing), the drafter's own greedy token of step i-1 (as a
//            target id) in validation (chain drafting, as served).
//   Step i at column t predicts x_{t+2+i}. RoPE position of step i's state of column t is t + i
//   (a drafted token's position advances by one per step, as vLLM, SGLang and speculators do).
//   Attention of step i: queries = the S states of step i, keys/values = the K/V of steps
//   0..i (computed once per step, reused), mask "eagle3_ttt": step-0 keys causally within
//   t's document, later steps' keys of column t only. set_mask() before each step's call,
//   so each call and its backward own their mask.
// Loss: target distribution p_i[t] = softmax over the draft vocabulary of the target's logits
//   at position t+1+i (the final-normed last-layer state times the target's LM head, only
//   the draft columns kept); L = sum_i step_decay^i * mean_{counted t} CE(p_i[t], log_softmax
//   (draft logits)). Soft labels: the target's whole distribution, as EAGLE-3 trains (an
//   argmax label would drop the target's uncertainty). A position is counted at step i when
//   t+2+i lies in t's document and inside the sequence, the loss mask holds there, and the
//   target's full-vocabulary argmax at t+1+i is in the draft vocabulary (EAGLE-3's position
//   mask). Each step's loss goes through the engine's LM-head op ([loss] kernels): the
//   trained draft head, the distributions as soft labels, the counted rows weighted 1.
// Metrics: per step, accuracy = draft argmax == target argmax (draft vocabulary) over the
//   counted positions; tau_sim from them. Validation returns drafts (model.hpp): for up to
//   eval_blocks positions t per sequence, a draft starting at a = t+1 whose column j is the
//   step j greedy token at t (a proposal for x_{a+1+j}), labels x_{a+1+j}.
#include "hf_format.hpp"

#include <flashdraft/acceptance.hpp>
#include <flashdraft/bound_run.hpp>
#include <flashdraft/layers.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/ops.hpp>
#include <flashdraft/rope_config.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>

namespace flashdraft {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

class Eagle3Drafter final : public Drafter, protected BoundRun {
 public:
  static void declare(Schema& s) {
    s.integer("hidden", "drafter width; must equal the target's hidden size (0 = the target's)")
        .def(int64_t{0})
        .range(0, 1 << 20);
    s.integer("heads", "query heads").def(int64_t{32}).range(1, 1024);
    s.integer("kv_heads", "key/value heads (GQA: heads must be a multiple)").def(int64_t{8}).range(1, 1024);
    s.integer("head_dim", "width of one head (0 = hidden / heads)").def(int64_t{0}).range(0, 1024);
    s.integer("intermediate_size", "SwiGLU inner width (0 = 4 x hidden)").def(int64_t{0}).range(0, 1 << 22);
    s.integers("target_layers",
               "the low, mid and high target layer ids fc reads; id l = the output of decoder layer l, "
               "transformers' hidden_states[l + 1] (empty = {1, L/2 - 1, L - 4}, the states vLLM and SGLang "
               "capture; an even spread for targets of fewer than 7 layers). The last layer L - 1 is read too, "
               "for the target's logits")
        .def(std::vector<int64_t>{});
    s.integer("ttt_steps", "training-time-test unroll steps (EAGLE-3: 7)").def(int64_t{7});
    s.integer("draft_vocab", "draft vocabulary size: the most frequent target tokens of the training data")
        .def(int64_t{32000});
    s.real("step_decay", "loss weight of unroll step i is step_decay^i").def(0.8).range(0.0, 1.0);
    s.real("rope_theta", "RoPE base").def(500000.0).at_least(1.0);
    declare_rope_keys(s);
    s.real("rms_eps", "RMSNorm epsilon").def(1e-6).range(0.0, 1.0);
    s.real("init_std", "standard deviation of the initial projection weights").def(0.02).at_least(0.0);
    s.integer("vocab_batches", "training batches whose loss-carrying tokens are counted for the draft vocabulary")
        .def(int64_t{64})
        .at_least(1);
    s.integer("eval_blocks", "validation: drafted chains per sequence, spread evenly over its positions")
        .def(int64_t{64})
        .at_least(1);
    s.integer("max_position", "max_position_embeddings written to the export (0 = max(sequence length, 2048))")
        .def(int64_t{0})
        .at_least(0);
    s.string("init",
             "a Hugging Face EAGLE-3 drafter folder (as `flashdraft export --format hf` writes) whose weights and "
             "vocabulary maps replace the initial ones (empty = random initial weights, counted vocabulary)")
        .def(std::string());
  }

  explicit Eagle3Drafter(const Config& config) : config_(config) {
    hidden_ = config.integer("hidden");
    heads_ = config.integer("heads");
    kv_heads_ = config.integer("kv_heads");
    head_dim_ = config.integer("head_dim");
    ffn_ = config.integer("intermediate_size");
    layer_ids_ = config.integers("target_layers");
    ttt_ = config.integer("ttt_steps");
    draft_vocab_ = config.integer("draft_vocab");
    decay_ = config.real("step_decay");
    rope_theta_ = config.real("rope_theta");
    rope_ = rope_scaling(config);
    eps_ = config.real("rms_eps");
    init_std_ = config.real("init_std");
    vocab_batches_ = config.integer("vocab_batches");
    eval_blocks_ = config.integer("eval_blocks");
    if (ttt_ < 1)
      config.fail("ttt_steps", "ttt_steps = " + str(ttt_) +
                                   " leaves nothing to train: the drafter is unrolled at least once (accepted: 1 or "
                                   "more; EAGLE-3 trains with 7)");
    if (draft_vocab_ < 1)
      config.fail("draft_vocab", "draft_vocab = " + str(draft_vocab_) +
                                     " gives the drafter no token to propose (accepted: 1 or more; it is clamped to "
                                     "the target's vocabulary; EAGLE-3 uses 32000)");
    if (!layer_ids_.empty() && layer_ids_.size() != 3)
      config.fail("target_layers", "target_layers = " + list_str(layer_ids_) + " has " +
                                       str(int64_t(layer_ids_.size())) +
                                       " ids; EAGLE-3's fc reads exactly 3 (low, mid, high), e.g. [1, 15, 28]");
    if (heads_ % kv_heads_ != 0)
      config.fail("kv_heads", "heads = " + str(heads_) + " is not a multiple of kv_heads = " + str(kv_heads_) +
                                  " (GQA shares each kv head among heads / kv_heads query heads)");
  }

  // [low, mid, high, L - 1]: the configured ids or the defaults, then the last layer (its
  // state is after the target's final norm: the target's logits come from it).
  std::vector<int64_t> target_layers(const TargetModel& target) const override {
    const int64_t L = target.layers;
    std::vector<int64_t> ids = layer_ids_;
    if (!ids.empty()) {
      for (int64_t id : ids)
        if (id < 0 || id >= L)
          config_.fail("target_layers", "target layer " + str(id) + " in target_layers = " + list_str(ids) +
                                            " does not exist: the target (" + target.source + ") has layers 0.." +
                                            str(L - 1) + " (accepted: 3 ids in 0.." + str(L - 1) + ")");
    } else {
      ids = default_ids(L);
    }
    ids.push_back(L - 1);
    return ids;
  }

  void bind(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) override {
    if (hidden_ > 0 && hidden_ != target.hidden)
      config_.fail("hidden", "hidden = " + str(hidden_) + " differs from the target's hidden size " +
                                 str(target.hidden) +
                                 " (the drafter reads the target's embedding and hidden states; use " +
                                 str(target.hidden) + " or 0)");
    hidden_ = target.hidden;
    if (hidden_ % heads_ != 0 && head_dim_ == 0)
      config_.fail("heads", "hidden size " + str(hidden_) + " is not divisible by heads = " + str(heads_) +
                                " (accepted: a number of heads that divides it, or an explicit head_dim)");
    if (head_dim_ == 0) head_dim_ = hidden_ / heads_;
    if (head_dim_ % 2 != 0)
      config_.fail("head_dim",
                   "head_dim = " + str(head_dim_) + " is odd; RoPE's rotate-half layout needs an even width");
    if (ffn_ == 0) ffn_ = 4 * hidden_;
    if (seq_len < 2)
      config_.fail("ttt_steps", "the data's sequences of " + str(seq_len) +
                                    " tokens leave nothing to predict (EAGLE-3 needs at least 3)");
    if (layer_ids_.empty() && target.layers < 7 && ctx.say)
      ctx.say("eagle3: the target has " + str(target.layers) +
              " layers (fewer than 7): the default ids {1, L/2-1, L-4} " + "would not be distinct; fc reads layers " +
              list_str(default_ids(target.layers)) + " (spread evenly)");
    const std::vector<int64_t> ids = target_layers(target);
    feature_index_.clear();
    for (int64_t id : ids) {
      int64_t found = -1;
      for (size_t e = 0; e < target.exported_layers.size(); ++e)
        if (target.exported_layers[e] == id) found = static_cast<int64_t>(e);
      if (found < 0)
        config_.fail("target_layers", "target layer " + str(id) + " is not among the layers the data exports " +
                                          list_str(target.exported_layers) + " (EAGLE-3 reads " + list_str(ids) +
                                          ": the three of target_layers and the last layer " + str(target.layers - 1) +
                                          ", for the target's logits; export them or give a [target])");
      feature_index_.push_back(found);
    }
    bind_run(target, ctx, batch_size, seq_len);
    if (rope_.type != "default") inv_freq_ = rope_inv_freq(rope_theta_, head_dim_, rope_).to(device_);
    count_vocabulary(ctx);

    params_.clear();
    ParamMaker make(params_, ctx.seed, 0xea613, device_, dtype_, init_std_);
    const int64_t H = hidden_, q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    fc_ = make.linear("fc.weight", H, 3 * H);
    input_norm_ = make.norm("midlayer.input_layernorm.weight", H);
    hidden_norm_ = make.norm("midlayer.hidden_norm.weight", H);
    attn_ = layers::SelfAttention{};  // Llama's: no per-head q/k norm
    attn_.q_proj = make.linear("midlayer.self_attn.q_proj.weight", q, 2 * H);
    attn_.k_proj = make.linear("midlayer.self_attn.k_proj.weight", kv, 2 * H);
    attn_.v_proj = make.linear("midlayer.self_attn.v_proj.weight", kv, 2 * H);
    attn_.o_proj = make.linear("midlayer.self_attn.o_proj.weight", H, q);
    attn_.heads = heads_;
    attn_.kv_heads = kv_heads_;
    attn_.head_dim = head_dim_;
    attn_.eps = eps_;
    post_norm_ = make.norm("midlayer.post_attention_layernorm.weight", H);
    mlp_.gate_proj = make.linear("midlayer.mlp.gate_proj.weight", ffn_, H);
    mlp_.up_proj = make.linear("midlayer.mlp.up_proj.weight", ffn_, H);
    mlp_.down_proj = make.linear("midlayer.mlp.down_proj.weight", H, ffn_);
    final_norm_ = make.norm("norm.weight", H);
    lm_head_ = make.linear("lm_head.weight", draft_vocab_, H);
  }

  std::vector<std::pair<std::string, at::Tensor>> parameters() override { return params_; }
  std::vector<std::pair<std::string, at::Tensor>> buffers() override { return {{"d2t", d2t_}, {"t2d", t2d_}}; }
  int64_t attention_layers() const override { return ttt_; }
  std::vector<std::string> position_names() const override {
    std::vector<std::string> names;
    for (int64_t i = 0; i < ttt_; ++i) names.push_back("step " + str(i));
    return names;
  }
  std::vector<std::string> scalar_names() const override { return {"tau_sim"}; }

  AttentionProblem attention_problem() const override { return problem(0); }
  std::vector<AttentionProblem> attention_problems() const override {
    std::vector<AttentionProblem> out;
    for (int64_t i = 0; i < ttt_; ++i) out.push_back(problem(i));
    return out;
  }

  // Serving (decoding.hpp): chain drafting. From the known token x_a at position a, the
  // chain runs at column c = a - 1: step 0 reads fc(target states at c) and x_a, step i its
  // own state and token of step i - 1; step i proposes the token at a + 1 + i. As in
  // training's mask, step i sees the step-0 keys of the columns before c (the context
  // cache) and the chain's steps 0..i at column c: the "dflash" mask with causal blocks,
  // one block of ttt_steps chain slots after the cache, anchored at c.
  const DrafterFormat* format() const override {
    static const hf_eagle3::Format hf;
    return &hf;
  }
  int64_t max_proposals() const override { return ttt_; }
  std::vector<AttentionProblem> decoder_problems(int64_t batch, int64_t capacity) const override {
    AttentionProblem p = problem(0);
    p.batch = batch;
    p.q_len = ttt_;
    p.kv_len = capacity + ttt_;
    p.needs_backward = false;
    return std::vector<AttentionProblem>(static_cast<size_t>(ttt_), p);
  }
  DecoderMask decoder_mask() const override { return {"dflash", {{"in_block", Value(std::string("causal"))}}}; }
  std::unique_ptr<DraftDecoder> decoder(int64_t batch, int64_t capacity, AttentionContext& attention) override {
    return std::make_unique<Decoder>(*this, batch, capacity, attention);
  }

  StepResult step(const Batch& batch, DrafterContext& attention, at::Generator&, bool training) override {
    std::optional<at::NoGradGuard> no_grad;
    if (!training) no_grad.emplace();
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), H = hidden_, n = ttt_;
    if (batch.hidden.dim() != 4 || batch.hidden.size(0) != B || batch.hidden.size(1) != S)
      throw std::invalid_argument("batch hidden states must be [B, S, E, H] = [" + str(B) + ", " + str(S) + ", E, H]");
    const Plan plan = plan_step(batch);
    const auto long_opts = at::TensorOptions().dtype(at::kLong);

    // The target's side: fc's input, and its distribution over the draft vocabulary.
    const at::Tensor index = to_device(at::tensor(feature_index_, long_opts));
    const at::Tensor states = batch.hidden.to(device_).index_select(2, index);  // [B, S, 4, H]
    const at::Tensor F = at::linear(states.narrow(2, 0, 3).reshape({B, S, 3 * H}).to(dtype_), fc_);
    const TargetSide target = target_side(states.select(2, 3).reshape({B * S, H}).to(dtype_));

    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    at::Tensor h = F, tokens = plan.next_tokens.select(0, 0);  // [B, S] target ids fed at step 0
    std::vector<at::Tensor> keys, values;
    at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
    std::vector<at::Tensor> hits, counts, greedy;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor e = embedding_.index_select(0, tokens.reshape({-1})).view({B, S, H});
      const at::Tensor x = at::cat({rms_norm(e, input_norm_), rms_norm(h, hidden_norm_)}, -1);
      const auto [cos, sin] = rope_tables(S, i);  // step i of column t sits at position t + i
      const at::Tensor q = attn_.queries(x, cos, sin);
      keys.push_back(attn_.keys(x, cos, sin));
      values.push_back(attn_.values(x));
      MaskInput mask = plan.mask;
      mask.kv_len = (i + 1) * S;
      attention.set_mask(mask);
      const at::Tensor a = attention.attention(i, q.contiguous(), i == 0 ? keys[0].contiguous() : at::cat(keys, 2),
                                               i == 0 ? values[0].contiguous() : at::cat(values, 2), scale);
      const at::Tensor mid = h + attn_.output(a);
      const at::Tensor n2 = rms_norm(mid, post_norm_);
      h = mid + mlp_(n2);

      // The counted rows of this step and their targets (rows + 1 + i: the target position).
      // The soft cross-entropy of the counted rows through the engine's LM-head op (the
      // trained draft head, the target's distributions as soft labels): sum_t w_t CE_t, then
      // over the step's count on the device (no host read).
      const at::Tensor rows = plan.rows[static_cast<size_t>(i)], at_target = rows + (1 + i);
      const at::Tensor counted = target.in_draft.index_select(0, at_target);
      LmHeadLossInput in;
      in.hidden = rms_norm(h.reshape({B * S, H}).index_select(0, rows), final_norm_);
      in.weight = lm_head_;
      in.soft_labels = target.probs;
      in.target_index = at_target;
      in.row_weights = counted.to(at::kFloat);
      in.weight_sum = 1.0;
      const LmHeadLossOutput out = attention.lm_head_loss(in);
      const at::Tensor count = in.row_weights.sum();
      loss = loss + std::pow(decay_, double(i)) * out.loss / count.clamp_min(1.0);
      hits.push_back((out.argmax.eq(target.argmax.index_select(0, at_target)) & counted).sum());
      counts.push_back(count.detach());
      if (i + 1 < n) {
        if (training) {
          tokens = plan.next_tokens.select(0, i + 1);
        } else {  // chain drafting: the greedy token of this step, as a target id
          tokens = greedy_target_ids(h);
          greedy.push_back(tokens);
        }
      } else if (!training) {
        greedy.push_back(greedy_target_ids(h));
      }
    }
    StepResult result;
    result.loss = loss;
    result.loss_weight = double(plan.counted_step0);
    if (!training) proposals(batch, plan, greedy, result);
    const auto fill = metrics_of(at::stack(hits), at::stack(counts));
    if (training && device_.is_cuda())
      result.deferred = fill;
    else
      fill(result);
    return result;
  }

 private:
  // The greedy token of a step's states [B, S, H] as target ids (draft id d is target id d + d2t[d]).
  at::Tensor greedy_target_ids(const at::Tensor& h) const {
    const at::Tensor d = at::linear(rms_norm(h, final_norm_), lm_head_).argmax(-1);  // [B, S] draft ids
    return d + d2t_.index_select(0, d.reshape({-1})).view(d.sizes());
  }

  // Fills a step's per-step accuracy, token count and tau_sim from the hits and counted rows
  // of each unroll step (device tensors, read when the function runs).
  static std::function<void(StepResult&)> metrics_of(const at::Tensor& h_all, const at::Tensor& c_all) {
    return [h_all, c_all](StepResult& r) {
      const at::Tensor hc = h_all.to(at::kCPU, at::kDouble), cc = c_all.to(at::kCPU, at::kDouble);
      r.position_accuracy.clear();
      for (int64_t i = 0; i < hc.size(0); ++i) {
        const double c = cc[i].item<double>();
        r.position_accuracy.push_back(c > 0 ? hc[i].item<double>() / c : 0.0);
      }
      r.tokens = static_cast<int64_t>(cc[0].item<double>());
      r.scalars = {{"tau_sim", simulated_tau(r.position_accuracy)}};
    };
  }

  // The chain drafter's caches: fc(target states) per position [B, capacity, H], and per
  // slot the keys/values [B, kv_heads, capacity + ttt_steps, D]: slot t < capacity holds
  // column t's step-0 keys (from fc(states at t) and the token at t + 1), the last
  // ttt_steps slots the chain of the current proposal. Slot capacity - 1 is never a column
  // (a row's positions stay below capacity - 1 when it proposes): the keys of column -1
  // (a row's first position has no column before it) are written there and never read.
  class Decoder final : public DraftDecoder {
   public:
    Decoder(const Eagle3Drafter& d, int64_t batch, int64_t capacity, AttentionContext& attention)
        : d_(d), batch_(batch), capacity_(capacity), attention_(attention) {
      const auto opts = at::TensorOptions().dtype(d.dtype_).device(d.device_);
      k_ = at::zeros({batch, d.kv_heads_, capacity + d.ttt_, d.head_dim_}, opts);
      v_ = at::zeros({batch, d.kv_heads_, capacity + d.ttt_, d.head_dim_}, opts);
      fused_ = at::zeros({batch, capacity, d.hidden_}, opts);
      draft_ids_ = at::arange(d.draft_vocab_, at::TensorOptions().dtype(at::kLong).device(d.device_)) + d.d2t_;
    }

    void extend(const at::Tensor& tokens, const at::Tensor& features, const std::vector<int64_t>& start,
                const std::vector<int64_t>& count) override {
      (void)count;  // entries past a row's count land at positions it has not reached: rewritten before they are read
      at::NoGradGuard frozen;
      const int64_t B = features.size(0), T = features.size(1), H = d_.hidden_;
      check_rows(B, start, T, "extend");
      const auto long_opts = at::TensorOptions().dtype(at::kLong);
      const at::Tensor index = at::tensor(d_.feature_index_, long_opts).narrow(0, 0, 3).to(features.device());
      const at::Tensor F =
          at::linear(features.index_select(2, index).reshape({B, T, 3 * H}).to(d_.device_, d_.dtype_), d_.fc_);
      const at::Tensor pos = positions_of(start, T);  // [B, T]
      fused_.scatter_(1, pos.unsqueeze(-1).expand({B, T, H}), F);
      // Column p - 1 pairs fc(states at p - 1) with the token at p.
      const at::Tensor column = pos - 1;
      const at::Tensor previous = fused_.gather(1, column.clamp_min(0).unsqueeze(-1).expand({B, T, H}));
      const at::Tensor e =
          d_.embedding_.index_select(0, tokens.to(d_.device_, at::kLong).reshape({-1})).view({B, T, H});
      const at::Tensor x = at::cat({d_.rms_norm(e, d_.input_norm_), d_.rms_norm(previous, d_.hidden_norm_)}, -1);
      const auto [cos, sin] = tables(column.clamp_min(0));
      const at::Tensor k = d_.attn_.keys(x, cos, sin);
      const at::Tensor v = d_.attn_.values(x);
      const at::Tensor slot = at::where(column.lt(0), at::full_like(column, capacity_ - 1), column);
      const at::Tensor where = slot.view({B, 1, T, 1}).expand({B, d_.kv_heads_, T, d_.head_dim_});
      k_.scatter_(2, where, k);
      v_.scatter_(2, where, v);
    }

    DraftProposal propose(const DraftRequest& r) override {
      at::NoGradGuard frozen;
      const int64_t B = batch_, n = d_.ttt_, H = d_.hidden_;
      check_rows(static_cast<int64_t>(r.count.size()), r.start, n, "propose");
      int64_t K = 0;
      MaskInput mask;
      mask.batch = B;
      mask.q_len = n;
      mask.kv_len = capacity_ + n;
      mask.blocks.context_len = capacity_;
      mask.blocks.block_size = n;
      std::vector<int64_t> column(static_cast<size_t>(B), 0);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c = r.count[static_cast<size_t>(b)], a = r.start[static_cast<size_t>(b)];
        if (c < 0 || c > n)
          throw std::invalid_argument("eagle3 decoder: " + str(c) + " proposals asked of row " + str(b) +
                                      "; a chain of " + str(n) + " steps proposes 0.." + str(n));
        if (c > 0 && a < 1)
          throw std::invalid_argument(
              "eagle3 decoder: row " + str(b) + " proposes after position " + str(a) +
              "; the chain starts at the column before it, so position 0 cannot be drafted from");
        K = std::max(K, c);
        column[static_cast<size_t>(b)] = std::max<int64_t>(a - 1, 0);
        mask.blocks.anchors.push_back({column[static_cast<size_t>(b)]});
        mask.blocks.valid.push_back({static_cast<uint8_t>(c > 0)});
        mask.blocks.lengths.push_back({std::max<int64_t>(c, 1)});
      }
      DraftProposal out;
      const auto long_opts = at::TensorOptions().dtype(at::kLong).device(d_.device_);
      if (K == 0) {
        out.tokens = at::zeros({B, 0}, long_opts);
        return out;
      }
      attention_.set_mask(mask);
      const at::Tensor col = at::tensor(column, at::TensorOptions().dtype(at::kLong)).to(d_.device_).view({B, 1});
      at::Tensor h = fused_.gather(1, col.unsqueeze(-1).expand({B, 1, H}));  // [B, 1, H]
      at::Tensor token = r.last.to(d_.device_, at::kLong).view({B, 1});
      const double scale = 1.0 / std::sqrt(static_cast<double>(d_.head_dim_));
      std::vector<at::Tensor> tokens, probs;
      for (int64_t i = 0; i < K; ++i) {
        const at::Tensor e = d_.embedding_.index_select(0, token.reshape({-1})).view({B, 1, H});
        const at::Tensor x = at::cat({d_.rms_norm(e, d_.input_norm_), d_.rms_norm(h, d_.hidden_norm_)}, -1);
        const auto [cos, sin] = tables(col + i);  // chain step i at position c + i, as in training
        const at::Tensor q = d_.attn_.queries(x, cos, sin);
        k_.narrow(2, capacity_ + i, 1).copy_(d_.attn_.keys(x, cos, sin));
        v_.narrow(2, capacity_ + i, 1).copy_(d_.attn_.values(x));
        // Step i is query row i of the chain block (the other rows are not read).
        at::Tensor queries = at::zeros({B, d_.heads_, n, d_.head_dim_}, q.options());
        queries.narrow(2, i, 1).copy_(q);
        const at::Tensor a = attention_.attention(i, queries, k_, v_, scale).narrow(2, i, 1);
        const at::Tensor mid = h + d_.attn_.output(a);
        const at::Tensor n2 = d_.rms_norm(mid, d_.post_norm_);
        h = mid + d_.mlp_(n2);
        const at::Tensor logits = at::linear(d_.rms_norm(h, d_.final_norm_), d_.lm_head_).squeeze(1);  // [B, Vd]
        at::Tensor draft;
        if (r.sampling.greedy()) {
          draft = logits.argmax(-1);
        } else {
          const at::Tensor p = sampling_probs(logits, r.sampling.temperature, r.sampling.top_p);
          draft = sample_tokens(p, r.sampling.generator);
          probs.push_back(at::zeros({B, d_.vocab_}, p.options()).index_copy_(1, draft_ids_, p));
        }
        token = draft_ids_.index_select(0, draft).view({B, 1});  // as target ids
        tokens.push_back(token);
      }
      out.tokens = at::cat(tokens, 1);
      if (!probs.empty()) out.probs = at::stack(probs, 1);
      return out;
    }

   private:
    void check_rows(int64_t rows, const std::vector<int64_t>& start, int64_t T, const char* call) const {
      if (rows != batch_ || static_cast<int64_t>(start.size()) != batch_)
        throw std::invalid_argument(std::string("eagle3 decoder ") + call + ": " + str(rows) + " rows and " +
                                    str(static_cast<int64_t>(start.size())) + " start positions for a decoder of " +
                                    str(batch_) + " rows");
      for (int64_t b = 0; b < batch_; ++b)
        if (start[static_cast<size_t>(b)] < 0 || start[static_cast<size_t>(b)] + T > capacity_ - 1)
          throw std::invalid_argument(std::string("eagle3 decoder ") + call + ": row " + str(b) + " at positions " +
                                      str(start[static_cast<size_t>(b)]) + ".." +
                                      str(start[static_cast<size_t>(b)] + T - 1) + ", outside its cache of " +
                                      str(capacity_ - 1) + " positions");
    }
    at::Tensor positions_of(const std::vector<int64_t>& start, int64_t T) const {
      return at::tensor(start, at::TensorOptions().dtype(at::kLong)).to(d_.device_).unsqueeze(1) +
             at::arange(T, at::TensorOptions().dtype(at::kLong).device(d_.device_));
    }
    // RoPE tables [B, 1, T, D] of positions [B, T].
    std::pair<at::Tensor, at::Tensor> tables(const at::Tensor& positions) const {
      auto [cos, sin] = d_.tables_of(positions);
      return {cos.unsqueeze(1), sin.unsqueeze(1)};
    }
    const Eagle3Drafter& d_;
    int64_t batch_, capacity_;
    AttentionContext& attention_;
    at::Tensor k_, v_, fused_, draft_ids_;
  };

  // The host side of a step.
  struct Plan {
    MaskInput mask;                   // q_len = S; kv_len set per step; the rows' documents
    at::Tensor next_tokens;           // [n, B, S] on the device: x_{t+1+i} (0 past the sequence)
    std::vector<at::Tensor> rows;     // per step: flat b * S + t of the positions that may count
    std::vector<int64_t> doc_end;     // [B * S] end (exclusive) of t's document, within the length
    at::Tensor tokens_cpu, mask_cpu;  // [B, S] int64 / uint8 (mask undefined: every position)
    int64_t counted_step0 = 0;        // step-0 rows (the batch's loss weight)
  };

  struct TargetSide {
    at::Tensor probs;     // [B * S, Vd] float32: softmax of the target's logits over the draft vocabulary
    at::Tensor argmax;    // [B * S] int64: the draft id of the largest of them
    at::Tensor in_draft;  // [B * S] bool: the target's full-vocabulary argmax is in the draft vocabulary
  };

  static std::vector<int64_t> default_ids(int64_t L) {
    if (L >= 7) return {1, L / 2 - 1, L - 4};
    const int64_t hi = std::max<int64_t>(0, L - 2);
    return {0, static_cast<int64_t>(std::llround(hi / 2.0)), hi};
  }

  AttentionProblem problem(int64_t i) const {
    return AttentionProblem::of(device_, dtype_, batch_, heads_, kv_heads_, seq_len_, (i + 1) * seq_len_, head_dim_,
                                /*needs_backward=*/true, "eagle3_ttt");
  }

  at::Tensor to_device(const at::Tensor& t) const {
    return device_.is_cuda() ? t.pin_memory().to(device_, /*non_blocking=*/true) : t;
  }

  // The draft vocabulary: the draft_vocab most frequent tokens at loss-carrying positions of
  // the first vocab_batches training batches, ties by lower id, sorted by target id.
  void count_vocabulary(const RunContext& ctx) {
    if (draft_vocab_ > vocab_ && ctx.say)
      ctx.say("eagle3: draft_vocab = " + str(draft_vocab_) + " is larger than the target's vocabulary; clamped to " +
              str(vocab_));
    draft_vocab_ = std::min(draft_vocab_, vocab_);
    std::vector<int64_t> count(static_cast<size_t>(vocab_), 0);
    int64_t positions = 0, read = 0;
    if (ctx.train_batch)
      for (; read < vocab_batches_; ++read) {
        const Batch b = ctx.train_batch(read);
        const at::Tensor tok = b.tokens.to(at::kCPU, at::kLong).contiguous();
        const at::Tensor lm = b.loss_mask.defined() ? b.loss_mask.to(at::kCPU, at::kByte).contiguous() : at::Tensor();
        const at::Tensor len = b.lengths.defined() ? b.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
        const int64_t rows = tok.size(0), S = tok.size(1);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t length = len.defined() ? std::min(len.data_ptr<int64_t>()[r], S) : S;
          for (int64_t p = 0; p < length; ++p) {
            if (lm.defined() && !lm.data_ptr<uint8_t>()[r * S + p]) continue;
            const int64_t v = tok.data_ptr<int64_t>()[r * S + p];
            if (v >= 0 && v < vocab_) ++count[static_cast<size_t>(v)], ++positions;
          }
        }
      }
    std::vector<int64_t> order(static_cast<size_t>(vocab_));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return count[size_t(a)] > count[size_t(b)]; });
    std::vector<int64_t> chosen(order.begin(), order.begin() + draft_vocab_);
    std::sort(chosen.begin(), chosen.end());
    int64_t covered = 0;
    for (int64_t v : chosen) covered += count[static_cast<size_t>(v)];
    at::Tensor d2t = at::tensor(chosen, at::TensorOptions().dtype(at::kLong)) - at::arange(draft_vocab_, at::kLong);
    at::Tensor t2d = at::zeros({vocab_}, at::TensorOptions().dtype(at::kBool));
    t2d.index_fill_(0, at::tensor(chosen, at::TensorOptions().dtype(at::kLong)), true);
    d2t_ = d2t.to(device_);
    t2d_ = t2d.to(device_);
    if (ctx.say)
      ctx.say(
          "eagle3: draft vocabulary of " + str(draft_vocab_) + " tokens (of " + str(vocab_) +
          "), the most frequent at loss-carrying positions of " + str(read) + " training batches (" + str(positions) +
          " positions; the draft vocabulary covers " +
          (positions > 0 ? str(int64_t(std::llround(100.0 * double(covered) / double(positions)))) : std::string("-")) +
          "% of them)" + (ctx.train_batch ? "" : " -- no data given: the lowest ids"));
  }

  Plan plan_step(const Batch& batch) const {
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), n = ttt_;
    Plan plan;
    plan.tokens_cpu = batch.tokens.to(at::kCPU, at::kLong).contiguous();
    if (batch.loss_mask.defined()) plan.mask_cpu = batch.loss_mask.to(at::kCPU, at::kByte).contiguous();
    const at::Tensor len = batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
    const int64_t* tok = plan.tokens_cpu.data_ptr<int64_t>();
    const uint8_t* lm = plan.mask_cpu.defined() ? plan.mask_cpu.data_ptr<uint8_t>() : nullptr;
    plan.mask.batch = B;
    plan.mask.q_len = S;
    plan.doc_end.assign(static_cast<size_t>(B * S), 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t length = len.defined() ? std::min(len.data_ptr<int64_t>()[b], S) : S;
      std::vector<int64_t> docs;
      if (static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[static_cast<size_t>(b)].empty())
        docs = batch.documents[static_cast<size_t>(b)];
      else
        docs = {length};
      int64_t used = 0;
      for (int64_t d : docs) {
        for (int64_t t = used; t < std::min(used + d, S); ++t)
          plan.doc_end[size_t(b * S + t)] = std::min(used + d, length);
        used += d;
      }
      if (used < S) docs.push_back(S - used);  // padding: a document of its own (no loss)
      for (int64_t t = used; t < S; ++t) plan.doc_end[size_t(b * S + t)] = std::min<int64_t>(t, length);
      docs.erase(std::remove(docs.begin(), docs.end(), 0), docs.end());
      plan.mask.doc_lengths.push_back(docs);
    }
    at::Tensor next = at::zeros({n, B, S}, at::TensorOptions().dtype(at::kLong));
    int64_t* nx = next.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int64_t> rows;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < S; ++t) {
          const int64_t in = t + 1 + i, p = t + 2 + i;
          if (in < S) nx[(i * B + b) * S + t] = tok[b * S + in];
          if (p < plan.doc_end[size_t(b * S + t)] && (!lm || lm[b * S + p])) rows.push_back(b * S + t);
        }
      if (i == 0) plan.counted_step0 = static_cast<int64_t>(rows.size());
      plan.rows.push_back(to_device(at::tensor(rows, at::TensorOptions().dtype(at::kLong))));
    }
    plan.next_tokens = to_device(next);
    return plan;
  }

  // The target's logits from its final-normed last-layer states, full vocabulary in chunks
  // of rows (no gradient): the argmax over every token, and the draft columns' softmax.
  TargetSide target_side(const at::Tensor& last) const {
    at::NoGradGuard frozen;
    const int64_t rows = last.size(0);
    const int64_t chunk = std::max<int64_t>(16, (int64_t(1) << 29) / std::max<int64_t>(1, vocab_ * 4));
    const at::Tensor draft_ids = at::arange(draft_vocab_, at::TensorOptions().dtype(at::kLong).device(device_)) + d2t_;
    std::vector<at::Tensor> probs, full_argmax;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const at::Tensor logits = at::linear(last.narrow(0, r0, std::min(chunk, rows - r0)), target_head_);
      full_argmax.push_back(logits.argmax(-1));
      // (the target's distribution: its logits times its logit scale, Granite's 1 / logits_scaling, soft-capped where
      // it caps them, Gemma 4's)
      probs.push_back(at::softmax(
          served_logits(logits.index_select(1, draft_ids).to(at::kFloat), target_logit_scale_, target_logit_softcap_),
          -1));
    }
    TargetSide t;
    t.probs = at::cat(probs, 0);
    t.argmax = t.probs.argmax(-1);
    t.in_draft = t2d_.index_select(0, at::cat(full_argmax, 0));
    return t;
  }

  // Validation's drafts (model.hpp's Drafts; see the top of this file): at most eval_blocks
  // per row, at positions t spread evenly over those whose step-0 proposal counts; the draft
  // starts at t + 1 and holds the greedy tokens of unroll steps 0 .. ttt_steps-1 there.
  void proposals(const Batch& batch, const Plan& plan, const std::vector<at::Tensor>& greedy, StepResult& r) const {
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), N = eval_blocks_, K = ttt_;
    std::vector<at::Tensor> g;
    for (const auto& t : greedy) g.push_back(t.to(at::kCPU, at::kLong));
    const at::Tensor chains = at::stack(g, 0).contiguous();  // [K, B, S]
    const int64_t* ch = chains.data_ptr<int64_t>();
    const int64_t* tok = plan.tokens_cpu.data_ptr<int64_t>();
    const uint8_t* lm = plan.mask_cpu.defined() ? plan.mask_cpu.data_ptr<uint8_t>() : nullptr;
    std::vector<int64_t> rows, starts, tokens, labels;
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> cand;  // positions t whose step-0 prediction x_{t+2} counts
      for (int64_t t = 0; t + 2 < S; ++t)
        if (t + 2 < plan.doc_end[size_t(b * S + t)] && (!lm || lm[b * S + t + 2])) cand.push_back(t);
      const int64_t C = static_cast<int64_t>(cand.size());
      for (int64_t k = 0; k < std::min(C, N); ++k) {
        const int64_t t = cand[size_t(C <= N ? k : (N == 1 ? 0 : k * (C - 1) / (N - 1)))], a = t + 1;
        const int64_t end = plan.doc_end[size_t(b * S + t)];
        rows.push_back(b);
        starts.push_back(a);
        for (int64_t j = 1; j <= K; ++j) {
          tokens.push_back(ch[((j - 1) * B + b) * S + t]);
          labels.push_back(a + j < end && (!lm || lm[b * S + a + j]) ? tok[b * S + a + j] : -1);
        }
      }
    }
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const int64_t D = static_cast<int64_t>(rows.size());
    r.drafts.rows = at::tensor(rows, opts);
    r.drafts.starts = at::tensor(starts, opts);
    r.drafts.tokens = at::tensor(tokens, opts).view({D, K});
    r.drafts.labels = at::tensor(labels, opts).view({D, K});
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const { return layers::rms_norm(x, w, eps_); }
  // cos/sin of angles p * theta^(-2k/D) for positions p = step .. step + S - 1 (the states of
  // unroll step `step`: column t at t + step, as vLLM, SGLang and speculators advance a drafted
  // token's position by one per step), rotate-half layout: [1, 1, S, D].
  std::pair<at::Tensor, at::Tensor> rope_tables(int64_t S, int64_t step) const {
    const at::Tensor pos = at::arange(step, step + S, at::TensorOptions().dtype(at::kLong).device(device_));
    auto [cos, sin] = tables_of(pos);
    return {cos.view({1, 1, S, head_dim_}), sin.view({1, 1, S, head_dim_})};
  }
  // cos / sin [..., D] of positions [...]: theta^(-2k/D), or the scaled frequencies of [drafter] rope_type (YaRN's
  // tables times its attention factor).
  std::pair<at::Tensor, at::Tensor> tables_of(const at::Tensor& pos) const {
    if (rope_.type == "default") return flashdraft::rope_tables(pos, rope_theta_, head_dim_, dtype_);
    return flashdraft::rope_tables(pos, inv_freq_, rope_.scales_tables() ? rope_.attention_factor : 1.0, dtype_);
  }

  Config config_;
  int64_t hidden_, heads_, kv_heads_, head_dim_, ffn_, ttt_, draft_vocab_, vocab_batches_, eval_blocks_;
  std::vector<int64_t> layer_ids_, feature_index_;
  double decay_, rope_theta_, eps_, init_std_;
  RopeScaling rope_;     // [drafter] rope_type and its keys
  at::Tensor inv_freq_;  // its frequencies on the run's device (rope_type other than "default")
  at::Tensor d2t_, t2d_;
  at::Tensor fc_, input_norm_, hidden_norm_, post_norm_, final_norm_, lm_head_;
  layers::SelfAttention attn_;
  layers::SwiGluMlp mlp_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(drafter, "eagle3", "0.1.0",
                  "EAGLE-3 drafter: one Llama layer on the token embedding and fused target states, trained "
                  "with the training-time-test unroll",
                  flashdraft::Eagle3Drafter)

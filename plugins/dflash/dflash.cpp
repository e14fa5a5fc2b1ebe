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
//   output   logits = lm_head(RMSNorm(x)) with the target's frozen LM head.
//   loss     block position j (1..BS-1) predicts the token at anchor_b + j with weight
//            exp(-(j-1)/gamma); sum(w * CE) / sum(w) over the counted positions.
// The target's embedding and LM head are detached copies: never parameters, never a
// gradient. The pure label/anchor logic lives in dflash_labels.hpp.
#include "dflash_labels.hpp"

#include <flashdraft/acceptance.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/text.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <sstream>

namespace flashdraft {
namespace {

struct Layer {
  at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, gate_proj,
      up_proj, down_proj;
};

class DFlashDrafter final : public Drafter {
 public:
  static void declare(Schema& s) {
    s.integer("layers", "number of drafter decoder layers").def(int64_t{2}).range(1, 256);
    s.integer("hidden", "drafter width; must equal the target's hidden size (0 = the target's)")
        .def(int64_t{0})
        .range(0, 1 << 20);
    s.integer("heads", "query heads").def(int64_t{4}).range(1, 1024);
    s.integer("kv_heads", "key/value heads (GQA: heads must be a multiple)").def(int64_t{2}).range(1, 1024);
    s.integer("head_dim", "width of one head (0 = hidden / heads)").def(int64_t{0}).range(0, 1024);
    s.integer("ffn", "SwiGLU inner width (0 = 3 x hidden)").def(int64_t{0}).range(0, 1 << 22);
    s.integer("block_size", "tokens per block, anchor included (BS)").def(int64_t{16}).range(2, 4096);
    s.integer("mask_token", "token id of MASK in the target vocabulary (-1 = the last id)")
        .def(int64_t{-1})
        .at_least(-1);
    s.integers("target_layer_ids",
               "target layers whose hidden states form the context; id L = the output of decoder layer L, "
               "transformers' hidden_states[L + 1] (empty = every layer the data exports, or 5 spread over an "
               "online target's depth)")
        .def(std::vector<int64_t>{});
    s.real("rope_theta", "RoPE base").def(10000.0).at_least(1.0);
    s.real("rms_eps", "RMSNorm epsilon").def(1e-6).range(0.0, 1.0);
    s.integer("anchors", "blocks per sequence (N)").def(int64_t{8}).at_least(0);
    s.real("gamma", "loss weight decay: w_j = exp(-(j-1)/gamma)").def(7.0).at_least(0.0);
    s.real("init_std", "standard deviation of the initial projection weights").def(0.02).at_least(0.0);
    s.string("init",
             "a Hugging Face DFlash drafter folder (config.json + model.safetensors, as `flashdraft export "
             "--format hf` writes) whose weights replace the random ones, to continue training or to validate "
             "it; its config must match this table and the target (empty = random initial weights)")
        .def(std::string());
  }

  explicit DFlashDrafter(const Config& config) : config_(config) {
    layers_n_ = config.integer("layers");
    hidden_ = config.integer("hidden");
    heads_ = config.integer("heads");
    kv_heads_ = config.integer("kv_heads");
    head_dim_ = config.integer("head_dim");
    ffn_ = config.integer("ffn");
    block_size_ = config.integer("block_size");
    mask_token_ = config.integer("mask_token");
    layer_ids_ = config.integers("target_layer_ids");
    rope_theta_ = config.real("rope_theta");
    eps_ = config.real("rms_eps");
    anchors_ = config.integer("anchors");
    gamma_ = config.real("gamma");
    init_std_ = config.real("init_std");
    if (anchors_ == 0)
      config.fail("anchors", "anchors = 0 leaves no block to train on; give at least 1 anchor per sequence");
    if (!(gamma_ > 0.0))
      config.fail("gamma", "gamma = " + std::to_string(gamma_) + " must be positive (weights exp(-(j-1)/gamma))");
    if (heads_ % kv_heads_ != 0)
      config.fail("kv_heads", "heads = " + std::to_string(heads_) + " is not a multiple of kv_heads = " +
                                  std::to_string(kv_heads_) + " (GQA shares each kv head among heads / kv_heads query heads)");
    if (hidden_ > 0) check_hidden(hidden_);
  }

  void bind(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) override {
    const int64_t hidden = hidden_ > 0 ? hidden_ : target.hidden;
    if (hidden_ > 0 && hidden_ != target.hidden)
      config_.fail("hidden", "hidden = " + std::to_string(hidden_) + " differs from the target's hidden size " +
                                 std::to_string(target.hidden) +
                                 " (the drafter shares the target's embedding and LM head; use " +
                                 std::to_string(target.hidden) + " or 0)");
    check_hidden(hidden);
    hidden_ = hidden;
    if (head_dim_ == 0) head_dim_ = hidden_ / heads_;
    if (ffn_ == 0) ffn_ = 3 * hidden_;
    if (mask_token_ == -1) mask_token_ = target.vocab - 1;
    if (mask_token_ < 0 || mask_token_ >= target.vocab)
      config_.fail("mask_token", "mask_token = " + std::to_string(mask_token_) +
                                     " is outside the target vocabulary (ids 0.." + std::to_string(target.vocab - 1) +
                                     ", or -1 for the last id)");
    if (block_size_ > seq_len)
      config_.fail("block_size", "block_size = " + std::to_string(block_size_) + " is larger than the sequence length " +
                                     std::to_string(seq_len) + " of the data (a block must fit in a sequence)");
    if (layer_ids_.empty()) layer_ids_ = target.exported_layers;
    feature_index_.clear();
    for (int64_t id : layer_ids_) {
      int64_t found = -1;
      for (size_t e = 0; e < target.exported_layers.size(); ++e)
        if (target.exported_layers[e] == id) found = static_cast<int64_t>(e);
      if (found < 0)
        config_.fail("target_layer_ids", "target layer " + std::to_string(id) +
                                             " is not among the layers the data exports " +
                                             list_str(target.exported_layers) + " (target has " +
                                             std::to_string(target.layers) + " layers)");
      feature_index_.push_back(found);
    }
    device_ = ctx.device;
    dtype_ = ctx.dtype;
    batch_ = batch_size;
    seq_len_ = seq_len;
    vocab_ = target.vocab;
    // Frozen target parts: detached copies, so no gradient can reach the target's tensors.
    embedding_ = target.embedding.detach().to(device_, dtype_);
    lm_head_ = target.lm_head.detach().to(device_, dtype_);

    // Initial weights from a generator of our own (seeded by the run): same seed, same
    // drafter, whatever else drew from the global generator.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(ctx.seed * 0x9E3779B97F4A7C15ULL + 0xdf1a5);
    params_.clear();
    auto linear = [&](const std::string& name, int64_t out, int64_t in) {
      at::Tensor w = at::randn({out, in}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(init_std_);
      w = w.to(device_, dtype_).set_requires_grad(true);
      params_.emplace_back(name, w);
      return w;
    };
    auto norm = [&](const std::string& name, int64_t n) {
      at::Tensor w = at::ones({n}, at::TensorOptions().dtype(dtype_).device(device_)).set_requires_grad(true);
      params_.emplace_back(name, w);
      return w;
    };
    const int64_t features = static_cast<int64_t>(feature_index_.size()) * target.hidden;
    fc_ = linear("fc.weight", hidden_, features);
    hidden_norm_ = norm("hidden_norm.weight", hidden_);
    layers_.clear();
    for (int64_t l = 0; l < layers_n_; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      Layer L;
      L.input_norm = norm(p + "input_layernorm.weight", hidden_);
      L.q_proj = linear(p + "self_attn.q_proj.weight", heads_ * head_dim_, hidden_);
      L.k_proj = linear(p + "self_attn.k_proj.weight", kv_heads_ * head_dim_, hidden_);
      L.v_proj = linear(p + "self_attn.v_proj.weight", kv_heads_ * head_dim_, hidden_);
      L.o_proj = linear(p + "self_attn.o_proj.weight", hidden_, heads_ * head_dim_);
      L.q_norm = norm(p + "self_attn.q_norm.weight", head_dim_);
      L.k_norm = norm(p + "self_attn.k_norm.weight", head_dim_);
      L.post_norm = norm(p + "post_attention_layernorm.weight", hidden_);
      L.gate_proj = linear(p + "mlp.gate_proj.weight", ffn_, hidden_);
      L.up_proj = linear(p + "mlp.up_proj.weight", ffn_, hidden_);
      L.down_proj = linear(p + "mlp.down_proj.weight", hidden_, ffn_);
      layers_.push_back(L);
    }
    final_norm_ = norm("norm.weight", hidden_);
  }

  std::vector<std::pair<std::string, at::Tensor>> parameters() override { return params_; }
  // The configured ids; by default every layer the data exports or, for an online
  // target, five layers spread over its depth as the DFlash recipe does: from layer 1 to
  // layer L - 3, evenly (fewer when the target is shallower).
  std::vector<int64_t> target_layers(const TargetModel& target) const override {
    if (!layer_ids_.empty()) return layer_ids_;
    if (!target.online) return target.exported_layers;
    const int64_t first = std::min<int64_t>(1, target.layers - 1), last = std::max<int64_t>(first, target.layers - 3);
    const int64_t n = std::min<int64_t>(5, last - first + 1);
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i)
      ids.push_back(n == 1 ? first : first + static_cast<int64_t>(std::llround(double(i * (last - first)) / double(n - 1))));
    return ids;
  }
  int64_t attention_layers() const override { return layers_n_; }
  int64_t positions() const override { return block_size_ - 1; }
  std::vector<std::string> scalar_names() const override { return {"tau_sim"}; }

  AttentionProblem attention_problem() const override {
    AttentionProblem p;
    p.device = device_;
    p.dtype = dtype_;
    p.batch = batch_;
    p.heads_q = heads_;
    p.heads_kv = kv_heads_;
    p.q_len = anchors_ * block_size_;
    p.kv_len = seq_len_ + anchors_ * block_size_;
    p.head_dim = head_dim_;
    p.needs_backward = true;
    p.mask = "dflash";
    return p;
  }

  StepResult step(const Batch& batch, AttentionContext& attention, at::Generator& rng, bool training) override {
    std::optional<at::NoGradGuard> no_grad;
    if (!training) no_grad.emplace();
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), N = anchors_, BS = block_size_;
    const int64_t L = N * BS;
    if (batch.hidden.dim() != 4 || batch.hidden.size(0) != B || batch.hidden.size(1) != S)
      throw std::invalid_argument("batch hidden states must be [B, S, E, H] = [" + std::to_string(B) + ", " +
                                  std::to_string(S) + ", E, H]");
    if (BS > S)
      throw std::invalid_argument("block_size " + std::to_string(BS) + " is larger than the batch's sequence length " +
                                  std::to_string(S));

    // --- anchors and labels (host side) -------------------------------------------------
    const at::Tensor tokens_cpu = batch.tokens.to(at::kCPU, at::kLong).contiguous();
    const at::Tensor mask_cpu = batch.loss_mask.defined() ? batch.loss_mask.to(at::kCPU, at::kByte).contiguous() : at::Tensor();
    const at::Tensor len_cpu = batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
    MaskInput input;
    input.batch = B;
    input.q_len = L;
    input.kv_len = S + L;
    input.context_len = S;
    input.block_size = BS;
    std::vector<int64_t> block_tokens(static_cast<size_t>(B * L), mask_token_), positions(static_cast<size_t>(B * L));
    std::vector<int64_t> labels(static_cast<size_t>(B * L));
    std::vector<double> weights(static_cast<size_t>(B * L));
    auto draw = [&](int64_t k) { return at::randint(k, {1}, rng, at::kLong).item<int64_t>(); };
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* tok = tokens_cpu.data_ptr<int64_t>() + b * S;
      const uint8_t* lm = mask_cpu.defined() ? mask_cpu.data_ptr<uint8_t>() + b * S : nullptr;
      const int64_t length = len_cpu.defined() ? std::min(len_cpu.data_ptr<int64_t>()[b], S) : S;
      dflash::Anchors a = dflash::draw_anchors(dflash::anchor_candidates(length, BS, lm), N, draw);
      dflash::BlockLabels bl = dflash::block_labels(tok, lm, length, a, BS, gamma_);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < BS; ++j) {
          const size_t slot = static_cast<size_t>(b * L + n * BS + j);
          positions[slot] = a.anchors[static_cast<size_t>(n)] + j;
          if (j == 0) block_tokens[slot] = tok[std::min(a.anchors[static_cast<size_t>(n)], S - 1)];
          labels[slot] = bl.labels[static_cast<size_t>(n * BS + j)];
          weights[slot] = bl.weights[static_cast<size_t>(n * BS + j)];
        }
      input.anchors.push_back(a.anchors);
      input.block_valid.push_back(a.valid);
    }
    attention.set_mask(input);

    const auto long_opts = at::TensorOptions().dtype(at::kLong);
    const at::Tensor block_tok = at::tensor(block_tokens, long_opts).view({B, L}).to(device_);
    const at::Tensor block_pos = at::tensor(positions, long_opts).view({B, L});
    const at::Tensor label_t = at::tensor(labels, long_opts).view({B, L}).to(device_);
    const at::Tensor weight_t = at::tensor(weights, at::TensorOptions().dtype(at::kDouble)).view({B, L});
    const at::Tensor context_pos = at::arange(S, long_opts).unsqueeze(0).expand({B, S});

    // --- context features ---------------------------------------------------------------
    const at::Tensor index = at::tensor(feature_index_, long_opts).to(batch.hidden.device());
    at::Tensor feats = batch.hidden.index_select(2, index).reshape({B, S, -1}).to(device_, dtype_);
    const at::Tensor context = rms_norm(at::linear(feats, fc_), hidden_norm_);

    const auto [cos_c, sin_c] = rope_tables(context_pos);
    const auto [cos_b, sin_b] = rope_tables(block_pos);
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));

    // --- decoder layers -------------------------------------------------------------------
    at::Tensor x = embedding_.index_select(0, block_tok.reshape({-1})).view({B, L, hidden_});
    for (int64_t l = 0; l < layers_n_; ++l) {
      const Layer& P = layers_[static_cast<size_t>(l)];
      const at::Tensor h = rms_norm(x, P.input_norm);
      at::Tensor q = heads_of(at::linear(h, P.q_proj), heads_);
      q = apply_rope(rms_norm(q, P.q_norm), cos_b, sin_b);
      const at::Tensor kb = apply_rope(rms_norm(heads_of(at::linear(h, P.k_proj), kv_heads_), P.k_norm), cos_b, sin_b);
      const at::Tensor kc =
          apply_rope(rms_norm(heads_of(at::linear(context, P.k_proj), kv_heads_), P.k_norm), cos_c, sin_c);
      const at::Tensor vb = heads_of(at::linear(h, P.v_proj), kv_heads_);
      const at::Tensor vc = heads_of(at::linear(context, P.v_proj), kv_heads_);
      const at::Tensor k = at::cat({kc, kb}, 2);  // [B, Hkv, S + L, D]: context first
      const at::Tensor v = at::cat({vc, vb}, 2);
      const at::Tensor a = attention.attention(l, q.contiguous(), k.contiguous(), v.contiguous(), scale);
      x = x + at::linear(a.transpose(1, 2).reshape({B, L, heads_ * head_dim_}), P.o_proj);
      const at::Tensor h2 = rms_norm(x, P.post_norm);
      x = x + at::linear(at::silu(at::linear(h2, P.gate_proj)) * at::linear(h2, P.up_proj), P.down_proj);
    }
    at::Tensor logits = at::linear(rms_norm(x, final_norm_), lm_head_);  // [B, L, V]
    const bool reduced = dtype_ == at::kHalf || dtype_ == at::kBFloat16;
    if (reduced) logits = logits.to(at::kFloat);

    // --- loss: sum_j w_j CE_j / sum_j w_j over counted positions --------------------------
    const at::Tensor counted = label_t.ge(0);
    const at::Tensor logp = at::log_softmax(logits, -1);
    const at::Tensor nll = -logp.gather(-1, label_t.clamp_min(0).unsqueeze(-1)).squeeze(-1);
    const double weight_sum = weight_t.sum().item<double>();
    const at::Tensor w = weight_t.to(device_, logits.scalar_type());
    StepResult result;
    result.loss = (nll * w).sum() / (weight_sum > 0 ? weight_sum : 1.0);

    // --- metrics: per position j, argmax == label over the counted slots (0 when a
    // position has none, e.g. every block of the batch is padding) ------------------------
    const at::Tensor pred = logits.detach().argmax(-1);
    const at::Tensor correct = (pred.eq(label_t) & counted).view({B, N, BS}).sum(at::IntArrayRef{0, 1}).to(at::kCPU, at::kLong);
    const at::Tensor count = counted.view({B, N, BS}).sum(at::IntArrayRef{0, 1}).to(at::kCPU, at::kLong);
    for (int64_t j = 1; j < BS; ++j) {
      const int64_t c = count[j].item<int64_t>();
      result.position_accuracy.push_back(c > 0 ? double(correct[j].item<int64_t>()) / double(c) : 0.0);
      result.tokens += c;
    }
    result.scalars.emplace_back("tau_sim", simulated_tau(result.position_accuracy));
    if (!training) {
      // Validation: the block proposals, so the engine can measure the exact greedy
      // acceptance length (leading matches with the target's tokens at anchor + j).
      result.predictions = pred.view({B, N, BS}).to(at::kCPU);
      result.labels = label_t.view({B, N, BS}).to(at::kCPU);
      std::vector<uint8_t> valid;
      for (const auto& v : input.block_valid) valid.insert(valid.end(), v.begin(), v.end());
      result.block_valid = at::tensor(at::ArrayRef<uint8_t>(valid), at::TensorOptions().dtype(at::kByte)).view({B, N}).to(at::kBool);
      std::vector<int64_t> anchor_list;
      for (const auto& a : input.anchors) anchor_list.insert(anchor_list.end(), a.begin(), a.end());
      result.anchors = at::tensor(anchor_list, long_opts).view({B, N});
    }
    return result;
  }

 private:
  void check_hidden(int64_t hidden) const {
    if (hidden % heads_ != 0)
      config_.fail(config_.given("hidden") ? "hidden" : "heads",
                   "hidden size " + std::to_string(hidden) + " is not divisible by heads = " + std::to_string(heads_) +
                       " (accepted: a number of heads that divides the hidden size)");
  }

  // RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * w, in fp32 for 16-bit types.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    const bool reduced = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    const at::Tensor xf = reduced ? x.to(at::kFloat) : x;
    const at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps_);
    return (reduced ? y.to(x.scalar_type()) : y) * w;
  }

  // [B, T, heads * D] -> [B, heads, T, D]
  at::Tensor heads_of(const at::Tensor& x, int64_t heads) const {
    return x.view({x.size(0), x.size(1), heads, head_dim_}).transpose(1, 2);
  }

  // cos/sin of RoPE angles pos * theta^(-2i/D), i < D/2, duplicated over both halves
  // (the rotate-half layout): [B, 1, T, D]. Angles in fp64 so positions stay exact.
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& pos) const {
    const auto dopts = at::TensorOptions().dtype(at::kDouble);
    const at::Tensor inv = at::pow(rope_theta_, -at::arange(0, head_dim_, 2, dopts) / double(head_dim_));
    const at::Tensor ang = pos.to(at::kDouble).unsqueeze(-1) * inv;  // [B, T, D/2]
    const at::Tensor full = at::cat({ang, ang}, -1).unsqueeze(1);     // [B, 1, T, D]
    return {full.cos().to(device_, dtype_), full.sin().to(device_, dtype_)};
  }

  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for halves x1, x2.
  static at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t half = x.size(-1) / 2;
    const at::Tensor rot = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
    return x * cos + rot * sin;
  }

  Config config_;
  int64_t layers_n_, hidden_, heads_, kv_heads_, head_dim_, ffn_, block_size_, mask_token_, anchors_;
  std::vector<int64_t> layer_ids_, feature_index_;
  double rope_theta_, eps_, gamma_, init_std_;
  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = c10::kFloat;
  int64_t batch_ = 1, seq_len_ = 0, vocab_ = 0;
  at::Tensor embedding_, lm_head_, fc_, hidden_norm_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(drafter, "dflash", "0.1.0",
                  "DFlash block-diffusion drafter: Qwen3 layers with target KV injection", flashdraft::DFlashDrafter)

// hf: a Hugging Face decoder checkpoint as the online target ([target] plugin = "hf").
//
// Reads config.json (hf_config.hpp) and the weights (model.safetensors, or the shards of
// model.safetensors.index.json) with the engine's own safetensors reader, straight to
// the run's device in the target's dtype, checking every tensor's shape against the
// config. Each step it runs the decoder over the batch's tokens, frozen, up to the
// deepest layer the drafter reads, and returns the hidden states after those layers:
//   x = embed_tokens[tokens]
//   per layer: h = RMSNorm(x); q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)
//              [Qwen3: q, k = RMSNorm per head]; q, k = RoPE(q, k) at positions 0..S-1
//              x = x + attention(q, k, v) Wo (+bo)          (through the engine, GQA)
//              x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
//              [Qwen3-MoE, Qwen2-MoE, Mixtral and GLM-4.5, sparse layers: x = x + sum over the token's k
//               experts e of p_e down_e(silu(gate_e(h)) * up_e(h)), h = RMSNorm(x), p = the router's top k;
//               Qwen2-MoE: plus sigmoid(h g) x its shared expert's MLP of h; GLM-4.5: a sigmoid router,
//               plus its shared experts' MLP of h; q, k rotated in their first rotary_dim dimensions only;
//               MiniMax-M2: GLM-4.5's kind of router without groups or shared experts, q and k normed over
//               all their heads at once;
//               gpt-oss: the router's top k logits softmaxed, each expert (W_gu h + b_gu) through the clamped
//               GLU (up + 1) gate sigmoid(alpha gate), then W_d . + b_d; every attention softmax also over a
//               learned sink logit per head; its norms' weights applied in float32;
//               Qwen3.5: its Gated DeltaNet layers mix tokens by the gated delta rule instead of attention
//               (gated_delta.hpp), its attention layers' output times sigmoid(h W_gate), every norm 1 + w;
//               Granite 4.0-H: its Mamba-2 layers mix tokens by the selective state space rule (mamba2.hpp)]
// exactly as transformers computes it (RMSNorm in fp32, weight applied in the model's
// dtype; RoPE tables in fp32). Layer id L is the output of decoder layer L, which is
// transformers' hidden_states[L + 1]; for the last layer that is after the model's final
// RMSNorm (transformers reports the normed state there), so it is here too. Attention is causal within each document of
// a row (packed rows: Batch::documents; padded rows: the tokens past a row's length are a document of their own, so
// they never change the real ones), and in a sliding layer within its last sliding_window positions.
#include "gated_delta.hpp"
#include "hf_config.hpp"
#include "mamba2.hpp"

#include <flashdraft/dtype.hpp>
#include <flashdraft/hidden_cache.hpp>
#include <flashdraft/layers.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/ops.hpp>
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>

namespace flashdraft {
namespace {

// A decoder layer's weights, the projections packed once at load: qkv = [q; k; v] (and its
// bias) and gate_up = [gate; up], one product each (the checkpoint's tensors are not kept; Phi-3's
// come packed so).
// A sparse (mixture of experts) layer has no gate_up / down_proj but the router [E, H] and every
// expert's projections stacked as transformers holds them: experts_gate_up [E, 2 I, H] (each
// expert's gate rows, then its up rows), experts_down [E, H, I]; GLM-4.5's also its router's
// correction bias [E] (float32); GLM-4.5's and Qwen2-MoE's shared expert's packed gate / up and
// down, Qwen2-MoE's its gate [1, H].
struct DecoderLayer {
  at::Tensor input_norm, qkv, qkv_bias, o_proj, o_bias, q_norm, k_norm, post_norm, gate_up, down_proj;
  int64_t kv_heads = 0;  // an attention layer's key / value heads (Gemma 4's full layers: their own count)
  // Gemma 4: its values' weightless norm (ones, float32), and the layer's output scale [1] (undefined elsewhere); its
  // experts block's router scales (router.scale [H], router.per_expert_scale [E]) and norms (the experts' input, the
  // MLP's output, the experts' output)
  at::Tensor v_norm, layer_scalar, router_scale, per_expert_scale, pre_ff_norm_2, post_ff_norm_1, post_ff_norm_2;
  // Gemma 4 E2B / E4B: its per-layer input's gate [ple, H], projection [H, ple] and norm [H]; a layer that attends
  // with an earlier layer's keys and values (num_kv_shared_layers) projects its queries alone (qkv: q's rows)
  at::Tensor ple_gate, ple_proj, ple_norm;
  bool queries_only = false;
  // Gemma 3: post_norm normalises the attention's output before its residual add; these the MLP's input and output
  at::Tensor pre_ff_norm, post_ff_norm;
  at::Tensor router, experts_gate_up, experts_down, router_bias, shared_gate_up, shared_down, shared_gate;
  // Nemotron 3 Super: the routed experts' rows into their latent width [latent, H] and their sum out of it [H, latent]
  at::Tensor latent_in, latent_out;
  // gpt-oss: its router's bias [E] (a logit bias, in the model's dtype), its experts' biases [E, 2 I]
  // (gate entries, then up, as experts_gate_up's rows) and [E, H], and its sinks [heads] (float32)
  at::Tensor router_logit_bias, experts_gate_up_bias, experts_down_bias, sinks;
  // routed experts kept in block-wise FP8 ([target] fp8 = "keep"; experts_gate_up / experts_down undefined): each
  // projection's values [E, rows, cols] (Float8_e4m3fn) and its scales [E, row blocks, column blocks] (float32)
  struct Fp8 {
    at::Tensor values, scales;
  } fp8_gate, fp8_up, fp8_down;
  // gpt-oss's experts kept in MXFP4 ([target] mxfp4 = "keep"; experts_gate_up / experts_down undefined):
  // blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32], gate rows first, dequantized in each forward
  at::Tensor gate_up_blocks, gate_up_scales, down_blocks, down_scales;
  // A recurrent layer's mixer (Qwen3.5's Gated DeltaNet, Granite 4.0-H's Mamba-2: o_proj its out_proj; no qkv), or
  // Qwen3.5's attention layer's output gate [heads D, H] (the second half of each head's q_proj rows)
  std::shared_ptr<const hf::Recurrent> mixer;
  at::Tensor attn_gate;
  // Apertus's xIELU: softplus(alpha_p), beta + softplus(alpha_n), beta, eps (each [1], the model's dtype)
  at::Tensor xielu_p, xielu_n, xielu_beta, xielu_eps;
  // DeepSeek-V3's latent attention's projections (q_a and its norm undefined where q comes from q_proj: then q_b)
  struct Latent {
    at::Tensor q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b;
  } mla;
  bool sparse() const { return router.defined(); }
};

class HfTarget final : public Target {
 public:
  static void declare(Schema& s) {
    s.string("path", "Hugging Face checkpoint folder (config.json and model.safetensors or its shards)");
    s.string("dtype", "compute dtype of the target (auto: bfloat16 on CUDA, float32 on CPU)")
        .def(std::string("auto"))
        .one_of({"auto", "float32", "bfloat16", "float16"});
    s.string("kernels",
             "the layers' norms, RoPE and SwiGLU: \"engine\" = the engine's fused CUDA kernels where they run (one "
             "pass each, transformers' roundings), \"aten\" = transformers' separate ATen ops (the reference; "
             "the CPU always runs these)")
        .def(std::string("engine"))
        .one_of({"engine", "aten"});
    s.string("mxfp4",
             "gpt-oss's MXFP4 experts (a checkpoint as published): \"dequantize\" = to the target's dtype at load "
             "(4x their size on the device: gpt-oss-20b's ~38 GiB in bf16), \"keep\" = kept in MXFP4 and "
             "dequantized a layer at a time in each forward (gpt-oss-120b's ~61 GiB instead of ~220; one layer's "
             "bf16 experts at a time, ~6.4 GiB, and their dequantization's time each forward)")
        .def(std::string("dequantize"))
        .one_of({"dequantize", "keep"});
    s.string("fp8",
             "a block-wise FP8 checkpoint's routed experts: \"dequantize\" = to the target's dtype at load (2x "
             "their size on the device), \"keep\" = kept in FP8 with their scales and dequantized a layer at a time "
             "in each forward (the same values; e.g. GLM-4.5-Air-FP8's ~110 GB instead of ~210 on one H200); the "
             "other weights are dequantized at load either way")
        .def(std::string("dequantize"))
        .one_of({"dequantize", "keep"});
    s.string("hidden_cache",
             "a folder of the target's hidden states written by scripts/dump-hidden-states (a target too large to "
             "run beside the drafter: its states computed once, elsewhere): each document's states are read there "
             "instead of running the decoder, whose layers are not loaded; \"\" = run the target")
        .def(std::string(""));
  }

  explicit HfTarget(const Config& c)
      : config_(c),
        path_(c.string("path")),
        dtype_name_(c.string("dtype")),
        fused_(c.string("kernels") == "engine"),
        keep_mxfp4_(c.string("mxfp4") == "keep"),
        keep_fp8_(c.string("fp8") == "keep"),
        cache_path_(c.string("hidden_cache")) {}

  void open(const RunContext& ctx) override {
    try {
      cfg_ = hf::read_config(path_);
      checkpoint_ = std::make_unique<safetensors::Checkpoint>(path_);
    } catch (const std::exception& e) {
      config_.fail("path", e.what());
    }
    // A language model's tensors where its checkpoint has them: under model., model.language_model. (a multimodal
    // checkpoint; a Qwen3.5 language model saved so, as transformers also reads it) or language_model.model. with
    // language_model.lm_head. (a multimodal checkpoint in its original layout, Mistral 3's).
    if (cfg_.nemotron_h()) cfg_.prefix = "backbone.";  // (its embeddings and final norm_f there too)
    for (const auto& [prefix, head] : {std::pair<const char*, const char*>{"model.", "lm_head.weight"},
                                       {"model.language_model.", "lm_head.weight"},
                                       {"language_model.model.", "language_model.lm_head.weight"}})
      if (!checkpoint_->find(cfg_.prefix + embed_name()) && checkpoint_->find(std::string(prefix) + embed_name())) {
        cfg_.prefix = prefix;
        cfg_.lm_head = head;
      }
    if (keep_mxfp4_ && cfg_.quant_method != "mxfp4")
      config_.fail("mxfp4", "\"keep\" keeps a checkpoint's MXFP4 experts, but " + cfg_.path + " (" + cfg_.architecture +
                                ") has none (no quantization_config with quant_method \"mxfp4\"); accepted here: "
                                "\"dequantize\" (the default)");
    if (keep_fp8_ && (cfg_.quant_method != "fp8" || cfg_.experts == 0))
      config_.fail(
          "fp8", "\"keep\" keeps a block-wise FP8 checkpoint's routed experts, but " + cfg_.path + " (" +
                     cfg_.architecture + ") has " +
                     (cfg_.quant_method != "fp8" ? "no quantization_config with quant_method \"fp8\"" : "no experts") +
                     "; accepted here: \"dequantize\" (the default)");
    device_ = ctx.device;
    dtype_ = dtype_named(dtype_name_, device_);
    say_ = ctx.say;
    check_shapes();
    embed_ = load(cfg_.prefix + embed_name());
    tied_ = cfg_.tie_embeddings == 1 || (cfg_.tie_embeddings == -1 && !checkpoint_->find(cfg_.lm_head));
    lm_head_ = tied_ ? embed_ : load(cfg_.lm_head);
    final_norm_ = load_norm(cfg_.prefix + final_norm_name());
    // (the rotated part of each head: all of it but for a partial_rotary_factor, GLM-4.5's and Phi-3's)
    const at::Tensor exponents = at::arange(0, cfg_.rotary_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
    const at::Tensor pos_freqs = at::pow(at::tensor(cfg_.rope_theta, at::kFloat), exponents / double(cfg_.rotary_dim));
    // once, on the device: a copy from pageable memory at every forward waits for the device's queue
    if (cfg_.rope.type == "longrope") {
      const auto factors = [](const std::vector<double>& f) { return at::tensor(f, at::kDouble).to(at::kFloat); };
      inv_freq_ = (1.0 / (factors(cfg_.rope.short_factor) * pos_freqs)).to(device_);
      long_inv_freq_ = (1.0 / (factors(cfg_.rope.long_factor) * pos_freqs)).to(device_);
    } else {
      inv_freq_ = rope_inv_freq(cfg_.rope_theta, cfg_.rotary_dim, cfg_.rope).to(device_);
    }
    if (cfg_.rope_local_theta > 0)  // (Gemma 3's sliding layers: their own base, unscaled)
      local_inv_freq_ =
          (1.0 / at::pow(at::tensor(cfg_.rope_local_theta, at::kFloat), exponents / double(cfg_.rotary_dim)))
              .to(device_);
    if (cfg_.gemma4()) inv_freq_ = proportional_inv_freq().to(device_);
    if (!cache_path_.empty()) {
      try {
        cache_ = std::make_unique<HiddenCache>(cache_path_, cfg_.hidden, cfg_.layers);
      } catch (const std::exception& e) {
        config_.fail("hidden_cache", e.what());
      }
      if (say_) say_("target: hidden states read from " + cache_->describe() + "; the decoder does not run");
    }
    if (cfg_.ple > 0) {
      ple_embed_ = load(cfg_.prefix + "embed_tokens_per_layer.weight");
      ple_model_proj_ = load(cfg_.prefix + "per_layer_model_projection.weight");
      ple_proj_norm_ = load_norm(cfg_.prefix + "per_layer_projection_norm.weight");
    }
  }

  // Gemma 4's per-layer inputs [n, layers, ple] of token ids [n] whose scaled embedding rows are x [n, H]
  // (transformers' get_per_layer_inputs and project_per_layer_inputs; undefined without them).
  at::Tensor per_layer_inputs(const at::Tensor& ids, const at::Tensor& x) const {
    if (cfg_.ple == 0) return {};
    const int64_t n = x.size(0), P = cfg_.ple;
    const at::Tensor rows = ple_embed_.index_select(0, ids.reshape({-1}));
    const at::Tensor own = (rows * at::scalar_tensor(std::sqrt(double(P)), rows.options())).view({n, cfg_.layers, P});
    const at::Tensor projected =
        (at::linear(x, ple_model_proj_) * std::pow(double(cfg_.hidden), -0.5)).view({n, cfg_.layers, P});
    return (rms_norm(projected, ple_proj_norm_) + own) * std::pow(2.0, -0.5);
  }
  // Layer l's end in Gemma 4: the residual sum x plus its per-layer input's part (pli [..., ple], the layer's column
  // of per_layer_inputs), times the layer's scalar.
  at::Tensor layer_end(const DecoderLayer& L, const at::Tensor& x, const at::Tensor& pli) const {
    if (!L.layer_scalar.defined()) return x;
    if (!L.ple_gate.defined()) return x * L.layer_scalar;
    const at::Tensor g = at::gelu(at::linear(x, L.ple_gate), "tanh") * pli;
    return (x + rms_norm(at::linear(g, L.ple_proj), L.ple_norm)) * L.layer_scalar;
  }
  // Layer l's column of per-layer inputs pli [n, layers, ple] shaped as rows [..., H] (undefined without them).
  at::Tensor layer_input(const at::Tensor& pli, int64_t l, const at::Tensor& rows) const {
    if (!pli.defined()) return {};
    std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end() - 1);
    shape.push_back(cfg_.ple);
    return pli.select(1, l).reshape(shape);
  }

  // Gemma 4's full layers' proportional RoPE (transformers' _compute_proportional_rope_parameters) over their width
  // D (the last layer's: always a full one): 1 / theta^(2i / D) for the first floor(proportion x D / 2) frequencies, 0
  // for the rest, all divided by the factor.
  at::Tensor proportional_inv_freq() const {
    const int64_t D = cfg_.head_dim_of(cfg_.layers - 1);
    const int64_t turning = static_cast<int64_t>(std::floor(cfg_.rope_proportion * double(D) / 2));
    const at::Tensor exponents = at::arange(0, 2 * turning, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
    const at::Tensor turns = 1.0 / at::pow(at::tensor(cfg_.rope_theta, at::kFloat), exponents / double(D));
    return at::cat({turns, at::zeros({D / 2 - turning}, at::kFloat)}) / cfg_.rope_factor;
  }

  TargetModel model() const override {
    TargetModel t = TargetModel::online_model(
        embed_, lm_head_, cfg_.layers,
        cfg_.architecture + " " + std::filesystem::absolute(path_).string() + " (" + std::to_string(cfg_.layers) +
            " layers, hidden " + std::to_string(cfg_.hidden) + ", vocab " + std::to_string(cfg_.vocab) + ", " +
            experts_str() + recurrent_str() + c10::toString(dtype_) + (tied_ ? ", tied embeddings" : "") +
            "; norms, RoPE, SwiGLU: " + frozen::kernels_on(device_, fused_) + ")");
    t.logit_scale = cfg_.logit_scale;
    t.logit_softcap = cfg_.logit_softcap;
    return t;
  }

  AttentionProblem attention_problem(int64_t batch, int64_t seq_len) const override {
    return layer_problem(0, batch, seq_len);
  }
  // One problem per attention layer where their heads differ (Gemma 4's full layers), in the order a forward calls
  // them.
  std::vector<AttentionProblem> attention_problems(int64_t batch, int64_t seq_len) const override {
    if (cfg_.layer_head_dim.empty()) return {attention_problem(batch, seq_len)};
    std::vector<AttentionProblem> out;
    for (int64_t l = 0; l < cfg_.layers; ++l)
      if (!cfg_.linear_attention(l) && !cfg_.mlp_block(l)) out.push_back(layer_problem(l, batch, seq_len));
    return out;
  }
  AttentionProblem layer_problem(int64_t l, int64_t batch, int64_t seq_len) const {
    return AttentionProblem::of(device_, dtype_, batch, cfg_.heads, cfg_.kv_heads_of(l), seq_len, seq_len,
                                cfg_.head_dim_of(l), /*needs_backward=*/false);
  }

  int64_t prepare(const std::vector<int64_t>& layers) override {
    int64_t deepest = -1;
    for (int64_t l : layers) {
      if (l < 0 || l >= cfg_.layers)
        throw std::invalid_argument("hf target: layer " + std::to_string(l) + " requested, the model has layers 0.." +
                                    std::to_string(cfg_.layers - 1));
      deepest = std::max(deepest, l);
    }
    if (cache_) return prepare_cached(layers);
    for (int64_t l = static_cast<int64_t>(layers_.size()); l <= deepest; ++l) layers_.push_back(load_layer(l));
    if (say_)
      say_("target: loaded " + std::to_string(layers_.size()) + " of " + std::to_string(cfg_.layers) +
           " decoder layers (the deepest the drafter reads is " + std::to_string(deepest) + ")");
    int64_t calls = 0;  // an attention call per layer up to the deepest, but for the recurrent and MLP-only layers
    for (int64_t l = 0; l <= deepest; ++l) calls += cfg_.linear_attention(l) || cfg_.mlp_block(l) ? 0 : 1;
    return calls;
  }

  // With a hidden-state cache: `layers` must be among its layers; no decoder layer is loaded, no attention runs.
  int64_t prepare_cached(const std::vector<int64_t>& layers) {
    for (int64_t l : layers) {
      if (cache_->column(l) < 0)
        config_.fail("hidden_cache", cache_->describe() + " holds no states of layer " + std::to_string(l) +
                                         ", which the run reads (the drafter's target layers, and the last layer " +
                                         "where its labels are the target's); dump the cache with --layers " +
                                         "listing every one of them");
    }
    return 0;
  }
  // The cached states of every document of the batch, [B, S, E, H] (zeros on padding).
  at::Tensor cached_states(const Batch& batch, const std::vector<int64_t>& layers) {
    std::vector<int64_t> columns;
    for (int64_t l : layers) {
      columns.push_back(cache_->column(l));
      if (columns.back() < 0) throw std::logic_error("hf target: layer " + std::to_string(l) + " was not prepared");
    }
    return cache_->batch(batch, columns, device_, dtype_);
  }

  at::Tensor hidden_states(const Batch& batch, const std::vector<int64_t>& layers,
                           AttentionContext& attention) override {
    return cache_ ? cached_states(batch, layers) : run_decoder(batch, layers, attention);
  }
  // The training forward: the decoder up to the deepest of `layers`, its states straight into the result.
  at::Tensor run_decoder(const Batch& batch, const std::vector<int64_t>& layers, AttentionContext& attention) {
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
    const int64_t deepest = layers.empty() ? -1 : *std::max_element(layers.begin(), layers.end());
    if (deepest >= static_cast<int64_t>(layers_.size()))
      throw std::logic_error("hf target: layer " + std::to_string(deepest) + " was not prepared");
    const std::vector<std::vector<int64_t>> rows = row_documents(batch);
    warn_past_max_position(rows);
    const MaskInput docs = document_mask(rows, S);
    MaskInput current = layer_mask(docs, 0);  // (a sliding or chunked layer's; set again where a layer's differs)
    attention.set_mask(current);
    const at::Tensor tokens = to_device(batch.tokens.to(at::kLong));
    at::Tensor x = embed(tokens).view({B, S, cfg_.hidden});
    const at::Tensor pli = per_layer_inputs(tokens, x.view({B * S, cfg_.hidden}));
    std::vector<std::pair<at::Tensor, at::Tensor>> kv(static_cast<size_t>(deepest + 1));  // (kept for sharing)
    const ForwardRope rope = forward_rope(batch, docs, B, S);
    // The states go straight into the result [B, S, E, H] as each layer makes them: the input
    // norm of layer l + 1 writes the state after layer l into its slot (the residual stream then
    // reads it there), no copy.
    at::Tensor out = at::empty({B, S, static_cast<int64_t>(layers.size()), cfg_.hidden}, x.options());
    auto slot_of = [&](int64_t l) {
      for (size_t i = 0; i < layers.size(); ++i)
        if (layers[i] == l) return out.select(2, static_cast<int64_t>(i));
      return at::Tensor();
    };
    auto record = [&](int64_t l, const at::Tensor& state) {
      const at::Tensor s = l == cfg_.layers - 1 ? rms_norm(state, final_norm_) : state;
      for (size_t i = 0; i < layers.size(); ++i) {
        if (layers[i] != l) continue;
        at::Tensor dst = out.select(2, static_cast<int64_t>(i));
        if (dst.data_ptr() != s.data_ptr() || dst.strides() != s.strides()) dst.copy_(s);  // else written there
      }
    };
    // The residual stream is x + pending. On the engine's path each residual add goes into the
    // matrix product before it (add_linear_: x updated in place, the product's epilogue adding it)
    // while x is a buffer of the forward's own; where x is a recorded state, or the layer's state is
    // to be recorded, the add is left pending for the norm after it (add_rms_norm: one pass, which
    // writes the sum into the state's slot). Off the engine's path every add is pending, as
    // transformers rounds it.
    at::Tensor pending;
    const double scale = softmax_scale();
    int64_t call = 0;  // the forward's attention calls so far (Qwen3.5's Gated DeltaNet layers make none)
    for (int64_t l = 0; l <= deepest; ++l) {
      const DecoderLayer& L = layers_[static_cast<size_t>(l)];
      // (l - 1 < deepest <= the last layer: never the final-norm case)
      const at::Tensor into = l > 0 && pending.defined() ? slot_of(l - 1) : at::Tensor();
      const auto [stream, h] =
          L.input_norm.defined() ? add_norm(x, pending, L.input_norm, into) : add_pending(x, pending, into);
      if (l > 0) record(l - 1, stream);
      at::Tensor a;
      if (L.mixer) {
        a = L.mixer->mix(h, rows);
      } else if (!cfg_.mlp_block(l)) {
        const auto& [cos, sin] = cfg_.no_rope(l) ? rope.none : cfg_.local_rope(l) ? rope.local : rope.global;
        QKV p = project(L, h, cos, sin, layer_query_scale(l, rope.q_scale));
        if (!cfg_.kv_source.empty()) {  // (Gemma 4: the last layers attend with an earlier layer's keys and values)
          if (L.queries_only) std::tie(p.k, p.v) = kv[static_cast<size_t>(cfg_.kv_source[static_cast<size_t>(l)])];
          kv[static_cast<size_t>(l)] = {p.k, p.v};
        }
        set_layer_mask(attention, docs, l, current);
        a = attention_out(L, attend(attention, call++, L, p.q, p.k, p.v, scale), h);
      }
      // (Gemma 3, OLMo: the MLP's normed output pending; Cohere: its MLP's; Nemotron-H: its one block's output)
      if (cfg_.sandwich_norms || cfg_.parallel || cfg_.single_blocks()) {
        std::tie(x, pending) = cfg_.single_blocks() ? std::make_pair(stream, block_output(L, a, h))
                               : cfg_.parallel      ? parallel_rest(L, stream, a, h)
                                                    : sandwich_rest(L, stream, a);
        if (L.layer_scalar.defined()) x = layer_end(L, x + pending, layer_input(pli, l, x)), pending = at::Tensor();
        continue;
      }
      at::Tensor x1, h2;
      // stream is the forward's own (the embedding's rows, or a sum made here) unless it went into a slot
      if (!into.defined() && !L.o_bias.defined() && frozen::add_linear_(stream, a, L.o_proj, fused_)) {
        x1 = stream;
        h2 = frozen::add_rms_norm(x1, at::Tensor(), L.post_norm, cfg_.rms_eps, fused_).second;
      } else {
        std::tie(x1, h2) =
            frozen::add_rms_norm(stream, at::linear(a, L.o_proj, L.o_bias), L.post_norm, cfg_.rms_eps, fused_);
      }
      if (L.sparse()) {
        pending = experts(L, h2);
      } else {
        const at::Tensor g = mlp_act(L, h2);
        if (!slot_of(l).defined() && frozen::add_linear_(x1, g, L.down_proj, fused_))
          pending = at::Tensor();
        else
          pending = at::linear(g, L.down_proj);
      }
      x = x1;
    }
    at::Tensor last = deepest == cfg_.layers - 1 ? at::Tensor() : slot_of(deepest);
    if (!pending.defined())
      last = x;
    else if (last.defined())
      at::add_out(last, x, pending);  // the last state straight into its slot too
    else
      last = x + pending;
    record(deepest, last);
    return out;
  }

  // A training forward's RoPE tables (the full layers', the sliding layers' own, the NoPE layers') and its per-position
  // query scale (Ministral 3's, Llama 4's; undefined for the others).
  struct ForwardRope {
    std::pair<at::Tensor, at::Tensor> global, local, none;
    at::Tensor q_scale;
  };
  ForwardRope forward_rope(const Batch& batch, const MaskInput& docs, int64_t B, int64_t S) {
    ForwardRope r;
    r.global = forward_tables(batch, docs, B, S);
    r.local = cfg_.rope_local_theta > 0 ? forward_tables(batch, docs, B, S, /*local=*/true) : r.global;
    r.none = cfg_.nope.empty() ? r.global : unrotated(r.global);
    if (cfg_.query_scale_beta != 0)
      r.q_scale = batch.documents.empty()
                      ? query_scale(at::arange(S, at::TensorOptions().dtype(at::kLong).device(device_)))
                      : query_scale(document_positions(docs, B, S));
    return r;
  }

  // Layer l's mask in a training forward: docs (causal within each document) with the layer's window, or on Llama 4's
  // chunked layers each document cut into chunks of attention_chunk_size positions from its start.
  MaskInput layer_mask(const MaskInput& docs, int64_t l) const {
    MaskInput m = docs;
    m.window = cfg_.window(l);
    if (!cfg_.chunked_layer(l)) return m;
    for (std::vector<int64_t>& row : m.doc_lengths) {
      std::vector<int64_t> cut;
      for (int64_t d : row)
        for (int64_t from = 0; from < d; from += cfg_.chunk) cut.push_back(std::min(cfg_.chunk, d - from));
      row = cut;
    }
    return m;
  }
  // Sets layer l's mask on `attention` where it differs from `current`, the last one set.
  void set_layer_mask(AttentionContext& attention, const MaskInput& docs, int64_t l, MaskInput& current) const {
    if (current.window == cfg_.window(l) && cfg_.chunk == 0) return;
    MaskInput next = layer_mask(docs, l);
    if (next.window == current.window && next.doc_lengths == current.doc_lengths) return;
    current = std::move(next);
    attention.set_mask(current);
  }
  // Served decoding and target verification attend without chunks: a forward reaching past Llama 4's
  // attention_chunk_size (`positions` positions) is refused.
  void check_unchunked(int64_t positions, const std::string& what) const {
    if (cfg_.chunk == 0 || positions <= cfg_.chunk) return;
    for (int64_t l = 0; l < cfg_.layers; ++l)
      if (cfg_.chunked_layer(l))
        throw std::invalid_argument("hf target: " + what + " reaches position " + std::to_string(positions - 1) +
                                    ", past " + cfg_.architecture + "'s attention_chunk_size " +
                                    std::to_string(cfg_.chunk) + " (" + cfg_.path +
                                    "): its chunked attention runs in training forwards only; "
                                    "served decoding and target verification take sequences of at most " +
                                    std::to_string(cfg_.chunk) + " positions");
  }

  // The RoPE tables of a training forward: rows of one conversation, the tables of positions 0..S-1 (made once per
  // length); packed rows, positions counted from each document's start, as the conversation alone (longrope: the
  // factors of the batch's longest document, as transformers picks them per forward).
  // local: Gemma 3's sliding layers' tables.
  std::pair<at::Tensor, at::Tensor> forward_tables(const Batch& batch, const MaskInput& docs, int64_t B, int64_t S,
                                                   bool local = false) {
    if (!batch.documents.empty()) return rope_tables(document_positions(docs, B, S), /*whole_batch=*/true, local);
    at::Tensor& cos = local ? local_cos_ : plain_cos_;
    at::Tensor& sin = local ? local_sin_ : plain_sin_;
    if (!cos.defined() || cos.size(0) != S) {
      const at::Tensor pos = at::arange(S, at::TensorOptions().dtype(at::kFloat).device(device_));
      const at::Tensor freqs = pos.unsqueeze(1) * (local ? local_inv_freq_ : inv_freq_for(S)).unsqueeze(0);  // [S, D/2]
      std::tie(cos, sin) = cos_sin(at::cat({freqs, freqs}, -1), local);
    }
    return {cos, sin};
  }

  // Serving (decoding.hpp): a decoder with a key/value cache of `capacity` positions per row
  // and layer; every decoder layer is loaded and run.
  bool decodes() const override { return !cache_; }  // (with a hidden-state cache no decoder layer is loaded)
  std::unique_ptr<TargetDecoder> decoder(int64_t batch, int64_t capacity, const std::vector<int64_t>& layers,
                                         AttentionContext& attention) override {
    for (int64_t l : layers)
      if (l < 0 || l >= cfg_.layers)
        throw std::invalid_argument("hf target: layer " + std::to_string(l) + " requested, the model has layers 0.." +
                                    std::to_string(cfg_.layers - 1));
    load_every_layer();
    return std::make_unique<Decoder>(*this, batch, capacity, layers, attention);
  }

  AttentionProblem decoder_problem(int64_t batch, int64_t capacity, int64_t q_len) const override {
    AttentionProblem p = attention_problem(batch, capacity);
    p.q_len = q_len;
    return p;
  }

  std::vector<int64_t> stop_tokens() const override { return cfg_.eos; }
  bool reads_states() const override { return cache_ != nullptr; }
  std::string missing_states(const Batch& batch) override { return cache_ ? cache_->missing(batch) : std::string(); }

  // Target verification (model.hpp): every decoder layer runs over the context (causal within
  // each document) and over all blocks at once; block n's queries see the context before its
  // anchor (same document) and its own block causally, so one forward gives the greedy choice
  // after every prefix of every block. Attention here is computed densely in this plugin
  // (validation only, N * BS queries), not through the engine's dispatcher. A Gated DeltaNet layer (Qwen3.5) runs
  // each block from its state after the block's context (gated_delta_verify).
  at::Tensor verify(const Batch& batch, const at::Tensor& anchors, const at::Tensor& blocks) override {
    if (cache_) return {};  // (with a hidden-state cache the decoder is not loaded: tau_anchor on the data's tokens)
    at::NoGradGuard frozen;
    load_every_layer();
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), N = blocks.size(1), BS = blocks.size(2);
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
    const at::Tensor anchor = anchors.to(device_, at::kLong);
    const at::Tensor block_tokens = blocks.to(device_, at::kLong).reshape({B, N * BS});
    const at::Tensor context_tokens = batch.tokens.to(device_, at::kLong);
    at::Tensor xc = embed(context_tokens).view({B, S, cfg_.hidden});
    at::Tensor xb = embed(block_tokens).view({B, N * BS, cfg_.hidden});
    // (Gemma 4: the per-layer inputs of the context and of the blocks; its shared layers' sources' keys and values)
    const at::Tensor pli_c = per_layer_inputs(context_tokens, xc.view({B * S, cfg_.hidden}));
    const at::Tensor pli_b = per_layer_inputs(block_tokens, xb.view({B * N * BS, cfg_.hidden}));
    std::vector<DenseOut> kv_c(layers_.size()), kv_b(layers_.size());
    const std::vector<std::vector<int64_t>> rows = row_documents(batch);
    const at::Tensor context_pos = document_positions(document_mask(rows, S), B, S);  // [B, S]
    const bool two = cfg_.rope_local_theta > 0;  // (Gemma 3: the sliding layers' own tables too)
    const auto tables_c = rope_tables(context_pos), local_c = two ? rope_tables(context_pos, false, true) : tables_c;
    const at::Tensor block_pos =
        (context_pos.gather(1, anchor).unsqueeze(-1) + at::arange(BS, long_opts)).view({B, N * BS});
    if (cfg_.chunk > 0) check_unchunked(std::max(S, block_pos.max().item<int64_t>() + 1), "target verification");
    const at::Tensor q_scale_c = query_scale(context_pos), q_scale_b = query_scale(block_pos);
    const auto tables_b = rope_tables(block_pos), local_b = two ? rope_tables(block_pos, false, true) : tables_b;
    const auto none_c = cfg_.nope.empty() ? tables_c : unrotated(tables_c);
    const auto none_b = cfg_.nope.empty() ? tables_b : unrotated(tables_b);
    const auto full = verify_masks(batch, anchor, S, BS, 0);
    const auto sliding = cfg_.sliding_window > 0 ? verify_masks(batch, anchor, S, BS, cfg_.sliding_window) : full;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const DecoderLayer& L = layers_[l];
      if (cfg_.mlp_block(static_cast<int64_t>(l))) {  // (Nemotron-H: an MLP block alone)
        xc = finish_layer(L, xc, at::Tensor(), rms_norm(xc, L.input_norm));
        xb = finish_layer(L, xb, at::Tensor(), rms_norm(xb, L.input_norm));
        continue;
      }
      if (L.mixer) {  // (a recurrent layer: each block from the state at its anchor)
        const at::Tensor hc = rms_norm(xc, L.input_norm), hb = rms_norm(xb, L.input_norm);
        const auto [oc, ob] = L.mixer->verify(hc, rows, anchors, hb, BS);
        xc = finish_layer(L, xc, oc, hc);
        xb = finish_layer(L, xb, ob, hb);
        continue;
      }
      const auto& [mask_c, mask_b] = cfg_.window(static_cast<int64_t>(l)) > 0 ? sliding : full;
      const bool loc = cfg_.local_rope(static_cast<int64_t>(l)), nope = cfg_.no_rope(static_cast<int64_t>(l));
      const auto& [cos_c, sin_c] = nope ? none_c : loc ? local_c : tables_c;
      const auto& [cos_b, sin_b] = nope ? none_b : loc ? local_b : tables_b;
      const int64_t li = static_cast<int64_t>(l);
      const size_t src = cfg_.shares_kv(li) ? static_cast<size_t>(cfg_.kv_source[l]) : l;
      const DenseOut context = dense_layer(L, xc, cos_c, sin_c, layer_query_scale(li, q_scale_c), {}, {}, mask_c,
                                           layer_input(pli_c, li, xc), kv_c[src].k, kv_c[src].v);
      const DenseOut block = dense_layer(L, xb, cos_b, sin_b, layer_query_scale(li, q_scale_b), context.k, context.v,
                                         mask_b, layer_input(pli_b, li, xb), kv_b[src].k, kv_b[src].v);
      if (!cfg_.kv_source.empty()) kv_c[l] = context, kv_b[l] = block;
      xb = block.x;
      xc = context.x;
    }
    const at::Tensor greedy =
        served_logits(at::linear(rms_norm(xb, final_norm_), lm_head_), cfg_.logit_scale, cfg_.logit_softcap)
            .argmax(-1)
            .view({B, N, BS});
    at::Tensor out = at::full({B, N, BS}, -1, at::TensorOptions().dtype(at::kLong));
    out.narrow(2, 1, BS - 1).copy_(greedy.narrow(2, 0, BS - 1).to(at::kCPU));
    return out;
  }

 private:
  // The decoder of served validation: per layer, keys and values [B, kv_heads, capacity, D]
  // indexed by position. A call writes its positions' keys/values first and then attends
  // causally (key position <= query position, the causal generator with q_offsets), so a
  // row never reads a position it has not written in order.
  class Decoder final : public TargetDecoder {
   public:
    Decoder(const HfTarget& t, int64_t batch, int64_t capacity, std::vector<int64_t> layers,
            AttentionContext& attention)
        : t_(t), batch_(batch), capacity_(capacity), layers_(std::move(layers)), attention_(attention) {
      const auto opts = at::TensorOptions().dtype(t.dtype_).device(t.device_);
      for (size_t l = 0; l < t.layers_.size(); ++l) {
        // an attention layer keeps keys and values, a recurrent one a state per row, an MLP block (Nemotron-H's)
        // nothing
        // (Gemma 4's shared layers read their source's)
        const hf::Recurrent* mixer = t.layers_[l].mixer.get();
        const bool attends = !mixer && !t.cfg_.mlp_block(static_cast<int64_t>(l)) && !t.layers_[l].queries_only;
        const int64_t li = static_cast<int64_t>(l);
        const auto cache = [&] {
          return at::zeros(
              {batch, t.layers_[l].kv_heads, capacity, t.cfg_.mla() ? t.cfg_.head_dim : t.cfg_.head_dim_of(li)}, opts);
        };
        k_.push_back(attends ? cache() : at::Tensor());
        v_.push_back(attends ? cache() : at::Tensor());
        recurrent_.push_back(mixer ? std::make_unique<hf::RecurrentCache>(*mixer, batch, t.dtype_, t.device_)
                                   : nullptr);
      }
    }

    Output forward(const at::Tensor& tokens, const std::vector<int64_t>& start) override {
      return forward(tokens, start, std::vector<int64_t>(start.size(), tokens.size(1)));
    }

    Output forward(const at::Tensor& tokens, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& real) override {
      at::NoGradGuard frozen;
      const int64_t B = tokens.size(0), T = tokens.size(1), H = t_.cfg_.hidden;
      if (B != batch_ || static_cast<int64_t>(start.size()) != B)
        throw std::invalid_argument("hf target decoder: " + std::to_string(B) + " rows of tokens and " +
                                    std::to_string(start.size()) + " start positions for a decoder of " +
                                    std::to_string(batch_) + " rows");
      for (int64_t b = 0; b < B; ++b)
        if (start[static_cast<size_t>(b)] < 0 || start[static_cast<size_t>(b)] + T > capacity_)
          throw std::invalid_argument("hf target decoder: row " + std::to_string(b) + " runs positions " +
                                      std::to_string(start[static_cast<size_t>(b)]) + ".." +
                                      std::to_string(start[static_cast<size_t>(b)] + T - 1) +
                                      ", outside its cache of " + std::to_string(capacity_) + " positions");
      t_.check_unchunked(*std::max_element(start.begin(), start.end()) + T, "served decoding");
      const auto long_opts = at::TensorOptions().dtype(at::kLong).device(t_.device_);
      const at::Tensor first = at::tensor(start, at::TensorOptions().dtype(at::kLong)).to(t_.device_);
      const at::Tensor positions = first.unsqueeze(1) + at::arange(T, long_opts);  // [B, T]
      MaskInput mask;
      mask.batch = B;
      mask.q_len = T;
      mask.kv_len = capacity_;
      mask.q_offsets = start;
      mask.window = t_.cfg_.window(0);
      attention_.set_mask(mask);
      const auto global = t_.rope_tables(positions);
      const auto local = t_.cfg_.rope_local_theta > 0 ? t_.rope_tables(positions, false, true) : global;
      const auto none = t_.cfg_.nope.empty() ? global : unrotated(global);
      const at::Tensor q_scale = t_.query_scale(positions);
      const at::Tensor ids = tokens.to(t_.device_, at::kLong);
      at::Tensor x = t_.embed(ids).view({B, T, H});
      const at::Tensor pli = t_.per_layer_inputs(ids, x.view({B * T, H}));
      std::vector<at::Tensor> features(layers_.size());
      const double scale = t_.softmax_scale();
      int64_t call = 0;  // the forward's attention calls so far
      for (size_t l = 0; l < t_.layers_.size(); ++l) {
        const DecoderLayer& L = t_.layers_[l];
        const at::Tensor h = t_.rms_norm(x, L.input_norm);
        if (t_.cfg_.mlp_block(static_cast<int64_t>(l))) {  // (Nemotron-H: an MLP block alone)
          x = t_.finish_layer(L, x, at::Tensor(), h);
        } else if (recurrent_[l]) {
          x = t_.finish_layer(L, x, recurrent_[l]->forward(h, start, real), h);
        } else {
          const int64_t li = static_cast<int64_t>(l);
          const auto& [cos, sin] = t_.cfg_.no_rope(li) ? none : t_.cfg_.local_rope(li) ? local : global;
          const QKV p = t_.project(L, h, cos, sin, t_.layer_query_scale(li, q_scale));
          const size_t own = L.queries_only ? static_cast<size_t>(t_.cfg_.kv_source[l]) : l;  // (Gemma 4's sharing)
          if (!L.queries_only) {
            const at::Tensor index = positions.view({B, 1, T, 1}).expand_as(p.k);
            k_[l].scatter_(2, index, p.k);
            v_[l].scatter_(2, index, p.v);
          }
          if (t_.cfg_.window(static_cast<int64_t>(l)) != mask.window) {
            mask.window = t_.cfg_.window(static_cast<int64_t>(l));
            attention_.set_mask(mask);
          }
          const at::Tensor a = t_.attend(attention_, call++, L, p.q.contiguous(), k_[own], v_[own], scale);
          x = t_.finish_layer(L, x, t_.attention_out(L, a, h), h, t_.layer_input(pli, li, x));
        }
        for (size_t i = 0; i < layers_.size(); ++i)
          if (layers_[i] == static_cast<int64_t>(l))
            features[i] = static_cast<int64_t>(l) == t_.cfg_.layers - 1 ? t_.rms_norm(x, t_.final_norm_) : x;
      }
      Output out;
      out.last = t_.rms_norm(x, t_.final_norm_);
      out.features = features.empty() ? at::Tensor() : at::stack(features, 2);
      return out;
    }

   private:
    const HfTarget& t_;
    int64_t batch_, capacity_;
    std::vector<int64_t> layers_;
    AttentionContext& attention_;
    std::vector<at::Tensor> k_, v_;                               // per attention layer (undefined for the others)
    std::vector<std::unique_ptr<hf::RecurrentCache>> recurrent_;  // per recurrent layer (null for the others)
  };

  at::Tensor load(const std::string& name) const {
    const safetensors::TensorInfo* info = checkpoint_->find(name);
    if (info && info->scalar_type == at::kFloat8_e4m3fn) return load_fp8(name, *info);
    return checkpoint_->load(name, device_, dtype_);
  }

  // Every expert's FP8 projection `suffix` under `experts` (experts.E.<suffix>) stacked as it is, with its scales
  // (each checked as load_fp8 checks it).
  DecoderLayer::Fp8 stack_fp8(const std::string& experts, const std::string& suffix) const {
    std::vector<at::Tensor> values, scales;
    for (int64_t e = 0; e < cfg_.experts; ++e) {
      const std::string name = experts + std::to_string(e) + "." + suffix;
      const safetensors::TensorInfo* info = checkpoint_->find(name);
      if (!info || info->scalar_type != at::kFloat8_e4m3fn)
        config_.fail("fp8", "\"keep\" keeps FP8 experts, but '" + name + "' holds " +
                                (info ? info->dtype : std::string("nothing")) + ", not F8_E4M3");
      fp8_grid(name, *info);
      values.push_back(checkpoint_->load(name, device_, at::kFloat8_e4m3fn));
      scales.push_back(checkpoint_->load(name + "_scale_inv", device_, at::kFloat));
    }
    return {at::stack(values), at::stack(scales)};
  }

  // Experts kept in FP8 [E, rows, cols] to the target's dtype, as load_fp8 dequantizes each (a few experts at a
  // time: the float32 products of all of them at once would be 4x their FP8 size).
  at::Tensor dequantize_fp8(const DecoderLayer::Fp8& w) const {
    const int64_t E = w.values.size(0);
    at::Tensor out = at::empty(w.values.sizes(), w.values.options().dtype(dtype_));
    for (int64_t e0 = 0; e0 < E; e0 += 8) {
      const int64_t n = std::min<int64_t>(8, E - e0);
      out.narrow(0, e0, n).copy_(w.values.narrow(0, e0, n).to(at::kFloat) *
                                 per_value(w.scales.narrow(0, e0, n), w.values));
    }
    return out;
  }

  // Block scales [..., row blocks, column blocks] spread to each value of `values` [..., rows, cols]
  // (weight_block_size's blocks; the last ones ragged where the shape is not a multiple).
  at::Tensor per_value(const at::Tensor& scales, const at::Tensor& values) const {
    const int64_t N = values.size(-2), K = values.size(-1);
    return scales.repeat_interleave(cfg_.fp8_block[0], -2)
        .narrow(-2, 0, N)
        .repeat_interleave(cfg_.fp8_block[1], -1)
        .narrow(-1, 0, K);
  }

  // A block-wise FP8 weight (ModelConfig::fp8_block) dequantized on the device: its values in float32 times their
  // block's scale (name + "_scale_inv"), rounded once to the target's dtype.
  at::Tensor load_fp8(const std::string& name, const safetensors::TensorInfo& info) const {
    fp8_grid(name, info);
    const at::Tensor w = checkpoint_->load(name, device_, at::kFloat8_e4m3fn);
    return (w.to(at::kFloat) * per_value(checkpoint_->load(name + "_scale_inv", device_, at::kFloat), w)).to(dtype_);
  }

  // Checks that FP8 weight `name` is a 2-D block-wise FP8 weight with its scales (name + "_scale_inv") of the grid
  // its shape and weight_block_size imply.
  void fp8_grid(const std::string& name, const safetensors::TensorInfo& info) const {
    const std::string scale_name = name + "_scale_inv";
    const safetensors::TensorInfo* scale = checkpoint_->find(scale_name);
    if (cfg_.quant_method != "fp8" || info.shape.size() != 2 || !scale)
      config_.fail("path", path_ + ": tensor '" + name +
                               "' holds FP8 (F8_E4M3) values, which are read as block-wise "
                               "FP8 weights: a 2-D weight with its '" +
                               scale_name +
                               "' under config.json's "
                               "quantization_config quant_method \"fp8\"" +
                               (cfg_.quant_method != "fp8" ? " (config.json has none)" : ""));
    const int64_t N = info.shape[0], K = info.shape[1], bn = cfg_.fp8_block[0], bk = cfg_.fp8_block[1];
    const std::vector<int64_t> grid = {(N + bn - 1) / bn, (K + bk - 1) / bk};
    if (scale->shape != grid)
      config_.fail("path", path_ + ": tensor '" + scale_name + "' has shape " + list_str(scale->shape) + ", but '" +
                               name + "' " + list_str(info.shape) + " in blocks of weight_block_size [" +
                               std::to_string(bn) + ", " + std::to_string(bk) + "] implies " + list_str(grid));
  }

  // The embedding's rows of token ids (int64, on the device), flat [n, H]; Gemma 3's times sqrt(hidden) rounded to
  // the model's dtype (transformers' Gemma3TextScaledWordEmbedding).
  at::Tensor embed(const at::Tensor& ids) const {
    const at::Tensor x = embed_.index_select(0, ids.reshape({-1}));
    if (cfg_.embed_multiplier != 1.0) return x * cfg_.embed_multiplier;  // (Granite: the product rounded once)
    if (!cfg_.embed_scale) return x;
    return x * at::scalar_tensor(std::sqrt(double(cfg_.hidden)), x.options());
  }
  // A norm's weight: in the model's dtype, or in float32 where the family applies it so (gpt-oss; Qwen3.5's
  // 1 + w, the sum in float32 as transformers' Qwen3_5RMSNorm makes it).
  at::Tensor load_norm(const std::string& name) const {
    if (cfg_.norm_plus_one) return checkpoint_->load(name, device_, at::kFloat) + 1.0;
    return cfg_.norm_weight_fp32 ? checkpoint_->load(name, device_, at::kFloat) : load(name);
  }

  // Attention through the engine; with sinks (gpt-oss) the softmax also runs over a learned logit per
  // head that takes weight and gives no value: each row's output times sigmoid(lse - sink), in float32.
  static at::Tensor attend(AttentionContext& attention, int64_t layer, const DecoderLayer& L, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, double scale) {
    if (!L.sinks.defined()) return attention.attention(layer, q, k, v, scale);
    const auto [out, lse] = attention.attention_lse(layer, q, k, v, scale);
    const at::Tensor kept = at::sigmoid(lse - L.sinks.view({1, -1, 1})).unsqueeze(-1);
    return (out.to(at::kFloat) * kept).to(out.scalar_type());
  }

  // gpt-oss's experts' weights [E, rows, cols] (out x in, as the engine's products read them), their
  // gate / up rows (interleaved in the checkpoint: gate_i, up_i, ...) put gate rows first where
  // `gate_up`: from the checkpoint's `name` ([E, cols, rows], transformers' layout), or from its MXFP4
  // `name`_blocks [E, rows, cols / 32, 16] and `name`_scales [E, rows, cols / 32], dequantized
  // (frozen::dequantize_mxfp4) or, with [target] mxfp4 = "keep", kept as they are: then {blocks,
  // scales} come back and the weights are undefined.
  struct ExpertWeights {
    at::Tensor weights, blocks, scales;
  };
  ExpertWeights load_expert_weights(const std::string& name, bool gate_up) const {
    const int64_t I = cfg_.moe_intermediate;
    const auto gate_first = [&](const at::Tensor& t) {  // [E, 2 I, ...]: rows 2i, 2i + 1 -> i, I + i
      if (!gate_up) return t.contiguous();              // (the layout of the other families' experts)
      std::vector<int64_t> split(t.sizes().begin(), t.sizes().end());
      split[1] = I;
      split.insert(split.begin() + 2, 2);
      return t.view(split).transpose(1, 2).reshape(t.sizes()).contiguous();
    };
    if (checkpoint_->find(name)) return {gate_first(load(name).transpose(1, 2)), {}, {}};
    const at::Tensor blocks = gate_first(checkpoint_->load(name + "_blocks", device_, at::kByte));
    const at::Tensor scales = gate_first(checkpoint_->load(name + "_scales", device_, at::kByte));
    if (keep_mxfp4_) return {{}, blocks, scales};
    return {frozen::dequantize_mxfp4(blocks, scales, dtype_, fused_), {}, {}};
  }

  using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
  // gpt-oss's sparse layer under prefix p: its router and bias, and each expert tensor with its bias, in
  // transformers' layout or as MXFP4 blocks and scales (U8; rows of whole 32-value blocks).
  void add_gpt_oss_expert_shapes(const std::string& p, Shapes& expected) const {
    const int64_t E = cfg_.experts, I = cfg_.moe_intermediate, H = cfg_.hidden;
    expected.push_back({p + "mlp.router.weight", {E, H}});
    expected.push_back({p + "mlp.router.bias", {E}});
    for (const auto& [name, rows, cols] : {std::tuple<std::string, int64_t, int64_t>{"gate_up_proj", 2 * I, H},
                                           std::tuple<std::string, int64_t, int64_t>{"down_proj", H, I}}) {
      const std::string x = p + "mlp.experts." + name;
      if (!checkpoint_->find(x) && checkpoint_->find(x + "_blocks")) {
        if (cols % 32 != 0)
          config_.fail("path", path_ + ": tensor '" + x +
                                   "_blocks' holds MXFP4 blocks of 32 values, but its rows are " +
                                   std::to_string(cols) + " wide (a multiple of 32 is needed)");
        expected.push_back({x + "_blocks", {E, rows, cols / 32, 16}});
        expected.push_back({x + "_scales", {E, rows, cols / 32}});
        for (const char* part : {"_blocks", "_scales"})
          if (checkpoint_->find(x + part)->dtype != "U8")
            config_.fail("path", path_ + ": tensor '" + x + part + "' is " + checkpoint_->find(x + part)->dtype +
                                     " (MXFP4 blocks and scales are U8 bytes)");
      } else if (!checkpoint_->find(x)) {
        config_.fail("path", path_ + ": tensor '" + x + "' is missing, and so are its MXFP4 '" + x + "_blocks' / '" +
                                 x + "_scales' (a " + cfg_.architecture +
                                 " checkpoint with this config.json has one of them)");
      } else {
        expected.push_back({x, {E, cols, rows}});
      }
      expected.push_back({x + "_bias", {E, rows}});
    }
  }

  // Every tensor the model reads, with the shape config.json implies; the first
  // mismatch or missing tensor is refused before anything is loaded.
  void check_shapes() const {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim;
    Shapes expected = {{cfg_.prefix + embed_name(), {cfg_.vocab, H}}, {cfg_.prefix + final_norm_name(), {H}}};
    if (cfg_.ple > 0) {  // (Gemma 4's per-layer embeddings)
      const int64_t LP = cfg_.layers * cfg_.ple;
      expected.push_back({cfg_.prefix + "embed_tokens_per_layer.weight", {cfg_.ple_vocab, LP}});
      expected.push_back({cfg_.prefix + "per_layer_model_projection.weight", {LP, H}});
      expected.push_back({cfg_.prefix + "per_layer_projection_norm.weight", {cfg_.ple}});
    }
    if (cfg_.tie_embeddings != 1 && (cfg_.tie_embeddings == 0 || checkpoint_->find(cfg_.lm_head)))
      expected.push_back({cfg_.lm_head, {cfg_.vocab, H}});
    for (int64_t l = 0; l < cfg_.layers; ++l) {
      const std::string p = cfg_.prefix + "layers." + std::to_string(l) + ".";
      const NormNames n = norm_names();
      for (const std::string* name : {&n.input, &n.post, &n.pre_ff, &n.post_ff})
        if (!name->empty()) expected.push_back({p + *name + ".weight", {H}});
      if (cfg_.mlp_block(l)) {  // (Nemotron-H: an MLP block alone)
        add_mlp_shapes(l, p, expected);
        continue;
      }
      if (cfg_.linear_attention(l)) {
        if (cfg_.mamba2())
          add_mamba2_shapes(p, expected);
        else
          add_gated_delta_shapes(p, expected);
      } else {
        expected.push_back({p + attn() + "o_proj.weight",
                            {H, cfg_.mla() ? cfg_.heads * cfg_.v_dim : cfg_.heads * cfg_.head_dim_of(l)}});
        if (cfg_.mla())
          add_latent_shapes(p, expected);
        else
          add_attention_shapes(l, p, expected);
      }
      if (cfg_.gemma4()) expected.push_back({p + "layer_scalar", {1}});
      if (cfg_.ple > 0)
        for (const auto& [name, shape] :
             std::vector<std::pair<std::string, std::vector<int64_t>>>{{"per_layer_input_gate.weight", {cfg_.ple, H}},
                                                                       {"per_layer_projection.weight", {H, cfg_.ple}},
                                                                       {"post_per_layer_input_norm.weight", {H}}})
          expected.push_back({p + name, shape});
      if (!cfg_.single_blocks()) add_mlp_shapes(l, p, expected);
    }
    for (const auto& [name, shape] : expected) {
      const safetensors::TensorInfo* info = checkpoint_->find(name);
      if (!info)
        config_.fail("path", path_ + ": tensor '" + name + "' is missing (a " + cfg_.architecture +
                                 " checkpoint with this config.json has it)");
      if (info->shape != shape)
        config_.fail("path", path_ + ": tensor '" + name + "' has shape " + list_str(info->shape) + ", but " +
                                 cfg_.path + " (hidden_size " + std::to_string(H) + ", " + std::to_string(cfg_.heads) +
                                 " heads, " + std::to_string(cfg_.kv_heads) + " kv heads, head_dim " +
                                 std::to_string(D) + ", intermediate_size " + std::to_string(cfg_.intermediate) +
                                 experts_sizes() + linear_sizes() + ", vocab_size " + std::to_string(cfg_.vocab) +
                                 ") implies " + list_str(shape));
    }
  }

  // Layer l's attention projections under prefix p (o_proj aside): q, k, v (Phi-3: packed; Qwen3.5: q_proj
  // with each head's output gate after its query, twice the rows; Gemma 4's full layers with attention_k_eq_v: no
  // v_proj), biases, norms, sinks.
  void add_attention_shapes(int64_t l, const std::string& p, Shapes& expected) const {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim_of(l), q = cfg_.heads * D, kv = cfg_.kv_heads_of(l) * D;
    const bool v = !cfg_.values_are_keys(l);
    if (cfg_.shares_kv(l)) {  // (Gemma 4: queries alone, the keys and values an earlier layer's)
      expected.push_back({p + attn() + "q_proj.weight", {q, H}});
      expected.push_back({p + attn() + "q_norm.weight", {D}});
      if (cfg_.qkv_bias) expected.push_back({p + attn() + "q_proj.bias", {q}});
      if (cfg_.o_bias) expected.push_back({p + attn() + "o_proj.bias", {H}});
      return;
    }
    if (packed()) {
      expected.push_back({p + attn() + "qkv_proj.weight", {q + 2 * kv, H}});
    } else {
      expected.push_back({p + attn() + "q_proj.weight", {cfg_.attn_gate ? 2 * q : q, H}});
      expected.push_back({p + attn() + "k_proj.weight", {kv, H}});
      if (v) expected.push_back({p + attn() + "v_proj.weight", {kv, H}});
    }
    if (cfg_.sinks) expected.push_back({p + attn() + "sinks", {cfg_.heads}});
    if (cfg_.afmoe()) expected.push_back({p + attn() + "gate_proj.weight", {q, H}});
    if (cfg_.qkv_bias)
      for (const auto& e : std::vector<std::pair<std::string, std::vector<int64_t>>>{
               {"self_attn.q_proj.bias", {q}}, {"self_attn.k_proj.bias", {kv}}, {"self_attn.v_proj.bias", {kv}}})
        if (v || e.first != "self_attn.v_proj.bias") expected.push_back({p + e.first, e.second});
    if (cfg_.o_bias) expected.push_back({p + attn() + "o_proj.bias", {H}});
    if (cfg_.qk_norm || cfg_.qk_norm_full) {  // (MiniMax-M2: one norm over all heads)
      expected.push_back({p + attn() + "q_norm.weight", {cfg_.qk_norm_full ? q : D}});
      expected.push_back({p + attn() + "k_norm.weight", {cfg_.qk_norm_full ? kv : D}});
    }
    if (cfg_.qk_norm_after_rope && cfg_.hunyuan()) {  // (Hunyuan; Llama 4's L2 norms have no weights)
      expected.push_back({p + attn() + "query_layernorm.weight", {D}});
      expected.push_back({p + attn() + "key_layernorm.weight", {D}});
    }
  }

  // DeepSeek-V3's latent attention's projections under prefix p (o_proj aside).
  void add_latent_shapes(const std::string& p, Shapes& expected) const {
    const int64_t H = cfg_.hidden, heads = cfg_.heads, qk = cfg_.qk_nope + cfg_.qk_rope;
    const std::string a = p + attn();
    if (cfg_.q_lora > 0) {
      expected.push_back({a + "q_a_proj.weight", {cfg_.q_lora, H}});
      expected.push_back({a + "q_a_layernorm.weight", {cfg_.q_lora}});
      expected.push_back({a + "q_b_proj.weight", {heads * qk, cfg_.q_lora}});
    } else {
      expected.push_back({a + "q_proj.weight", {heads * qk, H}});
    }
    expected.push_back({a + "kv_a_proj_with_mqa.weight", {cfg_.kv_lora + cfg_.qk_rope, H}});
    expected.push_back({a + "kv_a_layernorm.weight", {cfg_.kv_lora}});
    expected.push_back({a + "kv_b_proj.weight", {heads * (cfg_.qk_nope + cfg_.v_dim), cfg_.kv_lora}});
  }

  // A Gated DeltaNet layer's tensors under prefix p (Qwen3.5's linear_attn.).
  void add_gated_delta_shapes(const std::string& p, Shapes& expected) const {
    const int64_t H = cfg_.hidden, kd = cfg_.lin_k_heads * cfg_.lin_k_dim, vd = cfg_.lin_v_heads * cfg_.lin_v_dim;
    const int64_t Hv = cfg_.lin_v_heads;
    const std::string x = p + "linear_attn.";
    if (qwen3_next()) {  // (packed per key head: q, k, v, z; b, a)
      expected.push_back({x + "in_proj_qkvz.weight", {2 * kd + 2 * vd, H}});
      expected.push_back({x + "in_proj_ba.weight", {2 * Hv, H}});
    } else {
      expected.push_back({x + "in_proj_qkv.weight", {2 * kd + vd, H}});
      expected.push_back({x + "in_proj_z.weight", {vd, H}});
      expected.push_back({x + "in_proj_b.weight", {Hv, H}});
      expected.push_back({x + "in_proj_a.weight", {Hv, H}});
    }
    expected.push_back({x + "conv1d.weight", {2 * kd + vd, 1, cfg_.conv_kernel}});
    expected.push_back({x + "dt_bias", {Hv}});
    expected.push_back({x + "A_log", {Hv}});
    expected.push_back({x + "norm.weight", {cfg_.lin_v_dim}});
    expected.push_back({x + "out_proj.weight", {H, vd}});
  }

  // A Mamba-2 layer's tensors under prefix p (Granite 4.0-H's mamba.).
  void add_mamba2_shapes(const std::string& p, Shapes& expected) const {
    const int64_t H = cfg_.hidden, heads = cfg_.mamba_heads, inner = heads * cfg_.mamba_head_dim;
    const int64_t conv_dim = inner + 2 * cfg_.mamba_groups * cfg_.mamba_state;
    const std::string x = p + mamba();
    expected.push_back({x + "in_proj.weight", {inner + conv_dim + heads, H}});
    expected.push_back({x + "conv1d.weight", {conv_dim, 1, cfg_.conv_kernel}});
    if (cfg_.mamba_conv_bias) expected.push_back({x + "conv1d.bias", {conv_dim}});
    for (const char* name : {"dt_bias", "A_log", "D"}) expected.push_back({x + name, {heads}});
    expected.push_back({x + "norm.weight", {inner}});
    expected.push_back({x + "out_proj.weight", {H, inner}});
    if (cfg_.mamba_proj_bias) {
      expected.push_back({x + "in_proj.bias", {inner + conv_dim + heads}});
      expected.push_back({x + "out_proj.bias", {H}});
    }
  }

  // Layer l's feed-forward tensors under prefix p: its MLP, or its router and experts.
  void add_mlp_shapes(int64_t l, const std::string& p, Shapes& expected) const {
    const int64_t H = cfg_.hidden;
    if (cfg_.sparse(l) && cfg_.gemma4()) {  // (its experts beside the MLP, below)
      const int64_t E = cfg_.experts, I = cfg_.moe_intermediate;
      for (const auto& [name, shape] :
           std::vector<std::pair<std::string, std::vector<int64_t>>>{{"router.proj.weight", {E, H}},
                                                                     {"router.scale", {H}},
                                                                     {"router.per_expert_scale", {E}},
                                                                     {"experts.gate_up_proj", {E, 2 * I, H}},
                                                                     {"experts.down_proj", {E, H, I}},
                                                                     {"pre_feedforward_layernorm_2.weight", {H}},
                                                                     {"post_feedforward_layernorm_1.weight", {H}},
                                                                     {"post_feedforward_layernorm_2.weight", {H}}})
        expected.push_back({p + name, shape});
    }
    if (cfg_.sparse(l) && gpt_oss()) {
      add_gpt_oss_expert_shapes(p, expected);
    } else if (cfg_.sparse(l) && cfg_.nemotron_h()) {
      add_nemotron_expert_shapes(p, expected);
    } else if (cfg_.sparse(l) && !cfg_.gemma4()) {
      const int64_t I = cfg_.moe_intermediate;
      const ExpertKeys n = expert_keys();
      expected.push_back({router_key(p), {cfg_.experts, H}});
      if (cfg_.granite_moe()) {  // (stacked as held)
        expected.push_back({p + granite_experts().first, {cfg_.experts, 2 * I, H}});
        expected.push_back({p + granite_experts().second, {cfg_.experts, H, I}});
      }
      if (cfg_.llama4()) {  // (stacked as each product's transpose)
        expected.push_back({p + "feed_forward.experts.gate_up_proj", {cfg_.experts, H, 2 * I}});
        expected.push_back({p + "feed_forward.experts.down_proj", {cfg_.experts, I, H}});
      }
      if (cfg_.mistral4()) {  // (stacked as transformers holds and saves them)
        expected.push_back({p + "mlp.experts.gate_up_proj", {cfg_.experts, 2 * I, H}});
        expected.push_back({p + "mlp.experts.down_proj", {cfg_.experts, H, I}});
      }
      if (cfg_.qwen3_vl()) {  // (stacked: as published, or as transformers holds and saves them)
        const int64_t E = cfg_.experts;
        expected.push_back(
            {p + "mlp.experts.gate_up_proj", stacked_layout(p + "mlp.experts.gate_up_proj", {E, 2 * I, H})});
        expected.push_back({p + "mlp.experts.down_proj", stacked_layout(p + "mlp.experts.down_proj", {E, H, I})});
      }
      for (int64_t e = 0; e < (stacked_experts() ? 0 : cfg_.experts); ++e) {
        const std::string x = p + n.block + "experts." + std::to_string(e) + ".";
        expected.push_back({x + n.gate, {I, H}});
        expected.push_back({x + n.up, {I, H}});
        expected.push_back({x + n.down, {H, I}});
      }
      if (cfg_.sigmoid_router) expected.push_back({router_bias_key(p), {cfg_.experts}});
      if (cfg_.softmax_choice_bias) expected.push_back({router_bias_key(p), {1, cfg_.experts}});  // (ERNIE 4.5)
      if (cfg_.shared_intermediate > 0) {
        const int64_t Is = cfg_.shared_intermediate;
        const std::string s = p + shared_block();
        if (cfg_.granite_moe()) {  // (gate | up packed)
          expected.push_back({s + "input_linear.weight", {2 * Is, H}});
          expected.push_back({s + "output_linear.weight", {H, Is}});
        } else {
          expected.push_back({s + "gate_proj.weight", {Is, H}});
          expected.push_back({s + "up_proj.weight", {Is, H}});
          expected.push_back({s + "down_proj.weight", {H, Is}});
        }
        if (cfg_.shared_gate) expected.push_back({p + "mlp.shared_expert_gate.weight", {1, H}});
      }
    } else {
      if (cfg_.granite_hybrid()) {  // (Granite-4.0-micro: the shared MLP alone, gate | up packed)
        expected.push_back({p + "shared_mlp.input_linear.weight", {2 * cfg_.intermediate, H}});
        expected.push_back({p + "shared_mlp.output_linear.weight", {H, cfg_.intermediate}});
        return;
      } else if (mlp_packed()) {
        expected.push_back({p + "mlp.gate_up_proj.weight", {2 * cfg_.intermediate, H}});
      } else if (cfg_.ungated_mlp()) {  // (Arcee, Apertus: up only; Apertus's xIELU's four numbers)
        expected.push_back({p + ff() + "up_proj.weight", {cfg_.intermediate, H}});
        if (cfg_.xielu_mlp)
          for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
                   {"alpha_p", {1}}, {"alpha_n", {1}}, {"beta", {}}, {"eps", {}}})
            expected.push_back({p + "mlp.act_fn." + name, shape});
      } else {
        expected.push_back({p + ff() + "gate_proj.weight", {cfg_.intermediate_of(l), H}});
        expected.push_back({p + ff() + "up_proj.weight", {cfg_.intermediate_of(l), H}});
      }
      expected.push_back({p + ff() + "down_proj.weight", {H, cfg_.intermediate_of(l)}});
    }
  }

  // Nemotron 3's experts block under prefix p (mixer.): its router and correction biases, its experts' up / down
  // (stacked, as transformers saves them, or one expert at a time, as published), its shared MLP's up / down.
  bool nemotron_stacked(const std::string& p) const {
    return checkpoint_->find(p + "mixer.experts.up_proj") != nullptr;
  }
  void add_nemotron_expert_shapes(const std::string& p, Shapes& expected) const {
    const int64_t E = cfg_.experts, I = cfg_.moe_intermediate, H = cfg_.hidden, Is = cfg_.shared_intermediate;
    const int64_t D = cfg_.moe_latent > 0 ? cfg_.moe_latent : H;  // the experts' width
    const std::string x = p + "mixer.";
    expected.push_back({x + "gate.weight", {E, H}});
    expected.push_back({x + "gate.e_score_correction_bias", {E}});
    if (cfg_.moe_latent > 0) {
      expected.push_back({x + "fc1_latent_proj.weight", {D, H}});
      expected.push_back({x + "fc2_latent_proj.weight", {H, D}});
    }
    const bool stacked = nemotron_stacked(p);
    if (stacked) {
      expected.push_back({x + "experts.up_proj", {E, I, D}});
      expected.push_back({x + "experts.down_proj", {E, D, I}});
    }
    for (int64_t e = 0; e < (stacked ? 0 : E); ++e) {
      expected.push_back({x + "experts." + std::to_string(e) + ".up_proj.weight", {I, D}});
      expected.push_back({x + "experts." + std::to_string(e) + ".down_proj.weight", {D, I}});
    }
    expected.push_back({x + "shared_experts.up_proj.weight", {Is, H}});
    expected.push_back({x + "shared_experts.down_proj.weight", {H, Is}});
  }
  void load_nemotron_experts(const std::string& p, DecoderLayer& L) const {
    const std::string x = p + "mixer.";
    L.router = load(x + "gate.weight").to(at::kFloat);
    L.router_bias = checkpoint_->load(x + "gate.e_score_correction_bias", device_, at::kFloat).reshape({-1});
    const auto each = [&](const char* name) {
      std::vector<at::Tensor> parts;
      for (int64_t e = 0; e < cfg_.experts; ++e)
        parts.push_back(load(x + "experts." + std::to_string(e) + "." + name + ".weight"));
      return at::stack(parts);
    };
    const bool stacked = nemotron_stacked(p);
    L.experts_gate_up = stacked ? load(x + "experts.up_proj") : each("up_proj");  // (up only: ungated)
    L.experts_down = stacked ? load(x + "experts.down_proj") : each("down_proj");
    L.shared_gate_up = load(x + "shared_experts.up_proj.weight");
    L.shared_down = load(x + "shared_experts.down_proj.weight");
    if (cfg_.moe_latent > 0)
      L.latent_in = load(x + "fc1_latent_proj.weight"), L.latent_out = load(x + "fc2_latent_proj.weight");
  }

  // Layer l's tensors; Granite's residual_multiplier folded into the products whose outputs join the residual stream
  // (rounded once to the model's dtype: o_proj and its bias, down_proj, the experts' and the shared expert's down).
  DecoderLayer load_layer(int64_t l) const {
    DecoderLayer L = load_layer_tensors(l);
    const std::string p = cfg_.prefix + "layers." + std::to_string(l) + ".";
    if (cfg_.gemma4()) L.layer_scalar = load(p + "layer_scalar");
    if (cfg_.ple > 0) {
      L.ple_gate = load(p + "per_layer_input_gate.weight");
      L.ple_proj = load(p + "per_layer_projection.weight");
      L.ple_norm = load_norm(p + "post_per_layer_input_norm.weight");
    }
    if (cfg_.residual_multiplier != 1.0)
      for (at::Tensor* w : {&L.o_proj, &L.o_bias, &L.down_proj, &L.experts_down, &L.shared_down})
        if (w->defined()) *w = (w->to(at::kFloat) * cfg_.residual_multiplier).to(w->scalar_type());
    return L;
  }

  DecoderLayer load_layer_tensors(int64_t l) const {
    const std::string p = cfg_.prefix + "layers." + std::to_string(l) + ".";
    DecoderLayer L;
    const NormNames n = norm_names();
    const auto norm = [&](const std::string& name) {
      return name.empty() ? at::Tensor() : load_norm(p + name + ".weight");
    };
    L.input_norm = norm(n.input), L.post_norm = norm(n.post), L.pre_ff_norm = norm(n.pre_ff);
    L.post_ff_norm = norm(n.post_ff);
    if (!cfg_.mlp_block(l)) {  // (Nemotron-H's MLP blocks: the MLP alone, below)
      if (cfg_.linear_attention(l) && cfg_.mamba2())
        load_mamba2(p, L);
      else if (cfg_.linear_attention(l))
        load_gated_delta(p, L);
      else
        load_attention(l, p, L);
      if (cfg_.single_blocks()) return L;  // (Nemotron-H: a mixer or attention block alone)
    }
    if (cfg_.llama4() && cfg_.qk_norm_after_rope && !cfg_.no_rope(l))  // (its L2 norms: RMSNorms of weight 1)
      L.q_norm = L.k_norm = at::ones({cfg_.head_dim}, at::TensorOptions().dtype(dtype_).device(device_));
    if (cfg_.sparse(l) && gpt_oss()) {
      const int64_t E = cfg_.experts, I = cfg_.moe_intermediate;
      L.router = load(p + "mlp.router.weight");
      L.router_logit_bias = load(p + "mlp.router.bias");
      const ExpertWeights gu = load_expert_weights(p + "mlp.experts.gate_up_proj", /*gate_up=*/true);
      const ExpertWeights down = load_expert_weights(p + "mlp.experts.down_proj", /*gate_up=*/false);
      L.experts_gate_up = gu.weights, L.gate_up_blocks = gu.blocks, L.gate_up_scales = gu.scales;
      L.experts_down = down.weights, L.down_blocks = down.blocks, L.down_scales = down.scales;
      // (the bias's entries interleaved as the rows were)
      L.experts_gate_up_bias =
          load(p + "mlp.experts.gate_up_proj_bias").view({E, I, 2}).transpose(1, 2).reshape({E, 2 * I}).contiguous();
      L.experts_down_bias = load(p + "mlp.experts.down_proj_bias");
      return L;
    }
    if (cfg_.sparse(l) && cfg_.nemotron_h()) {
      load_nemotron_experts(p, L);
      return L;
    }
    if (cfg_.sparse(l) && cfg_.gemma4()) {  // (the experts beside the layer's MLP, loaded below)
      load_gemma4_experts(p, L);
    } else if (cfg_.sparse(l)) {
      load_experts(p, L);
      return L;
    }
    if (cfg_.granite_hybrid()) {  // (Granite-4.0-micro: the shared MLP alone)
      L.gate_up = load(p + "shared_mlp.input_linear.weight");
      L.down_proj = load(p + "shared_mlp.output_linear.weight");
      return L;
    }
    L.gate_up = mlp_packed() ? load(p + "mlp.gate_up_proj.weight")
                : cfg_.ungated_mlp()
                    ? load(p + ff() + "up_proj.weight")  // (Arcee, Apertus, Nemotron-H: up only)
                    : at::cat({load(p + ff() + "gate_proj.weight"), load(p + ff() + "up_proj.weight")});
    L.down_proj = load(p + ff() + "down_proj.weight");
    if (cfg_.xielu_mlp) {  // (transformers' XIELUActivation: its parameters through softplus once)
      const auto number = [&](const char* name) { return load(p + "mlp.act_fn." + name).reshape({1}); };
      L.xielu_beta = number("beta"), L.xielu_eps = number("eps");
      L.xielu_p = at::softplus(number("alpha_p"));
      L.xielu_n = L.xielu_beta + at::softplus(number("alpha_n"));
    }
    return L;
  }

  // Gemma 4's experts block under prefix p (model.layers.N.): its router and its scales, the stacked experts, its
  // three norms.
  void load_gemma4_experts(const std::string& p, DecoderLayer& L) const {
    L.router = load(p + "router.proj.weight");
    L.router_scale = load(p + "router.scale");
    L.per_expert_scale = load(p + "router.per_expert_scale");
    L.experts_gate_up = load(p + "experts.gate_up_proj");
    L.experts_down = load(p + "experts.down_proj");
    L.pre_ff_norm_2 = load_norm(p + "pre_feedforward_layernorm_2.weight");
    L.post_ff_norm_1 = load_norm(p + "post_feedforward_layernorm_1.weight");
    L.post_ff_norm_2 = load_norm(p + "post_feedforward_layernorm_2.weight");
  }

  // A sparse layer's router, experts (stacked as held, or one at a time as published, or kept in FP8), router biases
  // and shared expert, under prefix p (model.layers.N.).
  void load_experts(const std::string& p, DecoderLayer& L) const {
    const ExpertKeys n = expert_keys();
    L.router = load(router_key(p));
    if (router_fp32()) L.router = L.router.to(at::kFloat);
    const int64_t E = cfg_.experts, I = cfg_.moe_intermediate, H = cfg_.hidden;
    const auto opts = at::TensorOptions().dtype(dtype_).device(device_);
    if (cfg_.qwen3_vl()) {  // Qwen3-VL-MoE's stacked experts, gate rows (columns as published) first
      const auto stacked = [&](const std::string& name, const std::vector<int64_t>& held) {
        const at::Tensor t = load(name);  // (as held, or as published: stacked_layout decides, as for the shapes)
        return stacked_layout(name, held) == held ? t : t.transpose(1, 2).contiguous();
      };
      L.experts_gate_up = stacked(p + "mlp.experts.gate_up_proj", {E, 2 * I, H});
      L.experts_down = stacked(p + "mlp.experts.down_proj", {E, H, I});
    } else if (cfg_.mistral4()) {  // (stacked as held: gate rows, then up rows)
      L.experts_gate_up = load(p + "mlp.experts.gate_up_proj");
      L.experts_down = load(p + "mlp.experts.down_proj");
    } else if (cfg_.llama4()) {  // (each product's transpose: [E, H, gate | up], [E, I, H])
      L.experts_gate_up = load(p + "feed_forward.experts.gate_up_proj").transpose(1, 2).contiguous();
      L.experts_down = load(p + "feed_forward.experts.down_proj").transpose(1, 2).contiguous();
    } else if (cfg_.granite_moe()) {  // (stacked as held: gate rows, then up rows)
      L.experts_gate_up = load(p + granite_experts().first);
      L.experts_down = load(p + granite_experts().second);
    } else if (keep_fp8_) {  // ([target] fp8 = "keep": the experts' FP8 values and scales, as they are)
      L.fp8_gate = stack_fp8(p + n.block + "experts.", n.gate);
      L.fp8_up = stack_fp8(p + n.block + "experts.", n.up);
      L.fp8_down = stack_fp8(p + n.block + "experts.", n.down);
    } else {
      L.experts_gate_up = at::empty({E, 2 * I, H}, opts);
      L.experts_down = at::empty({E, H, I}, opts);
    }
    for (int64_t e = 0; e < (stacked_experts() || keep_fp8_ ? 0 : E); ++e) {
      const std::string x = p + n.block + "experts." + std::to_string(e) + ".";
      L.experts_gate_up[e].narrow(0, 0, I).copy_(load(x + n.gate));
      L.experts_gate_up[e].narrow(0, I, I).copy_(load(x + n.up));
      L.experts_down[e].copy_(load(x + n.down));
    }
    if (cfg_.sigmoid_router || cfg_.softmax_choice_bias)
      L.router_bias = checkpoint_->load(router_bias_key(p), device_, at::kFloat).reshape({-1});
    if (cfg_.shared_intermediate > 0) {
      const std::string s = p + shared_block();
      L.shared_gate_up = cfg_.granite_moe() ? load(s + "input_linear.weight")
                                            : at::cat({load(s + "gate_proj.weight"), load(s + "up_proj.weight")});
      L.shared_down = load(s + (cfg_.granite_moe() ? "output_linear.weight" : "down_proj.weight"));
      if (cfg_.shared_gate) L.shared_gate = load(p + "mlp.shared_expert_gate.weight");
    }
  }

  // An attention layer's projections under prefix p: q | k | v packed (Qwen3.5: each head's query rows
  // of q_proj, its output gate's rows apart), o_proj, biases, q / k norms, sinks.
  void load_attention(int64_t l, const std::string& p, DecoderLayer& L) const {
    L.kv_heads = cfg_.mla() ? cfg_.heads : cfg_.kv_heads_of(l);
    if (cfg_.mla()) return load_latent(p, L);
    if (cfg_.shares_kv(l)) {  // (Gemma 4: its queries alone; its keys and values are kv_source's)
      L.queries_only = true;
      L.qkv = load(p + attn() + "q_proj.weight");
      if (cfg_.qkv_bias) L.qkv_bias = load(p + attn() + "q_proj.bias");
      if (cfg_.o_bias) L.o_bias = load(p + attn() + "o_proj.bias");
      L.o_proj = load(p + attn() + "o_proj.weight");
      L.q_norm = load_norm(p + attn() + "q_norm.weight");
      return;
    }
    at::Tensor q;
    if (!packed()) q = load(p + attn() + "q_proj.weight");
    if (cfg_.attn_gate) {  // [heads x (query D | gate D), H]
      const at::Tensor halves = q.view({cfg_.heads, 2, cfg_.head_dim, cfg_.hidden});
      L.attn_gate = halves.select(1, 1).reshape({-1, cfg_.hidden}).contiguous();
      q = halves.select(1, 0).reshape({-1, cfg_.hidden});
    }
    // (GLM-4: each head's rotated pairs stored interleaved, de-interleaved here; biases alike)
    const auto qk = [&](const at::Tensor& w, int64_t heads) { return pairs_apart(w, heads); };
    // (Gemma 4's full layers with attention_k_eq_v: the values are the keys' projection, its rows twice)
    const bool keys = cfg_.values_are_keys(l);
    const auto values = [&](const char* what) { return load(p + attn() + (keys ? "k_proj." : "v_proj.") + what); };
    L.qkv = packed()
                ? load(p + attn() + "qkv_proj.weight")
                : at::cat({qk(q, cfg_.heads), qk(load(p + attn() + "k_proj.weight"), L.kv_heads), values("weight")});
    L.o_proj = load(p + attn() + "o_proj.weight");
    if (cfg_.qkv_bias)
      L.qkv_bias = at::cat({qk(load(p + attn() + "q_proj.bias"), cfg_.heads),
                            qk(load(p + attn() + "k_proj.bias"), L.kv_heads), values("bias")});
    if (cfg_.v_norm) L.v_norm = at::ones({cfg_.head_dim_of(l)}, at::TensorOptions().dtype(at::kFloat).device(device_));
    if (cfg_.o_bias) L.o_bias = load(p + attn() + "o_proj.bias");
    if (cfg_.qk_norm || cfg_.qk_norm_full) {
      L.q_norm = load_norm(p + attn() + "q_norm.weight");
      L.k_norm = load_norm(p + attn() + "k_norm.weight");
    }
    if (cfg_.qk_norm_after_rope && cfg_.hunyuan()) {
      L.q_norm = load_norm(p + attn() + "query_layernorm.weight");
      L.k_norm = load_norm(p + attn() + "key_layernorm.weight");
    }
    if (cfg_.sinks) L.sinks = checkpoint_->load(p + attn() + "sinks", device_, at::kFloat);
    if (cfg_.afmoe()) L.attn_gate = load(p + attn() + "gate_proj.weight");  // (its output gate's own tensor)
  }

  // GLM-4's q or k rows (or bias) w [heads D, ...] with each head's first rotary_dim rows' pairs (x0, x1), (x2, x3),
  // ... stored interleaved: those rows reordered evens first, then odds (rotate-half RoPE then gives transformers'
  // interleaved rotation's values, a permutation of each head's dimensions that q . k does not see); w itself
  // without rope_interleave.
  at::Tensor pairs_apart(const at::Tensor& w, int64_t heads) const {
    if (!cfg_.rope_interleave) return w;
    const int64_t D = cfg_.head_dim, R = cfg_.rotary_dim;
    const at::Tensor b = w.reshape({heads, D, -1});
    const at::Tensor r = b.narrow(1, 0, R);
    return at::cat({r.slice(1, 0, R, 2), r.slice(1, 1, R, 2), b.narrow(1, R, D - R)}, 1)
        .reshape(w.sizes())
        .contiguous();
  }

  // DeepSeek-V3's latent attention under prefix p. With rope_interleave the rotated dimensions' pairs (x0, x1), (x2,
  // x3), ... are stored interleaved: their rows (each head's last qk_rope of q, the latent's last qk_rope) are
  // reordered evens first, then odds, which rotate-half RoPE turns into the values transformers' interleaved rotation
  // gives (apply_rotary_pos_emb_interleave: [x_even cos - x_odd sin, x_odd cos + x_even sin]).
  void load_latent(const std::string& p, DecoderLayer& L) const {
    const std::string a = p + attn();
    const int64_t nope = cfg_.qk_nope, rope = cfg_.qk_rope;
    const auto deinterleave = [&](const at::Tensor& w, int64_t blocks, int64_t width) {
      if (!cfg_.rope_interleave) return w;
      const at::Tensor b = w.view({blocks, width, -1});
      const at::Tensor r = b.narrow(1, width - rope, rope);
      return at::cat({b.narrow(1, 0, width - rope), r.slice(1, 0, rope, 2), r.slice(1, 1, rope, 2)}, 1)
          .reshape({blocks * width, -1})
          .contiguous();
    };
    if (cfg_.q_lora > 0) {
      L.mla.q_a = load(a + "q_a_proj.weight");
      L.mla.q_a_norm = load_norm(a + "q_a_layernorm.weight");
      L.mla.q_b = deinterleave(load(a + "q_b_proj.weight"), cfg_.heads, nope + rope);
    } else {
      L.mla.q_b = deinterleave(load(a + "q_proj.weight"), cfg_.heads, nope + rope);
    }
    L.mla.kv_a = deinterleave(load(a + "kv_a_proj_with_mqa.weight"), 1, cfg_.kv_lora + rope);
    L.mla.kv_a_norm = load_norm(a + "kv_a_layernorm.weight");
    L.mla.kv_b = load(a + "kv_b_proj.weight");
    L.o_proj = load(a + "o_proj.weight");
  }

  // A Gated DeltaNet layer under prefix p: its four input projections as one, the convolution's taps,
  // -exp(A_log) in float32 (transformers' A_log.float().exp(), from the model's dtype), dt_bias, the gated
  // norm's weight; out_proj as the layer's o_proj.
  void load_gated_delta(const std::string& p, DecoderLayer& L) const {
    const std::string x = p + "linear_attn.";
    const auto mixer = std::make_shared<hf::GatedDeltaNet>();
    hf::GatedDeltaNet& g = *mixer;
    if (qwen3_next()) {
      // Qwen3-Next packs them per key head: in_proj_qkvz's rows [q (Dk), k (Dk), v (r Dv), z (r Dv)] a key head
      // and in_proj_ba's [b (r), a (r)] (r value heads a key head); the engine's order is every head's q, then k,
      // v, z, b, a (transformers' fix_query_key_value_ordering)
      const int64_t G = cfg_.lin_k_heads, Dk = cfg_.lin_k_dim, rv = cfg_.lin_v_heads / G * cfg_.lin_v_dim;
      const int64_t r = cfg_.lin_v_heads / G, H = cfg_.hidden;
      const at::Tensor qkvz = load(x + "in_proj_qkvz.weight").view({G, 2 * Dk + 2 * rv, H});
      const at::Tensor ba = load(x + "in_proj_ba.weight").view({G, 2 * r, H});
      const auto rows = [&](const at::Tensor& t, int64_t from, int64_t n) {
        return t.narrow(1, from, n).reshape({-1, H});
      };
      g.in_proj = at::cat({rows(qkvz, 0, Dk), rows(qkvz, Dk, Dk), rows(qkvz, 2 * Dk, rv), rows(qkvz, 2 * Dk + rv, rv),
                           rows(ba, 0, r), rows(ba, r, r)});
    } else {
      g.in_proj = at::cat({load(x + "in_proj_qkv.weight"), load(x + "in_proj_z.weight"), load(x + "in_proj_b.weight"),
                           load(x + "in_proj_a.weight")});
    }
    g.conv = load(x + "conv1d.weight").squeeze(1).contiguous();
    g.neg_A = -load(x + "A_log").to(at::kFloat).exp();
    g.dt_bias = load(x + "dt_bias");
    g.norm = load(x + "norm.weight");
    g.k_heads = cfg_.lin_k_heads, g.v_heads = cfg_.lin_v_heads, g.k_dim = cfg_.lin_k_dim, g.v_dim = cfg_.lin_v_dim;
    g.eps = cfg_.rms_eps;
    g.fused = fused_;
    L.o_proj = load(x + "out_proj.weight");
    L.mixer = mixer;
  }

  // A Mamba-2 layer under prefix p (Granite 4.0-H's mamba.): in_proj (and its bias), the convolution's taps and bias,
  // -exp(A_log) in float32 (transformers' -exp(A_log.float())), dt_bias, D, the gated norm's weight; out_proj (and its
  // bias) as the layer's o_proj.
  void load_mamba2(const std::string& p, DecoderLayer& L) const {
    const std::string x = p + mamba();
    const auto mixer = std::make_shared<hf::Mamba2>();
    hf::Mamba2& m = *mixer;
    m.in_proj = load(x + "in_proj.weight");
    m.conv = load(x + "conv1d.weight").squeeze(1).contiguous();
    if (cfg_.mamba_conv_bias) m.conv_bias = load(x + "conv1d.bias");
    if (cfg_.mamba_proj_bias) m.in_bias = load(x + "in_proj.bias"), L.o_bias = load(x + "out_proj.bias");
    m.neg_A = -load(x + "A_log").to(at::kFloat).exp();
    m.dt_bias = load(x + "dt_bias");
    m.D = load(x + "D");
    m.norm = load(x + "norm.weight");
    m.heads = cfg_.mamba_heads, m.head_dim = cfg_.mamba_head_dim, m.groups = cfg_.mamba_groups;
    m.state = cfg_.mamba_state, m.chunk = cfg_.mamba_chunk, m.dt_min = cfg_.dt_min, m.dt_max = cfg_.dt_max,
    m.eps = cfg_.rms_eps;
    m.fused = fused_;
    L.o_proj = load(x + "out_proj.weight");
    L.mixer = mixer;
  }

  // Tables that rotate nothing, shaped as `tables`: cos 1, sin 0 (x 1 + rotate_half(x) 0 is x, exactly; SmolLM3's NoPE
  // layers).
  static std::pair<at::Tensor, at::Tensor> unrotated(const std::pair<at::Tensor, at::Tensor>& tables) {
    return {at::ones_like(tables.first), at::zeros_like(tables.second)};
  }

  // cos and sin of the angles, times YaRN's or LongRoPE's attention factor (1 otherwise, and for the sliding layers'
  // own unscaled tables: local), in the run's dtype.
  std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& angles, bool local = false) const {
    const bool scaled = !local && cfg_.rope.scales_tables();
    const double f = scaled ? cfg_.rope.attention_factor : 1.0;
    if (f == 1.0) return {angles.cos().to(dtype_), angles.sin().to(dtype_)};
    return {(angles.cos() * f).to(dtype_), (angles.sin() * f).to(dtype_)};
  }

  // x / sqrt(mean(x^2) + eps) in fp32, back to the input dtype, times the weight; x itself where the weight is
  // undefined (OLMo's layers have no norm before attention or the MLP).
  // A norm of x with weight w (undefined: none): RMSNorm, or Cohere's LayerNorm.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    if (!w.defined()) return x;
    if (cfg_.layer_norm) return layer_norm(x, w);
    return frozen::add_rms_norm(x.contiguous(), at::Tensor(), w, cfg_.rms_eps, fused_).second;
  }
  // Cohere's LayerNorm (transformers' CohereLayerNorm): in float32, the mean taken out, times w (float32), no bias,
  // rounded once to x's dtype.
  at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w) const {
    return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, w, {}, cfg_.rms_eps).to(x.scalar_type());
  }
  // {x + pending (into `into` where defined), its norm}: the engine's fused RMSNorm, or Cohere's LayerNorm of the sum.
  std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& pending, const at::Tensor& w,
                                             const at::Tensor& into) const {
    if (!cfg_.layer_norm) return frozen::add_rms_norm(x, pending, w, cfg_.rms_eps, fused_, into);
    const at::Tensor sum = add_pending(x, pending, into).first;
    return {sum, layer_norm(sum, w)};
  }

  using QKV = frozen::Qkv;  // [B, heads, T, D], [B, kv_heads, T, D] x 2; q and k normed (Qwen3) and rotated
  // q, k, v of an attention layer from its normed input h.
  // q_scale (query_scale(): Ministral 3's or Llama 4's per-position factor) multiplies the rotated queries where
  // defined.
  QKV project(const DecoderLayer& L, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
              const at::Tensor& q_scale = at::Tensor()) const {
    if (cfg_.mla()) {  // (Mistral 4: its queries times the per-position scale too)
      QKV p = latent_project(L, h, cos, sin);
      if (q_scale.defined()) p.q = (p.q * q_scale).to(p.q.scalar_type());
      return p;
    }
    if (L.queries_only) return queries(L, h, cos, sin);
    at::Tensor qkv = at::linear(h, L.qkv, L.qkv_bias);
    if (cfg_.qk_norm_full) {  // (MiniMax-M2, OLMo: q and k normed over all their heads, then rotated)
      const int64_t q = cfg_.heads * cfg_.head_dim, kv = L.kv_heads * cfg_.head_dim;
      qkv = at::cat({rms_norm(qkv.narrow(-1, 0, q), L.q_norm), rms_norm(qkv.narrow(-1, q, kv), L.k_norm),
                     qkv.narrow(-1, q + kv, kv)},
                    -1);
    }
    if (cfg_.clip_qkv > 0) qkv = qkv.clamp(-cfg_.clip_qkv, cfg_.clip_qkv);  // (OLMoE: after the norms, before RoPE)
    // (per-head q / k norms before RoPE in the one pass: Qwen3's kind)
    const bool per_head_first = !cfg_.qk_norm_full && !cfg_.qk_norm_after_rope;
    QKV p = frozen::qkv_rope(qkv, cfg_.heads, L.kv_heads, per_head_first ? L.q_norm : at::Tensor(),
                             per_head_first ? L.k_norm : at::Tensor(), cfg_.rms_eps, cos, sin, fused_);
    if (L.v_norm.defined()) p.v = rms_norm(p.v, L.v_norm);                                      // (Gemma 4)
    if (cfg_.qk_norm_after_rope) p.q = rms_norm(p.q, L.q_norm), p.k = rms_norm(p.k, L.k_norm);  // (Hunyuan)
    if (q_scale.defined()) p.q = (p.q * q_scale).to(p.q.scalar_type());
    return p;
  }

  // A layer that attends with another's keys and values (Gemma 4's shared layers): its queries alone [B, heads, T, D],
  // normed per head and rotated (k and v undefined).
  QKV queries(const DecoderLayer& L, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t B = h.size(0), T = h.size(1), D = L.qkv.size(0) / cfg_.heads;
    const at::Tensor q =
        rms_norm(at::linear(h, L.qkv, L.qkv_bias).view({B, T, cfg_.heads, D}), L.q_norm).transpose(1, 2);
    QKV out;
    out.q = rotate_half(q, cos, sin).contiguous();
    return out;
  }

  // x [B, heads, T, R] rotated by rotate-half RoPE, x cos + rotate_half(x) sin in x's dtype, with tables cos, sin of
  // R columns: [T, R], [B, T, R] or [B, 1, T, R] (ATen's ops: the layers the fused q|k|v kernel does not take).
  static at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t T = x.size(2), R = x.size(-1), half = R / 2;
    const auto heads = [&](const at::Tensor& t) {
      return t.dim() == 2 ? t.view({1, 1, T, R}) : t.dim() == 3 ? t.unsqueeze(1) : t;
    };
    return x * heads(cos) + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * heads(sin);
  }

  // Ministral 3's query factor per position (positions [T] or [B, T], int64): 1 + beta ln(1 + floor(position /
  // length)) in float32, rounded to the model's dtype, [1 or B, 1, T, 1] (transformers' get_llama_4_attn_scale);
  // undefined for the other families.
  // Layer l's query scale: s, or none on Llama 4's layers that rotate (its temperature is its NoPE layers').
  at::Tensor layer_query_scale(int64_t l, const at::Tensor& s) const {
    return cfg_.query_scale_nope_only && !cfg_.no_rope(l) ? at::Tensor() : s;
  }
  at::Tensor query_scale(const at::Tensor& positions) const {
    if (cfg_.query_scale_beta == 0) return {};
    const at::Tensor pos = positions.dim() == 1 ? positions.unsqueeze(0) : positions;
    const at::Tensor f =
        1 + cfg_.query_scale_beta * at::log(1 + at::floor((pos.to(at::kFloat) + cfg_.query_scale_offset) /
                                                          double(cfg_.query_scale_length)));
    // (Ministral 3: the factor rounded to the model's dtype, then the product; Llama 4: the product in float32, rounded
    // once, as transformers' ops round them)
    return (cfg_.query_scale_nope_only ? f : f.to(dtype_)).unsqueeze(1).unsqueeze(-1);
  }

  // DeepSeek-V3's multi-head latent attention (transformers' DeepseekV3Attention): q = q_b(norm(q_a h)) (or q_proj
  // h), per head [nope | rope]; the latent c = kv_a h = [kv | k_rope], kv_b(norm(kv)) per head [k_nope | v]; the
  // rope parts rotated (their pairs de-interleaved at load, so that rotate-half RoPE gives the interleaved rotation's
  // values), k_rope shared by every head; v padded with zeros to the keys' width (attention_out drops it).
  QKV latent_project(const DecoderLayer& L, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t B = h.size(0), T = h.size(1), H = cfg_.heads, nope = cfg_.qk_nope, rope = cfg_.qk_rope;
    const at::Tensor q_in = L.mla.q_a.defined() ? rms_norm(at::linear(h, L.mla.q_a), L.mla.q_a_norm) : h;
    const at::Tensor q = at::linear(q_in, L.mla.q_b).view({B, T, H, nope + rope}).transpose(1, 2);
    const at::Tensor latent = at::linear(h, L.mla.kv_a);  // [B, T, kv_lora + rope]
    const at::Tensor kv = at::linear(rms_norm(latent.narrow(-1, 0, cfg_.kv_lora), L.mla.kv_a_norm), L.mla.kv_b)
                              .view({B, T, H, nope + cfg_.v_dim})
                              .transpose(1, 2);
    const at::Tensor k_rope = latent.narrow(-1, cfg_.kv_lora, rope).unsqueeze(1);  // [B, 1, T, rope]
    const auto rotate = [&](const at::Tensor& x) { return rotate_half(x, cos, sin); };
    QKV out;
    out.q = at::cat({q.narrow(-1, 0, nope), rotate(q.narrow(-1, nope, rope))}, -1);
    out.k = at::cat({kv.narrow(-1, 0, nope), rotate(k_rope).expand({B, H, T, rope})}, -1);
    const at::Tensor v = kv.narrow(-1, nope, cfg_.v_dim);
    out.v = cfg_.v_dim == cfg_.head_dim ? v.contiguous() : at::constant_pad_nd(v, {0, cfg_.head_dim - cfg_.v_dim});
    return out;
  }

  // 1 / sqrt(head_dim), or the family's own (DeepSeek-V3's with YaRN's mscale).
  double softmax_scale() const {
    return cfg_.softmax_scale > 0 ? cfg_.softmax_scale : 1.0 / std::sqrt(double(cfg_.head_dim));
  }

  // An attention layer's output a [B, heads, T, D] merged to [B, T, heads D] (DeepSeek-V3: its v_dim values of each
  // head), times Qwen3.5's output gate sigmoid(h W_gate^T) in the model's dtype as transformers' ops round it.
  at::Tensor attention_out(const DecoderLayer& L, const at::Tensor& a, const at::Tensor& h) const {
    const at::Tensor merged = layers::merge_heads(cfg_.mla() ? a.narrow(-1, 0, cfg_.v_dim) : a);
    return L.attn_gate.defined() ? merged * at::sigmoid(at::linear(h, L.attn_gate)) : merged;
  }

  // The rest of a layer after attention (a: its merged output [..., heads D], or a Gated DeltaNet's mixer's; h: the
  // layer's normed input): output projection, residual, MLP, residual. (cuBLAS's gate / up product and the separate
  // SwiGLU pass: this cached path's values stay as they were; the training forward above takes frozen::linear_swiglu.)
  // pli: Gemma 4's per-layer input of these rows (layer_input()), where it has them.
  at::Tensor finish_layer(const DecoderLayer& L, const at::Tensor& x, const at::Tensor& a, const at::Tensor& h,
                          const at::Tensor& pli = at::Tensor()) const {
    if (cfg_.single_blocks()) return x + block_output(L, a, h);  // (Nemotron-H: the block's output alone)
    if (cfg_.parallel) {                                         // (Cohere: x + attention + MLP of h)
      const auto [x1, m] = parallel_rest(L, x, a, h);
      return x1 + m;
    }
    if (cfg_.sandwich_norms) {  // (Gemma 3; Gemma 4: the sum times the layer's scalar)
      const auto [x1, m] = sandwich_rest(L, x.contiguous(), a);
      return layer_end(L, x1 + m, pli);
    }
    const at::Tensor o = at::linear(a, L.o_proj, L.o_bias);
    const auto [x1, h2] = frozen::add_rms_norm(x.contiguous(), o, L.post_norm, cfg_.rms_eps, fused_);
    if (L.sparse()) return x1 + experts(L, h2);
    if (cfg_.ungated_mlp()) return x1 + at::linear(mlp_act(L, h2), L.down_proj);
    return x1 + at::linear(frozen::swiglu_packed(at::linear(h2, L.gate_up), fused_), L.down_proj);
  }

  // A single block's output (Nemotron-H's): a mixer's or attention's a through o_proj; an MLP or experts block's (a
  // undefined) from its normed input h.
  at::Tensor block_output(const DecoderLayer& L, const at::Tensor& a, const at::Tensor& h) const {
    if (a.defined()) return at::linear(a, L.o_proj, L.o_bias);
    return L.sparse() ? experts(L, h) : at::linear(mlp_act(L, h), L.down_proj);
  }

  // A dense MLP's activations from its normed input h: SwiGLU of the gate / up product, Arcee's relu(up h)^2, or
  // Apertus's xIELU of up h (u > 0: alpha_p u^2 + beta u; else (expm1(min(u, eps)) - u) alpha_n + beta u).
  at::Tensor mlp_act(const DecoderLayer& L, const at::Tensor& h) const {
    if (!cfg_.ungated_mlp()) return frozen::linear_swiglu(h, L.gate_up, fused_);
    const at::Tensor u = at::linear(h, L.gate_up);
    if (cfg_.xielu_mlp) {
      const at::Tensor linear = L.xielu_beta * u;
      return at::where(u > 0, L.xielu_p * u * u + linear,
                       (at::expm1(at::minimum(u, L.xielu_eps)) - u) * L.xielu_n + linear);
    }
    return relu2(u);
  }
  static at::Tensor relu2(const at::Tensor& u) {
    const at::Tensor r = at::relu(u);
    return r * r;
  }

  // Gemma 3's and OLMo's rest of a layer after attention, each part's output normed before its residual add: {x + the
  // attention's normed output, the MLP's normed output} (the second add the caller's). The MLP's input: that sum normed
  // (Gemma 3's pre_ff_norm), or the sum itself (OLMo); its gate: GELU's tanh approximation (Gemma 3) or SiLU.
  std::pair<at::Tensor, at::Tensor> sandwich_rest(const DecoderLayer& L, const at::Tensor& x,
                                                  const at::Tensor& a) const {
    const at::Tensor o = rms_norm(at::linear(a, L.o_proj, L.o_bias), L.post_norm);
    const auto [x1, h2] = L.pre_ff_norm.defined() ? frozen::add_rms_norm(x, o, L.pre_ff_norm, cfg_.rms_eps, fused_)
                                                  : add_pending(x, o, at::Tensor());
    if (L.router_scale.defined()) {  // (Gemma 4: the MLP's output and the experts', each normed, normed again)
      const at::Tensor mlp = at::linear(frozen::gelu_tanh_packed(at::linear(h2, L.gate_up), fused_), L.down_proj);
      const at::Tensor routed = experts(L, rms_norm(x1, L.pre_ff_norm_2), x1);
      return {x1, rms_norm(rms_norm(mlp, L.post_ff_norm_1) + rms_norm(routed, L.post_ff_norm_2), L.post_ff_norm)};
    }
    if (L.sparse()) return {x1, rms_norm(experts(L, h2), L.post_ff_norm)};  // (FlexOlmo)
    const at::Tensor gate_up = at::linear(h2, L.gate_up);
    // (Gemma 3: GELU's tanh approximation of the gate, as transformers' separate ops round it; else SiLU)
    const at::Tensor act =
        cfg_.gelu_mlp ? frozen::gelu_tanh_packed(gate_up, fused_) : frozen::swiglu_packed(gate_up, fused_);
    return {x1, rms_norm(at::linear(act, L.down_proj), L.post_ff_norm)};
  }

  // Cohere's rest of a layer: {x + the attention's output, the MLP's output of the same normed input h} (the second add
  // the caller's, as transformers adds them: x + attention, then + MLP).
  std::pair<at::Tensor, at::Tensor> parallel_rest(const DecoderLayer& L, const at::Tensor& x, const at::Tensor& a,
                                                  const at::Tensor& h) const {
    return {x + at::linear(a, L.o_proj, L.o_bias),
            at::linear(frozen::linear_swiglu(h, L.gate_up, fused_), L.down_proj)};
  }

  // x + pending (pending undefined: x), into `into` where defined, twice: the residual stream and, with no norm
  // before what reads it (OLMo), its input.
  static std::pair<at::Tensor, at::Tensor> add_pending(const at::Tensor& x, const at::Tensor& pending,
                                                       const at::Tensor& into) {
    if (!pending.defined()) return {x, x};
    if (!into.defined()) {
      const at::Tensor sum = x + pending;
      return {sum, sum};
    }
    at::Tensor sum = into;
    at::add_out(sum, x, pending);
    return {sum, sum};
  }

  // A sparse layer's feed-forward part on h [..., H], as transformers' Qwen3-MoE, Qwen2-MoE, Mixtral
  // and GLM-4.5 blocks compute it with their default grouped products: the router's logits in the
  // model's dtype, their softmax in float32, the top k (renormalised over the k when
  // norm_topk_prob) cast back (Qwen3-MoE) or kept in float32 (Mixtral; GLM-4.5: sigmoid_routing);
  // the (token, expert) pairs sorted by expert, each expert's rows through its gate / up product,
  // SwiGLU and down product as one grouped product each; every output row times its router weight
  // (rounded to the model's dtype where the weight is in it), then each token's k rows summed in
  // float32 and rounded once; the shared expert's MLP of h added to that (Qwen2-MoE: first times
  // sigmoid(h g^T), the gate's product and sigmoid rounded to the dtype as transformers' ops round them).
  // routed: the rows the router reads where they are not h (Gemma 4's: the stream before the experts' norm).
  at::Tensor experts(const DecoderLayer& L, const at::Tensor& h, const at::Tensor& routed_by = at::Tensor()) const {
    const int64_t H = cfg_.hidden, k = cfg_.experts_per_token;
    const at::Tensor x = h.reshape({-1, H});
    at::Tensor top, chosen;
    if (L.router_scale.defined()) {
      std::tie(top, chosen) = gemma4_routing(L, routed_by.reshape({-1, H}));
    } else if (cfg_.sigmoid_router || cfg_.mistral4()) {
      std::tie(top, chosen) = sigmoid_routing(L, x);
    } else if (cfg_.softmax_choice_bias) {
      // ERNIE 4.5: softmax in float32, the top k of softmax + bias, their softmax values renormalised (the sum clamped)
      const at::Tensor probs = at::softmax(at::linear(x.to(at::kFloat), L.router), -1);
      chosen = std::get<1>((probs + L.router_bias).topk(k, -1));
      top = probs.gather(1, chosen);
      top = top / top.sum(-1, /*keepdim=*/true).clamp_min(cfg_.norm_min);
    } else if (cfg_.deepseek_v2()) {
      std::tie(top, chosen) = softmax_group_routing(L, x);
    } else if (cfg_.router_scales_input) {  // (Llama 4: the top k logits' sigmoids, in the model's dtype)
      std::tie(top, chosen) = at::topk(at::linear(x, L.router), k, -1);
      top = at::sigmoid(top.to(at::kFloat)).to(x.scalar_type());
    } else if (L.router_logit_bias.defined()) {
      // gpt-oss: the top k logits (with the router's bias), softmaxed in the model's dtype
      std::tie(top, chosen) = at::topk(at::linear(x, L.router, L.router_logit_bias), k, -1);
      top = at::softmax(top, -1, top.scalar_type());
    } else {
      // (a router held in float32, Hunyuan's: its logits from the rows in float32)
      const at::Tensor logits = at::linear(L.router.scalar_type() == at::kFloat ? x.to(at::kFloat) : x, L.router);
      const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
      std::tie(top, chosen) = at::topk(probs, k, -1);
      if (cfg_.norm_topk) top = top / top.sum(-1, /*keepdim=*/true);
    }
    const at::Tensor ids = chosen.reshape({-1});
    // the pairs in the experts' order (keys of 16 bits: two passes of the radix sort, not eight)
    const at::Tensor order =
        std::get<1>(at::sort(ids.to(cfg_.experts <= 32767 ? at::kShort : at::kInt), /*stable=*/true, 0, false));
    // (Nemotron 3 Super: the experts' rows in their latent width, the router having read the hidden ones)
    const at::Tensor in = L.latent_in.defined() ? at::linear(x, L.latent_in) : x;
    at::Tensor rows = in.index_select(0, order.div(k, "floor"));
    // (Llama 4: each expert's input times its weight, its output summed as it is)
    if (cfg_.router_scales_input) rows = rows * top.reshape({-1}).index_select(0, order).unsqueeze(1);
    // rows per expert, counted on the device (bincount would read the largest id on the host)
    const at::Tensor ends =
        at::zeros({cfg_.experts}, ids.options()).scatter_add_(0, ids, at::ones_like(ids)).cumsum(0).to(at::kInt);
    at::Tensor act, out;
    if (L.experts_gate_up_bias.defined()) {
      // gpt-oss: each product then its expert's bias (transformers' grouped products add them so; the gate / up
      // bias in the clamped GLU's pass);
      // experts kept in MXFP4 dequantized here, each product's weights freed after it
      const at::Tensor expert = ids.index_select(0, order);
      const at::Tensor gate_up = expert_weights(L.experts_gate_up, L.gate_up_blocks, L.gate_up_scales);
      act = frozen::clamped_glu(frozen::grouped_linear(rows, gate_up, ends), L.experts_gate_up_bias, expert,
                                cfg_.glu_alpha, cfg_.glu_limit, fused_);
      const at::Tensor down = expert_weights(L.experts_down, L.down_blocks, L.down_scales);
      out = frozen::grouped_linear(act, down, ends).add_(L.experts_down_bias.index_select(0, expert));
    } else if (L.fp8_gate.values.defined()) {  // experts kept in FP8: dequantized here, each freed after its product
      const at::Tensor gate_up = at::cat({dequantize_fp8(L.fp8_gate), dequantize_fp8(L.fp8_up)}, 1);
      act = frozen::swiglu_packed(frozen::grouped_linear(rows, gate_up, ends), fused_);
      out = frozen::grouped_linear(act, dequantize_fp8(L.fp8_down), ends);
    } else if (cfg_.relu2_mlp) {  // (Nemotron 3: ungated ReLU² experts, up only)
      act = relu2(frozen::grouped_linear(rows, L.experts_gate_up, ends));
      out = frozen::grouped_linear(act, L.experts_down, ends);
    } else {
      const at::Tensor gate_up = frozen::grouped_linear(rows, L.experts_gate_up, ends);
      // (Gemma 4's experts: GELU's tanh approximation of the gate)
      act = cfg_.gelu_mlp ? frozen::gelu_tanh_packed(gate_up, fused_) : frozen::swiglu_packed(gate_up, fused_);
      out = frozen::grouped_linear(act, L.experts_down, ends);
    }
    const at::Tensor slot = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
    const at::Tensor weights = cfg_.router_scales_input    ? at::ones_like(top)
                               : cfg_.float_router_weights ? top
                                                           : top.to(h.scalar_type());
    at::Tensor routed = frozen::combine_experts(out, weights, slot.view({-1, k}), fused_);
    routed = (L.latent_out.defined() ? at::linear(routed, L.latent_out) : routed).view(h.sizes());
    if (!L.shared_gate_up.defined()) return routed;
    const at::Tensor shared = at::linear(
        cfg_.relu2_mlp ? relu2(at::linear(h, L.shared_gate_up)) : frozen::linear_swiglu(h, L.shared_gate_up, fused_),
        L.shared_down);
    if (!L.shared_gate.defined()) return routed + shared;
    return routed + at::sigmoid(at::linear(h, L.shared_gate)) * shared;
  }

  // Gemma 4's choice of experts for the rows r [T, H] (transformers' Gemma4TextRouter): r's weightless RMSNorm (in
  // float32, rounded back), times router.scale and hidden^-1/2 in the model's dtype, through the router; the softmax
  // in float32, the top k renormalised, times each chosen expert's per_expert_scale (float32 [T, k], ids [T, k]).
  std::pair<at::Tensor, at::Tensor> gemma4_routing(const DecoderLayer& L, const at::Tensor& r) const {
    const at::Tensor f = r.to(at::kFloat);
    const at::Tensor normed =
        (f * at::pow(f.pow(2).mean(-1, /*keepdim=*/true) + cfg_.rms_eps, -0.5)).to(r.scalar_type());
    const at::Tensor logits = at::linear(normed * L.router_scale * std::pow(double(cfg_.hidden), -0.5), L.router);
    auto [top, chosen] = at::topk(at::softmax(logits, -1, at::kFloat), cfg_.experts_per_token, -1);
    top = top / top.sum(-1, /*keepdim=*/true);
    return {top * L.per_expert_scale.index_select(0, chosen.reshape({-1})).view_as(chosen), chosen};
  }

  // A layer's experts' weights: as loaded, or dequantized now from the MXFP4 blocks kept.
  at::Tensor expert_weights(const at::Tensor& loaded, const at::Tensor& blocks, const at::Tensor& scales) const {
    return loaded.defined() ? loaded : frozen::dequantize_mxfp4(blocks, scales, dtype_, fused_);
  }

  // DeepSeek-V2's choice of experts for rows x [T, H] (transformers' DeepseekV2TopkRouter): the softmax of x W^T in
  // float32; with groups (group_limited_greedy), the experts outside the topk_groups groups of the best single scores
  // zeroed; the top k, weighted by their softmax values times routed_scale (float32 [T, k]), with their ids [T, k].
  std::pair<at::Tensor, at::Tensor> softmax_group_routing(const DecoderLayer& L, const at::Tensor& x) const {
    const int64_t E = cfg_.experts, G = cfg_.groups;
    at::Tensor probs = at::softmax(at::linear(x.to(at::kFloat), L.router), -1);
    if (G > 1) {
      const at::Tensor best = probs.view({-1, G, E / G}).amax(-1);  // [T, G]
      const at::Tensor kept = at::zeros_like(best).scatter_(1, std::get<1>(best.topk(cfg_.topk_groups, -1)), 1.0);
      probs = probs.masked_fill(kept.unsqueeze(-1).expand({-1, G, E / G}).reshape({-1, E}) == 0, 0.0);
    }
    auto [top, chosen] = probs.topk(cfg_.experts_per_token, -1);
    return {top * cfg_.routed_scale, chosen};
  }

  // GLM-4.5's choice of experts for rows x [T, H] (transformers' Glm4MoeTopkRouter): scores =
  // sigmoid(x W^T) in float32; each group of experts rated by the sum of its two best
  // scores + correction biases; the experts outside the topk_groups best groups out of the
  // choice; the k best scores + biases chosen; their plain scores (renormalised when norm_topk)
  // times routed_scale as the weights, float32 [T, k], with the experts' ids [T, k].
  // Mistral 4's (transformers' Mistral4TopkRouter): the same with the softmax of x W^T in the model's dtype as the
  // scores, no biases (the weights in the model's dtype).
  std::pair<at::Tensor, at::Tensor> sigmoid_routing(const DecoderLayer& L, const at::Tensor& x) const {
    const int64_t E = cfg_.experts, G = cfg_.groups;
    const at::Tensor scores = cfg_.mistral4()               ? at::softmax(at::linear(x, L.router), -1)
                              : cfg_.router_logits_in_dtype ? at::linear(x, L.router).to(at::kFloat).sigmoid()
                                                            : at::linear(x.to(at::kFloat), L.router).sigmoid();
    at::Tensor choice = L.router_bias.defined() ? scores + L.router_bias : scores;
    if (cfg_.topk_groups < G) {
      const at::Tensor group_scores = std::get<0>(choice.view({-1, G, E / G}).topk(2, -1)).sum(-1);  // [T, G]
      const at::Tensor best = std::get<1>(group_scores.topk(cfg_.topk_groups, -1));
      const at::Tensor keep = at::zeros_like(group_scores, at::kBool).scatter_(1, best, true);
      choice = choice.masked_fill(~keep.unsqueeze(-1).expand({-1, G, E / G}).reshape({-1, E}),
                                  -std::numeric_limits<float>::infinity());
    }
    const at::Tensor chosen = std::get<1>(choice.topk(cfg_.experts_per_token, -1));
    at::Tensor top = scores.gather(1, chosen);
    if (cfg_.norm_topk) top = top / (top.sum(-1, /*keepdim=*/true) + 1e-20);
    return {top * cfg_.routed_scale, chosen};
  }

  // A layer's norms under model.layers.N.: before attention, after it (with sandwich norms: the attention's output's;
  // else the MLP's input's), before the MLP and after it (sandwich norms only); empty: none.
  struct NormNames {
    std::string input, post, pre_ff, post_ff;
  };
  NormNames norm_names() const {
    if (cfg_.glm4())
      return {"input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"};
    if (cfg_.nemotron_h()) return {"norm", "", "", ""};  // (one norm a block)
    if (cfg_.bamba()) return {"input_layernorm", "pre_ff_layernorm", "", ""};
    if (cfg_.parallel) return {"input_layernorm", "", "", ""};  // (Cohere: one norm a layer)
    if (cfg_.apertus()) return {"attention_layernorm", "feedforward_layernorm", "", ""};
    if (cfg_.post_norms) return {"", "post_attention_layernorm", "", "post_feedforward_layernorm"};  // (OLMo)
    if (cfg_.afmoe()) return {"input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"};
    if (cfg_.sandwich_norms)  // (Gemma 3)
      return {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"};
    return {"input_layernorm", "post_attention_layernorm", "", ""};
  }
  bool mixtral() const { return cfg_.architecture == "MixtralForCausalLM"; }
  bool gpt_oss() const { return cfg_.architecture == "GptOssForCausalLM"; }
  bool qwen3_next() const { return cfg_.architecture == "Qwen3NextForCausalLM"; }
  // Phi-3 / Phi-4 store the projections packed as the engine runs them: self_attn.qkv_proj [q; k; v]
  // and mlp.gate_up_proj [gate; up] (transformers' Phi3Attention / Phi3MLP split them in that order).
  bool packed() const { return cfg_.architecture == "Phi3ForCausalLM"; }
  // gate | up stored packed as mlp.gate_up_proj [gate; up]: Phi-3 / Phi-4's and GLM-4's (both kinds)
  bool mlp_packed() const { return packed() || cfg_.glm_attention(); }
  // Where a sparse layer's tensors sit under model.layers.N.: the router at <block>gate.weight,
  // expert e's projections at <block>experts.e.<gate | up | down>.
  struct ExpertKeys {
    std::string block, gate, up, down;
  };
  ExpertKeys expert_keys() const {
    if (mixtral() || cfg_.minimax_m2()) return {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight"};
    return {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"};
  }
  // Qwen3-VL-MoE's stacked experts: published as each product's transpose ([E, H, 2 I], [E, I, H]), held and
  // saved by transformers as `held` ([E, 2 I, H], [E, H, I]; it transposes at load unless the shape is held's).
  // The shape the checkpoint's tensor is to have: held's where it has it, else the published one.
  std::vector<int64_t> stacked_layout(const std::string& name, const std::vector<int64_t>& held) const {
    const safetensors::TensorInfo* info = checkpoint_->find(name);
    return info && info->shape == held ? held : std::vector<int64_t>{held[0], held[2], held[1]};
  }
  // Where a router's correction biases sit under model.layers.N. (GLM-4.5, DeepSeek-V3: mlp.gate.; MiniMax-M2:
  // block_sparse_moe., beside its router; ERNIE 4.5: mlp.moe_statics.; K-EXAONE: mlp.).
  std::string router_bias_key(const std::string& p) const {
    if (cfg_.ernie4_5_moe()) return p + "mlp.moe_statics.e_score_correction_bias";
    if (cfg_.afmoe()) return p + "mlp.expert_bias";
    // (K-EXAONE as published and as transformers saves it: beside the router, which transformers' loader renames)
    if (cfg_.exaone_moe() && checkpoint_->find(p + "mlp.e_score_correction_bias"))
      return p + "mlp.e_score_correction_bias";
    return p + (cfg_.minimax_m2() ? "block_sparse_moe." : "mlp.gate.") + "e_score_correction_bias";
  }
  // Where the shared expert's projections sit under model.layers.N. (GLM-4.5: mlp.shared_experts.,
  // Qwen2-MoE: mlp.shared_expert., Granite: shared_mlp.).
  std::string shared_block() const {
    if (cfg_.granite_moe()) return "shared_mlp.";
    if (cfg_.hunyuan_moe()) return "mlp.shared_mlp.";
    if (cfg_.llama4()) return "feed_forward.shared_expert.";
    return cfg_.shared_gate ? "mlp.shared_expert." : "mlp.shared_experts.";
  }
  // Granite's stacked experts [E, gate | up, H] and [E, H, I] under model.layers.N.: input_linear / output_linear as
  // GraniteMoe's checkpoints hold them, GraniteMoeSWA's as transformers' experts module saves them.
  std::pair<std::string, std::string> granite_experts() const {
    if (cfg_.granite_swa()) return {"block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"};
    return {"block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"};
  }
  // A sparse layer's router under model.layers.N. (Granite's: block_sparse_moe.router.layer.; Hunyuan's: mlp.gate.wg.;
  // else <block>gate.)
  std::string router_key(const std::string& p) const {
    if (cfg_.granite_moe() && cfg_.granite_swa()) return p + "block_sparse_moe.router.weight";
    if (cfg_.granite_moe()) return p + "block_sparse_moe.router.layer.weight";
    if (cfg_.llama4()) return p + "feed_forward.router.weight";
    if (cfg_.afmoe()) return p + "mlp.router.gate.weight";
    return p + (cfg_.hunyuan_moe() ? "mlp.gate.wg.weight" : expert_keys().block + "gate.weight");
  }
  // The routers transformers runs in float32: GLM-4.5's and DeepSeek-V3's sigmoid (not MiniMax-M2's, whose product is
  // in the model's dtype), ERNIE 4.5's, Hunyuan's and DeepSeek-V2's softmax.
  bool router_fp32() const {
    return ((cfg_.sigmoid_router || cfg_.softmax_choice_bias) && !cfg_.router_logits_in_dtype) || cfg_.hunyuan_moe() ||
           cfg_.deepseek_v2();
  }
  // Experts stored as two stacked tensors a layer (Qwen3-VL-MoE, Granite), not one set of tensors an expert.
  bool stacked_experts() const { return cfg_.qwen3_vl() || cfg_.granite_moe() || cfg_.llama4() || cfg_.mistral4(); }
  // Where a layer's MLP sits under model.layers.N. (Llama 4: feed_forward.)
  std::string ff() const {
    return cfg_.llama4() || cfg_.bamba() ? "feed_forward." : cfg_.nemotron_h() ? "mixer." : "mlp.";
  }
  // Where an attention layer's projections, a Mamba-2 layer's tensors, the embedding and the final norm sit
  // (Nemotron-H's: every block's under mixer., backbone.embeddings, backbone.norm_f; Bamba's final_layernorm).
  std::string attn() const { return cfg_.nemotron_h() ? "mixer." : "self_attn."; }
  std::string mamba() const { return cfg_.nemotron_h() ? "mixer." : "mamba."; }
  std::string embed_name() const { return cfg_.nemotron_h() ? "embeddings.weight" : "embed_tokens.weight"; }
  std::string final_norm_name() const {
    return cfg_.nemotron_h() ? "norm_f.weight" : cfg_.bamba() ? "final_layernorm.weight" : "norm.weight";
  }

  // The config.json keys that size a mixture of experts' tensors, as ", key value ..." for a message.
  std::string experts_sizes() const {
    if (cfg_.experts == 0) return "";
    std::string s = ", " + cfg_.experts_key + " " + std::to_string(cfg_.experts);
    if (!mixtral() && !gpt_oss() && !cfg_.minimax_m2() && !cfg_.granite_moe() && !cfg_.hunyuan_moe())
      s += ", moe_intermediate_size " + std::to_string(cfg_.moe_intermediate);
    if (cfg_.granite_moe() || cfg_.hunyuan_moe()) s += ", intermediate_size " + std::to_string(cfg_.moe_intermediate);
    if (cfg_.shared_experts > 0) s += ", n_shared_experts " + std::to_string(cfg_.shared_experts);
    if (cfg_.shared_gate) s += ", shared_expert_intermediate_size " + std::to_string(cfg_.shared_intermediate);
    if (cfg_.granite_moe() && cfg_.shared_intermediate > 0)
      s += ", shared_intermediate_size " + std::to_string(cfg_.shared_intermediate);
    return s;
  }

  // Qwen3.5's Gated DeltaNet sizes, as ", linear_num_key_heads 16, ..." for a message, Granite 4.0-H's Mamba-2 ones
  // (else nothing).
  std::string linear_sizes() const {
    if (cfg_.linear.empty()) return "";
    if (cfg_.mamba2())
      return ", mamba_n_heads " + std::to_string(cfg_.mamba_heads) + ", mamba_d_head " +
             std::to_string(cfg_.mamba_head_dim) + ", mamba_n_groups " + std::to_string(cfg_.mamba_groups) +
             ", mamba_d_state " + std::to_string(cfg_.mamba_state) + ", mamba_d_conv " +
             std::to_string(cfg_.conv_kernel);
    return ", linear_num_key_heads " + std::to_string(cfg_.lin_k_heads) + ", linear_num_value_heads " +
           std::to_string(cfg_.lin_v_heads) + ", linear_key_head_dim " + std::to_string(cfg_.lin_k_dim) +
           ", linear_value_head_dim " + std::to_string(cfg_.lin_v_dim) + ", linear_conv_kernel_dim " +
           std::to_string(cfg_.conv_kernel);
  }

  // "3 Mamba-2 layers (mamba_n_heads 8, ...), " for a model with recurrent layers, else nothing
  std::string recurrent_str() const {
    if (cfg_.linear.empty()) return "";
    const auto n = std::count(cfg_.linear.begin(), cfg_.linear.end(), 1);
    return std::to_string(n) + (cfg_.mamba2() ? " Mamba-2" : " Gated DeltaNet") + " layers (" +
           linear_sizes().substr(2) + "), ";
  }

  // ", 128 experts (8 a token)" for a mixture of experts, else nothing
  std::string experts_str() const {
    if (cfg_.experts == 0) return "";
    return std::to_string(cfg_.experts) + " experts (" + std::to_string(cfg_.experts_per_token) + " a token" +
           (cfg_.quant_method.empty()  ? ""
            : keep_mxfp4_ || keep_fp8_ ? ", " + cfg_.quant_method + " kept, dequantized a layer at a time"
                                       : ", " + cfg_.quant_method + " dequantized") +
           "), ";
  }

  // The most float32 scores a chunk of dense attention with sinks holds: 2^28 (1 GiB), or
  // FLASHDRAFT_VERIFY_SCORES (the tests' way to run many chunks at tiny shapes).
  static int64_t verify_scores() {
    static const int64_t n = [] {
      const char* v = std::getenv("FLASHDRAFT_VERIFY_SCORES");
      return v && std::atoll(v) > 0 ? static_cast<int64_t>(std::atoll(v)) : int64_t(1) << 28;
    }();
    return n;
  }

  // A layer with dense attention over [prefix keys/values | its own], mask [B, 1, T, K]
  // (true = visible); returns its output and its own keys/values. Gemma 4: pli its per-layer input; a shared layer's
  // own keys / values (k_own, v_own: its source's over the same rows) in place of a projection of its own.
  struct DenseOut {
    at::Tensor x, k, v;
  };
  DenseOut dense_layer(const DecoderLayer& L, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& q_scale, const at::Tensor& k_prefix, const at::Tensor& v_prefix,
                       const at::Tensor& mask, const at::Tensor& pli = at::Tensor(),
                       const at::Tensor& k_own = at::Tensor(), const at::Tensor& v_own = at::Tensor()) const {
    const at::Tensor h = rms_norm(x, L.input_norm);
    QKV p = project(L, h, cos, sin, q_scale);
    if (L.queries_only) p.k = k_own, p.v = v_own;
    const int64_t group = cfg_.heads / L.kv_heads;
    const at::Tensor k = (k_prefix.defined() ? at::cat({k_prefix, p.k}, 2) : p.k).repeat_interleave(group, 1);
    const at::Tensor v = (v_prefix.defined() ? at::cat({v_prefix, p.v}, 2) : p.v).repeat_interleave(group, 1);
    const double scale = softmax_scale();
    at::Tensor a;
    if (L.sinks.defined()) {
      // the softmax over the visible scores and the head's sink logit, in float32, the sink's share dropped;
      // in chunks of queries whose scores take at most ~1 GiB (verification's blocks: 8192 queries of 64 heads
      // over ~11K keys would be 24 GiB at once)
      const int64_t B = p.q.size(0), Hq = p.q.size(1), T = p.q.size(2), K = k.size(2);
      const int64_t chunk = std::max<int64_t>(1, verify_scores() / std::max<int64_t>(1, B * Hq * K));
      const at::Tensor kf = k.to(at::kFloat).transpose(-1, -2), vf = v.to(at::kFloat);
      std::vector<at::Tensor> parts;
      for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t n = std::min(chunk, T - t0);
        const at::Tensor s = (at::matmul(p.q.narrow(2, t0, n).to(at::kFloat), kf) * scale)
                                 .masked_fill(~mask.narrow(2, t0, n), -std::numeric_limits<float>::infinity());
        const at::Tensor sink = L.sinks.view({1, -1, 1, 1}).expand({B, Hq, n, 1});
        const at::Tensor probs = at::softmax(at::cat({s, sink}, -1), -1).narrow(-1, 0, K);
        parts.push_back(at::matmul(probs, vf).to(p.q.scalar_type()));
      }
      a = parts.size() == 1 ? parts[0] : at::cat(parts, 2);
    } else {
      a = at::scaled_dot_product_attention(p.q, k, v, mask, 0.0, false, scale);
    }
    return {finish_layer(L, x, attention_out(L, a, h), h, pli), p.k, p.v};
  }

  // cos/sin [B, 1, T, D] for positions [B, T], in fp32 as transformers computes them. LongRoPE: a
  // forward whose longest position + 1 passes the pretraining length takes the long factors, as
  // transformers' dynamic update does per forward: per row here (each row as its own served
  // decoding, as z-lab's dflash_generate runs one), or over the whole batch (whole_batch: the
  // training forward, as transformers runs a batch).
  // local: Gemma 3's and OLMo 3's sliding layers' tables.
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, bool whole_batch = false,
                                                bool local = false) const {
    at::Tensor inv = local ? local_inv_freq_ : inv_freq_;
    if (!local && long_inv_freq_.defined()) {
      const at::Tensor reach = whole_batch ? positions.max().view({1, 1, 1}) : positions.amax(-1).view({-1, 1, 1});
      inv = at::where(reach + 1 > cfg_.rope.original_max_position, long_inv_freq_, inv_freq_);  // [B or 1, 1, D/2]
    }
    const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv;
    return cos_sin(at::cat({freqs, freqs}, -1).unsqueeze(1), local);
  }
  // The frequencies of a forward over positions 0..seq_len-1 (LongRoPE: short or long, as above).
  const at::Tensor& inv_freq_for(int64_t seq_len) const {
    return long_inv_freq_.defined() && seq_len > cfg_.rope.original_max_position ? long_inv_freq_ : inv_freq_;
  }

  // Visibility for verification: the context causal within each document [B, 1, S, S]; the
  // blocks [B, 1, N*BS, S + N*BS]: block n sees context positions before its anchor in the
  // anchor's document, and its own positions up to the query's (causal); with a sliding window W
  // > 0 only keys fewer than W positions before the query (block n's query j sits at anchor + j).
  std::pair<at::Tensor, at::Tensor> verify_masks(const Batch& batch, const at::Tensor& anchor, int64_t S, int64_t BS,
                                                 int64_t W) const {
    const int64_t B = anchor.size(0), N = anchor.size(1), L = N * BS;
    const MaskInput docs = document_mask(row_documents(batch), S);
    std::vector<int64_t> doc_ids;
    for (const auto& row : docs.doc_lengths)
      for (size_t d = 0; d < row.size(); ++d) doc_ids.insert(doc_ids.end(), static_cast<size_t>(row[d]), int64_t(d));
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
    const at::Tensor doc = at::tensor(doc_ids, at::TensorOptions().dtype(at::kLong)).view({B, S}).to(device_);
    const at::Tensor pos = at::arange(S, long_opts);
    const at::Tensor same_doc = doc.unsqueeze(2).eq(doc.unsqueeze(1));
    at::Tensor mask_c = (pos.unsqueeze(1) >= pos.unsqueeze(0)).unsqueeze(0) & same_doc;
    const at::Tensor anchor_doc = doc.gather(1, anchor);
    const at::Tensor context =
        pos.view({1, 1, S}).lt(anchor.unsqueeze(2)) & doc.unsqueeze(1).eq(anchor_doc.unsqueeze(2));
    const at::Tensor q = at::arange(L, long_opts);
    at::Tensor own =
        (q.unsqueeze(1).div(BS, "floor") == q.unsqueeze(0).div(BS, "floor")) & (q.unsqueeze(1) >= q.unsqueeze(0));
    at::Tensor ctx = context.unsqueeze(2).expand({B, N, BS, S}).reshape({B, L, S});
    if (W > 0) {
      mask_c = mask_c & (pos.unsqueeze(1) - pos.unsqueeze(0)).lt(W).unsqueeze(0);
      own = own & (q.unsqueeze(1) - q.unsqueeze(0)).lt(W);
      const at::Tensor query_pos = (anchor.unsqueeze(2) + at::arange(BS, long_opts)).reshape({B, L});  // [B, L]
      ctx = ctx & (query_pos.unsqueeze(2) - pos.view({1, 1, S})).lt(W);
    }
    const at::Tensor mask_b = at::cat({ctx, own.unsqueeze(0).expand({B, L, L})}, 2);
    return {mask_c.unsqueeze(1), mask_b.unsqueeze(1)};
  }

  void load_every_layer() {
    if (static_cast<int64_t>(layers_.size()) == cfg_.layers) return;
    for (int64_t l = static_cast<int64_t>(layers_.size()); l < cfg_.layers; ++l) layers_.push_back(load_layer(l));
    if (say_) say_("target: loaded all " + std::to_string(cfg_.layers) + " decoder layers (target verification)");
  }

  // Once per run: a conversation longer than the checkpoint's length (hf::ModelConfig::max_position)
  // gives the drafter states at positions the target was not made for; transformers runs them
  // without a word.
  void warn_past_max_position(const std::vector<std::vector<int64_t>>& rows) {
    if (warned_past_max_position_ || cfg_.max_position <= 0 || !say_) return;
    int64_t longest = 0;
    for (const auto& row : rows)
      for (int64_t len : row) longest = std::max(longest, len);
    if (longest <= cfg_.max_position) return;
    warned_past_max_position_ = true;
    const std::string m = std::to_string(cfg_.max_position);
    say_("warning: target: a conversation of " + std::to_string(longest) + " tokens runs past the " + m +
         " positions the checkpoint is made for (" + cfg_.path +
         ": max_position_embeddings, or rope_scaling's factor x its original length); its hidden states from "
         "position " +
         m + " on are ones a server of this model never produces. Give [dataset] seq_len <= " + m +
         ", or a checkpoint whose rope_scaling covers the length (said once)");
  }

  // Each position's place in its document ([B, S] int64 on the device): p minus the start
  // of p's document (0..S-1 for a row of one document).
  at::Tensor document_positions(const MaskInput& docs, int64_t B, int64_t S) const {
    at::Tensor pos = at::empty({B, S}, at::TensorOptions().dtype(at::kLong));
    int64_t* p = pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      int64_t start = 0;
      for (int64_t len : docs.doc_lengths[static_cast<size_t>(b)]) {
        for (int64_t t = start; t < start + len && t < S; ++t) p[b * S + t] = t - start;
        start += len;
      }
    }
    return to_device(pos);
  }

  // A host tensor on the device without waiting for the device's queue: through pinned memory,
  // asynchronously (a plain .to(device) from pageable memory synchronises the stream, and the
  // device then idles while the host queues the next kernels).
  at::Tensor to_device(const at::Tensor& host) const {
    if (!device_.is_cuda() || !host.device().is_cpu()) return host.to(device_);
    return host.contiguous().pin_memory().to(device_, /*non_blocking=*/true);
  }

  // Causal within each document: a row's documents, then its padding as one more.
  static MaskInput document_mask(const std::vector<std::vector<int64_t>>& rows, int64_t S) {
    MaskInput in;
    in.batch = static_cast<int64_t>(rows.size());
    in.q_len = S;
    in.kv_len = S;
    for (std::vector<int64_t> docs : rows) {
      int64_t used = 0;
      for (int64_t d : docs) used += d;
      if (used < S) docs.push_back(S - used);  // padding: a document of its own
      docs.erase(std::remove(docs.begin(), docs.end(), 0), docs.end());
      in.doc_lengths.push_back(docs);
    }
    return in;
  }

  Config config_;
  std::string path_, dtype_name_;
  bool fused_ = true;        // [target] kernels = "engine"
  bool keep_mxfp4_ = false;  // [target] mxfp4 = "keep"
  bool keep_fp8_ = false;    // [target] fp8 = "keep"
  std::string cache_path_;   // [target] hidden_cache
  std::unique_ptr<HiddenCache> cache_;
  bool warned_past_max_position_ = false;
  hf::ModelConfig cfg_;
  std::unique_ptr<safetensors::Checkpoint> checkpoint_;
  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = at::kFloat;
  std::function<void(const std::string&)> say_;
  bool tied_ = false;
  at::Tensor embed_, lm_head_, final_norm_, inv_freq_;
  at::Tensor long_inv_freq_;   // LongRoPE's frequencies past the pretraining length (undefined otherwise)
  at::Tensor local_inv_freq_;  // Gemma 3's / 4's sliding layers' frequencies (undefined otherwise)
  // Gemma 4's per-layer embeddings (undefined without them): the table [ple_vocab, layers x ple], the embedding's
  // projection [layers x ple, H] and its norm [ple]
  at::Tensor ple_embed_, ple_model_proj_, ple_proj_norm_;
  at::Tensor local_cos_, local_sin_;  // their tables as plain_cos_ / plain_sin_
  at::Tensor plain_cos_, plain_sin_;  // hidden_states()' tables for positions 0..S-1, the last S asked
  std::vector<DecoderLayer> layers_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(
    target, "hf", "0.1.0",
    "Hugging Face decoder checkpoint run online as the target: Llama, Mistral, Ministral 3, Qwen2 / 3 / "
    "3.5 / 3-Next, Qwen2-VL / 2.5-VL / 3-VL, Phi-3, Gemma 3 / 4, SmolLM3, OLMo 2 / 3, GLM-4 / 4.1V / 4.5V, "
    "EXAONE 4, ERNIE 4.5, Seed-OSS, Hunyuan, Granite 3 / 4.0 (attention layers) / SWA, Cohere / Cohere 2, Arcee, "
    "Apertus, "
    "and the mixtures of experts Qwen-MoE, Mixtral, GLM-4.5 / 4.7-Flash, DeepSeek-V2 / V3, Mistral 4, gpt-oss, "
    "MiniMax-M2, "
    "ERNIE 4.5 MoE, Granite MoE, dots.llm1, Hunyuan-A13B, OLMoE, FlexOlmo, Llama 4, AFMoE, Solar Open",
    flashdraft::HfTarget)

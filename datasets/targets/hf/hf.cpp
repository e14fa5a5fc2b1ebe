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
// exactly as transformers computes it (RMSNorm in fp32, weight applied in the model's
// dtype; RoPE tables in fp32). Layer id L is the output of decoder layer L, which is
// transformers' hidden_states[L + 1]; for the last layer that is after the model's final
// RMSNorm (transformers reports the normed state there), so it is here too. Attention is causal within each document of
// a row (packed rows: Batch::documents; padded rows: the tokens past a row's length are a document of their own, so
// they never change the real ones).
#include "hf_config.hpp"

#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <torch/torch.h>

#include <cmath>
#include <filesystem>

namespace flashdraft {
namespace {

struct DecoderLayer {
  at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_bias, k_bias, v_bias, o_bias, q_norm, k_norm, post_norm,
      gate_proj, up_proj, down_proj;
};

c10::ScalarType dtype_named(const std::string& name, c10::Device device) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return device.is_cuda() ? at::kBFloat16 : at::kFloat;  // "auto"
}

class HfTarget final : public Target {
 public:
  static void declare(Schema& s) {
    s.string("path", "Hugging Face checkpoint folder (config.json and model.safetensors or its shards)");
    s.string("dtype", "compute dtype of the target (auto: bfloat16 on CUDA, float32 on CPU)")
        .def(std::string("auto"))
        .one_of({"auto", "float32", "bfloat16", "float16"});
  }

  explicit HfTarget(const Config& c) : config_(c), path_(c.string("path")), dtype_name_(c.string("dtype")) {}

  void open(const RunContext& ctx) override {
    try {
      cfg_ = hf::read_config(path_);
      checkpoint_ = std::make_unique<safetensors::Checkpoint>(path_);
    } catch (const std::exception& e) {
      config_.fail("path", e.what());
    }
    device_ = ctx.device;
    dtype_ = dtype_named(dtype_name_, device_);
    say_ = ctx.say;
    check_shapes();
    embed_ = load("model.embed_tokens.weight");
    tied_ = cfg_.tie_embeddings == 1 || (cfg_.tie_embeddings == -1 && !checkpoint_->find("lm_head.weight"));
    lm_head_ = tied_ ? embed_ : load("lm_head.weight");
    final_norm_ = load("model.norm.weight");
    const at::Tensor exponents = at::arange(0, cfg_.head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
    inv_freq_ =
        scaled_inv_freq(1.0 / at::pow(at::tensor(cfg_.rope_theta, at::kFloat), exponents / double(cfg_.head_dim)));
  }

  TargetModel model() const override {
    TargetModel t;
    t.embedding = embed_;
    t.lm_head = lm_head_;
    t.vocab = cfg_.vocab;
    t.hidden = cfg_.hidden;
    t.layers = cfg_.layers;
    for (int64_t l = 0; l < cfg_.layers; ++l) t.exported_layers.push_back(l);
    t.online = true;
    t.source = cfg_.architecture + " " + std::filesystem::absolute(path_).string() + " (" +
               std::to_string(cfg_.layers) + " layers, hidden " + std::to_string(cfg_.hidden) + ", vocab " +
               std::to_string(cfg_.vocab) + ", " + c10::toString(dtype_) + (tied_ ? ", tied embeddings" : "") + ")";
    return t;
  }

  AttentionProblem attention_problem(int64_t batch, int64_t seq_len) const override {
    AttentionProblem p;
    p.device = device_;
    p.dtype = dtype_;
    p.batch = batch;
    p.heads_q = cfg_.heads;
    p.heads_kv = cfg_.kv_heads;
    p.q_len = seq_len;
    p.kv_len = seq_len;
    p.head_dim = cfg_.head_dim;
    p.needs_backward = false;
    return p;
  }

  int64_t prepare(const std::vector<int64_t>& layers) override {
    int64_t deepest = -1;
    for (int64_t l : layers) {
      if (l < 0 || l >= cfg_.layers)
        throw std::invalid_argument("hf target: layer " + std::to_string(l) + " requested, the model has layers 0.." +
                                    std::to_string(cfg_.layers - 1));
      deepest = std::max(deepest, l);
    }
    for (int64_t l = static_cast<int64_t>(layers_.size()); l <= deepest; ++l) layers_.push_back(load_layer(l));
    if (say_)
      say_("target: loaded " + std::to_string(layers_.size()) + " of " + std::to_string(cfg_.layers) +
           " decoder layers (the deepest the drafter reads is " + std::to_string(deepest) + ")");
    return deepest + 1;
  }

  at::Tensor hidden_states(const Batch& batch, const std::vector<int64_t>& layers,
                           AttentionContext& attention) override {
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
    if (cfg_.sliding_window > 0 && S > cfg_.sliding_window)
      throw std::invalid_argument("hf target: sequences of " + std::to_string(S) + " tokens exceed the model's " +
                                  "sliding_window " + std::to_string(cfg_.sliding_window) +
                                  " (sliding-window attention is not supported; use seq_len <= the window)");
    int64_t deepest = -1;
    for (int64_t l : layers) deepest = std::max(deepest, l);
    if (deepest >= static_cast<int64_t>(layers_.size()))
      throw std::logic_error("hf target: layer " + std::to_string(deepest) + " was not prepared");
    attention.set_mask(document_mask(batch, B, S));
    const at::Tensor tokens = batch.tokens.to(device_, at::kLong);
    at::Tensor x = embed_.index_select(0, tokens.reshape({-1})).view({B, S, cfg_.hidden});
    const at::Tensor pos = at::arange(S, at::TensorOptions().dtype(at::kFloat).device(device_));
    const at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.to(device_).unsqueeze(0);  // [S, D/2], fp32
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    const at::Tensor cos = emb.cos().to(dtype_), sin = emb.sin().to(dtype_);
    std::vector<at::Tensor> out(layers.size());
    for (int64_t l = 0; l <= deepest; ++l) {
      x = layer_forward(layers_[static_cast<size_t>(l)], x, cos, sin, l, attention);
      const at::Tensor state = l == cfg_.layers - 1 ? rms_norm(x, final_norm_) : x;
      for (size_t i = 0; i < layers.size(); ++i)
        if (layers[i] == l) out[i] = state;
    }
    return at::stack(out, 2);  // [B, S, E, H]
  }

 private:
  at::Tensor load(const std::string& name) const { return checkpoint_->load(name, device_, dtype_); }

  // Every tensor the model reads, with the shape config.json implies; the first
  // mismatch or missing tensor is refused before anything is loaded.
  void check_shapes() const {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim, q = cfg_.heads * D, kv = cfg_.kv_heads * D;
    std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
        {"model.embed_tokens.weight", {cfg_.vocab, H}}, {"model.norm.weight", {H}}};
    if (cfg_.tie_embeddings != 1 && (cfg_.tie_embeddings == 0 || checkpoint_->find("lm_head.weight")))
      expected.push_back({"lm_head.weight", {cfg_.vocab, H}});
    for (int64_t l = 0; l < cfg_.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const auto& e :
           std::vector<std::pair<std::string, std::vector<int64_t>>>{{"input_layernorm.weight", {H}},
                                                                     {"post_attention_layernorm.weight", {H}},
                                                                     {"self_attn.q_proj.weight", {q, H}},
                                                                     {"self_attn.k_proj.weight", {kv, H}},
                                                                     {"self_attn.v_proj.weight", {kv, H}},
                                                                     {"self_attn.o_proj.weight", {H, q}},
                                                                     {"mlp.gate_proj.weight", {cfg_.intermediate, H}},
                                                                     {"mlp.up_proj.weight", {cfg_.intermediate, H}},
                                                                     {"mlp.down_proj.weight", {H, cfg_.intermediate}}})
        expected.push_back({p + e.first, e.second});
      if (cfg_.qkv_bias || cfg_.o_bias)
        for (const auto& e : std::vector<std::pair<std::string, std::vector<int64_t>>>{
                 {"self_attn.q_proj.bias", {q}}, {"self_attn.k_proj.bias", {kv}}, {"self_attn.v_proj.bias", {kv}}})
          expected.push_back({p + e.first, e.second});
      if (cfg_.o_bias) expected.push_back({p + "self_attn.o_proj.bias", {H}});
      if (cfg_.qk_norm) {
        expected.push_back({p + "self_attn.q_norm.weight", {D}});
        expected.push_back({p + "self_attn.k_norm.weight", {D}});
      }
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
                                 ", vocab_size " + std::to_string(cfg_.vocab) + ") implies " + list_str(shape));
    }
  }

  DecoderLayer load_layer(int64_t l) const {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    DecoderLayer L;
    L.input_norm = load(p + "input_layernorm.weight");
    L.post_norm = load(p + "post_attention_layernorm.weight");
    L.q_proj = load(p + "self_attn.q_proj.weight");
    L.k_proj = load(p + "self_attn.k_proj.weight");
    L.v_proj = load(p + "self_attn.v_proj.weight");
    L.o_proj = load(p + "self_attn.o_proj.weight");
    if (cfg_.qkv_bias || cfg_.o_bias) {
      L.q_bias = load(p + "self_attn.q_proj.bias");
      L.k_bias = load(p + "self_attn.k_proj.bias");
      L.v_bias = load(p + "self_attn.v_proj.bias");
    }
    if (cfg_.o_bias) L.o_bias = load(p + "self_attn.o_proj.bias");
    if (cfg_.qk_norm) {
      L.q_norm = load(p + "self_attn.q_norm.weight");
      L.k_norm = load(p + "self_attn.k_norm.weight");
    }
    L.gate_proj = load(p + "mlp.gate_proj.weight");
    L.up_proj = load(p + "mlp.up_proj.weight");
    L.down_proj = load(p + "mlp.down_proj.weight");
    return L;
  }

  // RoPE frequencies with the config's scaling (linear: positions / factor; llama3:
  // long wavelengths divided by factor, short kept, a smooth blend between).
  at::Tensor scaled_inv_freq(at::Tensor inv) const {
    const hf::RopeScaling& r = cfg_.rope;
    if (r.type == "linear") return inv / r.factor;
    if (r.type != "llama3") return inv;
    const double low_wavelen = double(r.original_max_position) / r.low_freq_factor;
    const double high_wavelen = double(r.original_max_position) / r.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor out = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    const at::Tensor smooth =
        (double(r.original_max_position) / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * out / r.factor + smooth * out;
    const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    return at::where(medium, smoothed, out);
  }

  // x / sqrt(mean(x^2) + eps) in fp32, back to the input dtype, times the weight.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, true) + cfg_.rms_eps);
    return w * y.to(x.scalar_type());
  }

  static at::Tensor rotate_half(const at::Tensor& x) {
    const int64_t half = x.size(-1) / 2;
    return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  }

  at::Tensor layer_forward(const DecoderLayer& L, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           int64_t index, AttentionContext& attention) const {
    const int64_t B = x.size(0), S = x.size(1), D = cfg_.head_dim;
    const at::Tensor h = rms_norm(x, L.input_norm);
    auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({B, S, n, D}).transpose(1, 2); };
    at::Tensor q = heads(at::linear(h, L.q_proj, L.q_bias), cfg_.heads);
    at::Tensor k = heads(at::linear(h, L.k_proj, L.k_bias), cfg_.kv_heads);
    const at::Tensor v = heads(at::linear(h, L.v_proj, L.v_bias), cfg_.kv_heads);
    if (cfg_.qk_norm) {
      q = rms_norm(q, L.q_norm);
      k = rms_norm(k, L.k_norm);
    }
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    const at::Tensor a =
        attention.attention(index, q.contiguous(), k.contiguous(), v.contiguous(), 1.0 / std::sqrt(double(D)));
    const at::Tensor x1 = x + at::linear(a.transpose(1, 2).reshape({B, S, cfg_.heads * D}), L.o_proj, L.o_bias);
    const at::Tensor h2 = rms_norm(x1, L.post_norm);
    return x1 + at::linear(at::silu(at::linear(h2, L.gate_proj)) * at::linear(h2, L.up_proj), L.down_proj);
  }

  // Causal within each document: a packed row's documents, or [length, padding].
  static MaskInput document_mask(const Batch& batch, int64_t B, int64_t S) {
    MaskInput in;
    in.batch = B;
    in.q_len = S;
    in.kv_len = S;
    const at::Tensor lengths =
        batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> docs;
      if (static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[static_cast<size_t>(b)].empty())
        docs = batch.documents[static_cast<size_t>(b)];
      else
        docs = {lengths.defined() ? std::min(lengths.data_ptr<int64_t>()[b], S) : S};
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
  hf::ModelConfig cfg_;
  std::unique_ptr<safetensors::Checkpoint> checkpoint_;
  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = at::kFloat;
  std::function<void(const std::string&)> say_;
  bool tied_ = false;
  at::Tensor embed_, lm_head_, final_norm_, inv_freq_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(target, "hf", "0.1.0",
                  "Hugging Face decoder checkpoint (Llama, Mistral, Qwen2, Qwen3) run online as the target",
                  flashdraft::HfTarget)

// The embedded default data: a small target LM that needs no download.
//
// A pre-norm transformer (RMSNorm, causal multi-head attention with RoPE, SwiGLU MLP,
// final RMSNorm, untied LM head) is initialised from a fixed seed. It continues random
// prompts greedily; the drafter then learns the target's greedy continuation from the
// target's hidden states, which is exactly what speculative decoding asks of it.
//
// Keeping greedy text non-trivial yet learnable: with every weight at variance 1/fan_in
// (the usual init) the random target's greedy text is close to noise (on the default
// sizes: ~510 distinct tokens, unigram entropy 5.9 nats, the previous token predicts the
// next one only 38% of the time) and nothing can learn it quickly; with the attention
// and MLP outputs switched off it collapses onto a few attractor tokens (77% of the
// tokens repeat their predecessor). We keep the unit-variance embedding and the
// 1/fan_in init for every other weight, but scale the two output projections of each
// block (attention o_proj, MLP down) by `branch_gain` (default 0.15): the residual
// stream stays close to the current token's embedding, so the greedy next token is
// mostly a function of the current token (92% of the time the most frequent successor),
// while attention over the context still bends it (~310 distinct tokens over the
// generated positions, ~50 per sequence, unigram entropy 4.3 nats, ~15% repeats of the
// previous token). The generator prints the number of distinct tokens and the repeat
// rate for every cache it writes. The prompts are uniform random
// tokens and carry no loss (loss_mask is false on them): only the target's own
// continuation is learnable.
//
// Cache: <out_dir>/data/<hash of every key that shapes the data>.h5, written to a
// temporary name and renamed, so a crash never leaves a half cache. Layout:
//   /tokens    int64   [sequences, seq_len]     (train sequences first, then eval)
//   /hidden    float32 [sequences, seq_len, E, hidden]: residual stream after target
//              layer exported_layers[e] (0-based), at every position; for the last layer,
//              after the final RMSNorm (layer id L = transformers' hidden_states[L + 1] of
//              the same model as a Llama checkpoint, which open() writes next to the cache)
//   /embedding float32 [vocab, hidden]   /lm_head float32 [vocab, hidden]
//   attributes: exported_layers, layers, prompt_len, train_sequences, eval_sequences, key
// The target's greedy continuation is the tokens themselves (positions >= prompt_len).
#include <flashdraft/hdf5_attributes.hpp>
#include <flashdraft/layers.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <hdf5.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <random>
#include <set>
#include <sstream>

namespace flashdraft {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFormat = "flashdraft-embedded-v2";  // v2: last layer after the final norm

// --- HDF5 in a few lines (C API; every call checked) ----------------------------------
void h5check(herr_t status, const std::string& what) {
  if (status < 0) throw std::runtime_error("HDF5: " + what + " failed");
}
hid_t h5check_id(hid_t id, const std::string& what) {
  if (id < 0) throw std::runtime_error("HDF5: " + what + " failed");
  return id;
}
void write_array(hid_t file, const std::string& name, hid_t type, const std::vector<hsize_t>& dims, const void* data) {
  hid_t space = h5check_id(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "dataspace " + name);
  hid_t set =
      h5check_id(H5Dcreate2(file, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create " + name);
  h5check(H5Dwrite(set, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "write " + name);
  H5Dclose(set);
  H5Sclose(space);
}
std::vector<hsize_t> array_dims(hid_t file, const std::string& name) {
  hid_t set = h5check_id(H5Dopen2(file, name.c_str(), H5P_DEFAULT), "open " + name);
  hid_t space = H5Dget_space(set);
  std::vector<hsize_t> dims(static_cast<size_t>(H5Sget_simple_extent_ndims(space)));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  H5Sclose(space);
  H5Dclose(set);
  return dims;
}
void read_array(hid_t file, const std::string& name, hid_t type, void* data) {
  hid_t set = h5check_id(H5Dopen2(file, name.c_str(), H5P_DEFAULT), "open " + name);
  h5check(H5Dread(set, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "read " + name);
  H5Dclose(set);
}

// --- the target LM ----------------------------------------------------------------------
struct TargetLayer {
  at::Tensor wq, wk, wv, wo, wg, wu, wd;  // [out, in]
};

at::Tensor rms(const at::Tensor& x) { return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6); }

class TargetLM {
 public:
  TargetLM(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t ffn, double branch_gain, uint64_t seed)
      : vocab_(vocab), hidden_(hidden), heads_(heads), dim_(hidden / heads) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto draw = [&](int64_t out, int64_t in, double stddev) {
      return at::randn({out, in}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(stddev);
    };
    // Variance 1/fan_in everywhere, output projections scaled by branch_gain (see the
    // file comment); unit-variance embedding.
    embedding = draw(vocab, hidden, 1.0);
    for (int64_t l = 0; l < layers; ++l) {
      const double s = 1.0 / std::sqrt(double(hidden)), sf = 1.0 / std::sqrt(double(ffn));
      layers_.push_back({draw(hidden, hidden, s), draw(hidden, hidden, s), draw(hidden, hidden, s),
                         draw(hidden, hidden, s * branch_gain), draw(ffn, hidden, s), draw(ffn, hidden, s),
                         draw(hidden, ffn, sf * branch_gain)});
    }
    lm_head = draw(vocab, hidden, 1.0 / std::sqrt(double(hidden)));
    inv_freq_ = at::pow(10000.0, -at::arange(0, dim_, 2, at::kDouble) / double(dim_));
  }

  // Runs tokens [B, T] at positions start..start+T-1 against the caches (which hold
  // positions 0..start-1 and get the new keys/values written after them; capacity =
  // the longest sequence). Writes the residual
  // stream after each exported layer into hidden_out[:, start:start+T, e, :] and returns
  // the logits of the last new position [B, V].
  at::Tensor forward(const at::Tensor& tokens, int64_t start, int64_t capacity, std::vector<at::Tensor>& kcache,
                     std::vector<at::Tensor>& vcache, const std::vector<int64_t>& exported, at::Tensor& hidden_out) {
    const int64_t B = tokens.size(0), T = tokens.size(1);
    at::Tensor x = embedding.index_select(0, tokens.reshape({-1})).view({B, T, hidden_});
    const at::Tensor ang = at::arange(start, start + T, at::kDouble).unsqueeze(-1) * inv_freq_;
    const at::Tensor full = at::cat({ang, ang}, -1);
    const at::Tensor cos = full.cos().to(at::kFloat), sin = full.sin().to(at::kFloat);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const TargetLayer& P = layers_[l];
      const layers::SelfAttention A{P.wq, P.wk, P.wv, P.wo, {}, {}, heads_, heads_, dim_};  // no q/k norm
      const at::Tensor h = rms(x);
      const at::Tensor q = A.queries(h, cos, sin), k = A.keys(h, cos, sin), v = A.values(h);
      // Caches are allocated once at full length ([B, heads, capacity, D]) and filled in
      // place: concatenating per token would copy the whole cache at every step.
      if (!kcache[l].defined()) {
        kcache[l] = at::empty({B, heads_, capacity, dim_}, k.options());
        vcache[l] = at::empty({B, heads_, capacity, dim_}, v.options());
      }
      kcache[l].narrow(2, start, T).copy_(k);
      vcache[l].narrow(2, start, T).copy_(v);
      // Causal: new query t sees keys 0..start+t. Prefill starts at 0 (the plain causal
      // mask); a single new token (T == 1) sees the whole filled cache.
      TORCH_CHECK(T == 1 || start == 0, "prefill must start at position 0");
      const at::Tensor a = at::scaled_dot_product_attention(q, kcache[l].narrow(2, 0, start + T),
                                                            vcache[l].narrow(2, 0, start + T), std::nullopt, 0.0,
                                                            /*is_causal=*/T > 1);
      x = x + A.output(a);
      x = x + layers::SwiGluMlp{P.wg, P.wu, P.wd}(rms(x));
      // Layer id L = transformers' hidden_states[L + 1]: the last layer's state is reported
      // after the final RMSNorm, as transformers does.
      const at::Tensor state = l + 1 == layers_.size() ? rms(x) : x;
      for (size_t e = 0; e < exported.size(); ++e)
        if (exported[e] == static_cast<int64_t>(l))
          hidden_out.narrow(1, start, T).select(2, static_cast<int64_t>(e)).copy_(state);
    }
    return at::linear(rms(x.select(1, T - 1)), lm_head);
  }

  // The same model as a Hugging Face LlamaForCausalLM's tensors: RMSNorm weights of one
  // (this model's norms have none), no biases, untied LM head.
  std::vector<std::pair<std::string, at::Tensor>> hf_weights() const {
    std::vector<std::pair<std::string, at::Tensor>> out = {{"model.embed_tokens.weight", embedding}};
    const at::Tensor ones = at::ones({hidden_}, at::kFloat);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const TargetLayer& P = layers_[l];
      for (const auto& [name, t] :
           std::vector<std::pair<std::string, at::Tensor>>{{"input_layernorm.weight", ones},
                                                           {"post_attention_layernorm.weight", ones},
                                                           {"self_attn.q_proj.weight", P.wq},
                                                           {"self_attn.k_proj.weight", P.wk},
                                                           {"self_attn.v_proj.weight", P.wv},
                                                           {"self_attn.o_proj.weight", P.wo},
                                                           {"mlp.gate_proj.weight", P.wg},
                                                           {"mlp.up_proj.weight", P.wu},
                                                           {"mlp.down_proj.weight", P.wd}})
        out.emplace_back(p + name, t);
    }
    out.emplace_back("model.norm.weight", ones);
    out.emplace_back("lm_head.weight", lm_head);
    return out;
  }

  at::Tensor embedding, lm_head;

 private:
  int64_t vocab_, hidden_, heads_, dim_;
  std::vector<TargetLayer> layers_;
  at::Tensor inv_freq_;
};

class EmbeddedDataset final : public Dataset {
 public:
  static void declare(Schema& s) {
    s.integer("vocab", "target vocabulary size").def(int64_t{512}).range(2, 1 << 20);
    s.integer("hidden", "target hidden size").def(int64_t{128}).range(2, 1 << 16);
    s.integer("layers", "target layers").def(int64_t{4}).range(1, 256);
    s.integer("heads", "target attention heads (must divide hidden; head width even)").def(int64_t{4}).range(1, 1024);
    s.integer("ffn", "target SwiGLU inner width (0 = 3 x hidden)").def(int64_t{0}).range(0, 1 << 22);
    s.integer("seq_len", "positions per sequence (prompt included)").def(int64_t{128}).range(2, 1 << 20);
    s.integer("prompt_len", "random prompt tokens before the greedy continuation").def(int64_t{16}).at_least(1);
    s.integer("train_sequences", "sequences in the training set").def(int64_t{512}).at_least(1);
    s.integer("eval_sequences", "held-out sequences").def(int64_t{32}).at_least(0);
    s.integers("exported_layers", "target layers (0-based) whose output hidden states batches carry")
        .def(std::vector<int64_t>{1, 3});
    s.real("branch_gain", "scale of the target's attention/MLP output projections (see embedded.cpp)")
        .def(0.15)
        .range(0.0, 10.0);
    s.integer("seed", "seed of the target weights and the prompts").def(int64_t{1234}).at_least(0);
    s.integer("batch_size", "sequences per batch").def(int64_t{4}).at_least(1);
    s.integer("generate_batch", "sequences generated together while building the cache").def(int64_t{128}).at_least(1);
  }

  explicit EmbeddedDataset(const Config& c) : config_(c) {
    vocab_ = c.integer("vocab");
    hidden_ = c.integer("hidden");
    layers_ = c.integer("layers");
    heads_ = c.integer("heads");
    ffn_ = c.integer("ffn") > 0 ? c.integer("ffn") : 3 * hidden_;
    seq_len_ = c.integer("seq_len");
    prompt_len_ = c.integer("prompt_len");
    n_train_ = c.integer("train_sequences");
    n_eval_ = c.integer("eval_sequences");
    exported_ = c.integers("exported_layers");
    seed_ = static_cast<uint64_t>(c.integer("seed"));
    batch_ = c.integer("batch_size");
    branch_gain_ = c.real("branch_gain");
    if (hidden_ % heads_ != 0 || (hidden_ / heads_) % 2 != 0)
      c.fail("heads", "hidden = " + std::to_string(hidden_) + " split over heads = " + std::to_string(heads_) +
                          " must give an even whole head width (RoPE rotates pairs)");
    if (prompt_len_ >= seq_len_)
      c.fail("prompt_len", "prompt_len = " + std::to_string(prompt_len_) +
                               " leaves no generated position in seq_len = " + std::to_string(seq_len_) +
                               " (accepted: 1 .. seq_len - 1)");
    if (exported_.empty()) c.fail("exported_layers", "exported_layers is empty; name at least one target layer");
    for (int64_t l : exported_)
      if (l < 0 || l >= layers_)
        c.fail("exported_layers", "layer " + std::to_string(l) + " in exported_layers " + list_str(exported_) +
                                      " is outside the target's layers 0.." + std::to_string(layers_ - 1));
    if (batch_ > n_train_)
      c.fail("batch_size",
             "batch_size = " + std::to_string(batch_) + " exceeds train_sequences = " + std::to_string(n_train_));
    std::ostringstream key;
    key << kFormat << ";vocab=" << vocab_ << ";hidden=" << hidden_ << ";layers=" << layers_ << ";heads=" << heads_
        << ";ffn=" << ffn_ << ";seq_len=" << seq_len_ << ";prompt_len=" << prompt_len_ << ";train=" << n_train_
        << ";eval=" << n_eval_ << ";exported=" << list_str(exported_) << ";gain=" << branch_gain_ << ";seed=" << seed_;
    key_ = key.str();
  }

  void open(const RunContext& ctx) override {
    say_ = ctx.say ? ctx.say : [](const std::string& s) { std::printf("%s\n", s.c_str()); };
    run_seed_ = ctx.seed;
    char name[32];
    std::snprintf(name, sizeof name, "%016llx.h5", static_cast<unsigned long long>(fnv1a64(key_)));
    const fs::path dir = fs::path(ctx.out_dir) / "data";
    fs::create_directories(dir);
    path_ = (dir / name).string();
    if (fs::exists(path_) && read_cache()) {
      say_("data: reusing " + path_);
    } else {
      generate();
    }
    write_hf_target((dir / (std::string(name, 16) + ".target")).string());
  }

  TargetModel target() const override {
    TargetModel t;
    t.embedding = embedding_;
    t.lm_head = lm_head_;
    t.vocab = vocab_;
    t.hidden = hidden_;
    t.layers = layers_;
    t.exported_layers = exported_;
    return t;
  }
  int64_t batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_len_; }
  std::string source() const override { return path_; }
  int64_t eval_batches() const override { return n_eval_ / batch_; }

  // Batch `index` of the training stream: epoch e = index / batches_per_epoch walks a
  // permutation of the training sequences drawn from (dataset seed, run seed, e).
  Batch train_batch(int64_t index) override {
    const int64_t per_epoch = n_train_ / batch_;
    const int64_t epoch = index / per_epoch, k = index % per_epoch;
    if (epoch != perm_epoch_) {
      std::mt19937_64 gen(seed_ * 0x9E3779B97F4A7C15ULL ^ (run_seed_ + 0x632BE59BD9B4E019ULL) ^
                          static_cast<uint64_t>(epoch + 1) * 0xD1B54A32D192ED03ULL);
      perm_.resize(static_cast<size_t>(n_train_));
      for (int64_t i = 0; i < n_train_; ++i) perm_[static_cast<size_t>(i)] = i;
      for (int64_t i = n_train_ - 1; i > 0; --i)  // Fisher-Yates
        std::swap(perm_[static_cast<size_t>(i)], perm_[static_cast<size_t>(gen() % static_cast<uint64_t>(i + 1))]);
      perm_epoch_ = epoch;
    }
    std::vector<int64_t> rows(perm_.begin() + k * batch_, perm_.begin() + (k + 1) * batch_);
    return make_batch(rows, index);
  }

  Batch eval_batch(int64_t index) override {
    if (index < 0 || index >= eval_batches())
      throw std::invalid_argument("eval batch " + std::to_string(index) + " does not exist (there are " +
                                  std::to_string(eval_batches()) + ")");
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < batch_; ++i) rows.push_back(n_train_ + index * batch_ + i);
    return make_batch(rows, index);
  }

 private:
  Batch make_batch(const std::vector<int64_t>& rows, int64_t index) const {
    const at::Tensor idx = at::tensor(rows, at::TensorOptions().dtype(at::kLong));
    Batch b;
    b.tokens = tokens_.index_select(0, idx);
    b.hidden = hidden_states_.index_select(0, idx);
    b.loss_mask =
        at::arange(seq_len_, at::kLong).ge(prompt_len_).unsqueeze(0).expand({idx.size(0), seq_len_}).contiguous();
    b.lengths = at::full({idx.size(0)}, seq_len_, at::TensorOptions().dtype(at::kLong));
    b.index = index;
    return b;
  }

  bool read_cache() {
    hid_t file = H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (file < 0) return false;
    try {
      const int64_t n = n_train_ + n_eval_, E = static_cast<int64_t>(exported_.size());
      const std::vector<hsize_t> want_tok{hsize_t(n), hsize_t(seq_len_)};
      const std::vector<hsize_t> want_hid{hsize_t(n), hsize_t(seq_len_), hsize_t(E), hsize_t(hidden_)};
      if (array_dims(file, "tokens") != want_tok || array_dims(file, "hidden") != want_hid ||
          hdf5::read_int_attribute(file, "exported_layers") != exported_)
        throw std::runtime_error("shapes differ from the configuration");
      tokens_ = at::empty({n, seq_len_}, at::kLong);
      hidden_states_ = at::empty({n, seq_len_, E, hidden_}, at::kFloat);
      embedding_ = at::empty({vocab_, hidden_}, at::kFloat);
      lm_head_ = at::empty({vocab_, hidden_}, at::kFloat);
      read_array(file, "tokens", H5T_NATIVE_INT64, tokens_.data_ptr());
      read_array(file, "hidden", H5T_NATIVE_FLOAT, hidden_states_.data_ptr());
      read_array(file, "embedding", H5T_NATIVE_FLOAT, embedding_.data_ptr());
      read_array(file, "lm_head", H5T_NATIVE_FLOAT, lm_head_.data_ptr());
      H5Fclose(file);
      return true;
    } catch (const std::exception& e) {
      H5Fclose(file);
      say_("data: cache " + path_ + " unusable (" + e.what() + "); generating it again");
      return false;
    }
  }

  // The target as a Hugging Face checkpoint folder (LlamaForCausalLM, float32), once per
  // cache: `[target] plugin = "hf"` with this path runs the very model that wrote the data,
  // so validation can verify drafts with it (its greedy choices are the data's tokens).
  void write_hf_target(const std::string& folder) const {
    if (fs::exists(fs::path(folder) / "config.json")) return;
    const TargetLM lm(vocab_, hidden_, layers_, heads_, ffn_, branch_gain_, seed_);
    const std::string tmp = folder + ".tmp." + std::to_string(::getpid());
    fs::create_directories(tmp);
    safetensors::write(tmp + "/model.safetensors", lm.hf_weights(), {{"format", "pt"}});
    std::ofstream(tmp + "/config.json")
        << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n  \"vocab_size\": " << vocab_
        << ",\n  \"hidden_size\": " << hidden_ << ",\n  \"intermediate_size\": " << ffn_
        << ",\n  \"num_hidden_layers\": " << layers_ << ",\n  \"num_attention_heads\": " << heads_
        << ",\n  \"num_key_value_heads\": " << heads_ << ",\n  \"head_dim\": " << hidden_ / heads_
        << ",\n  \"max_position_embeddings\": " << std::max<int64_t>(seq_len_, 2048)
        << ",\n  \"rms_norm_eps\": 1e-06,\n  \"rope_theta\": 10000.0,\n  \"hidden_act\": \"silu\",\n"
        << "  \"attention_bias\": false,\n  \"mlp_bias\": false,\n  \"tie_word_embeddings\": false,\n"
        << "  \"torch_dtype\": \"float32\"\n}\n";
    std::error_code ec;
    fs::rename(tmp, folder, ec);  // another process may have written it first: keep theirs
    if (ec)
      for (const char* f : {"/model.safetensors", "/config.json", ""}) fs::remove(tmp + f, ec);
    say_("data: the target as a Hugging Face checkpoint: " + folder);
  }

  // The cache's size is known from the shapes: refuse before generating it, not after, when
  // its folder cannot hold it (HDF5 would fail half-way through the write).
  void check_cache_space(int64_t n, int64_t E) const {
    const double need = 8.0 * n * seq_len_ + 4.0 * n * seq_len_ * E * hidden_ + 8.0 * vocab_ * hidden_;
    std::error_code ec;
    const fs::space_info space = fs::space(fs::path(path_).parent_path(), ec);
    const double spare = 16 << 20;  // the target's checkpoint written beside it, the run's log
    if (!ec && static_cast<double>(space.available) < need + spare) {
      char sizes[128];
      std::snprintf(sizes, sizeof sizes,
                    "it needs %.1f MB (%.1f MB with the files beside it) and the folder has %.1f MB free", need / 1e6,
                    (need + spare) / 1e6, static_cast<double>(space.available) / 1e6);
      throw std::runtime_error("data: cannot write the embedded data's cache " + path_ + ": " + sizes +
                               "; free space there or write the run elsewhere (--out)");
    }
  }

  void generate() {
    const int64_t n = n_train_ + n_eval_, E = static_cast<int64_t>(exported_.size());
    check_cache_space(n, E);
    say_("data: generating " + path_ + " (" + std::to_string(n) + " sequences of " + std::to_string(seq_len_) +
         " tokens from a " + std::to_string(layers_) + "-layer target, hidden " + std::to_string(hidden_) + ", vocab " +
         std::to_string(vocab_) + ")");
    at::NoGradGuard no_grad;
    TargetLM lm(vocab_, hidden_, layers_, heads_, ffn_, branch_gain_, seed_);
    at::Generator prompts = at::make_generator<at::CPUGeneratorImpl>(seed_ + 1);
    tokens_ = at::empty({n, seq_len_}, at::kLong);
    hidden_states_ = at::empty({n, seq_len_, E, hidden_}, at::kFloat);
    tokens_.narrow(1, 0, prompt_len_).copy_(at::randint(vocab_, {n, prompt_len_}, prompts, at::kLong));
    const int64_t chunk = config_.integer("generate_batch");
    int64_t done = 0, next_report = 0;
    for (int64_t s0 = 0; s0 < n; s0 += chunk) {
      const int64_t B = std::min(chunk, n - s0);
      at::Tensor tok = tokens_.narrow(0, s0, B);
      at::Tensor hid = hidden_states_.narrow(0, s0, B);
      std::vector<at::Tensor> kc(static_cast<size_t>(layers_)), vc(static_cast<size_t>(layers_));
      // Prefill the prompt, then one greedy token at a time: the token at position t is
      // the argmax of the logits after position t - 1.
      at::Tensor logits = lm.forward(tok.narrow(1, 0, prompt_len_), 0, seq_len_, kc, vc, exported_, hid);
      for (int64_t t = prompt_len_; t < seq_len_; ++t) {
        tok.select(1, t).copy_(logits.argmax(-1));
        logits = lm.forward(tok.narrow(1, t, 1), t, seq_len_, kc, vc, exported_, hid);
      }
      done += B;
      if (done >= next_report || done == n) {
        say_("data: generated " + std::to_string(done) + "/" + std::to_string(n) + " sequences");
        next_report = done + std::max<int64_t>(n / 4, 1);
      }
    }
    embedding_ = lm.embedding;
    lm_head_ = lm.lm_head;

    // Diversity check of the continuations (not the random prompts).
    const at::Tensor cont = tokens_.narrow(1, prompt_len_, seq_len_ - prompt_len_);
    const int64_t distinct = std::get<0>(at::_unique(cont)).numel();
    const double repeat = cont.narrow(1, 1, cont.size(1) - 1)
                              .eq(cont.narrow(1, 0, cont.size(1) - 1))
                              .to(at::kDouble)
                              .mean()
                              .item<double>();
    std::ostringstream os;
    os << "data: " << distinct << " distinct tokens in the generated positions; " << std::fixed << std::setprecision(1)
       << 100.0 * repeat << "% repeat the previous token";
    say_(os.str());

    // Write to a temporary name in the same folder, then rename (atomic on POSIX).
    const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
    hid_t file = h5check_id(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "create " + tmp);
    try {
      write_array(file, "tokens", H5T_NATIVE_INT64, {hsize_t(n), hsize_t(seq_len_)}, tokens_.data_ptr());
      write_array(file, "hidden", H5T_NATIVE_FLOAT, {hsize_t(n), hsize_t(seq_len_), hsize_t(E), hsize_t(hidden_)},
                  hidden_states_.data_ptr());
      const at::Tensor emb = embedding_.contiguous(), head = lm_head_.contiguous();
      write_array(file, "embedding", H5T_NATIVE_FLOAT, {hsize_t(vocab_), hsize_t(hidden_)}, emb.data_ptr());
      write_array(file, "lm_head", H5T_NATIVE_FLOAT, {hsize_t(vocab_), hsize_t(hidden_)}, head.data_ptr());
      hdf5::write_int_attribute(file, "exported_layers", exported_);
      hdf5::write_int_attribute(file, "layers", {layers_});
      hdf5::write_int_attribute(file, "prompt_len", {prompt_len_});
      hdf5::write_int_attribute(file, "train_sequences", {n_train_});
      hdf5::write_int_attribute(file, "eval_sequences", {n_eval_});
      hdf5::write_string_attribute(file, "key", key_);
      h5check(H5Fclose(file), "close " + tmp);
    } catch (...) {
      H5Fclose(file);
      std::remove(tmp.c_str());
      throw;
    }
    if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw std::runtime_error("could not rename " + tmp + " to " + path_);
    }
    say_("data: wrote " + path_);
  }

  Config config_;
  int64_t vocab_, hidden_, layers_, heads_, ffn_, seq_len_, prompt_len_, n_train_, n_eval_, batch_;
  std::vector<int64_t> exported_;
  double branch_gain_ = 0.15;
  uint64_t seed_ = 0, run_seed_ = 0;
  std::string key_, path_;
  std::function<void(const std::string&)> say_;
  at::Tensor tokens_, hidden_states_, embedding_, lm_head_;
  std::vector<int64_t> perm_;
  int64_t perm_epoch_ = -1;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(dataset, "embedded", "0.1.0",
                  "embedded default data: a seeded target LM's greedy text and hidden states, cached as HDF5",
                  flashdraft::EmbeddedDataset)

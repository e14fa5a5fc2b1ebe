// cache: a target read from disk ([target] plugin = "cache"): the folder scripts/dump-hidden-states wrote for a
// model that transformers runs, whatever its architecture (one no GPU here holds, or one the hf target does not
// read): the hidden states of every conversation (hidden-*.safetensors, flashdraft/hidden_cache.hpp) and, in
// target.safetensors, what a drafter borrows from the target:
//   embedding  [vocab, hidden]  the input embedding's table (transformers' get_input_embeddings().weight)
//   lm_head    [vocab, hidden]  the LM head (absent where the model ties it to the embedding: metadata tied = "1")
// with metadata format "flashdraft-target-v1", logit_scale and logit_softcap (the model's logits are
// cap tanh(scale h W^T / cap), checked by the script against the model's own logits), num_hidden_layers,
// hidden_size, vocab_size, eos_token_ids, architecture and model. No decoder runs: no attention call, no served
// decoding by the target (served tau is measured on the data's tokens).
#include <flashdraft/dtype.hpp>
#include <flashdraft/hidden_cache.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>

#include <filesystem>
#include <sstream>

namespace flashdraft {
namespace {

class CacheTarget final : public Target {
 public:
  static void declare(Schema& s) {
    s.string("path",
             "a folder written by scripts/dump-hidden-states: the target's hidden states (hidden-*.safetensors) and "
             "its embedding and LM head (target.safetensors)");
    s.string("dtype", "dtype of the states, the embedding and the LM head (auto: bfloat16 on CUDA, float32 on CPU)")
        .def(std::string("auto"))
        .one_of({"auto", "float32", "bfloat16", "float16"});
  }

  explicit CacheTarget(const Config& c) : config_(c), path_(c.string("path")), dtype_name_(c.string("dtype")) {}

  void open(const RunContext& ctx) override {
    device_ = ctx.device;
    dtype_ = dtype_named(dtype_name_, device_);
    const std::string file = (std::filesystem::path(path_) / "target.safetensors").string();
    if (!std::filesystem::is_regular_file(file))
      config_.fail("path", path_ +
                               " holds no target.safetensors (the embedding and LM head scripts/dump-hidden-states " +
                               "writes beside the states; a folder of states alone is read by [target] plugin = " +
                               "\"hf\" with hidden_cache = \"" + path_ + "\" and the checkpoint's path)");
    try {
      const safetensors::File f(file);
      const auto& m = f.metadata();
      const auto meta = [&](const std::string& key) {
        const auto it = m.find(key);
        if (it == m.end()) throw std::runtime_error(file + ": no metadata '" + key + "'");
        return it->second;
      };
      if (meta("format") != "flashdraft-target-v1")
        throw std::runtime_error(file + ": metadata format = \"" + meta("format") +
                                 "\", expected \"flashdraft-target-v1\"");
      const auto number = [&](const std::string& key) {
        const std::string text = meta(key);
        try {
          size_t used = 0;
          const double v = std::stod(text, &used);
          if (used == text.size()) return v;
        } catch (const std::exception&) {
        }
        throw std::runtime_error(file + ": metadata " + key + " = \"" + text + "\" is not a number");
      };
      embedding_ = f.load("embedding", device_, dtype_);
      lm_head_ = meta("tied") == "1" ? embedding_ : f.load("lm_head", device_, dtype_);
      layers_ = static_cast<int64_t>(number("num_hidden_layers"));
      logit_scale_ = number("logit_scale");
      logit_softcap_ = number("logit_softcap");
      std::stringstream eos(meta("eos_token_ids"));
      for (std::string id; std::getline(eos, id, ',');) eos_.push_back(static_cast<int64_t>(std::stod(id)));
      about_ = meta("architecture") + " " + meta("model");
      if (embedding_.dim() != 2 || lm_head_.sizes() != embedding_.sizes() ||
          embedding_.size(1) != static_cast<int64_t>(number("hidden_size")))
        throw std::runtime_error(file + ": embedding " + c10::str(embedding_.sizes()) + " and lm_head " +
                                 c10::str(lm_head_.sizes()) +
                                 " are not both [vocab, hidden_size = " + meta("hidden_size") + "]");
      cache_ = std::make_unique<HiddenCache>(path_, embedding_.size(1), layers_);
    } catch (const std::exception& e) {
      config_.fail("path", e.what());
    }
    if (ctx.say) ctx.say("target: read from " + cache_->describe() + "; no decoder runs");
  }

  TargetModel model() const override {
    TargetModel t = TargetModel::online_model(embedding_, lm_head_, layers_,
                                              about_ + " (" + std::to_string(layers_) + " layers, hidden " +
                                                  std::to_string(embedding_.size(1)) + ", vocab " +
                                                  std::to_string(embedding_.size(0)) + ", " + c10::toString(dtype_) +
                                                  "; hidden states read from " + path_ + ")");
    t.logit_scale = logit_scale_;
    t.logit_softcap = logit_softcap_;
    return t;
  }

  // (never posed: prepare() returns 0 calls, and the engine chooses no kernel for a target that makes none)
  AttentionProblem attention_problem(int64_t batch, int64_t seq_len) const override {
    return AttentionProblem::of(device_, dtype_, batch, 1, 1, seq_len, seq_len, 64, /*needs_backward=*/false);
  }

  int64_t prepare(const std::vector<int64_t>& layers) override {
    for (int64_t l : layers)
      if (cache_->column(l) < 0)
        config_.fail("path", cache_->describe() + " holds no states of layer " + std::to_string(l) +
                                 ", which the run reads (the drafter's target layers, and the last layer where its " +
                                 "labels are the target's); dump the cache with --layers listing every one of them");
    return 0;
  }

  at::Tensor hidden_states(const Batch& batch, const std::vector<int64_t>& layers, AttentionContext&) override {
    std::vector<int64_t> columns;
    for (int64_t l : layers) columns.push_back(cache_->column(l));
    return cache_->batch(batch, columns, device_, dtype_);
  }

  std::vector<int64_t> stop_tokens() const override { return eos_; }
  bool reads_states() const override { return true; }
  std::string missing_states(const Batch& batch) override { return cache_->missing(batch); }

 private:
  Config config_;
  std::string path_, dtype_name_, about_;
  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = at::kFloat;
  at::Tensor embedding_, lm_head_;
  int64_t layers_ = 0;
  double logit_scale_ = 1.0, logit_softcap_ = 0.0;
  std::vector<int64_t> eos_;
  std::unique_ptr<HiddenCache> cache_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(target, "cache", "0.1.0",
                  "a target read from disk: the hidden states, embedding and LM head scripts/dump-hidden-states wrote "
                  "for any model transformers runs",
                  flashdraft::CacheTarget)

// random: a synthetic target ([target] plugin = "random") for measuring the drafter's
// step at a real model's sizes without a checkpoint.
//
// The embedding and the LM head are frozen random matrices [vocab, hidden] (normal,
// std `init_std`), made once on the run's device in the target's dtype. Each step the
// "hidden states" of the requested layers are fresh normal noise made on the device,
// [B, S, E, hidden], seeded by (run seed, batch index): the same batch always gets the
// same states (so a resumed run continues bit for bit), and nothing crosses the host.
// There is no decoder, so no attention call. The loss a drafter reaches on this target is
// meaningless; its cost is a real drafter's.
#include <flashdraft/dtype.hpp>
#include <flashdraft/model.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

namespace flashdraft {
namespace {

class RandomTarget final : public Target {
 public:
  static void declare(Schema& s) {
    s.integer("hidden", "hidden size of the synthetic target").def(int64_t{4096}).range(1, 1 << 20);
    s.integer("vocab", "vocabulary size (embedding and LM head rows)").def(int64_t{151936}).range(2, 1 << 24);
    s.integer("layers", "decoder layers the target pretends to have (valid target_layer_ids: 0..layers-1)")
        .def(int64_t{36})
        .range(1, 4096);
    s.real("init_std", "standard deviation of the random embedding and LM head").def(0.02).at_least(0.0);
    s.string("dtype", "dtype of the target's tensors (auto: bfloat16 on CUDA, float32 on CPU)")
        .def(std::string("auto"))
        .one_of({"auto", "float32", "bfloat16", "float16"});
  }

  explicit RandomTarget(const Config& c)
      : hidden_(c.integer("hidden")),
        vocab_(c.integer("vocab")),
        layers_(c.integer("layers")),
        std_(c.real("init_std")),
        dtype_name_(c.string("dtype")) {}

  void open(const RunContext& ctx) override {
    device_ = ctx.device;
    seed_ = ctx.seed;
    dtype_ = dtype_named(dtype_name_, device_);
    const auto opts = at::TensorOptions().dtype(dtype_).device(device_);
    at::Generator gen = generator(0x7a11e7);
    embedding_ = at::randn({vocab_, hidden_}, gen, opts).mul_(std_);
    lm_head_ = at::randn({vocab_, hidden_}, gen, opts).mul_(std_);
    if (ctx.say)
      ctx.say("target: synthetic (random embedding and LM head " + std::to_string(vocab_) + " x " +
              std::to_string(hidden_) + ", " + c10::toString(dtype_) + "; random hidden states each step)");
  }

  TargetModel model() const override {
    return TargetModel::online_model(embedding_, lm_head_, layers_,
                                     "random (synthetic: " + std::to_string(layers_) + " layers, hidden " +
                                         std::to_string(hidden_) + ", vocab " + std::to_string(vocab_) + ", " +
                                         c10::toString(dtype_) + ")");
  }

  // No attention runs; the problem is still a valid one so that the engine's kernel
  // choice for the target stays uniform (forward only, one head of width 128).
  AttentionProblem attention_problem(int64_t batch, int64_t seq_len) const override {
    return AttentionProblem::of(device_, dtype_, batch, 1, 1, seq_len, seq_len, 128, /*needs_backward=*/false);
  }

  int64_t prepare(const std::vector<int64_t>& layers) override {
    for (int64_t l : layers)
      if (l < 0 || l >= layers_)
        throw std::invalid_argument("random target: layer " + std::to_string(l) +
                                    " requested, the target has layers 0.." + std::to_string(layers_ - 1));
    return 0;
  }

  at::Tensor hidden_states(const Batch& batch, const std::vector<int64_t>& layers, AttentionContext&) override {
    const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), E = static_cast<int64_t>(layers.size());
    at::Generator gen = generator(0x5eed0000ULL + static_cast<uint64_t>(batch.index));
    return at::randn({B, S, E, hidden_}, gen, at::TensorOptions().dtype(dtype_).device(device_));
  }

 private:
  // A generator on the run's device seeded by (run seed, salt).
  at::Generator generator(uint64_t salt) const {
    at::Generator gen = device_.is_cuda() ? at::detail::getCUDAHooks().getNewGenerator(device_.index())
                                          : at::make_generator<at::CPUGeneratorImpl>();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed_ * 0x9E3779B97F4A7C15ULL + salt);
    return gen;
  }

  int64_t hidden_, vocab_, layers_;
  double std_;
  std::string dtype_name_;
  c10::Device device_ = c10::kCPU;
  c10::ScalarType dtype_ = at::kFloat;
  uint64_t seed_ = 0;
  at::Tensor embedding_, lm_head_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(target, "random", "0.1.0",
                  "synthetic target: random embedding, LM head and hidden states at any size (for benchmarks)",
                  flashdraft::RandomTarget)

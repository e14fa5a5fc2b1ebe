// A test drafter: embedding -> causal self-attention layers through the engine's
// dispatcher -> logits; next-token loss. Small enough for tests to run in seconds.
#include <flashdraft/model.hpp>

#include <torch/nn/functional.h>
#include <torch/types.h>

namespace {

using namespace flashdraft;

class ToyDrafter final : public Drafter {
 public:
  explicit ToyDrafter(const Config& c)
      : layers_(c.integer("layers")), heads_(c.integer("heads")), head_dim_(c.integer("head_dim")) {}
  static void declare(Schema& s) {
    s.integer("layers", "attention layers").def(int64_t(2)).range(1, 64);
    s.integer("heads", "attention heads").def(int64_t(2)).range(1, 64);
    s.integer("head_dim", "head dimension").def(int64_t(8)).range(1, 512);
  }
  void bind(const TargetModel& t, const RunContext& ctx, int64_t batch, int64_t seq) override {
    vocab_ = t.vocab;
    batch_ = batch;
    seq_ = seq;
    device_ = ctx.device;
    const int64_t w = heads_ * head_dim_;
    embed_ = (torch::randn({vocab_, w}) * 0.1).requires_grad_();
    for (int64_t l = 0; l < layers_; ++l)
      qkv_.push_back((torch::randn({w, 3 * w}) / std::sqrt(double(w))).requires_grad_());
    out_ = (torch::randn({w, vocab_}) / std::sqrt(double(w))).requires_grad_();
  }
  std::vector<std::pair<std::string, at::Tensor>> parameters() override {
    std::vector<std::pair<std::string, at::Tensor>> p{{"embed", embed_}, {"out", out_}};
    for (size_t l = 0; l < qkv_.size(); ++l) p.push_back({"qkv." + std::to_string(l), qkv_[l]});
    return p;
  }
  int64_t attention_layers() const override { return layers_; }
  AttentionProblem attention_problem() const override {
    AttentionProblem p;
    p.device = device_;
    p.batch = batch_;
    p.heads_q = p.heads_kv = heads_;
    p.q_len = p.kv_len = seq_;
    p.head_dim = head_dim_;
    return p;
  }
  std::vector<std::string> position_names() const override { return {"position 1"}; }
  std::vector<std::string> scalar_names() const override { return {"accuracy"}; }
  StepResult step(const Batch& batch, DrafterContext& attention, at::Generator&, bool) override {
    MaskInput in;
    in.batch = batch_;
    in.q_len = in.kv_len = seq_;
    attention.set_mask(in);
    at::Tensor x = embed_.index_select(0, batch.tokens.reshape({-1})).view({batch_, seq_, -1});
    for (int64_t l = 0; l < layers_; ++l) {
      auto qkv = torch::matmul(x, qkv_[static_cast<size_t>(l)])
                     .view({batch_, seq_, 3, heads_, head_dim_})
                     .permute({2, 0, 3, 1, 4});
      at::Tensor o = attention.attention(l, qkv[0], qkv[1], qkv[2], 1.0 / std::sqrt(double(head_dim_)));
      x = x + o.permute({0, 2, 1, 3}).reshape({batch_, seq_, -1});
    }
    at::Tensor logits = torch::matmul(x, out_).slice(1, 0, seq_ - 1).reshape({-1, vocab_});
    at::Tensor labels = batch.tokens.slice(1, 1, seq_).reshape({-1});
    StepResult r;
    r.loss = torch::nn::functional::cross_entropy(logits, labels);
    const double acc = logits.argmax(-1).eq(labels).to(torch::kFloat).mean().item<double>();
    r.position_accuracy = {acc};
    r.scalars = {{"accuracy", acc}};
    r.tokens = labels.numel();
    return r;
  }

 private:
  int64_t layers_, heads_, head_dim_, vocab_ = 0, batch_ = 0, seq_ = 0;
  c10::Device device_ = c10::kCPU;
  at::Tensor embed_, out_;
  std::vector<at::Tensor> qkv_;
};

}  // namespace

FLASHDRAFT_PLUGIN(drafter, "toy_drafter", "0.1.0", "test drafter: tiny causal attention LM", ToyDrafter)

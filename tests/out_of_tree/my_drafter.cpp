// A user's own drafter, built out of tree against the installed package: one attention layer
// over the token embeddings and a next-token head, with a serving format of its own (a folder
// with config.json and model.safetensors) that the engine writes at the end of a run, that
// `flashdraft export` writes from the run's log, and that [drafter] init imports.
#include <flashdraft/drafter_format.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>

#include <ATen/TensorOperators.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace {

using namespace flashdraft;

// The folder: config.json {"architectures": ["MyDrafter"], "vocab_size": V, "width": W} and
// the tensors embed [V, W], qkv [W, 3W], out [W, V].
class MyFormat final : public DrafterFormat {
 public:
  std::string name() const override { return "my drafter folder"; }
  std::string layout(Drafter& drafter, const FormatInput& run) const override {
    const auto params = drafter.parameters();
    return config(run.target.vocab, params.front().second.size(1));
  }
  // The file order is the format's: by name, whichever order the tensors come in (the run
  // gives the drafter's, export the weights file's).
  void write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const override {
    NamedTensors sorted = tensors;
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    drafter_format::write_folder(folder, sorted, layout);
  }
  void import(const std::string& folder, Drafter& drafter, const FormatInput& run,
              const NamedTensors& tensors) const override {
    std::ifstream in(folder + "/config.json");
    std::stringstream text;
    text << in.rdbuf();
    const std::string want = layout(drafter, run);
    if (text.str() != want) {
      const auto line = [](std::string s) { return s.substr(0, s.find_last_not_of('\n') + 1); };
      throw FormatError(folder + "/config.json: " + (in ? "holds " + line(text.str()) : std::string("cannot be read")) +
                        ", the experiment's drafter is " + line(want) + " (accepted: a folder of the same sizes)");
    }
    const auto ck = drafter_format::open_checkpoint(folder);
    drafter_format::copy_into(folder, *ck, tensors);
  }

 private:
  static std::string config(int64_t vocab, int64_t width) {
    return "{\"architectures\": [\"MyDrafter\"], \"vocab_size\": " + std::to_string(vocab) +
           ", \"width\": " + std::to_string(width) + "}\n";
  }
};

class MyDrafter final : public Drafter {
 public:
  explicit MyDrafter(const Config& c) : heads_(c.integer("heads")), head_dim_(c.integer("head_dim")) {}
  static void declare(Schema& s) {
    s.integer("heads", "attention heads").def(int64_t(2)).range(1, 64);
    s.integer("head_dim", "head dimension").def(int64_t(8)).range(1, 512);
    s.string("init", "a folder of this drafter to start from (empty: random weights)").def(std::string());
  }
  void bind(const TargetModel& t, const RunContext& ctx, int64_t batch, int64_t seq) override {
    vocab_ = t.vocab;
    batch_ = batch;
    seq_ = seq;
    device_ = ctx.device;
    const int64_t w = heads_ * head_dim_;
    embed_ = (at::randn({vocab_, w}) * 0.1).requires_grad_();
    qkv_ = (at::randn({w, 3 * w}) / std::sqrt(double(w))).requires_grad_();
    out_ = (at::randn({w, vocab_}) / std::sqrt(double(w))).requires_grad_();
  }
  std::vector<std::pair<std::string, at::Tensor>> parameters() override {
    return {{"embed", embed_}, {"qkv", qkv_}, {"out", out_}};
  }
  int64_t attention_layers() const override { return 1; }
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
  StepResult step(const Batch& batch, DrafterContext& attention, at::Generator&, bool) override {
    MaskInput in;
    in.batch = batch_;
    in.q_len = in.kv_len = seq_;
    attention.set_mask(in);
    at::Tensor x = embed_.index_select(0, batch.tokens.reshape({-1})).view({batch_, seq_, -1});
    auto qkv = at::matmul(x, qkv_).view({batch_, seq_, 3, heads_, head_dim_}).permute({2, 0, 3, 1, 4});
    at::Tensor o = attention.attention(0, qkv[0], qkv[1], qkv[2], 1.0 / std::sqrt(double(head_dim_)));
    x = x + o.permute({0, 2, 1, 3}).reshape({batch_, seq_, -1});
    at::Tensor logits = at::matmul(x, out_).slice(1, 0, seq_ - 1).reshape({-1, vocab_});
    at::Tensor labels = batch.tokens.slice(1, 1, seq_).reshape({-1});
    StepResult r;
    r.loss = at::cross_entropy_loss(logits, labels);
    r.position_accuracy = {logits.argmax(-1).eq(labels).to(at::kFloat).mean().item<double>()};
    r.tokens = labels.numel();
    return r;
  }
  const DrafterFormat* format() const override {
    static const MyFormat folder;
    return &folder;
  }

 private:
  int64_t heads_, head_dim_, vocab_ = 0, batch_ = 0, seq_ = 0;
  c10::Device device_ = c10::kCPU;
  at::Tensor embed_, qkv_, out_;
};

}  // namespace

FLASHDRAFT_PLUGIN(drafter, "my_drafter", "0.1.0", "an out-of-tree drafter with its own serving folder", MyDrafter)

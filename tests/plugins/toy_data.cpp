// A test dataset: random token sequences from a fixed seed, no cache, no target.
#include <flashdraft/model.hpp>

#include <torch/types.h>
#include <torch/utils.h>

namespace {

using namespace flashdraft;

class ToyData final : public Dataset {
 public:
  explicit ToyData(const Config& c)
      : vocab_(c.integer("vocab")),
        seq_(c.integer("seq_len")),
        batch_(c.integer("batch_size")),
        hidden_(c.integer("hidden")) {}
  static void declare(Schema& s) {
    s.integer("vocab", "vocabulary size").def(int64_t(32)).range(2, 1 << 20);
    s.integer("seq_len", "tokens per sequence").def(int64_t(16)).range(2, 1 << 20);
    s.integer("batch_size", "sequences per batch").def(int64_t(2)).range(1, 4096);
    s.integer("hidden", "width of the fake target").def(int64_t(8)).range(1, 1 << 16);
  }
  void open(const RunContext& ctx) override {
    seed_ = ctx.seed;
    torch::manual_seed(static_cast<uint64_t>(seed_) + 7);
    emb_ = torch::randn({vocab_, hidden_});
  }
  TargetModel target() const override {
    TargetModel t;
    t.embedding = emb_;
    t.lm_head = emb_;
    t.vocab = vocab_;
    t.hidden = hidden_;
    t.layers = 1;
    t.exported_layers = {0};
    return t;
  }
  int64_t batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_; }
  Batch train_batch(int64_t index) override { return make(index); }
  int64_t eval_batches() const override { return 1; }
  Batch eval_batch(int64_t index) override { return make(1000000 + index); }
  std::string source() const override { return "random tokens (toy_data)"; }

 private:
  Batch make(int64_t index) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    Batch b;
    // A learnable pattern: token t+1 = (token t + 1) mod vocab, random start.
    at::Tensor start = torch::randint(vocab_, {batch_, 1}, gen, torch::kLong);
    b.tokens = (start + torch::arange(seq_, torch::kLong).unsqueeze(0)).remainder(vocab_);
    b.hidden = torch::zeros({batch_, seq_, 1, hidden_});
    b.loss_mask = torch::ones({batch_, seq_}, torch::kBool);
    b.lengths = torch::full({batch_}, seq_, torch::kLong);
    b.index = index;
    return b;
  }
  int64_t vocab_, seq_, batch_, hidden_;
  uint64_t seed_ = 0;
  at::Tensor emb_;
};

}  // namespace

FLASHDRAFT_PLUGIN(dataset, "toy_data", "0.1.0", "test dataset: random shifted-token sequences", ToyData)

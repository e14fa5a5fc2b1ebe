// EAGLE-3 drafter (plugins/eagle3): one fp32 step through the engine's dispatcher with the
// eagle3_ttt mask, on dense_ref and on flash_cpu, written to HDF5 for the PyTorch oracle
// (tests/python/test_eagle3_oracle.py; path from FLASHDRAFT_EAGLE3_EXPORT, default
// <build>/eagle3_export.h5); the calls of a step (one mask per unroll step, each with its
// own key length, every column of the ledger filled forward and backward); the draft
// vocabulary (counts, ties, the d2t/t2d convention); validation's block layout; and the
// bad-input sentences.
#include "built_plugins.hpp"
#include "dflash_oracle.hpp"
#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"
#include "plugin_loading.hpp"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdlib>

using namespace flashdraft;

namespace {

std::unique_ptr<Drafter> make_eagle3(const std::map<std::string, Value>& overrides) {
  static Registry registry({built_plugin_dir()});
  const FoundPlugin& p = registry.get(PluginKind::drafter, "eagle3");
  return create_as<Drafter>(registry, p, dflash_test::make_config(registry.schema(p), overrides));
}

const std::map<std::string, Value> kSmall{{"heads", int64_t{4}},
                                          {"kv_heads", int64_t{2}},
                                          {"intermediate_size", int64_t{48}},
                                          {"ttt_steps", int64_t{3}},
                                          {"draft_vocab", int64_t{24}},
                                          {"init_std", 0.2},
                                          {"rope_theta", 500.0},
                                          {"rms_eps", 1e-5},
                                          {"step_decay", 0.7},
                                          {"eval_blocks", int64_t{4}}};

// A random problem: 4 target layers (ids 0..3 exported; the last one after the final norm),
// two rows of 12 tokens, the second shorter (length 10) and packed from two documents; the target's logits scaled
// by 0.625 (as Granite's by 1 / logits_scaling) and then soft-capped at 1.5 (as Gemma 4's final_logit_softcapping):
// the soft labels are the softmax of the scaled, capped logits.
dflash_test::Problem problem(uint64_t seed) {
  dflash_test::Problem p = dflash_test::random_problem(50, 32, {0, 1, 2, 3}, 2, 12, at::kFloat, seed);
  p.target.logit_scale = 0.625;
  p.target.logit_softcap = 1.5;
  p.batch.lengths[1] = 10;
  p.batch.documents = {{}, {6, 4}};
  return p;
}

// The engine's attention for one kernel: a dispatcher over the eagle3_ttt generator.
struct Engine {
  std::shared_ptr<AttentionKernel> kernel;
  std::shared_ptr<MaskGenerator> mask;
  KernelLedger ledger;
  std::unique_ptr<AttentionDispatcher> dispatcher;
  Engine(const std::string& name, const std::vector<AttentionProblem>& problems) {
    kernel = test::load<AttentionKernel>(PluginKind::kernel, name, "kernels." + name);
    mask = test::load<MaskGenerator>(PluginKind::mask, "eagle3_ttt", "mask");
    std::vector<KernelCandidate> c(1);
    c[0].name = name;
    c[0].kernel = kernel.get();
    std::vector<AttentionProblem> named = problems;
    for (auto& p : named) p.mask = "eagle3_ttt";
    dispatcher =
        std::make_unique<AttentionDispatcher>(choose_kernel(named, c, "error"), mask.get(), "error", &ledger, nullptr);
    // The loss of each unroll step through the engine's op (chunked: the CPU's), in the
    // ledger column after the unroll calls.
    const int64_t n = static_cast<int64_t>(problems.size());
    dispatcher->set_loss(choose_loss({"chunked"}, 0, {c10::kCPU, at::kFloat, 0}, "error"), n);
    ledger.begin_step(0, n + 1);
  }
};

void write(hid_t file, const std::string& name, const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  hid_t type = H5T_NATIVE_FLOAT;
  if (c.scalar_type() == at::kLong)
    type = H5T_NATIVE_INT64;
  else if (c.scalar_type() == at::kByte || c.scalar_type() == at::kBool) {
    c = c.to(at::kLong);
    type = H5T_NATIVE_INT64;
  } else if (c.scalar_type() == at::kDouble)
    type = H5T_NATIVE_DOUBLE;
  else
    c = c.to(at::kFloat);
  std::vector<hsize_t> dims(c.sizes().begin(), c.sizes().end());
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  hid_t space = dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  hid_t set = H5Dcreate2(file, name.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(set, 0) << name;
  ASSERT_GE(H5Dwrite(set, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, c.data_ptr()), 0) << name;
  H5Dclose(set);
  H5Sclose(space);
  H5Pclose(lcpl);
}

RunContext context_with_data(const Batch& batch) {
  RunContext ctx;
  ctx.seed = 17;
  ctx.train_batch = [batch](int64_t) { return batch; };
  return ctx;
}

TEST(Eagle3, WritesOneStepPerKernelForThePythonOracle) {
  const char* env = std::getenv("FLASHDRAFT_EAGLE3_EXPORT");
  const std::string path = env ? env : std::string(FLASHDRAFT_BINARY_DIR) + "/eagle3_export.h5";
  auto p = problem(2025);
  auto opts = kSmall;
  opts["vocab_batches"] = int64_t{1};
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(file, 0) << path;
  write(file, "batch/tokens", p.batch.tokens);
  write(file, "batch/hidden", p.batch.hidden);
  write(file, "batch/loss_mask", p.batch.loss_mask);
  write(file, "batch/lengths", p.batch.lengths);
  write(file, "batch/documents_1", at::tensor(p.batch.documents[1]));
  write(file, "target/embedding", p.target.embedding);
  write(file, "target/lm_head", p.target.lm_head);
  write(file, "target/logit_scale", at::scalar_tensor(p.target.logit_scale, at::kDouble));
  write(file, "target/logit_softcap", at::scalar_tensor(p.target.logit_softcap, at::kDouble));
  write(file, "config/ttt_steps", at::scalar_tensor(int64_t{3}, at::kLong));
  write(file, "config/heads", at::scalar_tensor(int64_t{4}, at::kLong));
  write(file, "config/kv_heads", at::scalar_tensor(int64_t{2}, at::kLong));
  write(file, "config/draft_vocab", at::scalar_tensor(int64_t{24}, at::kLong));
  write(file, "config/step_decay", at::scalar_tensor(0.7, at::kDouble));
  write(file, "config/rope_theta", at::scalar_tensor(500.0, at::kDouble));
  write(file, "config/rms_eps", at::scalar_tensor(1e-5, at::kDouble));
  for (const std::string kernel : {"dense_ref", "flash_cpu"}) {
    auto d = make_eagle3(opts);
    d->bind(p.target, context_with_data(p.batch), 2, 12);
    EXPECT_EQ(d->target_layers(p.target), (std::vector<int64_t>{0, 1, 2, 3}));  // 4 layers: even spread, then L-1
    Engine e(kernel, d->attention_problems());
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(5);
    StepResult r = d->step(p.batch, *e.dispatcher, rng, true);
    r.loss.backward();
    // Every unroll step ran its own call of this kernel, forward and backward.
    for (Phase ph : {Phase::forward, Phase::backward})
      for (int64_t c = 0; c < 3; ++c) {
        ASSERT_GE(e.ledger.ids(ph)[size_t(c)], 0) << kernel << " column " << c;
        EXPECT_EQ(e.ledger.names()[size_t(e.ledger.ids(ph)[size_t(c)])].rfind(kernel, 0), 0u);
      }
    const std::string k = kernel + "/";
    write(file, k + "loss", r.loss.detach());
    write(file, k + "position_accuracy", at::tensor(r.position_accuracy, at::kDouble));
    for (auto& [name, w] : d->parameters()) {
      ASSERT_TRUE(w.grad().defined()) << name;
      if (kernel == "dense_ref") write(file, "params/" + name, w);
      write(file, k + "grads/" + name, w.grad());
    }
    for (auto& [name, b] : d->buffers()) write(file, k + "buffers/" + name, b);
    // Validation (chain drafting) of the same batch: its drafts.
    StepResult v = d->step(p.batch, *e.dispatcher, rng, false);
    write(file, k + "eval/rows", v.drafts.rows);
    write(file, k + "eval/starts", v.drafts.starts);
    write(file, k + "eval/tokens", v.drafts.tokens);
    write(file, k + "eval/labels", v.drafts.labels);
    write(file, k + "eval/loss", v.loss);
    EXPECT_EQ(d->parameters().size(), 13u);
  }
  ASSERT_GE(H5Fclose(file), 0);
}

TEST(Eagle3, EachUnrollStepSetsItsOwnMaskAndKeyLength) {
  auto p = problem(7);
  auto d = make_eagle3(kSmall);
  d->bind(p.target, context_with_data(p.batch), 2, 12);
  const auto problems = d->attention_problems();
  ASSERT_EQ(problems.size(), 3u);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(problems[size_t(i)].q_len, 12);
    EXPECT_EQ(problems[size_t(i)].kv_len, 12 * (i + 1));
  }
  Engine e("flash_cpu", problems);
  // The choice checked the three distinct problems.
  EXPECT_EQ(e.dispatcher->choice().problems.size(), 3u);
  dflash_test::OracleAttention counter;  // not used for attention: only to count set_mask
  struct Recorder : DrafterContext {
    AttentionDispatcher* inner;
    std::vector<int64_t> kv_lens, mask_kv;
    void set_mask(const MaskInput& in) override {
      mask_kv.push_back(in.kv_len);
      inner->set_mask(in);
    }
    at::Tensor attention(int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double s) override {
      kv_lens.push_back(k.size(2));
      return inner->attention(l, q, k, v, s);
    }
    LmHeadLossOutput lm_head_loss(const LmHeadLossInput& in) override { return inner->lm_head_loss(in); }
  } rec;
  rec.inner = e.dispatcher.get();
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(1);
  StepResult r = d->step(p.batch, rec, rng, true);
  EXPECT_EQ(rec.mask_kv, (std::vector<int64_t>{12, 24, 36}));
  EXPECT_EQ(rec.kv_lens, (std::vector<int64_t>{12, 24, 36}));
  r.loss.backward();  // each backward runs with its forward's mask (shapes are checked by the kernel)
  EXPECT_EQ(e.ledger.calls(Phase::backward), 3 + 3);
  EXPECT_EQ(r.position_accuracy.size(), 3u);
  EXPECT_EQ(e.ledger.calls(Phase::forward), 3 + 3);  // the unroll calls, then the loss of each step
}

TEST(Eagle3, DraftVocabularyCountsTiesAndMaps) {
  // Tokens at loss-carrying positions: 7 x3, 3 x2, 9 x2, 1 x1, 4 x1; position 0 carries no loss (token 5).
  dflash_test::Problem p = dflash_test::random_problem(12, 32, {0, 1, 2, 3}, 1, 10, at::kFloat, 3);
  p.batch.tokens = at::tensor(std::vector<int64_t>{5, 7, 3, 9, 7, 1, 9, 3, 7, 4}).view({1, 10});
  p.batch.loss_mask = at::ones({1, 10}, at::kBool);
  p.batch.loss_mask[0][0] = false;
  auto opts = kSmall;
  opts["draft_vocab"] = int64_t{4};
  auto d = make_eagle3(opts);
  d->bind(p.target, context_with_data(p.batch), 1, 10);
  at::Tensor d2t, t2d;
  for (auto& [n, t] : d->buffers()) (n == "d2t" ? d2t : t2d) = t;
  // 7 (3), then 3 and 9 (2 each), then 1 (1; tie with 4 broken by the lower id); sorted: 1, 3, 7, 9.
  EXPECT_TRUE(at::equal(d2t, at::tensor(std::vector<int64_t>{1 - 0, 3 - 1, 7 - 2, 9 - 3})));
  std::vector<uint8_t> want(12, 0);
  for (int64_t v : {1, 3, 7, 9}) want[size_t(v)] = 1;
  EXPECT_TRUE(at::equal(t2d.to(at::kByte), at::tensor(at::ArrayRef<uint8_t>(want))));
  // Larger than the target's vocabulary: clamped.
  opts["draft_vocab"] = int64_t{500};
  auto big = make_eagle3(opts);
  big->bind(p.target, context_with_data(p.batch), 1, 10);
  for (auto& [n, t] : big->buffers())
    if (n == "d2t") {
      EXPECT_EQ(t.numel(), 12);
    }
}

TEST(Eagle3, ValidationDraftsAreChainsAtSpreadPositions) {
  auto p = problem(11);
  auto d = make_eagle3(kSmall);
  d->bind(p.target, context_with_data(p.batch), 2, 12);
  Engine e("dense_ref", d->attention_problems());
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(1);
  const StepResult v = d->step(p.batch, *e.dispatcher, rng, false);
  ASSERT_TRUE(v.drafts.defined());
  const int64_t D = v.drafts.rows.size(0);
  ASSERT_EQ(v.drafts.tokens.sizes(), at::IntArrayRef({D, 3}));  // ttt_steps columns
  ASSERT_EQ(v.drafts.labels.sizes(), at::IntArrayRef({D, 3}));
  EXPECT_GT(D, 4);  // both rows draft
  EXPECT_LE(D, 8);  // at most eval_blocks = 4 per row
  const at::Tensor tok = p.batch.tokens;
  for (int64_t k = 0; k < D; ++k) {
    const int64_t b = v.drafts.rows[k].item<int64_t>(), a = v.drafts.starts[k].item<int64_t>();
    ASSERT_TRUE(b == 0 || b == 1);
    EXPECT_EQ(v.drafts.labels[k][0].item<int64_t>(), tok[b][a + 1].item<int64_t>());  // the first label always counts
    for (int64_t j = 0; j < 3; ++j) {
      const int64_t l = v.drafts.labels[k][j].item<int64_t>();
      if (l >= 0) {
        EXPECT_EQ(l, tok[b][a + 1 + j].item<int64_t>());
      }
      // Row 1: documents [0, 6) and [6, 10): a label never crosses the document's end.
      if (b == 1 && a < 6 && a + 1 + j >= 6) {
        EXPECT_EQ(l, -1);
      }
      if (b == 1 && a + 1 + j >= 10) {
        EXPECT_EQ(l, -1);
      }
    }
  }
}

std::string config_error(const std::map<std::string, Value>& overrides, const dflash_test::Problem& p) {
  try {
    auto d = make_eagle3(overrides);
    d->target_layers(p.target);
    d->bind(p.target, context_with_data(p.batch), 2, 12);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Eagle3, BadInputsAreRefusedWithSentences) {
  auto p = problem(3);
  auto with = [](std::map<std::string, Value> o, const std::string& k, Value v) {
    o[k] = std::move(v);
    return o;
  };
  std::string e = config_error(with(kSmall, "ttt_steps", int64_t{0}), p);
  EXPECT_NE(e.find("ttt_steps = 0"), std::string::npos) << e;
  EXPECT_NE(e.find("at least once"), std::string::npos) << e;
  e = config_error(with(kSmall, "draft_vocab", int64_t{0}), p);
  EXPECT_NE(e.find("draft_vocab = 0"), std::string::npos) << e;
  EXPECT_NE(e.find("accepted: 1 or more"), std::string::npos) << e;
  e = config_error(with(kSmall, "target_layers", std::vector<int64_t>{0, 7, 2}), p);
  EXPECT_NE(e.find("target layer 7"), std::string::npos) << e;
  EXPECT_NE(e.find("layers 0..3"), std::string::npos) << e;
  e = config_error(with(kSmall, "target_layers", std::vector<int64_t>{-1, 1, 2}), p);
  EXPECT_NE(e.find("target layer -1"), std::string::npos) << e;
  e = config_error(with(kSmall, "target_layers", std::vector<int64_t>{0, 1}), p);
  EXPECT_NE(e.find("exactly 3"), std::string::npos) << e;
  // The data exports layers 0..2 only: the last layer (for the target's logits) is missing.
  auto q = p;
  q.target.exported_layers = {0, 1, 2};
  q.target.layers = 4;
  e = config_error(kSmall, q);
  EXPECT_NE(e.find("target layer 3 is not among the layers the data exports"), std::string::npos) << e;
  e = config_error(with(kSmall, "kv_heads", int64_t{3}), p);
  EXPECT_NE(e.find("not a multiple of kv_heads = 3"), std::string::npos) << e;
  EXPECT_EQ(config_error(kSmall, p), "");
}

}  // namespace

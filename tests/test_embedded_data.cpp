// The embedded default data: generated once and reused from its HDF5 cache; batches
// are deterministic; the tokens are the target's greedy continuation of its own last
// hidden states (checked through the exported LM head, written plainly here).
#include "built_plugins.hpp"
#include "dflash_oracle.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <set>

using namespace flashdraft;
namespace fs = std::filesystem;

namespace {

// Not fs::remove_all: the LibTorch of the PyPI wheel exports its own copy of it, which
// crashes when called from here.
void remove_tree(const fs::path& dir) {
  const std::string cmd = "rm -rf '" + dir.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

std::unique_ptr<Dataset> make_dataset(const std::map<std::string, Value>& over) {
  static Registry registry({built_plugin_dir()});
  const FoundPlugin& p = registry.get(PluginKind::dataset, "embedded");
  return create_as<Dataset>(registry, p, dflash_test::make_config(registry.schema(p), over));
}

const std::map<std::string, Value> kSmall{{"vocab", int64_t{48}},
                                          {"hidden", int64_t{16}},
                                          {"layers", int64_t{3}},
                                          {"heads", int64_t{2}},
                                          {"seq_len", int64_t{24}},
                                          {"prompt_len", int64_t{5}},
                                          {"train_sequences", int64_t{10}},
                                          {"eval_sequences", int64_t{6}},
                                          {"exported_layers", std::vector<int64_t>{0, 2}},
                                          {"batch_size", int64_t{3}},
                                          {"seed", int64_t{77}}};

TEST(EmbeddedData, GeneratedOnceThenReusedWithDeterministicBatches) {
  const fs::path dir = fs::temp_directory_path() / ("flashdraft_embedded_" + std::to_string(::getpid()));
  remove_tree(dir);
  std::vector<std::string> lines;
  RunContext ctx;
  ctx.out_dir = dir.string();
  ctx.seed = 3;
  ctx.say = [&](const std::string& s) { lines.push_back(s); };

  auto first = make_dataset(kSmall);
  first->open(ctx);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.front().rfind("data: generating ", 0), 0u) << lines.front();
  EXPECT_TRUE(fs::exists(first->source()));
  EXPECT_EQ(fs::path(first->source()).parent_path(), dir / "data");
  // No temporary left behind: the cache and the target as a Hugging Face checkpoint.
  for (const auto& e : fs::directory_iterator(dir / "data"))
    EXPECT_TRUE(e.path().extension() == ".h5" || e.path().extension() == ".target") << e.path();
  const fs::path target = fs::path(first->source()).replace_extension(".target");
  EXPECT_TRUE(fs::exists(target / "config.json") && fs::exists(target / "model.safetensors")) << target;

  lines.clear();
  auto second = make_dataset(kSmall);
  second->open(ctx);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "data: reusing " + first->source());

  for (int64_t i : {0, 1, 2, 3, 7}) {
    const Batch a = first->train_batch(i), b = second->train_batch(i);
    EXPECT_TRUE(at::equal(a.tokens, b.tokens)) << "batch " << i;
    EXPECT_TRUE(at::equal(a.hidden, b.hidden)) << "batch " << i;
    EXPECT_EQ(a.hidden.sizes().vec(), (std::vector<int64_t>{3, 24, 2, 16}));
  }
  // One epoch (10 / 3 = 3 batches) visits 9 distinct training sequences.
  std::set<std::vector<int64_t>> seen;
  for (int64_t i = 0; i < 3; ++i) {
    const Batch b = first->train_batch(i);
    for (int64_t r = 0; r < 3; ++r) {
      at::Tensor row = b.tokens[r].contiguous();
      seen.insert(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 24));
    }
    EXPECT_FALSE(b.loss_mask.narrow(1, 0, 5).any().item<bool>());
    EXPECT_TRUE(b.loss_mask.narrow(1, 5, 19).all().item<bool>());
  }
  EXPECT_EQ(seen.size(), 9u);
  // Held-out sequences are not training sequences.
  ASSERT_EQ(first->eval_batches(), 2);
  const Batch e = first->eval_batch(0);
  for (int64_t r = 0; r < 3; ++r) {
    at::Tensor row = e.tokens[r].contiguous();
    EXPECT_EQ(seen.count(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 24)), 0u);
  }

  // Greedy continuation: token t+1 = argmax_v lm_head[v] . rmsnorm(h_last[t]) for every
  // t from the last prompt position on (layer 2 is the target's last layer).
  const TargetModel tm = first->target();
  EXPECT_EQ(tm.exported_layers, (std::vector<int64_t>{0, 2}));
  for (int64_t i = 0; i < 2; ++i) {
    const Batch b = first->train_batch(i);
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t t = 4; t + 1 < 24; ++t) {
        const at::Tensor h = b.hidden[r][t][1].to(at::kDouble);
        const at::Tensor n = h / std::sqrt(h.pow(2).mean().item<double>() + 1e-6);
        const int64_t want = at::matmul(tm.lm_head.to(at::kDouble), n).argmax().item<int64_t>();
        EXPECT_EQ(b.tokens[r][t + 1].item<int64_t>(), want) << "row " << r << " position " << t + 1;
      }
  }
  remove_tree(dir);
}

TEST(EmbeddedData, BadSizesAreConfigErrors) {
  auto expect_error = [](std::map<std::string, Value> over, const std::string& needle) {
    std::map<std::string, Value> cfg = kSmall;
    for (auto& [k, v] : over) cfg[k] = v;
    try {
      make_dataset(cfg);
      FAIL() << "no error for " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({{"exported_layers", std::vector<int64_t>{0, 3}}}, "layer 3");
  expect_error({{"prompt_len", int64_t{24}}}, "prompt_len = 24");
  expect_error({{"heads", int64_t{3}}}, "heads = 3");
}

}  // namespace

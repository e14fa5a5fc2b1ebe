// The Hugging Face DFlash layout (plugins/dflash/hf_format.cpp), without loading the plugin:
//   - a drafter's tensors written by hf_drafter::write come back bit for bit through our
//     safetensors reader, in float32 and in bfloat16 (the dtype config.json names);
//   - config.json written and read back gives the same layout;
//   - import copies every tensor into place, and refuses (changing nothing) a folder whose
//     config or tensors do not fit, with a sentence naming the value and what is accepted.
// Tensors are fresh random values (seed printed).
#include "hf_format.hpp"         // plugins/dflash
#include "train/checkpoint.hpp"  // remove_tree

#include <flashdraft/safetensors.hpp>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

namespace hd = flashdraft::hf_drafter;
namespace fs = std::filesystem;

namespace {

hd::Layout small_layout(const std::string& dtype) {
  hd::Layout l;
  l.hidden = 24;
  l.layers = 2;
  l.heads = 4;
  l.kv_heads = 2;
  l.head_dim = 6;
  l.intermediate = 40;
  l.vocab = 97;
  l.block_size = 8;
  l.mask_token = 96;
  l.target_layers = 6;
  l.target_layer_ids = {1, 3, 4};
  l.rope_theta = 1e6;
  l.rms_eps = 1e-5;
  l.dtype = dtype;
  return l;
}

hd::Named random_weights(const hd::Layout& l, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  hd::Named out;
  for (const auto& [name, shape] : hd::tensor_shapes(l)) out.emplace_back(name, at::randn(shape).to(dtype));
  return out;
}

struct Folder {
  fs::path path;
  explicit Folder(const std::string& name)
      : path(fs::temp_directory_path() / ("hf_drafter_" + name + "_" + std::to_string(::getpid()))) {
    flashdraft::checkpoint::remove_tree(path);
  }
  ~Folder() { flashdraft::checkpoint::remove_tree(path); }
};

uint64_t fresh_seed() {
  const uint64_t seed = std::random_device{}();
  std::cout << "seed " << seed << std::endl;
  return seed;
}

}  // namespace

TEST(HfDrafter, LayoutNamesEveryTensorOnce) {
  const auto shapes = hd::tensor_shapes(small_layout("float32"));
  ASSERT_EQ(shapes.size(), 3u + 2u * 11u);
  EXPECT_EQ(shapes.front().first, "fc.weight");
  EXPECT_EQ(shapes.front().second, (std::vector<int64_t>{24, 3 * 24}));
  std::set<std::string> names;
  for (const auto& s : shapes) names.insert(s.first);
  EXPECT_EQ(names.size(), shapes.size());
  EXPECT_TRUE(names.count("layers.1.self_attn.k_norm.weight"));
  EXPECT_TRUE(names.count("hidden_norm.weight") && names.count("norm.weight"));
}

TEST(HfDrafter, WriteThenOurReaderIsBitwiseInEveryStoredDtype) {
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}}) {
    const hd::Layout layout = small_layout(name);
    // The run's tensors are float32; the folder stores them in the layout's dtype.
    const hd::Named weights = random_weights(layout, at::kFloat, fresh_seed());
    Folder folder("write_" + name);
    hd::write(folder.path.string(), layout, weights);
    const flashdraft::safetensors::Checkpoint ck(folder.path.string());
    ASSERT_EQ(ck.names().size(), weights.size());
    for (const auto& [tensor_name, t] : weights) {
      const auto* info = ck.find(tensor_name);
      ASSERT_NE(info, nullptr) << tensor_name;
      EXPECT_EQ(info->scalar_type, dtype) << tensor_name;
      const at::Tensor back = ck.load(tensor_name, c10::kCPU, dtype);
      EXPECT_TRUE(at::equal(back, t.to(dtype))) << name << " " << tensor_name;
    }
    const hd::Layout read = hd::read_config(folder.path.string());
    EXPECT_EQ(hd::config_json(read), hd::config_json(layout));
  }
}

TEST(HfDrafter, ImportCopiesEveryTensor) {
  const hd::Layout layout = small_layout("bfloat16");
  const hd::Named saved = random_weights(layout, at::kFloat, fresh_seed());
  Folder folder("import");
  hd::write(folder.path.string(), layout, saved);
  const hd::Named params = random_weights(layout, at::kFloat, fresh_seed() + 1);
  hd::import(folder.path.string(), layout, params);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::equal(params[i].second, saved[i].second.to(at::kBFloat16).to(at::kFloat))) << params[i].first;
}

TEST(HfDrafter, MismatchedImportsAreRefusedBeforeAnythingChanges) {
  const hd::Layout layout = small_layout("float32");
  Folder folder("refused");
  hd::write(folder.path.string(), layout, random_weights(layout, at::kFloat, fresh_seed()));
  struct Case {
    std::function<void(hd::Layout&)> change;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](hd::Layout& l) { l.hidden = 32; }, "hidden_size = 24, but the experiment's drafter has 32"},
      {[](hd::Layout& l) { l.kv_heads = 4; }, "num_key_value_heads = 2, but the experiment's drafter has 4"},
      {[](hd::Layout& l) { l.mask_token = 5; }, "dflash_config.mask_token_id = 96, but the experiment's drafter has 5"},
      {[](hd::Layout& l) {
         l.target_layer_ids = {0, 3, 4};
       },
       "target_layer_ids = [1, 3, 4], but the experiment's"},
      {[](hd::Layout& l) { l.block_size = 16; },
       "block_size = 8, but the experiment's drafter has 16 (from [drafter] block_size)"},
  };
  for (const Case& c : cases) {
    hd::Layout expected = layout;
    c.change(expected);
    const hd::Named params = random_weights(expected, at::kFloat, 7);
    std::vector<at::Tensor> before;
    for (const auto& p : params) before.push_back(p.second.clone());
    try {
      hd::import(folder.path.string(), expected, params);
      ADD_FAILURE() << "accepted: " << c.expected;
    } catch (const hd::Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos) << e.what();
    }
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].second, before[i]));
  }
}

TEST(HfDrafter, ForeignConfigIsRefused) {
  Folder folder("foreign");
  fs::create_directories(folder.path);
  std::ofstream(folder.path / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 24})";
  try {
    hd::read_config(folder.path.string());
    ADD_FAILURE() << "a Llama config was accepted";
  } catch (const hd::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("\"LlamaForCausalLM\" is not a DFlash drafter (accepted: \"DFlashDraftModel\""),
        std::string::npos)
        << e.what();
  }
}

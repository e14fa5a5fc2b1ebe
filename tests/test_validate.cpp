// `flashdraft validate` is a dry run: it refuses every experiment `flashdraft run`
// refuses before step 0, with the same first error line and the same exit code.
//
// The files: experiments/quickstart.toml (shrunk to a few sequences so the data is
// generated in seconds), then one defect each: schema defects (keys, types, ranges,
// tables, plugin names) and the ones only binding finds (a drafter that does not fit
// the data or the target, a kernel that does not exist, a dataset that contradicts
// itself, a device that is not there: device = "cuda", on a machine without CUDA only,
// since on a GPU machine that file is valid). Prints the table of both exit codes and
// first lines.
#include "cli_runner.hpp"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <sstream>

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Replaces the first match of `pattern` (a whole line) with `replacement`.
std::string with(const std::string& text, const std::string& pattern, const std::string& replacement) {
  const std::regex re(pattern, std::regex::multiline);
  if (!std::regex_search(text, re)) throw std::runtime_error("pattern not found in the base experiment: " + pattern);
  return std::regex_replace(text, re, replacement, std::regex_constants::format_first_only);
}

std::string first_line(const std::string& s) {
  const auto eol = s.find('\n');
  return s.substr(0, eol);
}

struct Defect {
  std::string name;
  std::string text;
};

std::vector<Defect> defects(const std::string& base) {
  const std::string drafter = "^plugin = \"dflash\"\\nlayers";
  std::vector<Defect> list = {
      {"unknown key in [drafter]", with(base, "^layers = 2$", "layerz = 2")},
      {"wrong type: [run] steps", with(base, "^steps = [0-9]+$", "steps = \"ten\"")},
      {"out of range: [optimizer] lr", with(base, "^lr = 3e-3$", "lr = -1.0")},
      {"unknown table [optimiser]", with(base, "^\\[optimizer\\]$", "[optimiser]")},
      {"missing [mask] table", with(base, "^\\[mask\\]\\nplugin = \"dflash\"\\nin_block = \"bidirectional\"$", "")},
      {"unknown drafter plugin", with(base, drafter, "plugin = \"dflashh\"\nlayers")},
      {"TOML syntax error", with(base, "^heads = 4\\nkv_heads", "heads = = 4\nkv_heads")},
      {"on_fallback not accepted", with(base, "^on_fallback = \"error\"", "on_fallback = \"ignore\"")},
      {"device not accepted", with(base, "^device = \"cpu\"$", "device = \"tpu\"")},
      {"mask in_block not accepted", with(base, "^in_block = \"bidirectional\"$", "in_block = \"diagonal\"")},
      {"heads not a multiple of kv_heads", with(base, "^heads = 4\\nkv_heads = 2$", "heads = 3\nkv_heads = 2")},
      {"unknown kernel name",
       with(base, "^kernels = \\[\"dense_ref\"\\]", "kernels = [\"flash_cpuu\", \"dense_ref\"]")},
      {"target layer the data lacks", with(base, "^target_layer_ids = \\[1, 3\\]$", "target_layer_ids = [1, 2]")},
      {"anchors = 0", with(base, "^anchors = 8$", "anchors = 0")},
      {"gamma negative", with(base, "^gamma = 7.0$", "gamma = -1.0")},
      {"mask token outside the vocabulary", with(base, "^gamma = 7.0$", "gamma = 7.0\nmask_token = 600")},
      {"block larger than the sequence", with(base, "^block_size = 16$", "block_size = 200")},
      {"drafter hidden differs from the target's", with(base, "^gamma = 7.0$", "gamma = 7.0\nhidden = 96")},
      {"hidden not divisible by heads", with(base, "^heads = 4\\nkv_heads = 2$", "heads = 6\nkv_heads = 2")},
      {"exported layer outside the target", with(base, "^exported_layers = \\[1, 3\\]$", "exported_layers = [1, 7]")},
      {"prompt as long as the sequence", with(base, "^prompt_len = 16$", "prompt_len = 128")},
      {"batch larger than the data", with(base, "^batch_size = 8$", "batch_size = 100")},
      {"unknown key in [kernels.dense_ref]", base + "\n[kernels.dense_ref]\ntile = 64\n"},
      {"a mask generator the drafter does not pose its attention for",
       with(base, "^\\[mask\\]\\nplugin = \"dflash\"\\nin_block = \"bidirectional\"$", "[mask]\nplugin = \"causal\"")},
  };
  // Where LibTorch sees a GPU, device = "cuda" is a valid experiment (it would train).
  if (!torch::cuda::is_available())
    list.push_back({"cuda on a machine without one", with(base, "^device = \"cpu\"$", "device = \"cuda\"")});
  return list;
}

}  // namespace

TEST(Validate, RefusesEveryExperimentRunRefusesBeforeStep0) {
  const std::string dir = test::temp_dir("validate");
  // The quickstart, small: every defect below is about another key.
  std::string base = read(std::string(FLASHDRAFT_SOURCE_DIR) + "/experiments/quickstart.toml");
  base = with(base, "^train_sequences = 512$", "train_sequences = 24");
  base = with(base, "^eval_sequences = 32$", "eval_sequences = 8");
  base = with(base, "^steps = 400$", "steps = 2");
  base = with(base, "^\\[run\\]$", "[run]\nout = \"" + dir + "/out\"");

  // The base itself is valid, and validate says what runs (the data is generated once,
  // and said to be).
  test::write_file(dir + "/base.toml", base);
  std::string out, err;
  ASSERT_EQ(test::run_cli({"validate", dir + "/base.toml"}, &out, &err), 0) << out << err;
  EXPECT_NE(out.find("data: generating"), std::string::npos) << out;
  EXPECT_NE(out.find("dense_ref: selected"), std::string::npos) << out;
  EXPECT_NE(out.find(": valid"), std::string::npos) << out;
  ASSERT_EQ(test::run_cli({"validate", dir + "/base.toml"}, &out, &err), 0) << out << err;
  EXPECT_NE(out.find("data: reusing"), std::string::npos) << out;

  std::printf("| # | defect | validate | run | first line (both) |\n|---|---|---|---|---|\n");
  int i = 0;
  for (const Defect& d : defects(base)) {
    ++i;
    const std::string path = dir + "/defect" + std::to_string(i) + ".toml";
    test::write_file(path, d.text);
    std::string v_out, v_err, r_out, r_err;
    const int v = test::run_cli({"validate", path}, &v_out, &v_err);
    const int r = test::run_cli({"run", path}, &r_out, &r_err);
    EXPECT_TRUE(r == 1 || r == 2) << d.name << ": run exited " << r << " (1 or 2: refused before step 0)\n"
                                  << r_out << r_err;
    EXPECT_EQ(v, r) << d.name << "\nvalidate: " << v_err << "\nrun: " << r_err;
    EXPECT_EQ(first_line(v_err), first_line(r_err)) << d.name;
    EXPECT_EQ(r_out.find("training:"), std::string::npos) << d.name << ": run started training\n" << r_out;
    std::string line = first_line(v_err);
    if (line.size() > 150) line = line.substr(0, 147) + "...";
    std::printf("| %d | %s | %d | %d | %s |\n", i, d.name.c_str(), v, r, line.c_str());
  }
}

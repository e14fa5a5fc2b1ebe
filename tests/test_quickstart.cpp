// The quickstart experiment end to end through the CLI: determinism (same file, same
// seed, same losses on CPU) and the fused CPU kernel training to the same losses as the
// dense reference, with its variants in the log for every step and layer.
#include "log/run_log.hpp"

#include "cli_runner.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

using flashdraft::LogReader;

namespace {

// quickstart.toml with some keys of [run] and [attention] replaced, and less of everything
// that is not the training step: 64 training sequences of the same target and drafter instead
// of 512 (the embedded data is generated once per test process), 8 held out, no validation and
// no checkpoint (neither is what these tests compare).
std::string variant_of_quickstart(const std::string& dir, const std::string& name, int steps,
                                  const std::string& kernel) {
  std::ifstream in(std::string(FLASHDRAFT_SOURCE_DIR) + "/experiments/quickstart.toml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  text = std::regex_replace(text, std::regex("\nname = \"[^\"]*\""), "\nname = \"" + name + "\"");
  text = std::regex_replace(text, std::regex("\nsteps = [0-9]+"), "\nsteps = " + std::to_string(steps));
  text = std::regex_replace(text, std::regex("\nkernels = \\[[^\\]]*\\]"), "\nkernels = [\"" + kernel + "\"]");
  text = std::regex_replace(text, std::regex("\ntrain_sequences = [0-9]+"), "\ntrain_sequences = 64");
  text = std::regex_replace(text, std::regex("\neval_sequences = [0-9]+"), "\neval_sequences = 8");
  text = std::regex_replace(text, std::regex("\nenabled = true"), "\nenabled = false");
  const std::string path = dir + "/" + name + ".toml";
  test::write_file(path, text);
  return path;
}

std::string shared_dir() {
  static const std::string dir = test::temp_dir("quickstart");
  return dir;
}

}  // namespace

TEST(Quickstart, SameExperimentSameLosses) {
  const std::string dir = shared_dir();
  const std::string exp = variant_of_quickstart(dir, "det", 8, "dense_ref");
  std::string out;
  ASSERT_EQ(test::run_cli({"run", exp, "--out", dir}, &out), 0) << out;
  ASSERT_EQ(test::run_cli({"run", exp, "--out", dir}, &out), 0) << out;
  EXPECT_NE(out.find("data: reusing"), std::string::npos) << out;  // the cache is reused
  LogReader a(dir + "/det.h5"), b(dir + "/det-1.h5");
  const auto la = a.f64("steps/loss"), lb = b.f64("steps/loss");
  ASSERT_EQ(la.size(), 8u);
  EXPECT_EQ(la, lb);  // bitwise
  EXPECT_EQ(a.f64("steps/tau_sim"), b.f64("steps/tau_sim"));
}

TEST(Quickstart, FlashCpuTrainsLikeDenseRef) {
  const std::string dir = shared_dir();
  std::string out;
  const std::string dense = variant_of_quickstart(dir, "dense", 20, "dense_ref");
  const std::string flash = variant_of_quickstart(dir, "flash", 20, "flash_cpu");
  ASSERT_EQ(test::run_cli({"run", dense, "--out", dir}, &out), 0) << out;
  ASSERT_EQ(test::run_cli({"run", flash, "--out", dir}, &out), 0) << out;
  LogReader d(dir + "/dense.h5"), f(dir + "/flash.h5");
  const auto ld = d.f64("steps/loss"), lf = f.f64("steps/loss");
  ASSERT_EQ(ld.size(), 20u);
  ASSERT_EQ(lf.size(), 20u);
  double worst = 0;
  for (size_t i = 0; i < ld.size(); ++i) worst = std::max(worst, std::fabs(lf[i] - ld[i]) / std::fabs(ld[i]));
  std::printf("max relative loss difference flash_cpu vs dense_ref over 20 steps: %.2e\n", worst);
  EXPECT_LE(worst, 1e-4);
  // Every step and layer ran flash_cpu's own variants, forward and backward.
  const auto names = f.strings("kernels/names");
  for (const char* phase : {"kernels/forward", "kernels/backward"}) {
    const auto ids = f.f64(phase);
    ASSERT_EQ(int64_t(ids.size()), 20 * f.shape(phase)[1]);
    for (double id : ids) {
      ASSERT_GE(id, 0) << phase;
      EXPECT_EQ(names[size_t(id)].rfind(std::string("flash_cpu/") + (phase[8] == 'f' ? "fwd" : "bwd"), 0), 0u)
          << names[size_t(id)];
    }
  }
  for (double id : d.f64("kernels/backward")) EXPECT_EQ(d.strings("kernels/names")[size_t(id)], "dense_ref");
  // The fused kernel holds less memory in the backward pass.
  const auto md = d.f64("memory/backward"), mf = f.f64("memory/backward");
  EXPECT_LT(*std::max_element(mf.begin(), mf.end()), *std::max_element(md.begin(), md.end()));
}

// Queued steps ([run] queue_ahead, CUDA): a run that queues each step before reading the
// previous one computes exactly the run that reads every step first - the same losses,
// gradient norms, accuracies, kernel columns and validations, bit for bit - and stops at
// the same step, with the same log, when the loss stops being finite. On the CPU the key
// changes nothing (steps run as they are queued). The CUDA runs skip without a GPU.
#include "log/run_log.hpp"

#include "cli_runner.hpp"

#include <torch/cuda.h>
#include <torch/types.h>

#include <gtest/gtest.h>

#include <algorithm>

using flashdraft::LogReader;

namespace {

// experiments/dflash_gpu.toml with another name, step count, output folder, extra keys for
// [run], and (`blow_up`) float16 with lr 10 and no warm-up, so that the first update
// overflows the activations and a later loss is not finite; validation every 4 steps (a
// point where queued steps are read).
std::string gpu_experiment(const std::string& dir, const std::string& name, int steps, const std::string& run_extra,
                           bool blow_up = false) {
  std::string text = test::read_file(std::string(FLASHDRAFT_SOURCE_DIR) + "/experiments/dflash_gpu.toml");
  auto replace = [&](const std::string& from, const std::string& to) {
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
  };
  replace("name = \"dflash_gpu\"", "name = \"" + name + "\"\nout = \"" + dir + "\"\n" + run_extra);
  replace("steps = 20", "steps = " + std::to_string(steps));
  if (blow_up) {
    replace("lr = 3e-3", "lr = 10.0");
    replace("warmup_steps = 5", "warmup_steps = 0");
    replace("dtype = \"bfloat16\"", "dtype = \"float16\"");
  }
  text += "\n[eval]\nenabled = true\nevery = 4\nbatches = 1\n";
  const std::string path = dir + "/" + name + ".toml";
  test::write_file(path, text);
  return path;
}

void expect_same_columns(const std::string& a, const std::string& b) {
  LogReader x(a), y(b);
  for (const char* column : {"steps/step", "steps/loss", "steps/grad_norm", "steps/lr", "steps/position_accuracy",
                             "steps/tau_sim", "kernels/forward", "kernels/backward", "kernels/loss", "eval/step",
                             "eval/loss", "eval/tau_anchor", "eval/tau_served", "eval/served_steps"})
    EXPECT_EQ(x.f64(column), y.f64(column)) << column;
  EXPECT_EQ(x.strings("kernels/names"), y.strings("kernels/names"));
  EXPECT_EQ(x.strings("events/kind"), y.strings("events/kind"));
}

}  // namespace

TEST(QueuedSteps, SameRunAsReadingEveryStep) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here: steps are queued ahead on CUDA only";
  const std::string dir = test::temp_dir("queued");
  std::string out;
  ASSERT_EQ(test::run_cli({"run", gpu_experiment(dir, "queued", 10, "queue_ahead = true")}, &out), 0) << out;
  EXPECT_NE(out.find("steps: queued ahead"), std::string::npos) << out;
  ASSERT_EQ(test::run_cli({"run", gpu_experiment(dir, "read", 10, "queue_ahead = false")}, &out), 0) << out;
  EXPECT_EQ(out.find("steps: queued ahead"), std::string::npos) << out;
  expect_same_columns(dir + "/queued.h5", dir + "/read.h5");
  LogReader q(dir + "/queued.h5");
  EXPECT_EQ(q.f64("steps/step").size(), 10u);
  EXPECT_EQ(q.f64("eval/step"), (std::vector<double>{0, 4, 8, 10}));
  for (double t : q.f64("steps/step_time_s")) EXPECT_GT(t, 0);
}

TEST(QueuedSteps, NonFiniteLossStopsAtTheSameStepWithTheSameLog) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here: steps are queued ahead on CUDA only";
  const std::string dir = test::temp_dir("queued-nan");
  std::string out_q, out_r;
  const int rc_q = test::run_cli({"run", gpu_experiment(dir, "queued", 12, "queue_ahead = true", true)}, &out_q);
  const int rc_r = test::run_cli({"run", gpu_experiment(dir, "read", 12, "queue_ahead = false", true)}, &out_r);
  EXPECT_EQ(rc_q, 1) << out_q;
  EXPECT_EQ(rc_r, 1) << out_r;
  for (const std::string* o : {&out_q, &out_r}) {
    EXPECT_NE(o->find("is not finite"), std::string::npos) << *o;
    EXPECT_NE(o->find("the run stops before its update"), std::string::npos) << *o;
  }
  expect_same_columns(dir + "/queued.h5", dir + "/read.h5");
  LogReader q(dir + "/queued.h5");
  EXPECT_LT(q.f64("steps/step").size(), 12u);
  const auto kinds = q.strings("events/kind");
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "nan"), kinds.end());
}

TEST(QueuedSteps, KeyIsAcceptedAndChangesNothingOnCpu) {
  // A small CPU run (the quickstart's drafter on a little embedded data set), both ways.
  const std::string dir = test::temp_dir("queued-cpu");
  for (const std::string flag : {"true", "false"}) {
    const std::string exp = dir + "/cpu_" + flag + ".toml";
    test::write_file(exp, "[run]\nname = \"cpu_" + flag + "\"\nout = \"" + dir +
                              "\"\nsteps = 4\nqueue_ahead = " + flag +
                              "\n[attention]\nkernels = [\"dense_ref\"]\n[drafter]\nplugin = \"dflash\"\nlayers = 1\n"
                              "heads = 2\nkv_heads = 1\nblock_size = 4\nanchors = 4\ntarget_layer_ids = [1]\n"
                              "[dataset]\nplugin = \"embedded\"\nvocab = 64\nhidden = 32\nlayers = 2\nheads = 2\n"
                              "seq_len = 32\nprompt_len = 4\ntrain_sequences = 16\neval_sequences = 4\n"
                              "exported_layers = [1]\nbatch_size = 4\n[mask]\nplugin = \"dflash\"\n");
    std::string out;
    ASSERT_EQ(test::run_cli({"run", exp}, &out), 0) << out;
    EXPECT_EQ(out.find("steps: queued ahead"), std::string::npos) << out;
  }
  EXPECT_EQ(LogReader(dir + "/cpu_true.h5").f64("steps/loss"), LogReader(dir + "/cpu_false.h5").f64("steps/loss"));
}

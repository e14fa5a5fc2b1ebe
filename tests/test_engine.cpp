// End-to-end runs of the CLI with the toy plugins: the kernel ledger and fallbacks,
// kernel selection, and the run log under SWMR reading and SIGKILL; the profiler's account
// of the device's idle time.
#include "log/run_log.hpp"
#include "train/profile.hpp"

#include "cli_runner.hpp"

#include <hdf5.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

using flashdraft::LogReader;

namespace {

std::string experiment(const std::string& dir, const std::string& name, int steps, const std::string& extra) {
  const std::string path = dir + "/" + name + ".toml";
  test::write_file(path, "[run]\nname = \"" + name + "\"\nsteps = " + std::to_string(steps) + "\nout = \"" + dir +
                             "\"\n[drafter]\nplugin = \"toy_drafter\"\n[dataset]\nplugin = \"toy_data\"\n"
                             "[mask]\nplugin = \"causal\"\n" +
                             extra);
  return path;
}

std::vector<std::string> run_args(const std::string& exp) {
  return {"run", exp, "--plugin-path", FLASHDRAFT_TEST_PLUGIN_DIR};
}

}  // namespace

TEST(Engine, RunLogsKernelVariantsForEveryStepAndLayer) {
  const std::string dir = test::temp_dir("engine-ok");
  const std::string exp = experiment(dir, "ok", 6, "[attention]\nkernels = [\"toy_kernel\"]\n");
  std::string out;
  ASSERT_EQ(test::run_cli(run_args(exp), &out), 0) << out;
  EXPECT_NE(out.find("log: " + dir + "/ok.h5"), std::string::npos) << out;
  EXPECT_NE(out.find("kernels fwd toy_kernel/fwd bwd toy_kernel/bwd"), std::string::npos) << out;
  LogReader r(dir + "/ok.h5");
  EXPECT_EQ(r.f64("steps/step"), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  const auto names = r.strings("kernels/names");
  ASSERT_EQ(names, (std::vector<std::string>{"toy_kernel/fwd", "toy_kernel/bwd"}));
  EXPECT_EQ(r.shape("kernels/forward"), (std::vector<int64_t>{6, 2}));
  for (double id : r.f64("kernels/forward")) EXPECT_EQ(id, 0);
  for (double id : r.f64("kernels/backward")) EXPECT_EQ(id, 1);
  for (const char* ph : {"memory/forward", "memory/backward", "memory/optimizer"})
    for (double b : r.f64(ph)) EXPECT_GT(b, 0) << ph;
  const auto attrs = r.attributes("/");
  EXPECT_NE(attrs.at("experiment").find("toy_drafter"), std::string::npos);
  EXPECT_NE(attrs.at("plugins").find("kernel toy_kernel 0.1.0"), std::string::npos) << attrs.at("plugins");
  EXPECT_EQ(r.strings("events/kind").back(), "finished");
  // A second run of the same experiment gets a new log name and identical losses (CPU).
  ASSERT_EQ(test::run_cli(run_args(exp), &out), 0) << out;
  LogReader r2(dir + "/ok-1.h5");
  EXPECT_EQ(r.f64("steps/loss"), r2.f64("steps/loss"));
  // inspect summarises it.
  ASSERT_EQ(test::run_cli({"inspect", dir + "/ok.h5"}, &out), 0) << out;
  EXPECT_NE(out.find("steps     6 recorded"), std::string::npos) << out;
  EXPECT_NE(out.find("toy_kernel/bwd x12"), std::string::npos) << out;
}

TEST(Engine, BackwardFallbackStopsTheRunWithErrorPolicy) {
  const std::string dir = test::temp_dir("engine-fallback");
  // 2 layers: backward calls 0..5 are the kernel's own (steps 0-2), the 7th reports
  // another variant: a fallback at step 3.
  const std::string exp = experiment(dir, "fb", 10,
                                     "[attention]\nkernels = [\"toy_kernel\"]\non_fallback = \"error\"\n"
                                     "[kernels.toy_kernel]\nbackward_variant = \"other/bwd\"\nfallback_after = 6\n");
  std::string out;
  EXPECT_EQ(test::run_cli(run_args(exp), &out), 1) << out;
  EXPECT_NE(out.find("kernel fallback: backward of layer 1 ran 'other/bwd', not a variant of the selected kernel "
                     "'toy_kernel'"),
            std::string::npos)
      << out;
  LogReader r(dir + "/fb.h5");
  EXPECT_EQ(r.f64("steps/step"), (std::vector<double>{0, 1, 2}));  // every step before it
  const auto kinds = r.strings("events/kind");
  ASSERT_FALSE(kinds.empty());
  EXPECT_EQ(kinds.front(), "fallback");
  EXPECT_EQ(r.f64("events/step").front(), 3);
}

TEST(Engine, BackwardFallbackIsRecordedWithWarnPolicy) {
  const std::string dir = test::temp_dir("engine-warn");
  const std::string exp = experiment(dir, "warn", 4,
                                     "[attention]\nkernels = [\"toy_kernel\"]\non_fallback = \"warn\"\n"
                                     "[kernels.toy_kernel]\nbackward_variant = \"other/bwd\"\nfallback_after = 2\n");
  std::string out;
  ASSERT_EQ(test::run_cli(run_args(exp), &out), 0) << out;
  LogReader r(dir + "/warn.h5");
  const auto names = r.strings("kernels/names");
  const auto bwd = r.f64("kernels/backward");  // 4 steps x 2 layers
  ASSERT_EQ(bwd.size(), 8u);
  EXPECT_EQ(names[size_t(bwd[0])], "toy_kernel/bwd");
  EXPECT_EQ(names[size_t(bwd[7])], "other/bwd");  // the ledger shows what really ran
  int fallbacks = 0;
  for (const auto& k : r.strings("events/kind")) fallbacks += k == "fallback";
  EXPECT_EQ(fallbacks, 6);  // steps 1-3, both layers
}

TEST(Engine, RefusedKernelStopsBeforeStepZeroOrFallsBackWithWarn) {
  const std::string dir = test::temp_dir("engine-select");
  std::string out;
  const std::string strict = experiment(dir, "strict", 3,
                                        "[attention]\nkernels = [\"toy_kernel\", \"dense_ref\"]\n"
                                        "[kernels.toy_kernel]\nrefuse_head_dim = 8\n");
  EXPECT_EQ(test::run_cli({"run", strict, "--plugin-path", FLASHDRAFT_TEST_PLUGIN_DIR}, &out), 1) << out;
  EXPECT_NE(out.find("toy_kernel: refused: head_dim 8 unsupported"), std::string::npos) << out;
  EXPECT_NE(out.find("on_fallback = \"error\""), std::string::npos) << out;
  const std::string lax = experiment(dir, "lax", 3,
                                     "[attention]\nkernels = [\"toy_kernel\", \"dense_ref\"]\non_fallback = \"warn\"\n"
                                     "[kernels.toy_kernel]\nrefuse_head_dim = 8\n");
  ASSERT_EQ(test::run_cli({"run", lax, "--plugin-path", FLASHDRAFT_TEST_PLUGIN_DIR}, &out), 0) << out;
  EXPECT_NE(out.find("dense_ref: selected (FALLBACK"), std::string::npos) << out;
  LogReader r(dir + "/lax.h5");
  EXPECT_EQ(r.strings("kernels/names").at(0), "dense_ref");
  EXPECT_EQ(r.strings("events/kind").at(0), "fallback");
  EXPECT_NE(r.strings("events/message").at(0).find("head_dim 8 unsupported"), std::string::npos);
  // A kernel that is not installed is named with the ones that are.
  const std::string missing = experiment(dir, "missing", 3, "[attention]\nkernels = [\"flash_nope\"]\n");
  EXPECT_EQ(test::run_cli({"run", missing, "--plugin-path", FLASHDRAFT_TEST_PLUGIN_DIR}, &out), 1) << out;
  EXPECT_NE(out.find("no kernel plugin named 'flash_nope' was found (kernels found: ["), std::string::npos) << out;
}

TEST(Engine, LogIsReadableWhileWrittenAndAfterSigkill) {
  const std::string dir = test::temp_dir("engine-kill");
  // 2 layers x 60 ms per forward call: ~0.15 s per step.
  const std::string exp =
      experiment(dir, "kill", 1000, "[attention]\nkernels = [\"toy_kernel\"]\n[kernels.toy_kernel]\nsleep_ms = 60\n");
  test::Child child = test::start_cli(run_args(exp), dir + "/out.txt");
  const std::string log = dir + "/kill.h5";
  // A second process (this one) reads the log while it is written (SWMR).
  int64_t seen = 0, reads = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (seen < 8 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!std::filesystem::exists(log)) continue;
    try {
      LogReader r(log);
      if (!r.exists("steps/step")) continue;
      const auto steps = r.f64("steps/step");
      for (size_t i = 0; i < steps.size(); ++i) ASSERT_EQ(steps[i], double(i));
      EXPECT_GE(int64_t(steps.size()), seen);  // never goes backwards
      seen = int64_t(steps.size());
      ++reads;
    } catch (const std::runtime_error&) {
      // the writer may not have started SWMR yet
    }
  }
  ASSERT_GE(seen, 8) << child.output();
  EXPECT_GE(reads, 3);
  kill(child.pid, SIGKILL);
  EXPECT_EQ(child.wait(), 128 + SIGKILL);

  // The killed run's log opens with the plain HDF5 C API and holds steps 0..k-1.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  hid_t f = H5Fopen(log.c_str(), H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, H5P_DEFAULT);
  ASSERT_GE(f, 0) << "the killed run's log does not open";
  hid_t d = H5Dopen2(f, "steps/step", H5P_DEFAULT);
  ASSERT_GE(d, 0);
  hid_t s = H5Dget_space(d);
  hsize_t n = 0;
  H5Sget_simple_extent_dims(s, &n, nullptr);
  ASSERT_GE(int64_t(n), seen);
  std::vector<int64_t> steps(n);
  H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, steps.data());
  for (hsize_t i = 0; i < n; ++i) EXPECT_EQ(steps[i], int64_t(i));
  H5Sclose(s);
  H5Dclose(d);
  hid_t l = H5Dopen2(f, "steps/loss", H5P_DEFAULT);
  std::vector<double> loss(n);
  H5Dread(l, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, loss.data());
  for (double x : loss) EXPECT_TRUE(std::isfinite(x));
  H5Dclose(l);
  H5Fclose(f);
  // And with h5py, the Python side's reader (the project's .venv; absent on machines
  // that build against another torch, where this part is reported and left out).
  if (!std::filesystem::exists(FLASHDRAFT_PYTHON)) {
    std::printf("note: %s not found; h5py check of the killed log left out\n", FLASHDRAFT_PYTHON);
    return;
  }
  std::string out;
  const std::string py =
      std::string(FLASHDRAFT_PYTHON) +
      " -c \"import h5py,sys; f=h5py.File(sys.argv[1],'r',swmr=True);"
      " n=len(f['steps/step']); assert list(f['steps/step'][:])==list(range(n)); print('h5py steps', n)\" " +
      log;
  FILE* p = popen(py.c_str(), "r");
  char buf[256] = {0};
  std::string got;
  while (fgets(buf, sizeof buf, p)) got += buf;
  EXPECT_EQ(pclose(p), 0) << got;
  EXPECT_NE(got.find("h5py steps " + std::to_string(n)), std::string::npos) << got;
}

// A step in parts ([drafter] anchor_parts: the same batch and target forward, each part's
// forward and backward in turn, their gradients weighted as micro-batches') trains the same
// run as one part: the quickstart's DFlash drafter for 12 steps in 1 and in 4 parts, float32
// on the CPU; the losses agree to float32 summation order, the accuracies exactly, and the
// parts hold less memory at once.
TEST(Engine, StepInPartsTrainsTheSameRun) {
  const std::string dir = test::temp_dir("parts");
  const std::string base = test::read_file(std::string(FLASHDRAFT_SOURCE_DIR) + "/experiments/quickstart.toml");
  auto variant = [&](const std::string& name, const std::string& drafter_extra) {
    std::string text = base;
    auto replace = [&](const std::string& from, const std::string& to) {
      const size_t at = text.find(from);
      ASSERT_NE(at, std::string::npos) << from;
      text.replace(at, from.size(), to);
    };
    replace("name = \"quickstart\"", "name = \"" + name + "\"\nout = \"" + dir + "\"");
    replace("steps = 400", "steps = 12");
    replace("[drafter]\n", "[drafter]\n" + drafter_extra);
    // (the served decoding of the validations is not compared here: 3.4 s of the test's 17 per run)
    replace("[eval]\n", "[eval]\nserved = false\n");
    test::write_file(dir + "/" + name + ".toml", text);
  };
  variant("one", "");
  variant("four", "anchor_parts = 4\n");
  std::string out;
  ASSERT_EQ(test::run_cli({"run", dir + "/one.toml"}, &out), 0) << out;
  ASSERT_EQ(test::run_cli({"run", dir + "/four.toml"}, &out), 0) << out;
  EXPECT_NE(out.find("runs in 4 parts"), std::string::npos) << out;
  LogReader one(dir + "/one.h5"), four(dir + "/four.h5");
  const std::vector<double> a = one.f64("steps/loss"), b = four.f64("steps/loss");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
  const std::vector<double> acc_a = one.f64("steps/position_accuracy"), acc_b = four.f64("steps/position_accuracy");
  EXPECT_EQ(acc_a[0], acc_b[0]);  // step 1: the same draft from the same weights
  EXPECT_EQ(one.f64("eval/tau_anchor")[0], four.f64("eval/tau_anchor")[0]);  // before step 1
  const std::vector<double> pa = one.f64("memory/backward"), pb = four.f64("memory/backward");
  EXPECT_LT(*std::max_element(pb.begin(), pb.end()), *std::max_element(pa.begin(), pa.end()));
}

// --profile's idle account on made-up spans (the CPU has no device kernels): the gaps between
// kernels of every stream merged, each long gap named by the host op overlapping it most.
TEST(Engine, ProfilerNamesTheHostOpsTheDeviceWaitedFor) {
  using flashdraft::TimedSpan;
  const std::vector<TimedSpan> kernels = {{0, 10, "a", 0},  {12, 20, "b", 0},   {50, 60, "c", 0},
                                          {55, 70, "d", 0}, {110, 120, "e", 0}, {200, 210, "f", 0}};
  // Gaps: 10..12 (short), 20..50, 70..110 (60..70 is covered by the second stream), 120..200.
  const std::vector<TimedSpan> host = {{20, 55, "aten::to", 1},
                                       {20, 50, "cudaStreamSynchronize", 1},  // a synchronize inside a copy: both named
                                       {60, 115, "aten::mm", 2},
                                       {108, 109, "cudaLaunchKernel", 2},  // the outer op overlaps the gap most
                                       {0, 5, "aten::empty", 1}};          // during a kernel: no gap
  const flashdraft::DeviceIdle idle = flashdraft::device_idle(kernels, host, 5);
  EXPECT_EQ(idle.idle_ns, 2 + 30 + 40 + 80);
  EXPECT_EQ(idle.long_gaps, 3);
  ASSERT_EQ(idle.causes.size(), 3u);
  EXPECT_EQ(idle.causes[0], (std::pair<double, std::string>{80, "(no host op)"}));
  EXPECT_EQ(idle.causes[1], (std::pair<double, std::string>{40, "aten::mm"}));
  EXPECT_EQ(idle.causes[2], (std::pair<double, std::string>{30, "aten::to > cudaStreamSynchronize"}));
  // Unsorted input and a threshold above every gap: the same idle time, no long gaps.
  const flashdraft::DeviceIdle none = flashdraft::device_idle({kernels.rbegin(), kernels.rend()}, host, 100);
  EXPECT_EQ(none.idle_ns, 152);
  EXPECT_EQ(none.long_gaps, 0);
  EXPECT_TRUE(none.causes.empty());
  EXPECT_EQ(flashdraft::device_idle({}, host, 5).idle_ns, 0);
}

// --profile's parts of a step on made-up spans: a kernel belongs to the innermost named range
// holding its launching op's start; a part's span runs from its first kernel to its last, per
// occurrence; kernels launched outside every range (or by no known op) are counted apart.
TEST(Engine, ProfilerSplitsDeviceTimeByPartOfTheStep) {
  using flashdraft::LaunchedKernel;
  const std::vector<flashdraft::TimedSpan> ranges = {{0, 100, "target_forward", 1},
                                                     {100, 200, "drafter_forward", 1},  // step 1
                                                     {300, 400, "target_forward", 1},
                                                     {320, 330, "inner", 1}};  // step 2, a range inside
  const std::vector<LaunchedKernel> kernels = {
      {10, 40, "gemm", 5},     {45, 50, "norm", 20},    {60, 90, "gemm", 50},  // target 1: span 10..90
      {95, 150, "gemm", 150},                                                  // drafter (runs on past 100)
      {400, 430, "gemm", 310}, {440, 460, "attn", 325},                        // target 2; inner
      {500, 505, "adam", 500}, {510, 512, "copy", -1}};                        // outside; unknown launch
  const std::vector<flashdraft::PartTime> parts = flashdraft::device_parts(kernels, ranges);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].part, "target_forward");
  EXPECT_EQ(parts[0].kernel_ns, 30 + 5 + 30 + 30);
  EXPECT_EQ(parts[0].span_ns, 80 + 30);  // 10..90, then 400..430
  EXPECT_EQ(parts[0].occurrences, 2);
  ASSERT_EQ(parts[0].kernels.size(), 2u);
  EXPECT_EQ(parts[0].kernels[0], (std::pair<double, std::string>{90, "gemm (3 calls)"}));
  EXPECT_EQ(parts[0].kernels[1], (std::pair<double, std::string>{5, "norm (1 calls)"}));
  EXPECT_EQ(parts[1].part, "drafter_forward");
  EXPECT_EQ(parts[1].kernel_ns, 55);
  EXPECT_EQ(parts[1].span_ns, 55);
  EXPECT_EQ(parts[2].part, "inner");
  EXPECT_EQ(parts[2].kernel_ns, 20);
  EXPECT_EQ(parts[3].part, "(outside the named parts)");
  EXPECT_EQ(parts[3].kernel_ns, 7);
  EXPECT_EQ(parts[3].span_ns, 7);
  EXPECT_TRUE(flashdraft::device_parts({}, ranges).empty());
}

// --profile on the CPU: the table of host ops, no device section.
TEST(Engine, ProfileWindowPrintsItsTable) {
  const std::string dir = test::temp_dir("engine-profile");
  const std::string exp = experiment(dir, "prof", 4, "[attention]\nkernels = [\"toy_kernel\"]\n");
  std::vector<std::string> args = run_args(exp);
  args.insert(args.end(), {"--profile", "1:3"});
  std::string out;
  ASSERT_EQ(test::run_cli(args, &out), 0) << out;
  EXPECT_NE(out.find("profile: steps 1..2, wall "), std::string::npos) << out;
  EXPECT_NE(out.find("longest host ops"), std::string::npos) << out;
  EXPECT_EQ(out.find("device idle"), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/prof.trace.json"));
}

// Checkpoints, exact resume and validation, end to end through the CLI on a tiny DFlash
// experiment (the quickstart's plugins at toy sizes: a run takes seconds on CPU).
//   - a run of 2N steps and a run SIGKILLed after N+k steps then resumed from the
//     step-N checkpoint log bitwise identical losses, each step once, in order;
//   - damaged checkpoints (truncated, edited, partial, another drafter shape) are refused
//     with a sentence naming the file and the problem; --resume latest skips them;
//   - /eval rows: exact greedy tau against a plain oracle, bounds that tie it to the
//     per-position accuracies, and tau rising with training.
#include "eval/eval.hpp"
#include "log/run_log.hpp"
#include "train/checkpoint.hpp"
#include "train/trainer.hpp"

#include <flashdraft/acceptance.hpp>

#include "cli_runner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;
using flashdraft::LogReader;

namespace {

constexpr int kSteps = 16;      // 2N
constexpr int kEvery = 8;       // N
constexpr int kKillAfter = 11;  // N + k

// The quickstart's plugins at toy sizes. `extra_drafter` lands in [drafter].
std::string experiment(const std::string& dir, int steps, int sleep_ms, const std::string& extra_drafter = "",
                       int ckpt_every = kEvery, int eval_every = 4) {
  const std::string path = dir + "/tiny.toml";
  test::write_file(path, "[run]\nname = \"tiny\"\nseed = 3\nsteps = " + std::to_string(steps) +
                             "\nthreads = 1\nprint_every = 100\nout = \"" + dir +
                             "\"\n"
                             "[attention]\nkernels = [\"toy_kernel\"]\n"
                             "[kernels.toy_kernel]\nsleep_ms = " +
                             std::to_string(sleep_ms) +
                             "\n"
                             "[optimizer]\nlr = 1e-2\nwarmup_steps = 2\n"
                             "[checkpoint]\nenabled = true\nevery = " +
                             std::to_string(ckpt_every) +
                             "\nkeep = 3\n"
                             "[eval]\nenabled = true\nevery = " +
                             std::to_string(eval_every) +
                             "\n"
                             "[drafter]\nplugin = \"dflash\"\nlayers = 1\nheads = 2\nkv_heads = 1\nblock_size = 8\n"
                             "anchors = 2\n" +
                             extra_drafter +
                             "[dataset]\nplugin = \"embedded\"\nvocab = 64\nhidden = 32\nlayers = 2\nheads = 2\n"
                             "seq_len = 32\nprompt_len = 4\ntrain_sequences = 32\neval_sequences = 32\n"
                             "exported_layers = [0, 1]\nbatch_size = 4\ngenerate_batch = 64\n"
                             "[mask]\nplugin = \"dflash\"\n");
  return path;
}

std::vector<std::string> run_args(const std::string& exp, std::vector<std::string> more = {}) {
  std::vector<std::string> a{"run", exp, "--plugin-path", FLASHDRAFT_TEST_PLUGIN_DIR};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// One finished 16-step run, shared by the tests that only read or damage its files.
struct Reference {
  std::string dir, exp, log;
  std::vector<double> loss, eval_step, eval_loss, eval_tau, eval_served;
};
const Reference& reference() {
  static Reference r = [] {
    Reference x;
    x.dir = test::temp_dir("ckpt-ref");
    x.exp = experiment(x.dir, kSteps, 0);
    std::string out;
    EXPECT_EQ(test::run_cli(run_args(x.exp), &out), 0) << out;
    x.log = x.dir + "/tiny.h5";
    LogReader log(x.log);
    x.loss = log.f64("steps/loss");
    x.eval_step = log.f64("eval/step");
    x.eval_loss = log.f64("eval/loss");
    x.eval_tau = log.f64("eval/tau_anchor");
    x.eval_served = log.f64("eval/tau_served");
    return x;
  }();
  return r;
}

// A copy of the reference run folder (log, data cache, checkpoints) to damage.
std::string copy_of_reference(const std::string& name) {
  const std::string dir = test::temp_dir(name);
  fs::copy(reference().dir, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  // The experiment names its out folder: rewrite it for the copy.
  std::ifstream in(dir + "/tiny.toml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const auto at = text.find(reference().dir);
  text.replace(at, reference().dir.size(), dir);
  test::write_file(dir + "/tiny.toml", text);
  return dir;
}

}  // namespace

TEST(Checkpoint, SigkilledRunResumedFromStepNLogsBitwiseIdenticalLosses) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.loss.size(), size_t(kSteps));
  for (const char* c : {"step_8", "step_16"}) EXPECT_TRUE(fs::exists(ref.dir + "/checkpoints/" + c + "/manifest")) << c;

  // The same run, slowed by the toy kernel's pause (no change to the numbers), killed
  // once its log holds N + k steps.
  const std::string dir = test::temp_dir("ckpt-kill");
  const std::string exp = experiment(dir, kSteps, 60);
  test::Child child = test::start_cli(run_args(exp), dir + "/out.txt");
  const std::string log_path = dir + "/tiny.h5";
  int64_t seen = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (seen < kKillAfter && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!fs::exists(log_path)) continue;
    try {
      LogReader r(log_path);
      if (r.exists("steps/step")) seen = static_cast<int64_t>(r.f64("steps/step").size());
    } catch (const std::runtime_error&) {
    }
  }
  kill(child.pid, SIGKILL);
  ASSERT_EQ(child.wait(), 128 + SIGKILL) << child.output();
  {
    LogReader r(log_path);
    const int64_t rows = static_cast<int64_t>(r.f64("steps/step").size());
    ASSERT_GE(rows, kKillAfter);
    ASSERT_LT(rows, kSteps) << "the run finished before it could be killed";
  }
  ASSERT_TRUE(fs::exists(dir + "/checkpoints/step_8/manifest")) << child.output();
  ASSERT_FALSE(fs::exists(dir + "/checkpoints/step_16"));

  // Resume from the step-N checkpoint, at full speed.
  const std::string fast = experiment(dir, kSteps, 0);
  std::string out;
  ASSERT_EQ(test::run_cli(run_args(fast, {"--resume", dir + "/checkpoints/step_8"}), &out), 0) << out;
  EXPECT_TRUE(contains(out, "resume: resumed from " + dir + "/checkpoints/step_8 at step 8")) << out;

  LogReader r(log_path);
  std::vector<double> expect_steps;
  for (int i = 0; i < kSteps; ++i) expect_steps.push_back(i);
  EXPECT_EQ(r.f64("steps/step"), expect_steps);  // every step once, in order
  const std::vector<double> loss = r.f64("steps/loss");
  ASSERT_EQ(loss.size(), ref.loss.size());
  for (size_t i = 0; i < loss.size(); ++i)
    EXPECT_EQ(std::memcmp(&loss[i], &ref.loss[i], sizeof(double)), 0)
        << "step " << i << ": " << loss[i] << " vs " << ref.loss[i] << " (uninterrupted run)";
  EXPECT_EQ(r.f64("steps/lr"), LogReader(ref.log).f64("steps/lr"));
  EXPECT_EQ(r.shape("kernels/forward"), (std::vector<int64_t>{kSteps, 1}));
  EXPECT_EQ(r.shape("steps/position_accuracy"), (std::vector<int64_t>{kSteps, 7}));
  // Validation rows: the same steps and numbers as the uninterrupted run, once each.
  EXPECT_EQ(r.f64("eval/step"), ref.eval_step);
  EXPECT_EQ(r.f64("eval/loss"), ref.eval_loss);
  EXPECT_EQ(r.f64("eval/tau_anchor"), ref.eval_tau);
  EXPECT_EQ(r.f64("eval/tau_served"), ref.eval_served);
  // inspect's validation table: the scalar measures only, one row per validation.
  ASSERT_EQ(test::run_cli({"inspect", log_path}, &out), 0) << out;
  EXPECT_TRUE(contains(out, "      step       loss tau_served     +- tau_anchor   tau_data    tau_sim\n")) << out;
  // The events record the resume (and keep the killed run's history).
  const auto kinds = r.strings("events/kind");
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), "resume"), 1);
  EXPECT_EQ(kinds.back(), "finished");
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step_16/manifest"));
}

TEST(Checkpoint, InterruptedRunCheckpointsWhereItStoppedAndLatestContinuesIt) {
  const Reference& ref = reference();
  const std::string dir = test::temp_dir("ckpt-int");
  // A crashed checkpoint write leaves only a .tmp-* folder: never taken for a checkpoint.
  fs::create_directories(dir + "/checkpoints/.tmp-step_12-999");
  test::write_file(dir + "/checkpoints/.tmp-step_12-999/weights.pt", "half");
  const std::string exp = experiment(dir, kSteps, 60);
  test::Child child = test::start_cli(run_args(exp), dir + "/out.txt");
  const std::string log_path = dir + "/tiny.h5";
  int64_t seen = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (seen < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!fs::exists(log_path)) continue;
    try {
      LogReader r(log_path);
      if (r.exists("steps/step")) seen = static_cast<int64_t>(r.f64("steps/step").size());
    } catch (const std::runtime_error&) {
    }
  }
  kill(child.pid, SIGINT);  // finishes the step in flight, checkpoints, exits 130
  ASSERT_EQ(child.wait(), 130) << child.output();
  const std::string out1 = child.output();
  const auto at = out1.find("interrupted before step ");
  ASSERT_NE(at, std::string::npos) << out1;
  const int stopped = std::stoi(out1.substr(at + 24));
  ASSERT_LT(stopped, kEvery) << "interrupt after the first periodic checkpoint; the test wants one before it";
  EXPECT_TRUE(contains(out1, "checkpoint: writing step " + std::to_string(stopped) + " ...\ncheckpoint: " + dir +
                                 "/checkpoints/step_" + std::to_string(stopped) + " ("))
      << out1;
  EXPECT_TRUE(contains(out1, " MB in ")) << out1;                   // a small drafter's checkpoint
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/.tmp-step_12-999"));  // cleared by the write

  std::string out;
  ASSERT_EQ(test::run_cli(run_args(experiment(dir, kSteps, 0), {"--resume"}), &out), 0) << out;
  EXPECT_TRUE(contains(out, "resumed from " + dir + "/checkpoints/step_" + std::to_string(stopped) + " at step " +
                                std::to_string(stopped)))
      << out;
  LogReader r(log_path);
  EXPECT_EQ(r.f64("steps/loss"), ref.loss);
  EXPECT_EQ(r.f64("eval/step"), ref.eval_step);
  EXPECT_EQ(r.f64("eval/tau_anchor"), ref.eval_tau);
  EXPECT_EQ(r.f64("eval/tau_served"), ref.eval_served);
}

TEST(Checkpoint, DamagedCheckpointsAreRefusedWithTheFileAndTheProblem) {
  const std::string dir = copy_of_reference("ckpt-bad");
  const std::string exp = dir + "/tiny.toml";
  const std::string step8 = dir + "/checkpoints/step_8", step16 = dir + "/checkpoints/step_16";
  std::string out;

  // Truncated file: the size in the manifest gives it away.
  const auto full = fs::file_size(step16 + "/weights.pt");
  fs::resize_file(step16 + "/weights.pt", full / 2);
  EXPECT_EQ(test::run_cli(run_args(exp, {"--resume", step16}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "checkpoint file " + step16 + "/weights.pt has " + std::to_string(full / 2) +
                                " bytes, the manifest says " + std::to_string(full) + " (truncated or overwritten)"))
      << out;

  // --resume latest skips it, says so, and takes step_8; the finished log is cut back to
  // 8 steps and the resumed steps reproduce the original ones.
  ASSERT_EQ(test::run_cli(run_args(exp, {"--resume", "latest"}), &out), 0) << out;
  EXPECT_TRUE(contains(out, "resume: skipping " + step16 + ": checkpoint file " + step16 + "/weights.pt has")) << out;
  EXPECT_TRUE(contains(out, "resumed from " + step8 + " at step 8")) << out;
  {
    LogReader r(dir + "/tiny.h5");
    EXPECT_EQ(r.f64("steps/loss"), reference().loss);
    EXPECT_EQ(r.f64("eval/step"), reference().eval_step);
  }
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/abandoned_step_16/manifest"));
  EXPECT_TRUE(fs::exists(step16 + "/manifest"));  // written again by the resumed run

  // An edited byte: same size, another checksum.
  {
    std::fstream f(step8 + "/optimizer.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  EXPECT_EQ(test::run_cli(run_args(exp, {"--resume", step8}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "checkpoint file " + step8 + "/optimizer.pt has checksum ")) << out;
  EXPECT_TRUE(contains(out, "(the file was changed or corrupted after it was written)")) << out;

  // A partial manifest (no final "complete" line), and a missing one.
  {
    std::ifstream in(step16 + "/manifest");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    text.resize(text.rfind("complete"));
    test::write_file(step16 + "/manifest", text);
  }
  EXPECT_EQ(test::run_cli(run_args(exp, {"--resume", step16}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "checkpoint manifest " + step16 +
                                "/manifest is damaged: it does not end with the line \"complete\" (a partial write)"))
      << out;
  fs::remove(step16 + "/manifest");
  EXPECT_EQ(test::run_cli(run_args(exp, {"--resume", step16}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "checkpoint " + step16 + " has no manifest file " + step16 + "/manifest")) << out;

  // Nothing usable left: latest names every reason.
  EXPECT_EQ(test::run_cli(run_args(exp, {"--resume"}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "no usable checkpoint under " + dir + "/checkpoints")) << out;
}

TEST(Checkpoint, CheckpointOfAnotherDrafterShapeIsRefused) {
  const std::string dir = copy_of_reference("ckpt-shape");
  const std::string step8 = dir + "/checkpoints/step_8";
  std::string out;
  // Two layers: the checkpoint lacks layer 1's tensors.
  const std::string deeper = experiment(dir, kSteps, 0, "", kEvery, 4);
  {
    std::ifstream in(deeper);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    text.replace(text.find("layers = 1"), 10, "layers = 2");
    test::write_file(deeper, text);
  }
  EXPECT_EQ(test::run_cli(run_args(deeper, {"--resume", step8}), &out), 1) << out;
  EXPECT_TRUE(
      contains(out, "checkpoint file " + step8 + "/weights.pt has no tensor 'layers.1.input_layernorm.weight' [32]"))
      << out;
  // Another MLP width: shape mismatch, both shapes named.
  const std::string wider = experiment(dir, kSteps, 0, "ffn = 48\n");
  EXPECT_EQ(test::run_cli(run_args(wider, {"--resume", step8}), &out), 1) << out;
  EXPECT_TRUE(contains(out, "checkpoint file " + step8 +
                                "/weights.pt: tensor 'layers.0.mlp.gate_proj.weight' has shape [96, 32], the "
                                "experiment's drafter expects [48, 32]"))
      << out;
  // The refused resumes left the log as it was.
  EXPECT_EQ(LogReader(dir + "/tiny.h5").f64("steps/loss"), reference().loss);
}

// A checkpoint is refused before its first byte when the disk cannot hold it (a 14 GB
// drafter checkpoint beside a kept one fills a small disk half-way through otherwise), with
// the sizes, what the kept ones take and what would make room.
TEST(Checkpoint, ACheckpointThatDoesNotFitIsRefusedWithTheSpaceItNeeds) {
  using flashdraft::checkpoint::space_refusal;
  // Room to spare: 1/16 of the checkpoint, at least 1 MiB, at most 64 MiB.
  const uintmax_t mib = uintmax_t(1) << 20;
  EXPECT_EQ(space_refusal("step_8", 1000, 1000 + mib, "/r", 0, 0, 2), "");
  EXPECT_NE(space_refusal("step_8", 1000, 1000 + mib - 1, "/r", 0, 0, 2), "");
  EXPECT_EQ(space_refusal("step_8", 320 * mib, 340 * mib, "/r", 0, 0, 2), "");
  EXPECT_NE(space_refusal("step_8", 320 * mib, 340 * mib - 1, "/r", 0, 0, 2), "");
  EXPECT_EQ(space_refusal("step_8", 16000 * mib, 16064 * mib, "/r", 0, 0, 2), "");
  EXPECT_NE(space_refusal("step_8", 16000 * mib, 16064 * mib - 1, "/r", 0, 0, 2), "");
  EXPECT_EQ(space_refusal("step_8", 30'000'000, 10'000'000, "/r", 0, 0, 2),
            "cannot write checkpoint step_8: it needs 30.0 MB and /r has 10.0 MB free; free space there, lower "
            "[checkpoint] keep, or write the run elsewhere (--out)");
  EXPECT_EQ(space_refusal("step_2", 14'000'000'000, 9'800'000'000, "/runs/x/checkpoints", 1, 14'050'000'000, 1),
            "cannot write checkpoint step_2: it needs 14.00 GB and /runs/x/checkpoints has 9.80 GB free (the 1 "
            "checkpoint kept there take 14.05 GB; [checkpoint] keep = 1 holds the newest until a new one is whole); "
            "free space there, lower [checkpoint] keep, or write the run elsewhere (--out)");
  EXPECT_EQ(space_refusal("step_4", 3'000'000'000, 1'000'000'000, "/c", 0, 0, 2),
            "cannot write checkpoint step_4: it needs 3.00 GB and /c has 1.00 GB free; free space there, lower "
            "[checkpoint] keep, or write the run elsewhere (--out)");
  // folder_bytes, which sizes both: every file below the folder, nested ones too.
  const std::string dir = test::temp_dir("ckpt-bytes");
  fs::create_directories(dir + "/a/b");
  test::write_file(dir + "/x", std::string(1000, 'x'));
  test::write_file(dir + "/a/b/y", std::string(2345, 'y'));
  EXPECT_EQ(flashdraft::checkpoint::folder_bytes(dir), 3345u);
}

namespace {
// FNV-1a 64, written out plainly: the reference for the checkpoint's checksums.
uint64_t plain_fnv(const unsigned char* p, size_t n, uint64_t h = 1469598103934665603ULL) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}
}  // namespace

// Format 2's checksum (the FNV-1a 64 of the chunks' FNV-1a 64s, little-endian) against a
// sequential reference, on random bytes, at sizes around the chunk boundaries and with 1, 3 or
// every thread.
TEST(Checkpoint, ChunkedChecksumEqualsTheSequentialDefinition) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<unsigned char> bytes(5000);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  for (size_t chunk : {size_t(1), size_t(7), size_t(64), size_t(1000), size_t(1) << 26}) {
    for (size_t size : {size_t(0), size_t(1), size_t(7), size_t(63), size_t(64), size_t(65), size_t(1000), size_t(4099),
                        size_t(5000)}) {
      const size_t pieces = std::max<size_t>(1, (size + chunk - 1) / chunk);
      uint64_t want = 1469598103934665603ULL;
      for (size_t i = 0; i < pieces; ++i) {
        const size_t begin = std::min(size, i * chunk), end = std::min(size, begin + chunk);
        const uint64_t v = plain_fnv(bytes.data() + begin, end - begin);
        unsigned char le[8];
        for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(v >> (8 * b));
        want = plain_fnv(le, 8, want);
      }
      for (unsigned threads : {1u, 3u, 0u})
        EXPECT_EQ(flashdraft::checkpoint::chunked_checksum(bytes.data(), size, chunk, threads), want)
            << "size " << size << " chunk " << chunk << " threads " << threads;
    }
  }
  // One flipped bit anywhere changes it.
  const uint64_t whole = flashdraft::checkpoint::chunked_checksum(bytes.data(), bytes.size(), 64);
  bytes[std::uniform_int_distribution<size_t>(0, bytes.size() - 1)(rng)] ^= 1;
  EXPECT_NE(flashdraft::checkpoint::chunked_checksum(bytes.data(), bytes.size(), 64), whole);
}

// A checkpoint written by format 1 (whole-file FNV-1a 64 checksums) still reads; format 1's
// line with format 2's sums is a damaged manifest (the checksums do not match).
TEST(Checkpoint, FormatOneCheckpointsStillRead) {
  const Reference& ref = reference();
  const std::string dir = test::temp_dir("ckpt-format1") + "/step_16";
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(ref.dir + "/checkpoints/step_16"))
    fs::copy_file(e.path(), dir + "/" + e.path().filename().string());
  std::string text;
  {
    std::ifstream in(dir + "/manifest");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  ASSERT_EQ(text.rfind("flashdraft-checkpoint 2\n", 0), 0u) << text;
  const auto wrote = flashdraft::checkpoint::weights(ref.dir + "/checkpoints/step_16");
  // Format 1 with format 2's sums: refused.
  std::string one = "flashdraft-checkpoint 1\n" + text.substr(text.find('\n') + 1);
  test::write_file(dir + "/manifest", one);
  try {
    flashdraft::checkpoint::weights(dir);
    ADD_FAILURE() << "format 1 with chunked sums was read";
  } catch (const flashdraft::checkpoint::Error& e) {
    EXPECT_TRUE(contains(e.what(), "checksum")) << e.what();
  }
  // Format 1 with whole-file sums: read, the same tensors.
  std::istringstream lines(text.substr(text.find('\n') + 1));
  std::string line;
  one = "flashdraft-checkpoint 1\n";
  while (std::getline(lines, line)) {
    if (line.rfind("file ", 0) == 0) {
      std::istringstream f(line.substr(5));
      std::string bytes, sum, name;
      f >> bytes >> sum >> name;
      std::ifstream in(dir + "/" + name, std::ios::binary);
      const std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::ostringstream hex;
      hex << std::hex << std::setw(16) << std::setfill('0')
          << plain_fnv(reinterpret_cast<const unsigned char*>(content.data()), content.size());
      line = "file " + bytes + " " + hex.str() + " " + name;
      EXPECT_NE(hex.str(), sum) << name;  // the two formats' sums differ
    }
    one += line + "\n";
  }
  test::write_file(dir + "/manifest", one);
  const auto read = flashdraft::checkpoint::weights(dir);
  ASSERT_EQ(read.size(), wrote.size());
  for (size_t i = 0; i < read.size(); ++i) {
    EXPECT_EQ(read[i].first, wrote[i].first);
    EXPECT_TRUE(read[i].second.equal(wrote[i].second)) << read[i].first;
  }
}

TEST(Checkpoint, KeepsTheLastKAndExportsWeights) {
  const Reference& ref = reference();
  // every = 8, 16 steps, keep = 3: step_8 and step_16, nothing half-written.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ref.dir + "/checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_16", "step_8"}));
  // The finished run's weights file and the final checkpoint's export hold the same
  // tensors; the config is the [drafter] table with every key.
  std::string out;
  const std::string exported = ref.dir + "/step16.weights.h5";
  ASSERT_EQ(test::run_cli({"export-weights", ref.dir + "/checkpoints/step_16", "--out", exported}, &out), 0) << out;
  LogReader a(ref.dir + "/tiny.weights.h5"), b(exported);
  const auto attrs = a.attributes("/");
  EXPECT_EQ(attrs.at("format"), "flashdraft-drafter-weights-v1");
  EXPECT_EQ(attrs.at("drafter_plugin"), "dflash");
  EXPECT_TRUE(contains(attrs.at("drafter_config"), "[drafter]\nplugin = \"dflash\"\nlayers = 1\n"))
      << attrs.at("drafter_config");
  EXPECT_TRUE(contains(attrs.at("drafter_config"), "block_size = 8\n"));
  EXPECT_EQ(a.members("/weights"), b.members("/weights"));
  EXPECT_EQ(a.shape("weights/fc.weight"), (std::vector<int64_t>{32, 64}));  // hidden x (2 layers x 32)
  for (const auto& name : a.members("/weights")) EXPECT_EQ(a.f64("weights/" + name), b.f64("weights/" + name)) << name;
  // Not an all-ones or all-zero export: trained projections.
  const auto fc = a.f64("weights/fc.weight");
  double sq = 0;
  for (double v : fc) sq += v * v;
  EXPECT_GT(sq, 0.0);
}

// --- exact greedy acceptance ------------------------------------------------------------

TEST(Validation, GreedyAcceptanceCountsLeadingMatchesHandBuilt) {
  const int64_t K = 3;
  // draft 0: matches at 0, 1, miss at 2            -> 2 accepted
  // draft 1: miss at 0 (later matches do not count) -> 0
  // draft 2: match at 0, no label at 1 (sequence end) -> 1
  // draft 3: no label at 0                        -> not counted
  // draft 4: all three match                      -> 3
  const std::vector<int64_t> labels{5, 6, 7, 2, 3, 4, 3, -1, -1, -1, 2, 2, 9, 8, 7};
  const std::vector<int64_t> tokens{5, 6, 9, 1, 3, 4, 3, 0, 0, 0, 2, 2, 9, 8, 7};
  const auto a = flashdraft::greedy_acceptance(tokens.data(), labels.data(), 5, K);
  EXPECT_EQ(a.drafts, 4);
  EXPECT_EQ(a.accepted, 6);  // tau = 1 + 6/4 = 2.5
  EXPECT_DOUBLE_EQ(a.tau(), 2.5);
}

TEST(Validation, GreedyAcceptanceMatchesAPlainOracleOnRandomDrafts) {
  std::mt19937_64 gen(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t K = 1 + static_cast<int64_t>(gen() % 15), drafts = 1 + static_cast<int64_t>(gen() % 200);
    std::vector<int64_t> tokens(static_cast<size_t>(drafts * K)), labels(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      labels[i] = static_cast<int64_t>(gen() % 3);  // small vocabulary: many matches
      tokens[i] = gen() % 4 == 0 ? static_cast<int64_t>(gen() % 3) : labels[i];
      if (gen() % 20 == 0) labels[i] = -1;
    }
    // Oracle: walk each draft with an index; count drafts with a label at column 0.
    int64_t want_drafts = 0, want_accepted = 0;
    for (int64_t d = 0; d < drafts; ++d) {
      if (labels[size_t(d * K)] == -1) continue;
      ++want_drafts;
      int64_t j = 0;
      while (j < K && labels[size_t(d * K + j)] != -1 && labels[size_t(d * K + j)] == tokens[size_t(d * K + j)]) ++j;
      want_accepted += j;
    }
    const auto a = flashdraft::greedy_acceptance(tokens.data(), labels.data(), drafts, K);
    EXPECT_EQ(a.drafts, want_drafts) << "trial " << trial;
    EXPECT_EQ(a.accepted, want_accepted) << "trial " << trial;
  }
}

// A drafter's drafts that do not fit the batch stop validation with a sentence naming what
// is wrong, instead of reading past the tensors.
TEST(Validation, DraftsThatDoNotFitTheBatchAreRefusedWithASentence) {
  auto drafts = [](at::Tensor rows, at::Tensor starts, at::Tensor tokens, at::Tensor labels) {
    flashdraft::Drafts d;
    d.rows = rows, d.starts = starts, d.tokens = tokens, d.labels = labels;
    return d;
  };
  const auto L = at::TensorOptions().dtype(at::kLong);
  const at::Tensor rows = at::tensor({0, 1, 1}, L), starts = at::tensor({2, 0, 9}, L);
  const at::Tensor tokens = at::randint(0, 50, {3, 4}, L), labels = at::randint(-1, 50, {3, 4}, L);
  EXPECT_NO_THROW(flashdraft::check_drafts(drafts(rows, starts, tokens, labels), 2, 10, 4));
  EXPECT_NO_THROW(
      flashdraft::check_drafts(drafts(rows, starts, tokens.narrow(1, 0, 2), labels.narrow(1, 0, 2)), 2, 10, 4));
  auto message = [&](const flashdraft::Drafts& d) {
    try {
      flashdraft::check_drafts(d, 2, 10, 4);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      message(drafts(rows, starts, tokens, labels.narrow(1, 0, 3))).find("have tokens [3, 4] Long and labels [3, 3]"),
      std::string::npos);
  EXPECT_NE(message(drafts(rows.narrow(0, 0, 2), starts, tokens, labels)).find("have rows [2] Long and starts [3]"),
            std::string::npos);
  EXPECT_NE(message(drafts(at::tensor({0, 2, 1}, L), starts, tokens, labels)).find("name rows 0..2"),
            std::string::npos);
  EXPECT_NE(message(drafts(rows, at::tensor({2, 0, 10}, L), tokens, labels)).find("start at 0..10"), std::string::npos);
  EXPECT_NE(message(drafts(rows, starts, tokens.to(at::kFloat), labels)).find("not of integers"), std::string::npos);
  const std::string wide = message(drafts(rows, starts, at::zeros({3, 5}, L), at::zeros({3, 5}, L)));
  EXPECT_NE(wide.find("have 5 columns for 4 metric columns"), std::string::npos) << wide;
  EXPECT_NE(wide.find("rows in 0..1 and starts in 0..9"), std::string::npos) << wide;
}

TEST(Validation, EvalRowsTauBoundsAndTauRisesWithTraining) {
  const std::string dir = test::temp_dir("ckpt-eval");
  // 150 steps: with anchors on response tokens this tiny drafter is accepted now and then from
  // the start (tau 1.05) and needs about that long to move tau clearly (1.70).
  const std::string exp = experiment(dir, 150, 0, "", 0, 50);
  std::string out;
  ASSERT_EQ(test::run_cli(run_args(exp), &out), 0) << out;
  EXPECT_TRUE(contains(out, "eval  after step 150: loss ")) << out;
  LogReader r(dir + "/tiny.h5");
  EXPECT_EQ(r.f64("eval/step"), (std::vector<double>{0, 50, 100, 150}));
  EXPECT_EQ(r.shape("eval/position_accuracy"), (std::vector<int64_t>{4, 7}));
  const auto tau = r.f64("eval/tau_anchor"), sim = r.f64("eval/tau_sim"), acc = r.f64("eval/position_accuracy");
  const auto blocks = r.f64("eval/blocks");
  for (size_t i = 0; i < tau.size(); ++i) {
    EXPECT_EQ(blocks[i], 32 * 2);  // 32 held-out sequences x 2 anchors
    // tau - 1 = sum_k P(positions 1..k all right): at least P(position 1 right) = acc_1,
    // at most sum_k min_{j<=k} acc_j (Frechet bound of each joint event).
    double upper = 0, running_min = 1;
    for (size_t j = 0; j < 7; ++j) {
      running_min = std::min(running_min, acc[i * 7 + j]);
      upper += running_min;
    }
    EXPECT_GE(tau[i] - 1, acc[i * 7] - 1e-12) << i;
    EXPECT_LE(tau[i] - 1, upper + 1e-12) << i;
    // tau_sim is the formula on the logged accuracies.
    double s = 1, run = 1;
    for (size_t j = 0; j < 7; ++j) s += (run *= acc[i * 7 + j]);
    EXPECT_DOUBLE_EQ(sim[i], s);
  }
  EXPECT_GT(tau.back(), tau.front() + 0.2) << out;
  EXPECT_LT(r.f64("eval/loss").back(), r.f64("eval/loss").front());
}

// flash_cuda (kernels/flash_cuda) against dense_ref on CUDA.
//
// Both kernels are loaded through the registry from the build's plugin folder. The
// oracle is dense_ref run on the same device in fp32 on the very same (bf16/fp16-
// rounded) inputs: materialised scores, masked softmax, autograd gradients. Masks come
// from every mask generator plugin (causal, sliding_window, document, prefix_lm, dflash
// bidirectional and in_block = "causal", with padding blocks) through their own
// build(), plus hand-built masks (per-head masks, mask batch = B, rows with no visible
// key, GQA 8:1) at sizes that are not multiples of the 128 x 64 tile.
//
// Relative error of a result a against the reference b: max|a - b| / max|b| (lse: over
// the finite entries; the -inf entries of empty rows must coincide exactly). Bounds:
// bf16 <= 2e-2, fp16 <= 1e-2. No NaN anywhere.
//
// Poisoning: before every call the CUDA caching allocator's free blocks are filled with
// NaN (allocate, fill, free), and LibTorch's "fill uninitialized memory" mode makes
// every at::empty NaN-filled too; so an output element the kernel does not write stays
// NaN and fails the NaN check.
//
// Configurations: every case runs once per configuration this GPU runs ("auto", "sm90a",
// "sm90", "sm120"), forced through the experiment key [kernels.flash_cuda].config with
// FLASHDRAFT_FLASH_CUDA_CONFIG unset; the reported variant must name the configuration and
// supports()'s note must say who chose it. Another test checks that the variable overrides
// the key and is read on every call, and the sentences of every choice and refusal are
// checked on the configuration rules themselves (flash_config.hpp) for an H200, an A100 and
// a 99 KB part, without a GPU.
//
// The checks of each comparison are kernel_comparison.hpp's, shared with test_kernels_cpu.
//
// Without a CUDA device (CI) the GPU tests skip with a message; the supports() refusals
// that need no device and the configuration rules still run.
#include "attention_error.hpp"
#include "flash_config.hpp"
#include "kernel_comparison.hpp"
#include "plugin_loading.hpp"
#include "registry/registry.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>
#include <flashdraft/mask_generator.hpp>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

namespace fc = flashdraft::flash_cuda;
using fc::kConfigEnv;
using test::load;

std::shared_ptr<fd::AttentionKernel> dense_ref() {
  return load<fd::AttentionKernel>(fd::PluginKind::kernel, "dense_ref", "kernels.dense_ref");
}
// flash_cuda as an experiment with [kernels.flash_cuda] config = `config` configures it.
std::shared_ptr<fd::AttentionKernel> flash_cuda(const std::string& config,
                                                const std::string& schedule = "longest-first") {
  return load<fd::AttentionKernel>(fd::PluginKind::kernel, "flash_cuda", "kernels.flash_cuda",
                                   {{"config", config}, {"schedule", schedule}});
}

// Sets FLASHDRAFT_FLASH_CUDA_CONFIG for a scope ("" unsets it), restoring it after.
class ConfigEnv {
 public:
  explicit ConfigEnv(const std::string& value) {
    const char* old = std::getenv(kConfigEnv);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value.empty())
      unsetenv(kConfigEnv);
    else
      setenv(kConfigEnv, value.c_str(), 1);
  }
  ~ConfigEnv() {
    if (had_)
      setenv(kConfigEnv, old_.c_str(), 1);
    else
      unsetenv(kConfigEnv);
  }

 private:
  bool had_ = false;
  std::string old_;
};

using test::PoisonedAllocations;

// Fills the caching allocator's free memory with NaN: large blocks (one 256 MB tensor,
// split by later allocations) and the small-allocation pool (many < 1 MB tensors).
void poison_cuda_cache() {
  const auto opt = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  { at::Tensor big = at::full({64 * 1024 * 1024}, std::nan(""), opt); }
  std::vector<at::Tensor> small;
  for (int i = 0; i < 64; ++i) small.push_back(at::full({(i % 8 + 1) * 8192}, std::nan(""), opt));
  small.clear();
}

using test::KernelResults;
using test::lse_relative_error;
using test::relative_error;
using test::run_kernel;
using test::Visible;

struct Case {
  std::string name;
  int64_t batch, heads_q, heads_kv, q_len, kv_len;
  std::function<fd::BlockMask()> build;  // at 128 x 64
  Visible visible;                       // the same mask, element by element (b, h of the problem)
  bool expect_empty_rows = false;
};

// The kernel's tile (128 x 64).
fd::BlockMask build_from_predicate(int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len,
                                   const Visible& visible) {
  return test::build_mask(batch, heads, q_len, kv_len, 128, 64, visible);
}

// Cases from every mask generator plugin, through its own build().
std::vector<Case> generator_cases() {
  fd::MaskInput self;  // packed self-attention, Lq = Lkv = 301 (not a tile multiple)
  self.batch = 2, self.q_len = self.kv_len = 301;
  self.doc_lengths = {{90, 130, 81}, {1, 300}};
  fd::MaskInput dflash;  // [context 230 | 11 blocks of 16]: Lq 176, Lkv 406; padding blocks
  dflash.batch = 2, dflash.blocks.context_len = 230, dflash.blocks.block_size = 16;
  dflash.blocks.anchors = {{3, 20, 41, 42, 60, 74, 100, 150, 151, 200, 0},
                           {0, 10, 30, 50, 70, 74, 130, 140, 199, 205, 214}};
  dflash.blocks.valid = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, {1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1}};
  dflash.q_len = 11 * 16, dflash.kv_len = 230 + 11 * 16;
  fd::MaskInput eagle3 = self;  // EAGLE-3's fourth unroll step: keys of steps 0..3 (Lkv 1204)
  eagle3.kv_len = 4 * self.q_len;
  // Packed DFlash rows: documents 40 + 100 + 90 and 1 + 229; each block sees its own
  // document's context and stays inside it.
  fd::MaskInput dflash_packed = dflash;
  dflash_packed.blocks.anchors = {{3, 20, 41, 60, 74, 100, 120, 150, 151, 200, 210},
                                  {10, 30, 50, 70, 74, 130, 140, 199, 205, 210, 0}};
  dflash_packed.blocks.valid = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}};
  dflash_packed.doc_lengths = {{40, 100, 90}, {1, 229}};
  // Served decoding: one block of 16 per row after a cache of 230 positions (shorter blocks).
  fd::MaskInput dflash_served;
  dflash_served.batch = 2, dflash_served.blocks.context_len = 230, dflash_served.blocks.block_size = 16;
  dflash_served.blocks.anchors = {{140}, {201}};
  dflash_served.blocks.valid = {{1}, {1}};
  dflash_served.blocks.lengths = {{16}, {7}};
  dflash_served.q_len = 16, dflash_served.kv_len = 230 + 16;
  // The target's cached decoding: 16 queries per row at positions 0.. and 201.. of 246 keys.
  fd::MaskInput decode;
  decode.batch = 2, decode.q_len = 16, decode.kv_len = 246;
  decode.q_offsets = {0, 201};

  struct Gen {
    std::string label, plugin;
    std::map<std::string, fd::Value> keys;
    const fd::MaskInput* input;
    bool empty_rows;
  };
  const std::vector<Gen> gens = {
      {"causal", "causal", {}, &self, false},
      {"sliding_window", "sliding_window", {{"window", int64_t{77}}}, &self, false},
      {"document", "document", {}, &self, false},
      {"prefix_lm", "prefix_lm", {{"prefix", int64_t{45}}}, &self, false},
      {"dflash", "dflash", {{"in_block", std::string("bidirectional")}}, &dflash, true},
      {"dflash_causal", "dflash", {{"in_block", std::string("causal")}}, &dflash, true},
      {"dflash_packed", "dflash", {{"in_block", std::string("bidirectional")}}, &dflash_packed, true},
      {"dflash_served", "dflash", {{"in_block", std::string("bidirectional")}}, &dflash_served, true},
      {"causal_decode", "causal", {{"bottom_right", false}}, &decode, false},
      {"eagle3_ttt", "eagle3_ttt", {}, &eagle3, false},
  };
  std::vector<Case> cases;
  for (const Gen& g : gens) {
    std::shared_ptr<fd::MaskGenerator> gen = load<fd::MaskGenerator>(fd::PluginKind::mask, g.plugin, "mask", g.keys);
    const fd::MaskInput in = *g.input;
    // GQA 4:2 for every generator
    cases.push_back({g.label, in.batch, 4, 2, in.q_len, in.kv_len, [gen, in] { return gen->build(in, 128, 64); },
                     [gen, in](int64_t b, int64_t h, int64_t q, int64_t k) { return gen->visible(in, b, h, q, k); },
                     g.empty_rows});
  }
  return cases;
}

// Hand-built masks for what the generators do not cover.
std::vector<Case> predicate_cases() {
  std::vector<Case> cases;
  std::mt19937_64 rng(20261129);
  {  // per-head random mask (mask heads = Hq), rows with nothing visible, GQA 4:1
    const int64_t H = 4, Lq = 200, Lkv = 150;
    auto bits = std::make_shared<std::vector<uint8_t>>(H * Lq * Lkv);
    std::bernoulli_distribution on(0.3);
    for (auto& x : *bits) x = on(rng);
    Visible vis = [bits, Lq, Lkv](int64_t, int64_t h, int64_t q, int64_t k) {
      return q % 11 != 3 && (*bits)[(h * Lq + q) * Lkv + k] != 0;
    };
    cases.push_back(
        {"random_per_head", 1, H, 1, Lq, Lkv, [=] { return build_from_predicate(1, H, Lq, Lkv, vis); }, vis, true});
  }
  {  // GQA 8:1, causal bottom-right aligned, Lq < Lkv, mask batch = B with a shift per b
    const int64_t B = 2, Lq = 133, Lkv = 390;
    Visible vis = [=](int64_t b, int64_t, int64_t q, int64_t k) { return k <= q + (Lkv - Lq) - 17 * b; };
    cases.push_back(
        {"gqa8_causal_rect", B, 8, 1, Lq, Lkv, [=] { return build_from_predicate(B, 1, Lq, Lkv, vis); }, vis, false});
  }
  {  // one query row tile, one partial key tile; nothing visible for odd rows
    Visible vis = [](int64_t, int64_t, int64_t q, int64_t k) { return q % 2 == 0 && k % 3 != 1; };
    cases.push_back(
        {"tiny_33x17", 1, 2, 2, 33, 17, [=] { return build_from_predicate(1, 1, 33, 17, vis); }, vis, true});
  }
  return cases;
}

class FlashCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available())
      GTEST_SKIP() << "no CUDA device here (torch::cuda::is_available() is false): flash_cuda runs only on a "
                      "GPU; the device machine runs this test (bench/flash_cuda_device.sh)";
  }
};

using test::base_seed;

// A problem every configuration accepts, for supports() alone.
fd::AttentionProblem small_problem() {
  fd::AttentionProblem p;
  p.device = c10::Device(c10::kCUDA, 0), p.dtype = at::kBFloat16, p.head_dim = 64, p.q_len = p.kv_len = 70;
  return p;
}

// The configuration a supports() note names: "config sm90a (...)" -> "sm90a".
std::string noted_config(const std::string& note) {
  if (note.rfind("config ", 0) != 0) return "";
  return note.substr(7, note.find(' ', 7) - 7);
}

// The configurations this GPU runs: "auto", then each forced one its supports() accepts
// (sm90a needs compute capability 9.0, sm90 160 KB of shared memory per block). Where
// FLASHDRAFT_EXPECT_SM90A is set (the device scripts set it on the H200), a refusal of
// sm90a is a failure, not a skip.
std::vector<std::string> configs_here() {
  const ConfigEnv env("");
  std::vector<std::string> configs = {"auto"};
  for (const std::string config : {"sm90a", "sm90", "sm120"}) {
    const fd::Support s = flash_cuda(config)->supports(small_problem());
    if (s.ok)
      configs.push_back(config);
    else if (config == "sm90a" && std::getenv("FLASHDRAFT_EXPECT_SM90A"))
      ADD_FAILURE() << "sm90a refused: " << s.reason;
    else
      std::printf("  configuration %s not run here: %s\n", config.c_str(), s.reason.c_str());
  }
  return configs;
}

// One case, one dtype, one head dim, one configuration of the experiment key.
void compare(fd::AttentionKernel& flash, fd::AttentionKernel& dense, const Case& c, at::ScalarType dtype, int64_t dim,
             const std::string& config, uint64_t seed) {
  const std::string precision = dtype == at::kBFloat16 ? "bf16" : "fp16";
  SCOPED_TRACE(c.name + " " + precision + " d" + std::to_string(dim) + " config " + config + " seed " +
               std::to_string(seed));
  const ConfigEnv env("");  // the experiment key alone decides
  fd::AttentionProblem problem;
  problem.device = c10::Device(c10::kCUDA, 0);
  problem.dtype = dtype;
  problem.batch = c.batch, problem.heads_q = c.heads_q, problem.heads_kv = c.heads_kv;
  problem.q_len = c.q_len, problem.kv_len = c.kv_len, problem.head_dim = dim;
  const fd::Support s = flash.supports(problem);
  ASSERT_TRUE(s.ok) << s.reason;
  if (config == "auto")
    EXPECT_NE(s.reason.find(" (auto: compute capability "), std::string::npos) << s.reason;
  else
    EXPECT_EQ(s.reason, "config " + config + " (forced by [kernels.flash_cuda].config)");
  const std::string ran = noted_config(s.reason);
  const fd::BlockSize bs = flash.block_size(problem);
  ASSERT_EQ(bs.q, 128);
  ASSERT_EQ(bs.kv, 64);
  const fd::BlockMask mask = c.build();
  ASSERT_EQ(mask.block_q, 128);
  ASSERT_EQ(mask.block_kv, 64);
  const double scale = 1.0 / std::sqrt(double(dim));

  at::manual_seed(seed);
  const auto opt = at::TensorOptions().device(at::kCUDA);
  const at::Tensor q = at::randn({c.batch, c.heads_q, c.q_len, dim}, opt).to(dtype);
  const at::Tensor k = at::randn({c.batch, c.heads_kv, c.kv_len, dim}, opt).to(dtype);
  const at::Tensor v = at::randn({c.batch, c.heads_kv, c.kv_len, dim}, opt).to(dtype);
  const at::Tensor dout = at::randn({c.batch, c.heads_q, c.q_len, dim}, opt).to(dtype);

  KernelResults got, want;
  {
    PoisonedAllocations poison;
    got = run_kernel(flash, q, k, v, dout, mask, scale, poison_cuda_cache);
  }
  // The oracle: dense_ref on the same device in fp32 on the very same rounded values.
  want = run_kernel(dense, q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), dout.to(at::kFloat), mask, scale);
  const std::string suffix = ran + "/" + precision + "/d" + std::to_string(dim) + "/m128n64";
  EXPECT_EQ(got.fwd, "flash_cuda/fwd/" + suffix);
  EXPECT_EQ(got.bwd, "flash_cuda/bwd/" + suffix);
  char label[64];
  std::snprintf(label, sizeof label, "%-17s %s d%-3lld %-5s", c.name.c_str(), precision.c_str(),
                static_cast<long long>(dim), config == "auto" ? ("auto=" + ran).c_str() : config.c_str());
  ASSERT_NO_FATAL_FAILURE(
      test::expect_matches_reference(got, want, q, k, dtype, dtype == at::kBFloat16 ? 2e-2 : 1e-2, label));
  const int64_t empty_rows = test::expect_unseen_exactly_zero(got, c.heads_kv, c.visible);
  if (c.expect_empty_rows) {
    EXPECT_GT(empty_rows, 0) << "the case was meant to have rows with no visible key";
  }
}

TEST_F(FlashCuda, MatchesDenseRefForEveryMaskGeneratorDtypeHeadDimAndConfig) {
  std::shared_ptr<fd::AttentionKernel> dense = dense_ref();
  std::vector<Case> cases = generator_cases();
  for (Case& c : predicate_cases()) cases.push_back(std::move(c));
  uint64_t seed = base_seed();
  int runs = 0;
  const std::vector<std::string> configs = configs_here();
  for (const std::string& config : configs) {
    std::shared_ptr<fd::AttentionKernel> flash = flash_cuda(config);
    for (const Case& c : cases)
      for (at::ScalarType dtype : {at::kBFloat16, at::kHalf})
        for (int64_t dim : {64, 128}) {
          compare(*flash, *dense, c, dtype, dim, config, seed++);
          ++runs;
        }
  }
  std::printf("  %d comparisons (%zu masks x 2 dtypes x 2 head dims x %zu configurations)\n", runs, cases.size(),
              configs.size());
}

// Heads of 192 and 256 (the online target's attention for DeepSeek-V3 / Qwen3.5 / Gemma) run the
// forward alone: on every mask case, both dtypes and every configuration, out and lse against
// dense_ref's forward in float32 on the same rounded values, rows that see no key exactly 0 / -inf;
// under a configuration whose shared memory cannot hold the forward (256 under sm120) supports()
// refuses it, saying so.
TEST_F(FlashCuda, WideHeadsForwardOnlyMatchesDenseRef) {
  std::shared_ptr<fd::AttentionKernel> dense = dense_ref();
  std::vector<Case> cases = generator_cases();
  for (Case& c : predicate_cases()) cases.push_back(std::move(c));
  uint64_t seed = base_seed() + 7919;
  int runs = 0, refused = 0;
  const ConfigEnv env("");
  for (const std::string& config : configs_here()) {
    std::shared_ptr<fd::AttentionKernel> flash = flash_cuda(config);
    for (int64_t dim : {192, 256})
      for (const Case& c : cases)
        for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
          const std::string precision = dtype == at::kBFloat16 ? "bf16" : "fp16";
          SCOPED_TRACE(c.name + " " + precision + " d" + std::to_string(dim) + " config " + config);
          fd::AttentionProblem problem = fd::AttentionProblem::of(c10::Device(c10::kCUDA, 0), dtype, c.batch, c.heads_q,
                                                                  c.heads_kv, c.q_len, c.kv_len, dim, true);
          const fd::Support with_grad = flash->supports(problem);
          EXPECT_FALSE(with_grad.ok);
          EXPECT_NE(with_grad.reason.find("head_dim " + std::to_string(dim) + " runs forward only"), std::string::npos)
              << with_grad.reason;
          problem.needs_backward = false;
          const fd::Support s = flash->supports(problem);
          if (!s.ok) {
            EXPECT_TRUE(dim == 256 && noted_config(flash->supports(small_problem()).reason) == "sm120") << s.reason;
            EXPECT_NE(s.reason.find("KB of shared memory per block, config sm120 allows 99 KB"), std::string::npos)
                << s.reason;
            ++refused;
            continue;
          }
          const fd::BlockMask mask = c.build();
          const double scale = 1.0 / std::sqrt(double(dim));
          at::manual_seed(seed++);
          const auto opt = at::TensorOptions().device(at::kCUDA);
          const at::Tensor q = at::randn({c.batch, c.heads_q, c.q_len, dim}, opt).to(dtype);
          const at::Tensor k = at::randn({c.batch, c.heads_kv, c.kv_len, dim}, opt).to(dtype);
          const at::Tensor v = at::randn({c.batch, c.heads_kv, c.kv_len, dim}, opt).to(dtype);
          fd::AttentionForward got;
          {
            PoisonedAllocations poison;
            poison_cuda_cache();
            got = flash->forward(q, k, v, fd::to_tensors(mask, q.device()), scale);
          }
          const fd::AttentionForward want = dense->forward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                                           fd::to_tensors(mask, q.device()), scale);
          const std::string ran = noted_config(s.reason);
          EXPECT_EQ(got.variant, "flash_cuda/fwd/" + std::string(ran == "sm90a" ? "sm90" : ran) + "/" + precision +
                                     "/d" + std::to_string(dim) + "/m128n64");
          EXPECT_EQ(got.out.scalar_type(), dtype);
          ASSERT_EQ(got.out.sizes(), q.sizes());
          EXPECT_FALSE(test::has_nan(got.out));
          const double e_out = test::relative_error(got.out, want.out),
                       e_lse = test::lse_relative_error(got.lse, want.lse);
          const double bound = dtype == at::kBFloat16 ? 2e-2 : 1e-2;
          std::printf("  %-17s %s d%-3lld %-5s rel err: out %.1e lse %.1e (bound %.0e)\n", c.name.c_str(),
                      precision.c_str(), static_cast<long long>(dim), config.c_str(), e_out, e_lse, bound);
          EXPECT_LE(e_out, bound);
          EXPECT_LE(e_lse, bound);
          const at::Tensor empty = want.lse.isneginf();  // rows that see no key
          EXPECT_TRUE(got.lse.isneginf().equal(empty));
          EXPECT_EQ(got.out.to(at::kFloat).abs().amax(-1).masked_select(empty).sum().item<double>(), 0.0);
          ++runs;
        }
  }
  std::printf("  %d forward-only comparisons at heads of 192 and 256, %d refused for shared memory\n", runs, refused);
  EXPECT_GT(runs, 0);
}

// The order in which CTAs take their tiles ([kernels.flash_cuda].schedule) changes no bit of
// any output: every output element is written by exactly one CTA. The comparison above ran
// "longest-first" (the default); here "grid" against it, on every case plus a DFlash mask
// with more tiles (8 query tiles x 4 heads x 2 batches, 32 key columns), where the two
// orders differ the most.
TEST_F(FlashCuda, TheCtaOrderChangesNoOutputBit) {
  std::vector<Case> cases = generator_cases();
  for (Case& c : predicate_cases()) cases.push_back(std::move(c));
  {
    fd::MaskInput in;
    in.batch = 2, in.blocks.context_len = 1024, in.blocks.block_size = 16;
    std::mt19937_64 rng(base_seed());
    for (int64_t b = 0; b < 2; ++b) {
      std::vector<int64_t> a(1000);  // 64 distinct anchors in [0, 1000), sorted
      for (int64_t i = 0; i < 1000; ++i) a[i] = i;
      std::shuffle(a.begin(), a.end(), rng);
      a.resize(64);
      std::sort(a.begin(), a.end());
      in.blocks.anchors.push_back(a);
      in.blocks.valid.push_back(std::vector<uint8_t>(64, 1));
    }
    in.q_len = 64 * 16, in.kv_len = 1024 + 64 * 16;
    std::shared_ptr<fd::MaskGenerator> gen =
        load<fd::MaskGenerator>(fd::PluginKind::mask, "dflash", "mask", {{"in_block", std::string("bidirectional")}});
    cases.push_back({"dflash_64_blocks", 2, 4, 4, in.q_len, in.kv_len, [gen, in] { return gen->build(in, 128, 64); },
                     [gen, in](int64_t b, int64_t h, int64_t q, int64_t k) { return gen->visible(in, b, h, q, k); },
                     false});
  }
  const ConfigEnv env("");
  uint64_t seed = base_seed();
  int runs = 0;
  for (const std::string& config : configs_here()) {
    std::shared_ptr<fd::AttentionKernel> lpt = flash_cuda(config, "longest-first"), grid = flash_cuda(config, "grid");
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name + " config " + config);
      const fd::BlockMask mask = c.build();
      at::manual_seed(seed++);
      const auto opt = at::TensorOptions().device(at::kCUDA);
      const at::Tensor q = at::randn({c.batch, c.heads_q, c.q_len, 128}, opt).to(at::kBFloat16);
      const at::Tensor k = at::randn({c.batch, c.heads_kv, c.kv_len, 128}, opt).to(at::kBFloat16);
      const at::Tensor v = at::randn({c.batch, c.heads_kv, c.kv_len, 128}, opt).to(at::kBFloat16);
      const at::Tensor dout = at::randn({c.batch, c.heads_q, c.q_len, 128}, opt).to(at::kBFloat16);
      KernelResults a, b;
      {
        PoisonedAllocations poison;
        a = run_kernel(*lpt, q, k, v, dout, mask, 1.0 / std::sqrt(128.0), poison_cuda_cache);
        b = run_kernel(*grid, q, k, v, dout, mask, 1.0 / std::sqrt(128.0), poison_cuda_cache);
      }
      EXPECT_TRUE(at::equal(a.out, b.out));
      EXPECT_TRUE(at::equal(a.lse, b.lse));
      EXPECT_TRUE(at::equal(a.dq, b.dq));
      EXPECT_TRUE(at::equal(a.dk, b.dk));
      EXPECT_TRUE(at::equal(a.dv, b.dv));
      EXPECT_FALSE(a.out.isnan().any().item<bool>());
      EXPECT_FALSE(a.dk.isnan().any().item<bool>());
      ++runs;
    }
  }
  std::printf("  %d comparisons of schedule \"grid\" with \"longest-first\", bit for bit\n", runs);
}

// Every mask generator plugin found is covered above (a new one must be added there).
// Runs without a GPU.
TEST(FlashCudaCases, EveryMaskGeneratorIsCovered) {
  std::vector<std::string> covered = {"causal", "sliding_window", "document", "prefix_lm", "dflash", "eagle3_ttt"};
  for (const fd::FoundPlugin* p : test::plugins().of_kind(fd::PluginKind::mask))
    EXPECT_NE(std::find(covered.begin(), covered.end(), p->name), covered.end())
        << "mask generator " << p->name << " has no case in test_flash_cuda.cpp";
}

// FLASHDRAFT_FLASH_CUDA_CONFIG wins over the experiment key, is read on every call, and
// supports()'s note says so.
TEST_F(FlashCuda, EnvironmentVariableOverridesTheExperimentKeyOnEveryCall) {
  std::shared_ptr<fd::AttentionKernel> flash = flash_cuda("sm120");
  bool sm90a = false;
  {
    const ConfigEnv env("");
    sm90a = flash_cuda("sm90a")->supports(small_problem()).ok;
  }
  const fd::BlockMask mask =
      build_from_predicate(1, 1, 130, 70, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; });
  const fd::BlockMaskTensors t = fd::to_tensors(mask, c10::Device(c10::kCUDA, 0));
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor q = at::randn({1, 2, 130, 64}, opt), k = at::randn({1, 2, 70, 64}, opt),
                   v = at::randn({1, 2, 70, 64}, opt);
  const std::string over = ", overriding [kernels.flash_cuda].config = \"sm120\")";
  struct Step {
    std::string env, note, variant;
  };
  std::vector<Step> steps = {
      {"", "config sm120 (forced by [kernels.flash_cuda].config)", "sm120"},
      {"sm90", "config sm90 (forced by FLASHDRAFT_FLASH_CUDA_CONFIG=sm90" + over, "sm90"},
      {"sm120", "config sm120 (forced by FLASHDRAFT_FLASH_CUDA_CONFIG=sm120, as [kernels.flash_cuda].config)", "sm120"},
      {"auto", "", ""},  // the note and variant of auto depend on the GPU
      {"", "config sm120 (forced by [kernels.flash_cuda].config)", "sm120"},
  };
  if (sm90a)
    steps.insert(steps.begin() + 2,
                 {"sm90a", "config sm90a (forced by FLASHDRAFT_FLASH_CUDA_CONFIG=sm90a" + over, "sm90a"});
  for (const Step& step : steps) {
    SCOPED_TRACE("FLASHDRAFT_FLASH_CUDA_CONFIG=" + step.env);
    const ConfigEnv env(step.env);
    const fd::Support s = flash->supports(small_problem());
    ASSERT_TRUE(s.ok) << s.reason;
    std::string variant = step.variant;
    if (step.env == "auto") {
      EXPECT_NE(s.reason.find(" (auto: compute capability "), std::string::npos) << s.reason;
      EXPECT_NE(s.reason.find("; FLASHDRAFT_FLASH_CUDA_CONFIG=auto" + over), std::string::npos) << s.reason;
      variant = noted_config(s.reason);
    } else {
      EXPECT_EQ(s.reason, step.note);
    }
    std::printf("  FLASHDRAFT_FLASH_CUDA_CONFIG=%-5s [kernels.flash_cuda].config = \"sm120\": %s\n", step.env.c_str(),
                s.reason.c_str());
    const fd::AttentionForward f = flash->forward(q, k, v, t, 0.125);
    EXPECT_EQ(f.variant, "flash_cuda/fwd/" + variant + "/bf16/d64/m128n64");
    EXPECT_EQ(flash->backward(at::randn_like(q), q, k, v, f.out, f.lse, t, 0.125).variant,
              "flash_cuda/bwd/" + variant + "/bf16/d64/m128n64");
  }
  // A value that names no configuration: refused by supports() and by the calls alike.
  const ConfigEnv env("sm75");
  const fd::Support s = flash->supports(small_problem());
  EXPECT_FALSE(s.ok);
  try {
    flash->forward(q, k, v, t, 0.125);
    ADD_FAILURE() << "forward ran with FLASHDRAFT_FLASH_CUDA_CONFIG=sm75";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), s.reason);
  }
}

// An invalid value of the variable is refused before any device question (runs in CI).
TEST(FlashCudaSupports, RefusesAnEnvironmentValueThatNamesNoConfiguration) {
  if (!FLASHDRAFT_FLASH_CUDA_BUILT)
    GTEST_SKIP() << "flash_cuda is not built in this build (no CUDA, or FLASHDRAFT_BUILD_CUDA=OFF)";
  const ConfigEnv env("sm75");
  const fd::Support s = flash_cuda("auto")->supports(small_problem());
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("flash_cuda: FLASHDRAFT_FLASH_CUDA_CONFIG is 'sm75', not a configuration; accepted values: "
                          "auto, sm90a, sm90, sm120 (or unset it to use [kernels.flash_cuda].config = \"auto\")"),
            std::string::npos)
      << s.reason;
}

// Checks that the plugin's schema declares `name` as a string key with this default and
// these choices, in this order.
void expect_choice_key(const std::string& name, const std::string& fallback, const std::vector<std::string>& choices) {
  const fd::Schema schema = test::plugins().schema(test::plugins().get(fd::PluginKind::kernel, "flash_cuda"));
  const fd::KeySpec* key = schema.find(name);
  ASSERT_NE(key, nullptr) << name;
  EXPECT_EQ(key->type, fd::ValueType::string) << name;
  ASSERT_TRUE(key->fallback.has_value()) << name;
  EXPECT_EQ(std::get<std::string>(*key->fallback), fallback) << name;
  EXPECT_EQ(key->choices, choices) << name;
}

// The key is declared in the plugin's schema: a string, default "auto", four choices.
TEST(FlashCudaSupports, DeclaresTheConfigKey) {
  if (!FLASHDRAFT_FLASH_CUDA_BUILT)
    GTEST_SKIP() << "flash_cuda is not built in this build (no CUDA, or FLASHDRAFT_BUILD_CUDA=OFF)";
  expect_choice_key("config", "auto", {"auto", "sm90a", "sm90", "sm120"});
}

// The schedule key: a string, default "longest-first", two choices; any other value is refused
// by the schema with the value and the choices (runs in CI).
TEST(FlashCudaSupports, DeclaresTheScheduleKey) {
  if (!FLASHDRAFT_FLASH_CUDA_BUILT)
    GTEST_SKIP() << "flash_cuda is not built in this build (no CUDA, or FLASHDRAFT_BUILD_CUDA=OFF)";
  expect_choice_key("schedule", "longest-first", {"longest-first", "grid"});
  try {
    flash_cuda("auto", "shortest-first");
    ADD_FAILURE() << "schedule = \"shortest-first\" was accepted";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("shortest-first"), std::string::npos) << what;
    EXPECT_NE(what.find("longest-first"), std::string::npos) << what;
    EXPECT_NE(what.find("grid"), std::string::npos) << what;
  }
}

// The work order's groups for an H200 (50 MB of L2) and an RTX 5090 (96 MB), on the shapes
// bench/flash_cuda.cpp times: the sm90a kernels sort within groups of heads whose K/V (query
// kernels, 40% of the L2) or Q/dO (dK/dV, 70%) fit; the mma.sync kernels over all heads.
TEST(FlashCudaSchedule, GroupsOfHeadsFitTheirShareOfTheL2) {
  const size_t h200 = 50u << 20, rtx5090 = 96u << 20;
  // DFlash S=4096, 512 x 16: K/V of a head 2 x 12288 x 128 x 2 B = 6.3 MB, Q/dO 4.2 MB
  fc::ScheduleGroups g = fc::flash_schedule_groups(1, 32, 32, 8192, 12288, 128, 2, h200, true);
  EXPECT_EQ(g.q_units, 3);   // 20 MB / 6.3 MB
  EXPECT_EQ(g.kv_units, 8);  // 35 MB / 4.2 MB
  g = fc::flash_schedule_groups(1, 32, 32, 8192, 12288, 128, 2, h200, false);
  EXPECT_EQ(g.q_units, 32);
  EXPECT_EQ(g.kv_units, 32);
  g = fc::flash_schedule_groups(1, 32, 32, 8192, 8192, 128, 2, rtx5090, true);  // causal 8192
  EXPECT_EQ(g.q_units, 9);                                                      // 38 MB / 4.2 MB
  EXPECT_EQ(g.kv_units, 16);
  // GQA 4:1: a kv head's Q/dO are its 4 q heads'; a group never exceeds the problem nor falls below 1
  g = fc::flash_schedule_groups(2, 32, 8, 8192, 8192, 128, 2, h200, true);
  EXPECT_EQ(g.kv_units, 2);  // 35 MB / 16.8 MB
  g = fc::flash_schedule_groups(1, 4, 1, 1 << 20, 1 << 20, 128, 2, h200, true);
  EXPECT_EQ(g.q_units, 1);
  EXPECT_EQ(g.kv_units, 1);
  g = fc::flash_schedule_groups(1, 2, 2, 256, 256, 64, 2, h200, true);
  EXPECT_EQ(g.q_units, 2);
  EXPECT_EQ(g.kv_units, 2);
}

// The choice and its sentences, for devices this machine may not have.
TEST(FlashCudaConfigChoice, NotesAndRefusalsNameTheValueWhereItCameFromAndWhatIsAccepted) {
  const fc::DeviceLimits h200{9, 0, 227 * 1024}, a100{8, 0, 163 * 1024}, rtx{12, 0, 99 * 1024};
  auto choose = [](const std::string& key, const std::string& where, std::optional<std::string> env,
                   const fc::DeviceLimits& d) {
    fc::ConfigRequest r;
    r.key_value = key, r.key_where = where, r.env = std::move(env);
    return fc::flash_choose_config(r, d, "cuda:0");
  };
  fc::ConfigChoice c = choose("auto", "", std::nullopt, h200);
  EXPECT_EQ(c.config, fc::Config::sm90a);
  EXPECT_EQ(c.note, "config sm90a (auto: compute capability 9.0)");
  EXPECT_EQ(c.refusal, "");
  c = choose("auto", "", std::nullopt, a100);
  EXPECT_EQ(c.config, fc::Config::sm90);
  EXPECT_EQ(c.note, "config sm90 (auto: compute capability 8.0, 163 KB of shared memory per block)");
  c = choose("auto", "", std::nullopt, rtx);
  EXPECT_EQ(c.config, fc::Config::sm120);
  EXPECT_EQ(c.note,
            "config sm120 (auto: compute capability 12.0, 99 KB of shared memory per block, below the 160 KB "
            "sm90 needs)");
  c = choose("sm90a", "x.toml:22:10", std::nullopt, h200);
  EXPECT_EQ(c.config, fc::Config::sm90a);
  EXPECT_EQ(c.note, "config sm90a (forced by [kernels.flash_cuda].config)");
  c = choose("auto", "", std::string("sm120"), h200);
  EXPECT_EQ(c.config, fc::Config::sm120);
  EXPECT_EQ(c.note,
            "config sm120 (forced by FLASHDRAFT_FLASH_CUDA_CONFIG=sm120, overriding [kernels.flash_cuda].config = "
            "\"auto\")");
  c = choose("sm90", "", std::string("auto"), h200);
  EXPECT_EQ(c.config, fc::Config::sm90a);
  EXPECT_EQ(c.note,
            "config sm90a (auto: compute capability 9.0; FLASHDRAFT_FLASH_CUDA_CONFIG=auto, overriding "
            "[kernels.flash_cuda].config = \"sm90\")");
  // Forced configurations the device cannot run.
  c = choose("sm90a", "x.toml:22:10", std::nullopt, a100);
  EXPECT_EQ(c.note, "");
  EXPECT_EQ(c.refusal,
            "[kernels.flash_cuda].config = \"sm90a\" (x.toml:22:10) cannot run on cuda:0: sm90a needs "
            "compute capability 9.0 (wgmma), the device has 8.0; accepted on cuda:0: \"auto\", \"sm90\", "
            "\"sm120\"");
  c = choose("auto", "", std::string("sm90"), rtx);
  EXPECT_EQ(c.refusal,
            "FLASHDRAFT_FLASH_CUDA_CONFIG=sm90 (overriding [kernels.flash_cuda].config = \"auto\") cannot "
            "run on cuda:0: sm90 needs 160 KB of shared memory per block, the device allows 99 KB; accepted "
            "on cuda:0: auto, sm120");
  c = choose("sm120", "", std::string("sm90a"), rtx);
  EXPECT_EQ(c.refusal,
            "FLASHDRAFT_FLASH_CUDA_CONFIG=sm90a (overriding [kernels.flash_cuda].config = \"sm120\") "
            "cannot run on cuda:0: sm90a needs compute capability 9.0 (wgmma), the device has 12.0; "
            "accepted on cuda:0: auto, sm120");
  // Values that name no configuration (a file value only reaches here past the schema in tests).
  c = choose("auto", "", std::string("SM90"), h200);
  EXPECT_EQ(c.refusal,
            "FLASHDRAFT_FLASH_CUDA_CONFIG is 'SM90', not a configuration; accepted values: auto, sm90a, "
            "sm90, sm120 (or unset it to use [kernels.flash_cuda].config = \"auto\")");
  c = choose("sm80", "x.toml:3:1", std::nullopt, h200);
  EXPECT_EQ(c.refusal,
            "[kernels.flash_cuda].config is \"sm80\" at x.toml:3:1, not a configuration; accepted values: "
            "\"auto\", \"sm90a\", \"sm90\", \"sm120\"");
}

// Inputs that are not contiguous (a transposed [B, L, H, D] layout) give the same result.
TEST_F(FlashCuda, StridedInputs) {
  std::shared_ptr<fd::AttentionKernel> flash = flash_cuda("auto"), dense = dense_ref();
  const fd::BlockMask mask =
      build_from_predicate(1, 1, 150, 150, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; });
  const fd::BlockMaskTensors t = fd::to_tensors(mask, c10::Device(c10::kCUDA, 0));
  at::manual_seed(base_seed() + 99);
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kHalf);
  const at::Tensor q = at::randn({1, 150, 4, 128}, opt).transpose(1, 2);
  const at::Tensor k = at::randn({1, 150, 2, 128}, opt).transpose(1, 2);
  const at::Tensor v = at::randn({1, 150, 2, 128}, opt).transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  const fd::AttentionForward got = flash->forward(q, k, v, t, 0.09);
  const fd::AttentionForward want = dense->forward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), t, 0.09);
  EXPECT_LE(relative_error(got.out, want.out), 1e-2);
  EXPECT_LE(lse_relative_error(got.lse, want.lse), 1e-2);
}

// The output is laid out [B, L, H, D] in memory (the head merge before an output projection
// is a view), the backward reads a dout in that layout as it comes, and a forward keeps its
// CTA order for the next forward under the very same mask tensors: a run of forwards under
// one mask, another mask of the same sizes, a fresh copy of the first mask's lists and other
// sizes each give dense_ref's result.
TEST_F(FlashCuda, OutputLayoutAndTheKeptCtaOrder) {
  std::shared_ptr<fd::AttentionKernel> flash = flash_cuda("auto"), dense = dense_ref();
  const c10::Device dev(c10::kCUDA, 0);
  const fd::BlockMask causal =
      build_from_predicate(2, 1, 300, 300, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; });
  const fd::BlockMask window =
      build_from_predicate(2, 1, 300, 300, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q && q - k < 70; });
  const fd::BlockMask small =
      build_from_predicate(2, 1, 200, 200, [](int64_t b, int64_t, int64_t q, int64_t k) { return k <= q + b; });
  const fd::BlockMaskTensors causal_t = fd::to_tensors(causal, dev), window_t = fd::to_tensors(window, dev);
  const fd::BlockMaskTensors causal_again = fd::to_tensors(causal, dev), small_t = fd::to_tensors(small, dev);
  struct Call {
    const char* what;
    const fd::BlockMaskTensors* mask;
    int64_t L;
  };
  const Call calls[] = {{"causal", &causal_t, 300},
                        {"causal, kept order", &causal_t, 300},
                        {"window, same sizes", &window_t, 300},
                        {"causal, fresh lists", &causal_again, 300},
                        {"other sizes", &small_t, 200},
                        {"causal, after other sizes", &causal_t, 300}};
  const auto opt = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  uint64_t seed = base_seed() + 123;
  for (const Call& c : calls) {
    SCOPED_TRACE(c.what);
    at::manual_seed(seed++);
    const at::Tensor q = at::randn({2, 8, c.L, 128}, opt), k = at::randn({2, 2, c.L, 128}, opt);
    const at::Tensor v = at::randn({2, 2, c.L, 128}, opt);
    const fd::AttentionForward got = flash->forward(q, k, v, *c.mask, 0.088);
    const fd::AttentionForward want =
        dense->forward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), *c.mask, 0.088);
    ASSERT_EQ(got.out.sizes(), q.sizes());
    EXPECT_FALSE(got.out.is_view());
    EXPECT_TRUE(got.out.transpose(1, 2).is_contiguous()) << got.out.strides();
    EXPECT_LE(relative_error(got.out, want.out), 2e-2);
    EXPECT_LE(lse_relative_error(got.lse, want.lse), 2e-2);
    // dout in the output's layout, as a head merge's backward gives it
    const at::Tensor dout = at::randn({2, c.L, 8, 128}, opt).transpose(1, 2);
    ASSERT_EQ(dout.strides(), got.out.strides());
    const fd::AttentionBackward g = flash->backward(dout, q, k, v, got.out, got.lse, *c.mask, 0.088);
    const fd::AttentionBackward w = dense->backward(dout.to(at::kFloat), q.to(at::kFloat), k.to(at::kFloat),
                                                    v.to(at::kFloat), want.out, want.lse, *c.mask, 0.088);
    EXPECT_LE(relative_error(g.dq, w.dq), 2e-2);
    EXPECT_LE(relative_error(g.dk, w.dk), 2e-2);
    EXPECT_LE(relative_error(g.dv, w.dv), 2e-2);
  }
  // Under c10::InferenceMode (served validation), with mask lists made there (inference tensors,
  // which have no version counter): twice, the second with the kept order.
  c10::InferenceMode inference;
  const fd::BlockMaskTensors inference_t = fd::to_tensors(window, dev);
  ASSERT_TRUE(inference_t.full_offset.is_inference());
  at::manual_seed(seed);
  const at::Tensor q = at::randn({2, 8, 300, 128}, opt), k = at::randn({2, 2, 300, 128}, opt);
  const at::Tensor v = at::randn({2, 2, 300, 128}, opt);
  const fd::AttentionForward want =
      dense->forward(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), inference_t, 0.088);
  for (int call = 0; call < 2; ++call) {
    const fd::AttentionForward got = flash->forward(q, k, v, inference_t, 0.088);
    EXPECT_LE(relative_error(got.out, want.out), 2e-2) << "inference mode, call " << call;
  }
}

// The cases themselves, without a GPU: every mask builds at 128 x 64, matches its
// predicate element by element, and the cases meant to have empty rows have them.
TEST(FlashCudaCases, MasksBuildAndMatchTheirPredicates) {
  std::vector<Case> cases = generator_cases();
  for (Case& c : predicate_cases()) cases.push_back(std::move(c));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fd::BlockMask m = c.build();
    m.validate();
    EXPECT_EQ(m.block_q, 128);
    EXPECT_EQ(m.block_kv, 64);
    EXPECT_EQ(m.q_len, c.q_len);
    EXPECT_EQ(m.kv_len, c.kv_len);
    int64_t mismatches = 0, empty_rows = 0;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.heads_q; ++h)
        for (int64_t q = 0; q < c.q_len; ++q) {
          bool any = false;
          for (int64_t k = 0; k < c.kv_len; ++k) {
            const bool v = c.visible(b, h, q, k);
            any |= v;
            mismatches += v != m.visible(m.batch == 1 ? 0 : b, m.heads == 1 ? 0 : h, q, k);
          }
          empty_rows += !any;
        }
    EXPECT_EQ(mismatches, 0);
    if (c.expect_empty_rows) {
      EXPECT_GT(empty_rows, 0);
    }
  }
}

// Refusals that need no GPU: they run in CI too.
TEST(FlashCudaSupports, RefusesWithReasonsNamingFoundAndSupportedValues) {
  if (!FLASHDRAFT_FLASH_CUDA_BUILT)
    GTEST_SKIP() << "flash_cuda is not built in this build (no CUDA, or FLASHDRAFT_BUILD_CUDA=OFF)";
  const ConfigEnv env("");
  std::shared_ptr<fd::AttentionKernel> flash = flash_cuda("auto");
  fd::AttentionProblem p;
  p.dtype = at::kBFloat16, p.head_dim = 128, p.q_len = p.kv_len = 256, p.heads_q = 4, p.heads_kv = 2;
  fd::Support s = flash->supports(p);  // device cpu
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("device cpu unsupported (supported: cuda)"), std::string::npos) << s.reason;

  p.dtype = at::kFloat;
  s = flash->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("dtype Float unsupported (supported: BFloat16, Half)"), std::string::npos) << s.reason;

  p.dtype = at::kHalf, p.head_dim = 96;
  s = flash->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("head_dim 96 unsupported (supported: 64, 128; 192, 256 forward only)"), std::string::npos)
      << s.reason;

  p.head_dim = 256;  // a forward-only head dim with a backward to run (needs_backward: the default)
  s = flash->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("head_dim 256 runs forward only (the backward's head dims: 64, 128), and this problem "
                          "needs a backward"),
            std::string::npos)
      << s.reason;
  p.needs_backward = false;  // the online target's attention: only the device is refused here
  s = flash->supports(p);
  EXPECT_EQ(s.reason.find("head_dim"), std::string::npos) << s.reason;
  p.needs_backward = true;

  p.head_dim = 64, p.heads_q = 6, p.heads_kv = 4;
  s = flash->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("heads_q 6 is not a multiple of heads_kv 4"), std::string::npos) << s.reason;

  const fd::BlockSize bs = flash->block_size(p);
  EXPECT_EQ(bs.q, 128);
  EXPECT_EQ(bs.kv, 64);

  if (torch::cuda::is_available()) {  // the GPU itself is accepted with a valid problem
    p.device = c10::Device(c10::kCUDA, 0), p.heads_q = 4, p.heads_kv = 2;
    s = flash->supports(p);
    EXPECT_TRUE(s.ok) << s.reason;
  } else {
    p.device = c10::Device(c10::kCUDA, 0), p.heads_q = 4, p.heads_kv = 2;
    s = flash->supports(p);
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.reason.find("CUDA device 0 is not available"), std::string::npos) << s.reason;
  }
}

}  // namespace

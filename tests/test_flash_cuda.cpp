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
// Configurations: every case runs with FLASHDRAFT_FLASH_CUDA_CONFIG unset (auto), then
// forced to sm120 and to sm90; the reported variant must name the forced one, which
// also proves the plugin reads the variable on every call.
//
// Without a CUDA device (CI) the GPU tests skip with a message; the supports() refusals
// that need no device still run.
#include "attention_error.hpp"
#include "plugin_loading.hpp"
#include "registry.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>
#include <flashdraft/mask_generator.hpp>

#include <ATen/ATen.h>
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
#include <random>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

const char* kConfigEnv = "FLASHDRAFT_FLASH_CUDA_CONFIG";

using test::load;

std::shared_ptr<fd::AttentionKernel> kernel(const std::string& name) {
  return load<fd::AttentionKernel>(fd::PluginKind::kernel, name, "kernels." + name);
}

// Sets FLASHDRAFT_FLASH_CUDA_CONFIG for a scope ("" unsets it), restoring it after.
class ConfigEnv {
 public:
  explicit ConfigEnv(const std::string& value) {
    const char* old = std::getenv(kConfigEnv);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value.empty()) unsetenv(kConfigEnv);
    else setenv(kConfigEnv, value.c_str(), 1);
  }
  ~ConfigEnv() {
    if (had_) setenv(kConfigEnv, old_.c_str(), 1);
    else unsetenv(kConfigEnv);
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

using test::has_nan;
using test::lse_relative_error;
using test::max_abs;
using test::relative_error;

using test::Visible;

struct Case {
  std::string name;
  int64_t batch, heads_q, heads_kv, q_len, kv_len;
  std::function<fd::BlockMask()> build;  // at 128 x 64
  Visible visible;                        // the same mask, element by element (b, h of the problem)
  bool expect_empty_rows = false;
};

// The kernel's tile (128 x 64).
fd::BlockMask build_from_predicate(int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len, const Visible& visible) {
  return test::build_mask(batch, heads, q_len, kv_len, 128, 64, visible);
}

// Cases from every mask generator plugin, through its own build().
std::vector<Case> generator_cases() {
  fd::MaskInput self;  // packed self-attention, Lq = Lkv = 301 (not a tile multiple)
  self.batch = 2, self.q_len = self.kv_len = 301;
  self.doc_lengths = {{90, 130, 81}, {1, 300}};
  fd::MaskInput dflash;  // [context 230 | 11 blocks of 16]: Lq 176, Lkv 406; padding blocks
  dflash.batch = 2, dflash.context_len = 230, dflash.block_size = 16;
  dflash.anchors = {{3, 20, 41, 42, 60, 74, 100, 150, 151, 200, 0}, {0, 10, 30, 50, 70, 74, 130, 140, 199, 205, 214}};
  dflash.block_valid = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, {1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1}};
  dflash.q_len = 11 * 16, dflash.kv_len = 230 + 11 * 16;

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
    cases.push_back({"random_per_head", 1, H, 1, Lq, Lkv, [=] { return build_from_predicate(1, H, Lq, Lkv, vis); },
                     vis, true});
  }
  {  // GQA 8:1, causal bottom-right aligned, Lq < Lkv, mask batch = B with a shift per b
    const int64_t B = 2, Lq = 133, Lkv = 390;
    Visible vis = [=](int64_t b, int64_t, int64_t q, int64_t k) { return k <= q + (Lkv - Lq) - 17 * b; };
    cases.push_back({"gqa8_causal_rect", B, 8, 1, Lq, Lkv, [=] { return build_from_predicate(B, 1, Lq, Lkv, vis); },
                     vis, false});
  }
  {  // one query row tile, one partial key tile; nothing visible for odd rows
    Visible vis = [](int64_t, int64_t, int64_t q, int64_t k) { return q % 2 == 0 && k % 3 != 1; };
    cases.push_back({"tiny_33x17", 1, 2, 2, 33, 17, [=] { return build_from_predicate(1, 1, 33, 17, vis); }, vis,
                     true});
  }
  return cases;
}

struct Results {
  at::Tensor out, lse, dq, dk, dv;
  std::string fwd, bwd;
};

Results run(fd::AttentionKernel& k, const at::Tensor& q, const at::Tensor& kk, const at::Tensor& v,
            const at::Tensor& dout, const fd::BlockMask& mask, double scale, bool poison) {
  const fd::BlockMaskTensors tensors = fd::to_tensors(mask, q.device());
  if (poison) poison_cuda_cache();
  fd::AttentionForward f = k.forward(q, kk, v, tensors, scale);
  if (poison) poison_cuda_cache();
  fd::AttentionBackward g = k.backward(dout, q, kk, v, f.out, f.lse, tensors, scale);
  return {f.out, f.lse, g.dq, g.dk, g.dv, f.variant, g.variant};
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

// The configurations this GPU runs: sm90a (wgmma) exists on compute capability 9.0 only,
// which the plugin's supports() knows. Where FLASHDRAFT_EXPECT_SM90A is set (the device
// scripts set it on the H200), a refusal of sm90a is a failure, not a skip.
std::vector<std::string> configs_here(fd::AttentionKernel& flash) {
  std::vector<std::string> c = {"", "sm120", "sm90"};
  const ConfigEnv env("sm90a");
  fd::AttentionProblem p;
  p.device = c10::Device(c10::kCUDA, 0), p.dtype = at::kBFloat16, p.head_dim = 64, p.q_len = p.kv_len = 70;
  const fd::Support s = flash.supports(p);
  if (s.ok) c.push_back("sm90a");
  else if (std::getenv("FLASHDRAFT_EXPECT_SM90A")) ADD_FAILURE() << "sm90a refused on this device: " << s.reason;
  else std::printf("  configuration sm90a not run here: %s\n", s.reason.c_str());
  return c;
}

// One case, one dtype, one head dim, one configuration ("" = auto).
void compare(fd::AttentionKernel& flash, fd::AttentionKernel& dense, const Case& c, at::ScalarType dtype,
             int64_t dim, const std::string& config, uint64_t seed) {
  const std::string precision = dtype == at::kBFloat16 ? "bf16" : "fp16";
  const std::string cfg = config.empty() ? "auto" : config;
  SCOPED_TRACE(c.name + " " + precision + " d" + std::to_string(dim) + " config " + cfg + " seed " +
               std::to_string(seed));
  const ConfigEnv env(config);
  fd::AttentionProblem problem;
  problem.device = c10::Device(c10::kCUDA, 0);
  problem.dtype = dtype;
  problem.batch = c.batch, problem.heads_q = c.heads_q, problem.heads_kv = c.heads_kv;
  problem.q_len = c.q_len, problem.kv_len = c.kv_len, problem.head_dim = dim;
  const fd::Support s = flash.supports(problem);
  ASSERT_TRUE(s.ok) << s.reason;
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

  Results got, want;
  {
    PoisonedAllocations poison;
    got = run(flash, q, k, v, dout, mask, scale, true);
  }
  want = run(dense, q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), dout.to(at::kFloat), mask, scale, false);
  for (const at::Tensor& t : {want.out, want.lse, want.dq, want.dk, want.dv}) ASSERT_FALSE(has_nan(t));

  const std::string suffix = (config.empty() ? std::string("") : config + "/") + precision + "/d" +
                             std::to_string(dim) + "/m128n64";
  if (config.empty()) {  // auto: either configuration, named fully
    EXPECT_TRUE(got.fwd.rfind("flash_cuda/fwd/sm", 0) == 0) << got.fwd;
    EXPECT_NE(got.fwd.find(precision + "/d" + std::to_string(dim) + "/m128n64"), std::string::npos) << got.fwd;
    EXPECT_TRUE(got.bwd.rfind("flash_cuda/bwd/sm", 0) == 0) << got.bwd;
  } else {
    EXPECT_EQ(got.fwd, "flash_cuda/fwd/" + suffix);
    EXPECT_EQ(got.bwd, "flash_cuda/bwd/" + suffix);
  }
  EXPECT_EQ(got.out.scalar_type(), dtype);
  EXPECT_EQ(got.dq.scalar_type(), dtype);
  EXPECT_EQ(got.dk.scalar_type(), dtype);
  EXPECT_EQ(got.dv.scalar_type(), dtype);
  EXPECT_EQ(got.lse.scalar_type(), at::kFloat);
  EXPECT_TRUE(got.out.is_cuda() && got.dq.is_cuda() && got.dk.is_cuda() && got.dv.is_cuda());
  ASSERT_EQ(got.out.sizes(), q.sizes());
  ASSERT_EQ(got.lse.sizes().vec(), (std::vector<int64_t>{c.batch, c.heads_q, c.q_len}));
  ASSERT_EQ(got.dq.sizes(), q.sizes());
  ASSERT_EQ(got.dk.sizes(), k.sizes());
  ASSERT_EQ(got.dv.sizes(), v.sizes());
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"out", got.out}, {"lse", got.lse},
                                {"dq", got.dq}, {"dk", got.dk}, {"dv", got.dv}})
    EXPECT_FALSE(has_nan(t)) << name << " has NaN (an element left unwritten, or a 0/0)";
  EXPECT_FALSE(at::isinf(got.out).any().item<bool>() || at::isinf(got.dq).any().item<bool>() ||
               at::isinf(got.dk).any().item<bool>() || at::isinf(got.dv).any().item<bool>());

  const double tol = dtype == at::kBFloat16 ? 2e-2 : 1e-2;
  const double e_out = relative_error(got.out, want.out), e_lse = lse_relative_error(got.lse, want.lse),
               e_dq = relative_error(got.dq, want.dq), e_dk = relative_error(got.dk, want.dk),
               e_dv = relative_error(got.dv, want.dv);
  std::printf("  %-17s %s d%-3lld %-5s rel err: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e (bound %.0e)\n",
              c.name.c_str(), precision.c_str(), static_cast<long long>(dim), cfg.c_str(), e_out, e_lse, e_dq, e_dk,
              e_dv, tol);
  EXPECT_LE(e_out, tol) << "out";
  EXPECT_LE(e_lse, tol) << "lse";
  EXPECT_LE(e_dq, tol) << "dq";
  EXPECT_LE(e_dk, tol) << "dk";
  EXPECT_LE(e_dv, tol) << "dv";

  // Rows with no visible key, from the predicate itself: out 0, lse -inf, dq 0 exactly.
  const at::Tensor lse_cpu = got.lse.cpu(), out_rows = got.out.abs().amax(-1).cpu(),
                   dq_rows = got.dq.abs().amax(-1).cpu();
  int64_t empty_rows = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (int64_t qi = 0; qi < c.q_len; ++qi) {
        bool any = false;
        for (int64_t ki = 0; ki < c.kv_len && !any; ++ki) any = c.visible(b, h, qi, ki);
        if (any) continue;
        ++empty_rows;
        EXPECT_EQ(lse_cpu[b][h][qi].item<float>(), -std::numeric_limits<float>::infinity());
        EXPECT_EQ(out_rows[b][h][qi].item<float>(), 0.f);
        EXPECT_EQ(dq_rows[b][h][qi].item<float>(), 0.f);
      }
  if (c.expect_empty_rows) {
    EXPECT_GT(empty_rows, 0) << "the case was meant to have rows with no visible key";
  }
}

TEST_F(FlashCuda, MatchesDenseRefForEveryMaskGeneratorDtypeHeadDimAndConfig) {
  std::shared_ptr<fd::AttentionKernel> flash = kernel("flash_cuda"), dense = kernel("dense_ref");
  std::vector<Case> cases = generator_cases();
  for (Case& c : predicate_cases()) cases.push_back(std::move(c));
  uint64_t seed = base_seed();
  int runs = 0;
  const std::vector<std::string> configs = configs_here(*flash);
  for (const std::string& config : configs)
    for (const Case& c : cases)
      for (at::ScalarType dtype : {at::kBFloat16, at::kHalf})
        for (int64_t dim : {64, 128}) {
          compare(*flash, *dense, c, dtype, dim, config, seed++);
          ++runs;
        }
  std::printf("  %d comparisons (%zu masks x 2 dtypes x 2 head dims x %zu configurations)\n", runs, cases.size(),
              configs.size());
}

// Every mask generator plugin found is covered above (a new one must be added there).
// Runs without a GPU.
TEST(FlashCudaCases, EveryMaskGeneratorIsCovered) {
  std::vector<std::string> covered = {"causal", "sliding_window", "document", "prefix_lm", "dflash"};
  for (const fd::FoundPlugin* p : test::plugins().of_kind(fd::PluginKind::mask))
    EXPECT_NE(std::find(covered.begin(), covered.end(), p->name), covered.end())
        << "mask generator " << p->name << " has no case in test_flash_cuda.cpp";
}

// The configuration is read on every call: switching the variable switches the variant.
TEST_F(FlashCuda, ConfigSwitchIsReadPerCall) {
  std::shared_ptr<fd::AttentionKernel> flash = kernel("flash_cuda");
  const fd::BlockMask mask =
      build_from_predicate(1, 1, 130, 70, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; });
  const fd::BlockMaskTensors t = fd::to_tensors(mask, c10::Device(c10::kCUDA, 0));
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor q = at::randn({1, 2, 130, 64}, opt), k = at::randn({1, 2, 70, 64}, opt),
                   v = at::randn({1, 2, 70, 64}, opt);
  for (const std::string cfg : {"sm90", "sm120", "sm90"}) {
    const ConfigEnv env(cfg);
    EXPECT_EQ(flash->forward(q, k, v, t, 0.125).variant, "flash_cuda/fwd/" + cfg + "/bf16/d64/m128n64");
  }
  if (configs_here(*flash).back() == "sm90a") {
    const ConfigEnv env("sm90a");
    const fd::AttentionForward f = flash->forward(q, k, v, t, 0.125);
    EXPECT_EQ(f.variant, "flash_cuda/fwd/sm90a/bf16/d64/m128n64");
    EXPECT_EQ(flash->backward(at::randn_like(q), q, k, v, f.out, f.lse, t, 0.125).variant,
              "flash_cuda/bwd/sm90a/bf16/d64/m128n64");
  }
  const ConfigEnv env("sm75");
  fd::AttentionProblem p;
  p.device = c10::Device(c10::kCUDA, 0), p.dtype = at::kBFloat16, p.head_dim = 64, p.q_len = p.kv_len = 70;
  const fd::Support s = flash->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("'sm75'"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("auto, sm120, sm90, sm90a"), std::string::npos) << s.reason;
  EXPECT_THROW(flash->forward(q, k, v, t, 0.125), std::exception);
}

// Inputs that are not contiguous (a transposed [B, L, H, D] layout) give the same result.
TEST_F(FlashCuda, StridedInputs) {
  std::shared_ptr<fd::AttentionKernel> flash = kernel("flash_cuda"), dense = kernel("dense_ref");
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
  std::shared_ptr<fd::AttentionKernel> flash = kernel("flash_cuda");
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
  EXPECT_NE(s.reason.find("head_dim 96 unsupported (supported: 64, 128)"), std::string::npos) << s.reason;

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

// CPU attention kernels: flash_cpu against dense_ref, and dense_ref against a plain
// per-element loop.
//
// Both kernels are loaded through the registry from the build's plugin folder. Masks
// are built here with BlockMaskBuilder::add_tile from predicates written in this file
// (causal, sliding window, document, prefix-LM, DFlash-like with padding blocks, random
// per head), at odd sizes, with GQA and several head dims.
//
// Relative error of a result a against a reference b: max|a - b| / max|b| over all
// elements (lse: over the finite entries; the -inf entries must coincide exactly).
// Bounds: fp32 <= 1e-5, bf16 <= 2e-2 (bf16 results are compared with dense_ref run in
// fp32 on the same bf16-rounded inputs).
//
// Poisoning: LibTorch's "fill uninitialized memory" mode (deterministic algorithms on,
// warn only) makes every at::empty return NaN-filled memory, so an output element a
// kernel forgot to write stays NaN; every result is then checked to be NaN-free.
// The checks of each comparison are kernel_comparison.hpp's, shared with test_flash_cuda.
#include "attention_error.hpp"
#include "kernel_comparison.hpp"
#include "plugin_loading.hpp"
#include "registry/registry.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>
#include <flashdraft/mask_generator.hpp>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

constexpr double kInf = std::numeric_limits<double>::infinity();

std::shared_ptr<fd::AttentionKernel> load_kernel(const std::string& name) {
  return test::load<fd::AttentionKernel>(fd::PluginKind::kernel, name, "kernels." + name);
}

using test::build_mask;
using test::has_nan;
using test::KernelResults;
using test::lse_relative_error;
using test::max_abs;
using test::PoisonedAllocations;
using test::relative_error;
using test::run_kernel;
using test::Visible;

struct Case {
  std::string name;
  int64_t batch, heads_q, heads_kv, q_len, kv_len, dim;
  int64_t mask_batch, mask_heads;
  Visible visible;
  double scale = 0.0;                 // 0: 1/sqrt(dim)
  int64_t block_q = 0, block_kv = 0;  // 0: the kernel's block_size()
  // When set, the BlockMask comes from here (a mask generator plugin) instead of
  // add_tile over `visible`; `visible` is then the generator's own definition.
  std::function<fd::BlockMask(int64_t block_q, int64_t block_kv)> build = nullptr;
};

std::vector<Case> mask_cases() {
  std::vector<Case> cases;
  std::mt19937_64 rng(20261129);
  // causal, shared mask, GQA 4:2
  cases.push_back(
      {"causal", 2, 4, 2, 131, 131, 64, 1, 1, [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; }});
  // causal aligned bottom-right, Lq < Lkv, no GQA, small head dim, odd scale
  cases.push_back({"causal_rect", 1, 3, 3, 77, 150, 16, 1, 1,
                   [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q + 73; }, 0.7});
  // sliding window of 37 keys, head dim 96, GQA 6:2
  cases.push_back({"sliding_window", 1, 6, 2, 200, 200, 96, 1, 1,
                   [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q && k > q - 37; }});
  // documents: random boundaries per batch element, causal inside a document
  {
    std::vector<std::vector<int64_t>> doc(2, std::vector<int64_t>(173));
    for (auto& d : doc) {
      int64_t id = 0;
      for (int64_t t = 0; t < 173; ++t) {
        if (t > 0 && rng() % 23 == 0) ++id;
        d[t] = id;
      }
    }
    cases.push_back({"document", 2, 2, 1, 173, 173, 64, 2, 1,
                     [doc](int64_t b, int64_t, int64_t q, int64_t k) { return doc[b][q] == doc[b][k] && k <= q; }});
  }
  // prefix-LM: bidirectional prefix (per batch element), causal after it
  cases.push_back({"prefix_lm", 2, 4, 4, 150, 150, 32, 2, 1,
                   [](int64_t b, int64_t, int64_t q, int64_t k) { return k < (b ? 45 : 70) || k <= q; }});
  // DFlash-like: context of S keys, then N blocks of BS; block n sees context keys
  // before its anchor and its own block; padding blocks (anchor < 0) see nothing.
  {
    const int64_t S = 100, N = 7, BS = 16;
    std::vector<std::vector<int64_t>> anchor = {{5, 17, 30, 44, 61, 80, -1}, {0, 12, 13, 50, 99, -1, -1}};
    Visible dflash = [anchor, S, BS](int64_t b, int64_t, int64_t q, int64_t k) {
      const int64_t n = q / BS, a = anchor[b][n];
      if (a < 0) return false;
      return k < a || (k >= S && (k - S) / BS == n);
    };
    cases.push_back({"dflash", 2, 4, 1, N * BS, S + N * BS, 64, 2, 1, dflash});
    // the same at a block size that does not divide anything and needs 2 words per row
    cases.push_back({"dflash_tiles48x40", 2, 4, 2, N * BS, S + N * BS, 48, 2, 1, dflash, 0.0, 48, 40});
  }
  // random per head (mask heads = Hq), with rows that see nothing
  {
    const int64_t H = 4, Lq = 90, Lkv = 70;
    std::vector<uint8_t> bits(H * Lq * Lkv);
    std::bernoulli_distribution on(0.3);
    for (auto& x : bits) x = on(rng);
    cases.push_back(
        {"random_per_head", 1, H, 2, Lq, Lkv, 16, 1, H, [bits, Lq, Lkv](int64_t, int64_t h, int64_t q, int64_t k) {
           return q % 11 != 3 && bits[(h * Lq + q) * Lkv + k] != 0;
         }});
  }
  // degenerate: nothing visible anywhere, and no keys at all
  cases.push_back(
      {"nothing_visible", 1, 2, 1, 50, 40, 16, 1, 1, [](int64_t, int64_t, int64_t, int64_t) { return false; }});
  cases.push_back({"no_keys", 1, 2, 2, 33, 0, 16, 1, 1, [](int64_t, int64_t, int64_t, int64_t) { return true; }});
  return cases;
}

class KernelsCpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    flash_ = load_kernel("flash_cpu");
    dense_ = load_kernel("dense_ref");
  }
  static void TearDownTestSuite() {
    flash_.reset();
    dense_.reset();
  }
  static std::shared_ptr<fd::AttentionKernel> flash_, dense_;
};
std::shared_ptr<fd::AttentionKernel> KernelsCpu::flash_, KernelsCpu::dense_;

// The poisoning this file relies on is really active.
TEST_F(KernelsCpu, PoisonFillsEmptyTensorsWithNaN) {
  PoisonedAllocations poison;
  EXPECT_TRUE(at::isnan(at::empty({1000}, at::kFloat)).all().item<bool>());
  EXPECT_TRUE(at::isnan(at::empty({1000}, at::kBFloat16)).all().item<bool>());
}

void compare_with_dense(fd::AttentionKernel& flash, fd::AttentionKernel& dense, const Case& c, at::ScalarType dtype,
                        uint64_t seed) {
  SCOPED_TRACE(c.name + (dtype == at::kBFloat16 ? " bf16" : " fp32") + " seed " + std::to_string(seed));
  fd::AttentionProblem problem;
  problem.dtype = dtype;
  problem.batch = c.batch, problem.heads_q = c.heads_q, problem.heads_kv = c.heads_kv;
  problem.q_len = c.q_len, problem.kv_len = c.kv_len, problem.head_dim = c.dim;
  ASSERT_TRUE(flash.supports(problem).ok) << flash.supports(problem).reason;
  const fd::BlockSize bs = flash.block_size(problem);
  const int64_t block_q = c.block_q ? c.block_q : bs.q, block_kv = c.block_kv ? c.block_kv : bs.kv;
  const fd::BlockMask mask =
      c.build ? c.build(block_q, block_kv)
              : build_mask(c.mask_batch, c.mask_heads, c.q_len, c.kv_len, block_q, block_kv, c.visible);
  if (!c.build) {
    ASSERT_EQ(mask.batch, c.mask_batch);
    ASSERT_EQ(mask.heads, c.mask_heads);
  }
  const double scale = c.scale != 0.0 ? c.scale : 1.0 / std::sqrt(double(c.dim));

  at::manual_seed(seed);
  const at::Tensor q = at::randn({c.batch, c.heads_q, c.q_len, c.dim}).to(dtype);
  const at::Tensor k = at::randn({c.batch, c.heads_kv, c.kv_len, c.dim}).to(dtype);
  const at::Tensor v = at::randn({c.batch, c.heads_kv, c.kv_len, c.dim}).to(dtype);
  const at::Tensor dout = at::randn({c.batch, c.heads_q, c.q_len, c.dim}).to(dtype);

  KernelResults got, want;
  {
    PoisonedAllocations poison;
    got = run_kernel(flash, q, k, v, dout, mask, scale);
    // The oracle: dense_ref in fp32 on the very same (possibly bf16-rounded) values.
    want = run_kernel(dense, q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), dout.to(at::kFloat), mask, scale);
  }
  const std::string precision = dtype == at::kBFloat16 ? "bf16" : "fp32";
  const std::string tiles = "q" + std::to_string(mask.block_q) + "k" + std::to_string(mask.block_kv);
  EXPECT_EQ(got.fwd, "flash_cpu/fwd/" + precision + "/" + tiles);
  EXPECT_EQ(got.bwd, "flash_cpu/bwd/" + precision + "/" + tiles);
  EXPECT_EQ(want.fwd, "dense_ref");
  EXPECT_EQ(want.bwd, "dense_ref");
  char label[64];
  std::snprintf(label, sizeof label, "%-18s %s tiles %-7s", c.name.c_str(), precision.c_str(), tiles.c_str());
  ASSERT_NO_FATAL_FAILURE(
      test::expect_matches_reference(got, want, q, k, dtype, dtype == at::kBFloat16 ? 2e-2 : 1e-5, label));

  // The case's predicate sees mask coordinates: a mask of batch or heads 1 is shared.
  const Visible visible = [&c](int64_t b, int64_t h, int64_t qi, int64_t ki) {
    return c.visible(c.mask_batch == 1 ? 0 : b, c.mask_heads == 1 ? 0 : h, qi, ki);
  };
  const int64_t empty_rows = test::expect_unseen_exactly_zero(got, c.heads_kv, visible);
  if (c.name.rfind("dflash", 0) == 0 || c.name == "gen_dflash" || c.name == "random_per_head" ||
      c.name == "nothing_visible" || c.name == "no_keys") {
    EXPECT_GT(empty_rows, 0);
  }
}

using test::base_seed;

TEST_F(KernelsCpu, FlashMatchesDenseFp32) {
  uint64_t seed = base_seed();
  for (const Case& c : mask_cases()) compare_with_dense(*flash_, *dense_, c, at::kFloat, seed++);
}

TEST_F(KernelsCpu, FlashMatchesDenseBf16) {
  uint64_t seed = base_seed() + 1000;
  for (const Case& c : mask_cases()) compare_with_dense(*flash_, *dense_, c, at::kBFloat16, seed++);
}

// Every mask generator plugin found, through its own build(), with an input that fits
// it. A generator this test does not know is tried with its defaults and the
// self-attention input; if that cannot build, it is reported and skipped.
TEST_F(KernelsCpu, FlashMatchesDenseForEveryMaskGenerator) {
  fd::MaskInput self;  // packed self-attention: Lq = Lkv
  self.batch = 2, self.q_len = self.kv_len = 157;
  self.doc_lengths = {{60, 40, 57}, {1, 156}};
  fd::MaskInput dflash;  // [context 90 | 6 blocks of 16], padding blocks in both rows
  dflash.batch = 2, dflash.blocks.context_len = 90, dflash.blocks.block_size = 16;
  dflash.blocks.anchors = {{3, 20, 41, 42, 60, 74}, {0, 10, 30, 50, 70, 74}};
  dflash.blocks.valid = {{1, 1, 1, 1, 1, 0}, {1, 0, 1, 1, 1, 1}};
  dflash.q_len = 6 * 16, dflash.kv_len = 90 + 6 * 16;
  fd::MaskInput eagle3 = self;  // the third unroll step of EAGLE-3: keys of steps 0..2
  eagle3.kv_len = 3 * self.q_len;
  // Packed DFlash rows: each block sees its own document's context (documents 30 + 60 and 90).
  fd::MaskInput dflash_packed = dflash;
  dflash_packed.blocks.anchors = {{3, 10, 31, 42, 60, 74}, {0, 10, 30, 50, 70, 74}};
  dflash_packed.doc_lengths = {{30, 60}, {90}};
  // Served decoding: one block per row after a cache of 90 positions, the second shorter.
  fd::MaskInput dflash_served;
  dflash_served.batch = 2, dflash_served.blocks.context_len = 90, dflash_served.blocks.block_size = 16;
  dflash_served.blocks.anchors = {{61}, {17}};
  dflash_served.blocks.valid = {{1}, {1}};
  dflash_served.blocks.lengths = {{16}, {5}};
  dflash_served.q_len = 16, dflash_served.kv_len = 90 + 16;
  // The target's cached decoding: 16 queries per row at positions 0.. and 70.. of 100 keys.
  fd::MaskInput decode;
  decode.batch = 2, decode.q_len = 16, decode.kv_len = 100;
  decode.q_offsets = {0, 70};
  const std::map<std::string, std::map<std::string, fd::Value>> overrides = {
      {"prefix_lm", {{"prefix", int64_t{33}}}}, {"sliding_window", {{"window", int64_t{29}}}}};

  uint64_t seed = base_seed() + 4000;
  int64_t tested = 0;
  for (const fd::FoundPlugin* plugin : test::plugins().of_kind(fd::PluginKind::mask)) {
    const fd::Schema schema = test::plugins().schema(*plugin);
    fd::Config config("mask", fd::SourcePosition{});
    const auto over = overrides.find(plugin->name);
    bool complete = true;
    for (const fd::KeySpec& key : schema.keys()) {
      if (over != overrides.end() && over->second.count(key.name))
        config.set(key.name, over->second.at(key.name), std::nullopt);
      else if (key.fallback)
        config.set(key.name, *key.fallback, std::nullopt);
      else
        complete = false;
    }
    if (!complete) {
      std::printf("  mask generator %s skipped: a key without default that this test does not set\n",
                  plugin->name.c_str());
      continue;
    }
    std::shared_ptr<fd::MaskGenerator> gen = fd::create_as<fd::MaskGenerator>(test::plugins(), *plugin, config);
    const std::vector<fd::MaskInput> inputs = plugin->name == "dflash"
                                                  ? std::vector<fd::MaskInput>{dflash, dflash_packed, dflash_served}
                                              : plugin->name == "eagle3_ttt" ? std::vector<fd::MaskInput>{eagle3}
                                              : plugin->name == "causal"     ? std::vector<fd::MaskInput>{self, decode}
                                                                             : std::vector<fd::MaskInput>{self};
    for (const fd::MaskInput& input : inputs) {
      try {
        gen->build(input, 64, 64);
      } catch (const std::invalid_argument& e) {
        ADD_FAILURE() << "mask generator " << plugin->name << " refused this test's input: " << e.what();
        continue;
      }
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        // mask batch = B here only routes b unchanged to the generator's predicate (the
        // generator's BlockMask may still be shared: batch 1).
        Case c{"gen_" + plugin->name,
               input.batch,
               4,
               2,
               input.q_len,
               input.kv_len,
               64,
               input.batch,
               1,
               [gen, input](int64_t b, int64_t h, int64_t q, int64_t k) { return gen->visible(input, b, h, q, k); }};
        c.build = [gen, input](int64_t bq, int64_t bkv) { return gen->build(input, bq, bkv); };
        compare_with_dense(*flash_, *dense_, c, dtype, seed++);
      }
    }
    ++tested;
  }
  EXPECT_GE(tested, 1) << "no mask generator plugin was found in " FLASHDRAFT_PLUGIN_DIR;
}

// Head dims at the edges of what flash_cpu accepts.
TEST_F(KernelsCpu, FlashHeadDims) {
  uint64_t seed = base_seed() + 2000;
  for (int64_t dim : {1, 5, 128, 256}) {
    Case c{"causal_d" + std::to_string(dim), 1, 2, 1, 70, 70, dim, 1, 1, [](int64_t, int64_t, int64_t q, int64_t k) {
             return k <= q;
           }};
    compare_with_dense(*flash_, *dense_, c, at::kFloat, seed++);
  }
}

TEST_F(KernelsCpu, FlashRefusesWithReasons) {
  fd::AttentionProblem p;
  p.q_len = p.kv_len = 16, p.head_dim = 64;
  EXPECT_TRUE(flash_->supports(p).ok);
  p.device = c10::Device(c10::kCUDA, 0);
  fd::Support s = flash_->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("cuda:0"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("cpu"), std::string::npos) << s.reason;
  p.device = c10::kCPU;
  p.dtype = at::kHalf;
  s = flash_->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("Half"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("BFloat16"), std::string::npos) << s.reason;
  p.dtype = at::kFloat;
  p.head_dim = 320;
  s = flash_->supports(p);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.reason.find("320"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("256"), std::string::npos) << s.reason;
  // and the call itself refuses, too
  const fd::BlockMask mask = build_mask(1, 1, 8, 8, 64, 64, [](int64_t, int64_t, int64_t, int64_t) { return true; });
  const at::Tensor h = at::randn({1, 1, 8, 16}).to(at::kHalf);
  EXPECT_THROW(flash_->forward(h, h, h, fd::to_tensors(mask, c10::kCPU), 0.25), std::invalid_argument);
}

// dense_ref against the definition, element by element, in double.
TEST_F(KernelsCpu, DenseRefMatchesLoop) {
  const int64_t B = 2, Hq = 2, Hkv = 1, Lq = 5, Lkv = 7, D = 3;
  const double scale = 0.6;
  // per batch element: b = 0 causal-ish band, b = 1 a pattern with an empty row (q = 2)
  Visible vis = [](int64_t b, int64_t, int64_t q, int64_t k) {
    return b == 0 ? (k <= q + 2) : (q != 2 && (k + q) % 3 != 0);
  };
  const fd::BlockMask mask = build_mask(B, 1, Lq, Lkv, 4, 4, vis);
  at::manual_seed(base_seed() + 3000);
  const at::Tensor q = at::randn({B, Hq, Lq, D}), k = at::randn({B, Hkv, Lkv, D}), v = at::randn({B, Hkv, Lkv, D}),
                   dout = at::randn({B, Hq, Lq, D});
  const KernelResults r = run_kernel(*dense_, q, k, v, dout, mask, scale);

  auto Q = q.accessor<float, 4>();
  auto K = k.accessor<float, 4>();
  auto V = v.accessor<float, 4>();
  auto dO = dout.accessor<float, 4>();
  at::Tensor out = at::zeros({B, Hq, Lq, D}, at::kDouble), lse = at::zeros({B, Hq, Lq}, at::kDouble);
  at::Tensor dq = at::zeros({B, Hq, Lq, D}, at::kDouble), dk = at::zeros({B, Hkv, Lkv, D}, at::kDouble),
             dv = at::zeros({B, Hkv, Lkv, D}, at::kDouble);
  auto O = out.accessor<double, 4>();
  auto LSE = lse.accessor<double, 3>();
  auto dQ = dq.accessor<double, 4>();
  auto dK = dk.accessor<double, 4>();
  auto dV = dv.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      for (int64_t i = 0; i < Lq; ++i) {
        std::vector<double> s(Lkv, -kInf), p(Lkv, 0.0), dp(Lkv, 0.0);
        double m = -kInf;
        for (int64_t j = 0; j < Lkv; ++j) {
          if (!vis(b, 0, i, j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(Q[b][h][i][d]) * K[b][g][j][d];
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        if (m == -kInf) {  // nothing visible: out 0, lse -inf, no gradient
          LSE[b][h][i] = -kInf;
          continue;
        }
        double l = 0;
        for (int64_t j = 0; j < Lkv; ++j) l += s[j] == -kInf ? 0.0 : std::exp(s[j] - m);
        LSE[b][h][i] = m + std::log(l);
        // P = softmax; dP_j = dO . v_j; dS_j = P_j (dP_j - sum_k P_k dP_k)
        double pdp = 0;
        for (int64_t j = 0; j < Lkv; ++j) {
          p[j] = s[j] == -kInf ? 0.0 : std::exp(s[j] - m) / l;
          for (int64_t d = 0; d < D; ++d) {
            O[b][h][i][d] += p[j] * V[b][g][j][d];
            dp[j] += double(dO[b][h][i][d]) * V[b][g][j][d];
          }
          pdp += p[j] * dp[j];
        }
        for (int64_t j = 0; j < Lkv; ++j) {
          const double ds = p[j] * (dp[j] - pdp);
          for (int64_t d = 0; d < D; ++d) {
            dQ[b][h][i][d] += scale * ds * K[b][g][j][d];
            dK[b][g][j][d] += scale * ds * Q[b][h][i][d];
            dV[b][g][j][d] += p[j] * dO[b][h][i][d];
          }
        }
      }
    }
  EXPECT_EQ(r.fwd, "dense_ref");
  EXPECT_EQ(r.bwd, "dense_ref");
  EXPECT_LE(relative_error(r.out, out), 1e-5);
  EXPECT_LE(lse_relative_error(r.lse.to(at::kDouble), lse), 1e-5);
  EXPECT_LE(relative_error(r.dq, dq), 1e-5);
  EXPECT_LE(relative_error(r.dk, dk), 1e-5);
  EXPECT_LE(relative_error(r.dv, dv), 1e-5);
  EXPECT_TRUE(std::isinf(r.lse[1][0][2].item<float>()));
  EXPECT_EQ(max_abs(r.out[1][1][2]), 0.0);
  EXPECT_EQ(max_abs(r.dq[1][1][2]), 0.0);
  EXPECT_FALSE(has_nan(r.out) || has_nan(r.dq) || has_nan(r.dk) || has_nan(r.dv) || has_nan(r.lse));

  // bf16 inputs: math in fp32, results in bf16, close to the fp32 results.
  const KernelResults rb = run_kernel(*dense_, q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16),
                                      dout.to(at::kBFloat16), mask, scale);
  EXPECT_EQ(rb.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(rb.dk.scalar_type(), at::kBFloat16);
  EXPECT_EQ(rb.lse.scalar_type(), at::kFloat);
  EXPECT_LE(relative_error(rb.out, out), 2e-2);
  EXPECT_LE(relative_error(rb.dq, dq), 2e-2);
}

}  // namespace

// DFlash drafter: labels, weights and anchors (pure logic, hand-worked numbers), a
// float64 finite-difference gradient check of a one-layer drafter against autograd,
// frozen target parts, the step's attention calls, and the bad-input errors.
#include "../plugins/dflash/dflash_labels.hpp"
#include "dflash_oracle.hpp"

#include <flashdraft/acceptance.hpp>

#include <ATen/Parallel.h>

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

using namespace flashdraft;
using flashdraft::dflash_test::make_drafter;
using flashdraft::dflash_test::OracleAttention;

namespace {

// --- labels and weights: a hand-worked example --------------------------------------------
// tokens 100..109 (length 10), BS = 4, gamma = 2, anchors {1, 5, pad}, loss mask off at 7.
//   block 0 (anchor 1): j=1 -> token at 2 = 102, j=2 -> 103, j=3 -> 104
//   block 1 (anchor 5): j=1 -> 106, j=2 -> position 7 is masked: no loss, j=3 -> 108
//   block 2: padding -> nothing
// weights: w_1 = exp(0) = 1, w_2 = exp(-1/2) = 0.6065306597126334, w_3 = exp(-1) = 0.36787944117144233
TEST(DFlashLabels, HandWorkedExample) {
  std::vector<int64_t> tokens{100, 101, 102, 103, 104, 105, 106, 107, 108, 109};
  std::vector<uint8_t> mask(10, 1);
  mask[7] = 0;
  dflash::Anchors a{{1, 5, 5}, {1, 1, 0}};
  const dflash::BlockLabels bl = dflash::block_labels(tokens.data(), mask.data(), 10, a, 4, 2.0);
  const std::vector<int64_t> want_labels{-1, 102, 103, 104, -1, 106, -1, 108, -1, -1, -1, -1};
  const std::vector<double> want_w{0, 1, 0.6065306597126334, 0.36787944117144233, 0, 1, 0, 0.36787944117144233, 0, 0,
                                   0, 0};
  EXPECT_EQ(bl.labels, want_labels);
  ASSERT_EQ(bl.weights.size(), want_w.size());
  for (size_t i = 0; i < want_w.size(); ++i) EXPECT_NEAR(bl.weights[i], want_w[i], 1e-15) << "slot " << i;
  // gamma = 7, BS = 16: w_15 = exp(-14/7) = exp(-2) = 0.1353352832366127
  EXPECT_NEAR(dflash::position_weight(15, 7.0), 0.1353352832366127, 1e-15);
  EXPECT_EQ(dflash::position_weight(0, 7.0), 0.0);
}

TEST(DFlashLabels, BlockPositionJIsTrainedOnTokenAtAnchorPlusJ) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t length = 5 + int64_t(gen() % 60), BS = 2 + int64_t(gen() % 8);
    std::vector<int64_t> tokens(static_cast<size_t>(length));
    for (auto& t : tokens) t = int64_t(gen() % 1000);
    dflash::Anchors a;
    for (int64_t x = 0; x < length; x += 1 + int64_t(gen() % 5)) {
      a.anchors.push_back(x);
      a.valid.push_back(gen() % 4 != 0);
    }
    const double gamma = 1.0 + double(gen() % 10);
    const dflash::BlockLabels bl = dflash::block_labels(tokens.data(), nullptr, length, a, BS, gamma);
    for (size_t n = 0; n < a.anchors.size(); ++n)
      for (int64_t j = 0; j < BS; ++j) {
        const size_t slot = n * size_t(BS) + size_t(j);
        const int64_t p = a.anchors[n] + j;
        const bool counted = a.valid[n] && j >= 1 && p < length;
        EXPECT_EQ(bl.labels[slot], counted ? tokens[size_t(p)] : -1);
        EXPECT_DOUBLE_EQ(bl.weights[slot], counted ? std::exp(-double(j - 1) / gamma) : 0.0);
      }
  }
}

TEST(DFlashLabels, SimulatedAcceptance) {
  // 1 + 0.5 + 0.5*0.5 + 0.5*0.5*1 = 2.0 ; all ones over 15 positions = 16
  EXPECT_DOUBLE_EQ(flashdraft::simulated_tau({0.5, 0.5, 1.0}), 2.0);
  EXPECT_DOUBLE_EQ(flashdraft::simulated_tau(std::vector<double>(15, 1.0)), 16.0);
  EXPECT_DOUBLE_EQ(flashdraft::simulated_tau({0.0, 1.0}), 1.0);
}

// --- anchors --------------------------------------------------------------------------------
TEST(DFlashAnchors, SortedUniqueInRangeAndPaddedWhenShort) {
  std::mt19937_64 gen(11);
  auto draw = [&](int64_t k) { return int64_t(gen() % uint64_t(k)); };
  int64_t padded_cases = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t length = 1 + int64_t(gen() % 50), BS = 1 + int64_t(gen() % 12), N = 1 + int64_t(gen() % 10);
    std::vector<uint8_t> mask(static_cast<size_t>(length));
    for (auto& m : mask) m = gen() % 5 != 0;
    // Plain definition of a candidate.
    std::set<int64_t> allowed;
    for (int64_t x = 0; x < length; ++x)
      if (x + BS - 1 <= length - 1 && (BS == 1 || mask[size_t(x + 1)])) allowed.insert(x);
    const dflash::Anchors a = dflash::draw_anchors(dflash::anchor_candidates(length, BS, mask.data()), N, draw);
    ASSERT_EQ(int64_t(a.anchors.size()), N);
    ASSERT_EQ(int64_t(a.valid.size()), N);
    const int64_t real = std::min<int64_t>(N, int64_t(allowed.size()));
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_EQ(a.valid[size_t(n)], n < real ? 1 : 0) << "valid blocks come first, padding after";
      if (n < real) {
        EXPECT_TRUE(allowed.count(a.anchors[size_t(n)])) << "anchor " << a.anchors[size_t(n)] << " not a candidate";
        if (n > 0) {
          EXPECT_LT(a.anchors[size_t(n - 1)], a.anchors[size_t(n)]) << "strictly increasing";
        }
      } else {
        EXPECT_GE(a.anchors[size_t(n)], 0);
        EXPECT_LT(a.anchors[size_t(n)], std::max<int64_t>(length, 1));
        if (n > 0) {
          EXPECT_LE(a.anchors[size_t(n - 1)], a.anchors[size_t(n)]);
        }
      }
    }
    padded_cases += real < N;
  }
  EXPECT_GT(padded_cases, 10);  // the trials did exercise padding
}

// Where blocks may start, hand-worked: a row of two documents [0, 8) and [8, 14), BS = 3,
// loss mask (1 = response): 0 0 1 1 1 1 0 1 | 1 1 1 1 0 1.
//   response    anchor on a response token followed by another, whole block in its document:
//               doc 0: a in 0..5 with mask[a] and mask[a+1]: 2, 3, 4;  doc 1: a in 8..11: 8, 9, 10
//   next_token  the token after the anchor carries loss: doc 0: 1, 2, 3, 4; doc 1: 8, 9, 10
// One document of 14 (no documents): next_token also admits 6 and 7, whose blocks would run
// from the first document into the second.
TEST(DFlashAnchors, RulesAndDocumentsHandWorked) {
  const std::vector<uint8_t> mask{0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1};
  const std::vector<dflash::Document> docs{{0, 8}, {8, 14}};
  EXPECT_EQ(dflash::anchor_candidates(docs, 3, mask.data(), dflash::AnchorRule::response),
            (std::vector<int64_t>{2, 3, 4, 8, 9, 10}));
  EXPECT_EQ(dflash::anchor_candidates(docs, 3, mask.data(), dflash::AnchorRule::next_token),
            (std::vector<int64_t>{1, 2, 3, 4, 8, 9, 10}));
  EXPECT_EQ(dflash::anchor_candidates(14, 3, mask.data()), (std::vector<int64_t>{1, 2, 3, 4, 6, 7, 8, 9, 10}));
  // Labels stop at the block's document end.
  const std::vector<int64_t> tokens{10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23};
  dflash::Anchors a{{5, 10}, {1, 1}};
  const dflash::BlockLabels bl = dflash::block_labels(tokens.data(), mask.data(), {8, 14}, a, 3, 7.0);
  EXPECT_EQ(bl.labels, (std::vector<int64_t>{-1, -1, 17, -1, 21, -1}));
}

// The defaults the references use: gamma by block size (DFlash paper: 7 / 5 / 4 for blocks
// of 16 / 10 / 8) and the target layer ids of z-lab dflash's build_target_layer_ids, worked
// out here from its formula (round(1 + i * (L - 4) / (n - 1)), Python rounding; L // 2 for
// one layer).
TEST(DFlashDefaults, GammaAndTargetLayersAsTheReferences) {
  EXPECT_EQ(dflash::default_gamma(16), 7.0);
  EXPECT_EQ(dflash::default_gamma(10), 5.0);
  EXPECT_EQ(dflash::default_gamma(8), 4.0);
  EXPECT_NEAR(dflash::default_gamma(12), 5.0 + 2.0 / 3.0, 1e-12);  // between the paper's values
  EXPECT_EQ(dflash::default_gamma(2), 1.0);                        // at least 1
  EXPECT_EQ(dflash::reference_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));  // Qwen3-8B
  EXPECT_EQ(dflash::reference_layer_ids(36, 1), (std::vector<int64_t>{18}));
  EXPECT_EQ(dflash::reference_layer_ids(28, 3), (std::vector<int64_t>{1, 13, 25}));
  // 1 + i * 28 / 3 = 1, 10.33, 19.67, 29
  EXPECT_EQ(dflash::reference_layer_ids(32, 4), (std::vector<int64_t>{1, 10, 20, 29}));
  // 1 + i * 36 / 5 = 1, 8.2, 15.4, 22.6, 29.8, 37
  EXPECT_EQ(dflash::reference_layer_ids(40, 6), (std::vector<int64_t>{1, 8, 15, 23, 30, 37}));
  // 1 + i * 5 / 2 = 1, 3.5, 6: Python's round(3.5) = 4 (halves to even)
  EXPECT_EQ(dflash::reference_layer_ids(9, 3), (std::vector<int64_t>{1, 4, 6}));
  // 1 + i * 3 / 2 = 1, 2.5, 4: round(2.5) = 2
  EXPECT_EQ(dflash::reference_layer_ids(7, 3), (std::vector<int64_t>{1, 2, 4}));
}

// labels = "auto" (the default): the target's greedy tokens where the target's last layer is
// there (an online target computes it; offline data may export it), else the data's tokens.
TEST(DFlashLabels, AutoIsTheTargetsGreedyTokenWhereItsLastLayerIsThere) {
  for (const bool exported : {true, false}) {
    auto d = make_drafter({{"layers", int64_t{1}},
                           {"hidden", int64_t{32}},
                           {"heads", int64_t{4}},
                           {"kv_heads", int64_t{2}},
                           {"block_size", int64_t{4}},
                           {"anchors", int64_t{2}},
                           {"target_layer_ids", std::vector<int64_t>{0, 1}}});
    auto p = dflash_test::random_problem(40, 32, {0, 1, 2}, 2, 16, at::kFloat, 7);
    if (!exported) p.target.layers = 5;  // the last layer, 4, is not among the exported {0, 1, 2}
    std::vector<std::string> said;
    RunContext ctx;
    ctx.say = [&said](const std::string& line) { said.push_back(line); };
    d->bind(p.target, ctx, 2, 16);
    OracleAttention attn;
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(3);
    d->step(p.batch, attn, rng, true);
    EXPECT_EQ(attn.labels_from_target, exported);
    EXPECT_FALSE(attn.soft_labels);
    ASSERT_EQ(said.size(), 1u);
    EXPECT_NE(said[0].find(exported ? "labels = \"target_argmax\" (auto" : "labels = \"data\" (auto"),
              std::string::npos)
        << said[0];
  }
}

TEST(DFlashAnchors, WithoutReplacementCoversEveryCandidate) {
  // 6 candidates, 3 drawn: every 3-subset is equally likely (20 subsets); each candidate
  // appears with probability 1/2.
  std::mt19937_64 gen(3);
  auto draw = [&](int64_t k) { return int64_t(gen() % uint64_t(k)); };
  std::vector<int64_t> hits(6, 0);
  const int trials = 20000;
  for (int t = 0; t < trials; ++t) {
    const dflash::Anchors a = dflash::draw_anchors({0, 1, 2, 3, 4, 5}, 3, draw);
    for (int64_t x : a.anchors) ++hits[size_t(x)];
  }
  for (int64_t h : hits) EXPECT_NEAR(double(h) / trials, 0.5, 0.02);
}

// --- the drafter ----------------------------------------------------------------------------
std::map<std::string, Value> small_drafter() {
  return {{"layers", int64_t{1}},
          {"hidden", int64_t{16}},
          {"heads", int64_t{4}},
          {"kv_heads", int64_t{2}},
          {"ffn", int64_t{24}},
          {"block_size", int64_t{4}},
          {"anchors", int64_t{3}},
          {"target_layer_ids", std::vector<int64_t>{0, 2}},
          {"gamma", 2.0},
          {"init_std", 0.3},
          {"mask_token", int64_t{19}}};
}

RunContext context(c10::ScalarType dtype, uint64_t seed) {
  RunContext ctx;
  ctx.dtype = dtype;
  ctx.seed = seed;
  return ctx;
}

double loss_at(Drafter& d, const Batch& batch, uint64_t rng_seed) {
  OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(rng_seed);
  at::NoGradGuard no_grad;
  return d.step(batch, attn, rng, true).loss.item<double>();
}

// Central finite differences (h = 1e-6, float64) against autograd for every entry of
// every parameter of a one-layer drafter; same anchors for every evaluation. One thread:
// thousands of tiny forwards, which intra-op threads only slow down on a shared machine.
TEST(DFlashDrafter, GradientCheckFloat64) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto d = make_drafter(small_drafter());
  auto p = dflash_test::random_problem(20, 16, {0, 1, 2}, 2, 14, at::kDouble, 123);
  d->bind(p.target, context(at::kDouble, 5), 2, 14);
  OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(99);
  StepResult r = d->step(p.batch, attn, rng, true);
  r.loss.backward();
  int64_t checked = 0;
  for (auto& [name, w] : d->parameters()) {
    ASSERT_TRUE(w.grad().defined()) << name;
    const at::Tensor g = w.grad().clone();
    at::Tensor flat = w.detach().view({-1});
    const at::Tensor gflat = g.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double x0 = flat[i].item<double>(), h = 1e-6;
      flat[i] = x0 + h;
      const double up = loss_at(*d, p.batch, 99);
      flat[i] = x0 - h;
      const double down = loss_at(*d, p.batch, 99);
      flat[i] = x0;
      const double fd = (up - down) / (2 * h), ag = gflat[i].item<double>();
      ASSERT_NEAR(fd, ag, 1e-7 + 1e-5 * std::abs(ag)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 2000);
  // The loss is a real function of the weights: gradients are not all zero.
  EXPECT_GT(d->parameters()[0].second.grad().abs().max().template item<double>(), 1e-6);
  at::set_num_threads(threads);
}

// A step in parts ([drafter] anchor_parts) is the same step: the parts' losses weighted by
// their loss weights give the one-part loss, their weighted gradients its gradient (as the
// engine's GradientSync adds them: the context's keys and values computed once, their
// gradients gathered over the parts and taken back in the last part's backward), and
// validation in parts gives the same drafts, accuracy and loss. float64, fresh random weights
// and data, 2 layers, anchors 6 in 1, 2 and 3 parts.
TEST(DFlashDrafter, StepInPartsIsTheSameStep) {
  auto cfg = small_drafter();
  cfg["anchors"] = int64_t{6};
  cfg["layers"] = int64_t{2};
  auto one = make_drafter(cfg);
  auto p = dflash_test::random_problem(20, 16, {0, 1, 2}, 2, 14, at::kDouble, 321);
  one->bind(p.target, context(at::kDouble, 5), 2, 14);
  OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(77);
  StepResult r1 = one->step(p.batch, attn, rng, true);
  r1.loss.backward();
  const auto p1 = one->parameters();
  std::unique_ptr<Drafter> two;
  for (int64_t parts : {3, 2}) {  // the validation checks below use the 2-part drafter
    cfg["anchor_parts"] = parts;
    two = make_drafter(cfg);
    two->bind(p.target, context(at::kDouble, 5), 2, 14);
    EXPECT_EQ(two->step_parts(), parts);
    EXPECT_EQ(two->attention_problem().q_len, 6 / parts * 4);
    double weight = 0, loss_sum = 0;
    for (int64_t part = 0; part < parts; ++part) {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(77);
      Batch b = p.batch;
      b.part = part;
      StepResult r = two->step(b, attn, g, true);
      EXPECT_EQ(r.more_roots.size(), part + 1 == parts ? 2u * 2u : 0u) << part;  // K and V of 2 layers, last part
      flashdraft::backward(r, r.loss_weight);
      weight += r.loss_weight;
      loss_sum += r.loss.item<double>() * r.loss_weight;
    }
    EXPECT_EQ(weight, r1.loss_weight);
    EXPECT_NEAR(loss_sum / weight, r1.loss.item<double>(), 1e-12 * r1.loss.item<double>());
    const auto p2 = two->parameters();
    ASSERT_EQ(p1.size(), p2.size());
    for (size_t i = 0; i < p1.size(); ++i) {
      ASSERT_TRUE(p1[i].second.detach().equal(p2[i].second.detach())) << p1[i].first;  // the same initial weights
      ASSERT_TRUE(p2[i].second.grad().defined()) << p1[i].first;
      const at::Tensor g2 = p2[i].second.grad() / weight;
      EXPECT_LE((g2 - p1[i].second.grad()).abs().max().item<double>(),
                1e-10 * p1[i].second.grad().abs().max().item<double>() + 1e-14)
          << parts << " parts: " << p1[i].first;
    }
  }
  EXPECT_GT(p1[0].second.grad().abs().max().item<double>(), 1e-6);
  // Validation in parts: one result for the whole anchor draw.
  at::Generator g1 = at::make_generator<at::CPUGeneratorImpl>(78), g2 = at::make_generator<at::CPUGeneratorImpl>(78);
  const StepResult v1 = one->step(p.batch, attn, g1, false), v2 = two->step(p.batch, attn, g2, false);
  EXPECT_TRUE(v2.drafts.tokens.equal(v1.drafts.tokens));
  EXPECT_TRUE(v2.drafts.labels.equal(v1.drafts.labels));
  EXPECT_TRUE(v2.drafts.rows.equal(v1.drafts.rows));
  EXPECT_TRUE(v2.drafts.starts.equal(v1.drafts.starts));
  EXPECT_NEAR(v2.loss.item<double>(), v1.loss.item<double>(), 1e-6 * v1.loss.item<double>());
  ASSERT_EQ(v2.position_accuracy.size(), v1.position_accuracy.size());
  for (size_t j = 0; j < v1.position_accuracy.size(); ++j)
    EXPECT_NEAR(v2.position_accuracy[j], v1.position_accuracy[j], 1e-12) << j;
  EXPECT_NEAR(v2.scalars[0].second, v1.scalars[0].second, 1e-12);  // tau_sim
  EXPECT_EQ(v2.tokens, v1.tokens);
  // The generator moved on as for one draw.
  EXPECT_TRUE(g1.get_state().equal(g2.get_state()));
}

TEST(DFlashDrafter, FrozenEmbeddingAndLmHeadGetNoGradient) {
  auto d = make_drafter(small_drafter());
  auto p = dflash_test::random_problem(20, 16, {0, 1, 2}, 2, 14, at::kFloat, 7);
  p.target.embedding.requires_grad_(true);
  p.target.lm_head.requires_grad_(true);
  d->bind(p.target, context(at::kFloat, 1), 2, 14);
  for (auto& [name, w] : d->parameters()) {
    EXPECT_EQ(name.find("embed"), std::string::npos) << name;
    EXPECT_EQ(name.find("lm_head"), std::string::npos) << name;
    EXPECT_NE(w.data_ptr(), p.target.embedding.data_ptr()) << name;
    EXPECT_NE(w.data_ptr(), p.target.lm_head.data_ptr()) << name;
  }
  OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(3);
  d->step(p.batch, attn, rng, true).loss.backward();
  EXPECT_FALSE(p.target.embedding.grad().defined());
  EXPECT_FALSE(p.target.lm_head.grad().defined());
  for (auto& [name, w] : d->parameters()) EXPECT_TRUE(w.grad().defined()) << name;
}

TEST(DFlashDrafter, StepPosesTheAnnouncedAttentionProblem) {
  auto d = make_drafter(small_drafter());
  auto p = dflash_test::random_problem(20, 16, {0, 1, 2}, 2, 14, at::kFloat, 8);
  d->bind(p.target, context(at::kFloat, 1), 2, 14);
  const AttentionProblem prob = d->attention_problem();
  EXPECT_EQ(prob.mask, "dflash");
  EXPECT_EQ(prob.q_len, 3 * 4);
  EXPECT_EQ(prob.kv_len, 14 + 3 * 4);
  EXPECT_EQ(d->position_names(), (std::vector<std::string>{"position 1", "position 2", "position 3"}));
  OracleAttention attn;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(3);
  const StepResult r = d->step(p.batch, attn, rng, true);
  EXPECT_EQ(attn.masks_set, 1);
  EXPECT_EQ(attn.calls, std::vector<int64_t>{0});
  EXPECT_EQ(attn.last_q_shape, (std::vector<int64_t>{2, prob.heads_q, prob.q_len, prob.head_dim}));
  EXPECT_EQ(attn.last_k_shape, (std::vector<int64_t>{2, prob.heads_kv, prob.kv_len, prob.head_dim}));
  // Anchors: sorted, whole block inside S, first label position carries loss (>= 2).
  for (const auto& a : attn.input_.blocks.anchors) {
    ASSERT_EQ(a.size(), 3u);
    for (size_t n = 0; n < a.size(); ++n) {
      EXPECT_GE(a[n] + 1, 2);
      EXPECT_LE(a[n] + 4 - 1, 13);
      if (n) {
        EXPECT_LT(a[n - 1], a[n]);
      }
    }
  }
  ASSERT_EQ(r.position_accuracy.size(), 3u);
  EXPECT_EQ(r.tokens, 2 * 3 * 3);
  double tau = 1, run = 1;
  for (double acc : r.position_accuracy) tau += (run *= acc);
  ASSERT_EQ(r.scalars.size(), 1u);
  EXPECT_EQ(r.scalars[0].first, "tau_sim");
  EXPECT_DOUBLE_EQ(r.scalars[0].second, tau);
  // Validation (training = false) also returns the drafts: one per valid block, row by row in
  // block order, starting at its anchor; labels are the tokens at anchor + 1 + j.
  OracleAttention attn_eval;
  const StepResult v = d->step(p.batch, attn_eval, rng, false);
  EXPECT_FALSE(v.loss.requires_grad());
  ASSERT_TRUE(v.drafts.defined());
  int64_t k = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t n = 0; n < 3; ++n) {
      if (!attn_eval.input_.blocks.valid[size_t(b)][size_t(n)]) continue;
      const int64_t anchor = attn_eval.input_.blocks.anchors[size_t(b)][size_t(n)];
      ASSERT_LT(k, v.drafts.rows.size(0));
      EXPECT_EQ(v.drafts.rows[k].item<int64_t>(), b);
      EXPECT_EQ(v.drafts.starts[k].item<int64_t>(), anchor);
      for (int64_t j = 0; j < 3; ++j)
        EXPECT_EQ(v.drafts.labels[k][j].item<int64_t>(), p.batch.tokens[b][anchor + 1 + j].item<int64_t>());
      ++k;
    }
  EXPECT_GT(k, 0);
  ASSERT_EQ(v.drafts.tokens.sizes().vec(), (std::vector<int64_t>{k, 3}));
  ASSERT_EQ(v.drafts.labels.sizes().vec(), (std::vector<int64_t>{k, 3}));
}

// --- bad input --------------------------------------------------------------------------------
void expect_bind_error(std::map<std::string, Value> over, const std::string& needle, int64_t hidden = 16) {
  auto cfg = small_drafter();
  for (auto& [k, v] : over) cfg[k] = v;
  auto p = dflash_test::random_problem(20, hidden, {0, 1, 2}, 2, 14, at::kFloat, 1);
  try {
    auto d = make_drafter(cfg);
    d->bind(p.target, context(at::kFloat, 1), 2, 14);
    FAIL() << "no error for " << needle;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(DFlashDrafter, BadInputIsAConfigErrorNamingTheValue) {
  expect_bind_error({{"mask_token", int64_t{20}}}, "mask_token = 20");
  expect_bind_error({{"block_size", int64_t{15}}}, "block_size = 15");
  expect_bind_error({{"target_layer_ids", std::vector<int64_t>{1, 7}}}, "target layer 7");
  expect_bind_error({{"anchors", int64_t{0}}}, "anchors = 0");
  expect_bind_error({{"hidden", int64_t{18}}}, "hidden size 18", 18);
  expect_bind_error({{"heads", int64_t{4}}, {"kv_heads", int64_t{3}}}, "kv_heads = 3");
  expect_bind_error({{"hidden", int64_t{32}}}, "hidden = 32");
  // RoPE scalings that need the pretraining length, or would divide by zero
  expect_bind_error({{"rope_type", std::string("yarn")}, {"rope_factor", 4.0}},
                    "rope_type = \"yarn\" needs the pretraining length");
  expect_bind_error({{"rope_type", std::string("llama3")},
                     {"rope_original_max_position", int64_t{16}},
                     {"rope_high_freq_factor", 1.0}},
                    "equals rope_low_freq_factor (1)");
}

}  // namespace

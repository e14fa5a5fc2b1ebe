// The attention dispatcher's autograd node owns the mask its forward used.
//
// One step builds two different DFlash masks (different anchors, as two unroll steps or
// two accumulated micro-batches would) and runs both forwards before a single backward.
// Every gradient must be the one of its own forward's mask: checked against a plain
// fp64 softmax-attention reference on the dense masks, for dense_ref and flash_cpu, on
// fresh random inputs. (Pointing the backward at the dispatcher's current mask instead
// makes the first call's gradients those of the second mask, and this test fail.)
#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"

#include "attention_error.hpp"
#include "plugin_loading.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>

namespace fd = flashdraft;

namespace {

constexpr int64_t kBatch = 2, kHeadsQ = 4, kHeadsKv = 2, kDim = 32, kContext = 96, kAnchors = 4, kBlock = 8;
constexpr int64_t kQ = kAnchors * kBlock, kKv = kContext + kAnchors * kBlock;

fd::MaskInput dflash_input(const std::vector<std::vector<int64_t>>& anchors) {
  fd::MaskInput in;
  in.batch = kBatch;
  in.q_len = kQ;
  in.kv_len = kKv;
  in.blocks.context_len = kContext;
  in.blocks.block_size = kBlock;
  in.blocks.anchors = anchors;
  in.blocks.valid.assign(kBatch, std::vector<uint8_t>(kAnchors, 1));
  in.blocks.valid[1][3] = 0;  // a padding block: rows with no visible key
  return in;
}

// softmax(q k^T * scale, masked) v in fp64; rows with no visible key give 0.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                               double scale) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor ke = k.repeat_interleave(group, 1), ve = v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(q, ke.transpose(-2, -1)) * scale;
  s = s.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor any = visible.any(-1, /*keepdim=*/true);
  const at::Tensor p = at::softmax(s.masked_fill(any.logical_not(), 0.0), -1).masked_fill(any.logical_not(), 0.0);
  return at::matmul(p, ve);
}

struct Inputs {
  at::Tensor q, k, v, grad_out;
};

Inputs random_inputs(uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto r = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)); };
  return {r({kBatch, kHeadsQ, kQ, kDim}), r({kBatch, kHeadsKv, kKv, kDim}), r({kBatch, kHeadsKv, kKv, kDim}),
          r({kBatch, kHeadsQ, kQ, kDim})};
}

// A dispatcher over one kernel plugin and the dflash mask generator, as the trainer
// builds it (the plugins it uses stay alive with it).
struct TestDispatcher {
  std::shared_ptr<fd::AttentionKernel> kernel;
  std::shared_ptr<fd::MaskGenerator> generator;
  fd::KernelLedger ledger;
  std::unique_ptr<fd::AttentionDispatcher> dispatcher;

  explicit TestDispatcher(const std::string& kernel_name)
      : kernel(test::load<fd::AttentionKernel>(fd::PluginKind::kernel, kernel_name, "kernels." + kernel_name)),
        generator(test::load<fd::MaskGenerator>(fd::PluginKind::mask, "dflash", "mask")) {
    fd::AttentionProblem problem;
    problem.batch = kBatch;
    problem.heads_q = kHeadsQ;
    problem.heads_kv = kHeadsKv;
    problem.q_len = kQ;
    problem.kv_len = kKv;
    problem.head_dim = kDim;
    problem.mask = "dflash";
    std::vector<fd::KernelCandidate> candidates(1);
    candidates[0].name = kernel_name;
    candidates[0].kernel = kernel.get();
    dispatcher = std::make_unique<fd::AttentionDispatcher>(fd::choose_kernel(problem, candidates, "error"),
                                                           generator.get(), "error", &ledger, nullptr);
  }
};

void check_two_masks_one_backward(const std::string& kernel_name) {
  TestDispatcher t(kernel_name);
  fd::AttentionDispatcher& dispatcher = *t.dispatcher;
  fd::KernelLedger& ledger = t.ledger;
  ledger.begin_step(0, 2);

  const fd::MaskInput first = dflash_input({{8, 30, 51, 77}, {3, 40, 41, 60}});
  const fd::MaskInput second = dflash_input({{20, 22, 70, 88}, {0, 12, 66, 80}});
  const uint64_t seed = test::base_seed() + std::hash<std::string>{}(kernel_name) % 1000;
  Inputs a = random_inputs(seed), b = random_inputs(seed + 1);
  const double scale = 1.0 / std::sqrt(double(kDim));

  // The step: both masks built and both forwards run before the one backward.
  std::vector<at::Tensor> leaves;
  for (Inputs* in : {&a, &b})
    for (at::Tensor* t : {&in->q, &in->k, &in->v}) leaves.push_back(t->clone().requires_grad_(true));
  dispatcher.set_mask(first);
  const at::Tensor visible_first = fd::dense(dispatcher.mask()).expand({kBatch, kHeadsQ, kQ, kKv});
  const at::Tensor out_a = dispatcher.attention(0, leaves[0], leaves[1], leaves[2], scale);
  dispatcher.set_mask(second);
  const at::Tensor visible_second = fd::dense(dispatcher.mask()).expand({kBatch, kHeadsQ, kQ, kKv});
  const at::Tensor out_b = dispatcher.attention(1, leaves[3], leaves[4], leaves[5], scale);
  ASSERT_FALSE(visible_first.equal(visible_second)) << "the two masks must differ for this test to mean anything";
  ((out_a * a.grad_out).sum() + (out_b * b.grad_out).sum()).backward();

  // The reference: each call with its own mask, fp64, autograd.
  const double bound = 1e-5;
  for (int call = 0; call < 2; ++call) {
    const Inputs& in = call == 0 ? a : b;
    const at::Tensor& visible = call == 0 ? visible_first : visible_second;
    std::vector<at::Tensor> ref_leaves;
    for (const at::Tensor* t : {&in.q, &in.k, &in.v}) ref_leaves.push_back(t->to(at::kDouble).requires_grad_(true));
    const at::Tensor ref_out = reference_attention(ref_leaves[0], ref_leaves[1], ref_leaves[2], visible, scale);
    (ref_out * in.grad_out.to(at::kDouble)).sum().backward();
    const at::Tensor& out = call == 0 ? out_a : out_b;
    const char* names[] = {"dq", "dk", "dv"};
    const double out_err = test::relative_error(out.detach(), ref_out.detach());
    EXPECT_LE(out_err, bound) << kernel_name << " call " << call << " out (seed " << seed << ")";
    for (int i = 0; i < 3; ++i) {
      const at::Tensor& grad = leaves[static_cast<size_t>(call * 3 + i)].grad();
      ASSERT_TRUE(grad.defined()) << kernel_name << " call " << call << " " << names[i];
      const double err = test::relative_error(grad, ref_leaves[static_cast<size_t>(i)].grad());
      EXPECT_LE(err, bound) << kernel_name << " call " << call << " " << names[i]
                            << " against its own forward's mask (seed " << seed << ")";
      std::printf("  %-9s call %d (mask %s): rel err %s %.1e (bound %.0e)\n", kernel_name.c_str(), call,
                  call == 0 ? "first " : "second", names[i], err, bound);
    }
  }
  // The ledger saw both layers' forward and backward.
  EXPECT_EQ(ledger.calls(fd::Phase::forward), 2);
  EXPECT_EQ(ledger.calls(fd::Phase::backward), 2);
}

}  // namespace

TEST(Dispatch, EachBackwardUsesItsOwnForwardsMaskDenseRef) { check_two_masks_one_backward("dense_ref"); }
TEST(Dispatch, EachBackwardUsesItsOwnForwardsMaskFlashCpu) { check_two_masks_one_backward("flash_cpu"); }

// A graph freed by its backward cannot be run again: a sentence, not a crash.
TEST(Dispatch, SecondBackwardWithoutRetainGraphIsRefusedWithASentence) {
  TestDispatcher t("dense_ref");
  fd::AttentionDispatcher& dispatcher = *t.dispatcher;
  t.ledger.begin_step(0, 1);
  dispatcher.set_mask(dflash_input({{8, 30, 51, 77}, {3, 40, 41, 60}}));
  Inputs in = random_inputs(test::base_seed() + 7);
  const at::Tensor q = in.q.requires_grad_(true);
  const at::Tensor loss = dispatcher.attention(0, q, in.k, in.v, 0.1).sum();
  loss.backward({}, /*retain_graph=*/false);
  try {
    loss.backward();
    ADD_FAILURE() << "a second backward over a freed graph ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

namespace {

fd::AttentionProblem problem_of(int64_t head_dim) {
  return fd::AttentionProblem::of(c10::kCPU, at::kFloat, kBatch, kHeadsQ, kHeadsKv, kQ, kKv, head_dim,
                                  /*needs_backward=*/true, "dflash");
}

}  // namespace

// Calls of two head widths (Gemma 4's sliding and full layers): flash_cpu runs heads up to 256 wide, so under
// on_fallback = "warn" the calls of 32 stay on it and those of 320 run on dense_ref; each call's forward and backward
// run its own kernel, at its kernel's mask block size (64 and 128), and equal a float64 reference. Under "error"
// the choice stops with a sentence that names the refused calls.
TEST(Dispatch, EachHeadShapeRunsOnTheKernelChosenForIt) {
  auto flash = test::load<fd::AttentionKernel>(fd::PluginKind::kernel, "flash_cpu", "kernels.flash_cpu");
  auto dense = test::load<fd::AttentionKernel>(fd::PluginKind::kernel, "dense_ref", "kernels.dense_ref");
  auto generator = test::load<fd::MaskGenerator>(fd::PluginKind::mask, "dflash", "mask");
  const std::vector<fd::KernelCandidate> candidates{{"flash_cpu", flash.get(), {}}, {"dense_ref", dense.get(), {}}};
  const int64_t wide = 320;
  const std::vector<fd::AttentionProblem> problems{problem_of(kDim), problem_of(kDim), problem_of(wide),
                                                   problem_of(kDim), problem_of(wide)};
  try {
    fd::choose_kernel(problems, candidates, "error");
    ADD_FAILURE() << "flash_cpu refuses heads of 320, and the policy is \"error\"";
  } catch (const fd::FallbackError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("flash_cpu: selected for calls 0-1,3; refused for the others: flash_cpu: head_dim 320"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("run the calls it refuses on 'dense_ref'"), std::string::npos) << what;
  }
  const fd::KernelChoice choice = fd::choose_kernel(problems, candidates, "warn");
  std::printf("%s", choice.report().c_str());
  EXPECT_TRUE(choice.mixed());
  EXPECT_TRUE(choice.fallback);
  EXPECT_EQ(choice.call_kernels(),
            (std::vector<std::string>{"flash_cpu", "flash_cpu", "dense_ref", "flash_cpu", "dense_ref"}));
  EXPECT_NE(choice.report().find("dense_ref: selected (FALLBACK: not the first preference) for calls 2,4"),
            std::string::npos)
      << choice.report();
  EXPECT_NE(choice.fallback_note().find("running calls 0-1,3 on 'flash_cpu', calls 2,4 on 'dense_ref'"),
            std::string::npos)
      << choice.fallback_note();
  // Every problem on the first preference: one kernel, the report as before routes.
  const fd::KernelChoice narrow = fd::choose_kernel({problem_of(kDim), problem_of(64)}, candidates, "error");
  EXPECT_FALSE(narrow.mixed());
  EXPECT_EQ(narrow.call_kernels(), (std::vector<std::string>{"flash_cpu", "flash_cpu"}));

  fd::KernelLedger ledger;
  ledger.begin_step(0, 2);
  fd::AttentionDispatcher dispatcher(choice, generator.get(), "warn", &ledger, nullptr);
  const fd::MaskInput input = dflash_input({{8, 30, 51, 77}, {3, 40, 41, 60}});
  dispatcher.set_mask(input);
  const at::Tensor visible = fd::dense(dispatcher.mask()).expand({kBatch, kHeadsQ, kQ, kKv});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(test::base_seed() + 11);
  const double bound = 1e-5;
  for (const int64_t dim : {kDim, wide}) {
    const int64_t call = dim == kDim ? 0 : 1;
    auto r = [&](int64_t heads, int64_t rows) { return at::randn({kBatch, heads, rows, dim}, gen, at::kFloat); };
    const at::Tensor q = r(kHeadsQ, kQ), k = r(kHeadsKv, kKv), v = r(kHeadsKv, kKv), g = r(kHeadsQ, kQ);
    std::vector<at::Tensor> leaves{q.clone().requires_grad_(true), k.clone().requires_grad_(true),
                                   v.clone().requires_grad_(true)};
    const double scale = 1.0 / std::sqrt(double(dim));
    (dispatcher.attention(call, leaves[0], leaves[1], leaves[2], scale) * g).sum().backward();
    std::vector<at::Tensor> ref{q.to(at::kDouble).requires_grad_(true), k.to(at::kDouble).requires_grad_(true),
                                v.to(at::kDouble).requires_grad_(true)};
    const at::Tensor ref_out = reference_attention(ref[0], ref[1], ref[2], visible, scale);
    (ref_out * g.to(at::kDouble)).sum().backward();
    const std::string want = dim == kDim ? "flash_cpu" : "dense_ref";
    for (const fd::Phase phase : {fd::Phase::forward, fd::Phase::backward}) {
      const std::string& ran = ledger.names()[static_cast<size_t>(ledger.ids(phase)[static_cast<size_t>(call)])];
      EXPECT_TRUE(fd::variant_belongs_to(ran, want)) << "heads of " << dim << " ran " << ran;
    }
    for (size_t i = 0; i < 3; ++i) {
      const double err = test::relative_error(leaves[i].grad(), ref[i].grad());
      EXPECT_LE(err, bound) << "heads of " << dim << " gradient " << i;
      std::printf("  heads of %ld on %s: gradient %zu rel err %.1e (bound %.0e)\n", static_cast<long>(dim),
                  want.c_str(), i, err, bound);
    }
  }
}

// The LM-head loss variants: chunked against the reference (loss, gradient with respect
// to the hidden rows, argmax) on fresh random inputs, CPU and (where there is one) CUDA;
// input checks; and the dispatcher's ledger entries and fallback policy for the op.
#include "dispatch/cuda_ops.hpp"
#include "dispatch/dispatch.hpp"
#include "dispatch/lm_head_loss.hpp"

#include <torch/cuda.h>
#include <torch/types.h>

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

using namespace flashdraft;

namespace {

struct Problem {
  at::Tensor hidden, weight, labels, row_weights;
  double weight_sum = 0;
};

// Random rows, LM head, labels and weights exp(-(j-1)/7) of random positions j.
Problem random_problem(int64_t rows, int64_t hidden, int64_t vocab, at::ScalarType dtype, c10::Device device,
                       uint64_t seed) {
  at::manual_seed(seed);
  const auto f = at::TensorOptions().dtype(at::kFloat);
  Problem p;
  p.hidden = at::randn({rows, hidden}, f).to(device, dtype);
  p.weight = (at::randn({vocab, hidden}, f) * (2.0 / std::sqrt(double(hidden)))).to(device, dtype);
  p.labels = at::randint(vocab, {rows}, at::TensorOptions().dtype(at::kLong)).to(device);
  const at::Tensor j = at::randint(1, 16, {rows}, f);
  p.row_weights = at::exp(-(j - 1) / 7.0).to(device);
  p.weight_sum = p.row_weights.sum().item<double>();
  return p;
}

LmHeadLossInput input_of(const Problem& p, const at::Tensor& hidden) {
  LmHeadLossInput in;
  in.hidden = hidden;
  in.weight = p.weight;
  in.labels = p.labels;
  in.row_weights = p.row_weights;
  in.weight_sum = p.weight_sum;
  return in;
}

struct Result {
  double loss;
  at::Tensor grad, argmax;
};

template <class F>
Result run(const Problem& p, F&& variant) {
  at::Tensor h = p.hidden.detach().clone().set_requires_grad(true);
  LmHeadLossOutput out = variant(input_of(p, h));
  out.loss.backward();
  return {out.loss.item<double>(), h.grad().to(at::kCPU, at::kFloat), out.argmax.to(at::kCPU)};
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

void compare(const Problem& p, int64_t chunk, double loss_tol, double grad_tol, double argmax_agree,
             bool fused = false) {
  const Result ref = run(p, [](const LmHeadLossInput& in) { return lm_head_loss_reference(in); });
  const Result chk = run(p, [chunk, fused](const LmHeadLossInput& in) {
    return fused ? lm_head_loss_fused(in, chunk) : lm_head_loss_chunked(in, chunk);
  });
  EXPECT_NEAR(chk.loss, ref.loss, loss_tol * std::abs(ref.loss)) << "chunk " << chunk;
  EXPECT_LE(max_rel(chk.grad, ref.grad), grad_tol) << "chunk " << chunk;
  const double agree = chk.argmax.eq(ref.argmax).to(at::kDouble).mean().item<double>();
  EXPECT_GE(agree, argmax_agree) << "chunk " << chunk;
  // Not a vacuous comparison: the gradient is not zero and the loss is a real CE.
  EXPECT_GT(ref.grad.abs().max().item<double>(), 0.0);
  EXPECT_GT(ref.loss, 1.0);
}

}  // namespace

// Labels from a target (DFlash labels = "target_argmax" / "target_kl"): every variant against
// the definition written here in float64 on fresh random inputs: target logits = th W^T;
// hard: CE against their argmax; soft: KL(softmax(target / T) || softmax(h W^T)); the
// weighted mean over weight_sum; the gradient with respect to h by autograd. With Scales,
// each side's logits are scaled and capped first (x s, then cap tanh(. / cap)); th undefined:
// the data's labels.
namespace {

struct TargetResult {
  double loss;
  at::Tensor grad, argmax, target_argmax;
};

struct Scales {
  double scale = 1.0, cap = 0.0, target_scale = 1.0, target_cap = 0.0;
};

at::Tensor scaled_and_capped(const at::Tensor& x, double scale, double cap) {
  return cap > 0 ? at::tanh(x * scale / cap) * cap : x * scale;
}

TargetResult target_definition(const Problem& p, const at::Tensor& th, bool soft, double temperature,
                               const Scales& s = {}) {
  at::Tensor h = p.hidden.detach().to(at::kCPU, at::kDouble).set_requires_grad(true);
  const at::Tensor W = p.weight.to(at::kCPU, at::kDouble);
  const at::Tensor t = th.defined()
                           ? scaled_and_capped(th.to(at::kCPU, at::kDouble).mm(W.t()), s.target_scale, s.target_cap)
                           : at::Tensor();
  const at::Tensor logq = at::log_softmax(scaled_and_capped(h.mm(W.t()), s.scale, s.cap), -1);
  at::Tensor per_row;
  if (!th.defined()) {
    per_row = -logq.gather(1, p.labels.to(at::kCPU).unsqueeze(1)).squeeze(1);
  } else if (soft) {
    const at::Tensor logp = at::log_softmax(t / temperature, -1);
    per_row = (logp.exp() * (logp - logq)).sum(-1);
  } else {
    per_row = -logq.gather(1, t.argmax(-1).unsqueeze(1)).squeeze(1);
  }
  const at::Tensor loss = (per_row * p.row_weights.to(at::kCPU, at::kDouble)).sum() / p.weight_sum;
  loss.backward();
  return {loss.item<double>(), h.grad().to(at::kFloat), logq.argmax(-1), th.defined() ? t.argmax(-1) : at::Tensor()};
}

template <class F>
TargetResult run_target(const Problem& p, const at::Tensor& th, bool soft, double temperature, F&& variant,
                        const Scales& s = {}) {
  at::Tensor h = p.hidden.detach().clone().set_requires_grad(true);
  LmHeadLossInput in = input_of(p, h);
  if (th.defined()) in.labels = at::Tensor();  // the target gives them
  in.target_hidden = th;
  in.target_soft = soft;
  in.target_temperature = temperature;
  in.logit_scale = s.scale;
  in.logit_softcap = s.cap;
  in.target_logit_scale = s.target_scale;
  in.target_logit_softcap = s.target_cap;
  LmHeadLossOutput out = variant(in);
  out.loss.backward();
  return {out.loss.item<double>(), h.grad().to(at::kCPU, at::kFloat), out.argmax.to(at::kCPU),
          out.target_argmax.defined() ? out.target_argmax.to(at::kCPU) : at::Tensor()};
}

// exact: float32 inputs (the target's argmax must be the definition's); bf16 logits may flip
// near-ties.
void compare_target(const Problem& p, const at::Tensor& th, double loss_tol, double grad_tol, bool fused,
                    bool exact = true) {
  for (const bool soft : {false, true})
    for (const double temperature : {1.0, 0.7}) {
      if (!soft && temperature != 1.0) continue;
      const TargetResult def = target_definition(p, th, soft, temperature);
      const auto chunked = [fused](const LmHeadLossInput& in) {
        return fused ? lm_head_loss_fused(in, 40) : lm_head_loss_chunked(in, 40);
      };
      const auto reference = [](const LmHeadLossInput& in) { return lm_head_loss_reference(in); };
      for (const TargetResult& got :
           {run_target(p, th, soft, temperature, chunked), run_target(p, th, soft, temperature, reference)}) {
        const std::string what = std::string(soft ? "soft" : "hard") + ", temperature " + std::to_string(temperature);
        EXPECT_NEAR(got.loss, def.loss, loss_tol * std::abs(def.loss)) << what;
        const at::Tensor agree = got.target_argmax.eq(def.target_argmax);
        // 16-bit target logits may round a near-tie to another argmax: a hard label then
        // differs on that row by design, so hard gradients compare on the rows that agree.
        const at::Tensor rows = soft || exact ? at::ones_like(agree) : agree;
        EXPECT_LE(max_rel(got.grad.index({rows}), def.grad.index({rows})), grad_tol) << what;
        const double same = agree.to(at::kDouble).mean().item<double>();
        EXPECT_GE(same, exact ? 1.0 : 0.97) << what;
        EXPECT_GE(got.argmax.eq(def.argmax).to(at::kDouble).mean().item<double>(), exact ? 0.99 : 0.97) << what;
      }
      // Not vacuous: a real loss and gradient; the target's labels are not the data's.
      EXPECT_GT(def.loss, 0.1);
      EXPECT_GT(def.grad.abs().max().item<double>(), 0.0);
      EXPECT_LT(def.target_argmax.eq(p.labels.to(at::kCPU)).to(at::kDouble).mean().item<double>(), 0.5);
    }
}

}  // namespace

TEST(LmHeadLoss, TargetLabelsMatchTheDefinitionCpu) {
  const Problem p = random_problem(97, 48, 301, at::kFloat, c10::kCPU, 31);
  const at::Tensor th = at::randn({97, 48}, at::TensorOptions().dtype(at::kFloat));
  compare_target(p, th, 1e-5, 1e-5, /*fused=*/false);
}

// Rows that share a target position (DFlash's overlapping blocks) pass its state once, with an
// index: the same loss and gradient as the states repeated per row.
TEST(LmHeadLoss, TargetIndexEqualsRepeatedStates) {
  const Problem p = random_problem(60, 32, 211, at::kFloat, c10::kCPU, 34);
  const at::Tensor unique = at::randn({17, 32}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor index = at::randint(17, {60}, at::TensorOptions().dtype(at::kLong));
  for (const bool soft : {false, true}) {
    const auto chunked = [](const LmHeadLossInput& in) { return lm_head_loss_chunked(in, 16); };
    const TargetResult repeated = run_target(p, unique.index_select(0, index), soft, 0.8, chunked);
    at::Tensor h = p.hidden.detach().clone().set_requires_grad(true);
    LmHeadLossInput in = input_of(p, h);
    in.labels = at::Tensor();
    in.target_hidden = unique;
    in.target_index = index;
    in.target_soft = soft;
    in.target_temperature = 0.8;
    LmHeadLossOutput out = lm_head_loss_chunked(in, 16);
    out.loss.backward();
    EXPECT_NEAR(out.loss.item<double>(), repeated.loss, 1e-6 * std::abs(repeated.loss)) << soft;
    EXPECT_LE(max_rel(h.grad(), repeated.grad), 1e-6) << soft;
    EXPECT_TRUE(out.target_argmax.equal(repeated.target_argmax)) << soft;
  }
}

TEST(LmHeadLoss, TargetLabelsMatchTheDefinitionCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!cuda_ops::cuda_ops_built()) GTEST_SKIP() << "this engine was built without its CUDA kernels";
  const c10::Device cuda(c10::kCUDA, 0);
  const Problem p = random_problem(300, 128, 32001, at::kFloat, cuda, 32);
  const at::Tensor th = at::randn({300, 128}, at::TensorOptions().dtype(at::kFloat)).to(cuda);
  compare_target(p, th, 1e-5, 1e-4, /*fused=*/true);
  // bf16 logits (the fused kernel reads both rows in the compute dtype): looser, as the CE tests.
  const Problem b = random_problem(300, 128, 32000, at::kBFloat16, cuda, 33);
  compare_target(b, at::randn({300, 128}, at::TensorOptions().dtype(at::kFloat)).to(cuda, at::kBFloat16), 3e-3, 3e-2,
                 true, /*exact=*/false);
}

// Logits as served (a DFlash drafter's output_multiplier and final_logit_softcapping; the
// target's own scale and cap): data, hard and soft target labels, every variant against the
// float64 definition; and not vacuous: each of the four numbers moves the loss.
namespace {

void compare_scaled(const Problem& p, const at::Tensor& th, bool fused, double loss_tol, double grad_tol) {
  const Scales s{0.7, 3.0, 1.3, 4.0};
  const auto variants = {std::function<LmHeadLossOutput(const LmHeadLossInput&)>([fused](const LmHeadLossInput& in) {
                           return fused ? lm_head_loss_fused(in, 40) : lm_head_loss_chunked(in, 40);
                         }),
                         std::function<LmHeadLossOutput(const LmHeadLossInput&)>(
                             [](const LmHeadLossInput& in) { return lm_head_loss_reference(in); })};
  for (const int mode : {0, 1, 2}) {  // data labels, target_argmax, target_kl at 0.8
    const at::Tensor t = mode == 0 ? at::Tensor() : th;
    const bool soft = mode == 2;
    const TargetResult def = target_definition(p, t, soft, 0.8, s);
    for (const auto& variant : variants) {
      const TargetResult got = run_target(p, t, soft, 0.8, variant, s);
      EXPECT_NEAR(got.loss, def.loss, loss_tol * std::abs(def.loss)) << "mode " << mode;
      EXPECT_LE(max_rel(got.grad, def.grad), grad_tol) << "mode " << mode;
      EXPECT_GE(got.argmax.eq(def.argmax).to(at::kDouble).mean().item<double>(), 0.99) << "mode " << mode;
      if (mode > 0) {
        EXPECT_TRUE(got.target_argmax.equal(def.target_argmax)) << "mode " << mode;
      }
    }
    // Each number matters where it can: the drafter's scale and cap always, the target's in the soft labels.
    for (const Scales& other : {Scales{1.0, 3.0, 1.3, 4.0}, Scales{0.7, 0.0, 1.3, 4.0}, Scales{0.7, 3.0, 1.0, 4.0},
                                Scales{0.7, 3.0, 1.3, 0.0}}) {
      const bool target_side = other.target_scale != s.target_scale || other.target_cap != s.target_cap;
      if (target_side && !soft) continue;
      const double moved = std::abs(target_definition(p, t, soft, 0.8, other).loss - def.loss) / std::abs(def.loss);
      EXPECT_GT(moved, 1e-2) << "mode " << mode << ": scale " << other.scale << ", cap " << other.cap << ", target's "
                             << other.target_scale << ", " << other.target_cap;
    }
  }
}

}  // namespace

TEST(LmHeadLoss, ScaledAndCappedLogitsMatchTheDefinitionCpu) {
  const Problem p = random_problem(97, 48, 301, at::kFloat, c10::kCPU, 35);
  // (rows of 3x the usual spread: logits past the cap of 3, where tanh bends)
  const Problem wide{p.hidden * 3, p.weight, p.labels, p.row_weights, p.weight_sum};
  compare_scaled(wide, at::randn({97, 48}, at::TensorOptions().dtype(at::kFloat)) * 3, false, 1e-5, 1e-5);
}

TEST(LmHeadLoss, ScaledAndCappedLogitsMatchTheDefinitionCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!cuda_ops::cuda_ops_built()) GTEST_SKIP() << "this engine was built without its CUDA kernels";
  const c10::Device cuda(c10::kCUDA, 0);
  const Problem p = random_problem(300, 128, 32001, at::kFloat, cuda, 36);
  const Problem wide{p.hidden * 3, p.weight, p.labels, p.row_weights, p.weight_sum};
  // (the target's rows not widened: over 32001 tokens its largest logits, x 1.3 / 4, would reach tanh's float32
  // saturation, where the cap ties them and the float64 definition's argmax is another token)
  compare_scaled(wide, at::randn({300, 128}, at::TensorOptions().dtype(at::kFloat)).to(cuda), true, 1e-5, 1e-4);
}

TEST(LmHeadLoss, ChunkedMatchesReferenceFloat32Cpu) {
  // Uneven chunks (37 rows in 16s), one chunk, and a chunk per row.
  const Problem p = random_problem(37, 48, 301, at::kFloat, c10::kCPU, 11);
  for (int64_t chunk : {16, 37, 64, 1}) compare(p, chunk, 1e-6, 1e-5, 1.0);
}

TEST(LmHeadLoss, ChunkedMatchesReferenceBFloat16Cpu) {
  // Both round the logits to bf16 (8-bit mantissa: half an ulp is 2^-9 relative) after a
  // GEMM whose blocking depends on the number of rows, so a logit can differ by one bf16
  // ulp between a chunk and the whole; the float32 softmax is the same. That bounds the
  // loss difference near 1e-3 relative (float32 inputs above agree to 1e-6).
  const Problem p = random_problem(64, 64, 512, at::kBFloat16, c10::kCPU, 12);
  compare(p, 24, 2e-3, 2e-2, 0.98);
}

TEST(LmHeadLoss, ChunkedMatchesReferenceCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const Problem f = random_problem(1000, 256, 32000, at::kFloat, c10::Device(c10::kCUDA, 0), 13);
  compare(f, 128, 1e-5, 1e-4, 1.0);
  const Problem b = random_problem(1000, 256, 32000, at::kBFloat16, c10::Device(c10::kCUDA, 0), 14);
  compare(b, 96, 2e-3, 3e-2, 0.98);  // bf16 logits: see the CPU bfloat16 test
}

TEST(LmHeadLoss, FusedMatchesReferenceCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!cuda_ops::cuda_ops_built()) GTEST_SKIP() << "this engine was built without its CUDA kernels";
  // Uneven chunks (1000 rows in 128s and 96s), a ragged vocabulary (32001: the kernel's
  // scalar tail) and one chunk for everything (0 = auto).
  const c10::Device cuda(c10::kCUDA, 0);
  const Problem f = random_problem(1000, 256, 32001, at::kFloat, cuda, 23);
  compare(f, 128, 1e-5, 1e-4, 1.0, /*fused=*/true);
  const Problem b = random_problem(1000, 256, 32000, at::kBFloat16, cuda, 24);
  compare(b, 96, 2e-3, 3e-2, 0.98, true);  // bf16 logits: see the CPU bfloat16 test
  compare(b, 0, 2e-3, 3e-2, 0.98, true);
  const Problem h = random_problem(300, 128, 50000, at::kHalf, cuda, 25);
  compare(h, 64, 1e-3, 1e-2, 0.99, true);
}

TEST(LmHeadLoss, FusedAgreesWithChunkedOnTheSameLogits) {
  // Same logits (one GEMM of the same chunk): the two variants differ by the float32
  // softmax's summation order only, so the argmax is identical and the loss agrees closely.
  if (!torch::cuda::is_available() || !cuda_ops::cuda_ops_built())
    GTEST_SKIP() << "needs CUDA and the engine's kernels";
  const Problem b = random_problem(777, 192, 151936, at::kBFloat16, c10::Device(c10::kCUDA, 0), 26);
  const Result chunked = run(b, [](const LmHeadLossInput& in) { return lm_head_loss_chunked(in, 256); });
  const Result fused = run(b, [](const LmHeadLossInput& in) { return lm_head_loss_fused(in, 256); });
  EXPECT_NEAR(fused.loss, chunked.loss, 1e-5 * chunked.loss);
  EXPECT_TRUE(fused.argmax.equal(chunked.argmax));
  // Both round the same float32 gradient of the logits to bf16 before the gradient GEMM;
  // they differ where the two float32 softmaxes (other summation orders, exp vs exp2) fall
  // on opposite sides of a bf16 rounding boundary: a small share of values, one ulp each.
  const double rel = ((fused.grad - chunked.grad).norm() / chunked.grad.norm()).item<double>();
  EXPECT_LE(rel, 2e-3) << "||fused - chunked|| / ||chunked|| of the gradient wrt hidden = " << rel;
}

TEST(LmHeadLoss, FusedIsRefusedWhereItCannotRun) {
  const Problem p = random_problem(8, 16, 50, at::kFloat, c10::kCPU, 27);
  try {
    lm_head_loss_fused(input_of(p, p.hidden), 4);
    FAIL() << "the fused variant ran on the CPU";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on cpu"), std::string::npos) << e.what();
  }
  try {
    LmHeadLoss("fused", 0, {}, {c10::kCPU, at::kFloat, 50});
    FAIL() << "[loss] kernels = [\"fused\"] was accepted for a CPU run";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("accepted here: auto, chunked, reference"), std::string::npos) << e.what();
  }
  EXPECT_EQ(LmHeadLoss("auto", 0, {}, {c10::kCPU, at::kFloat, 50}).variant(), kLossChunked);
  if (torch::cuda::is_available() && cuda_ops::cuda_ops_built()) {
    const LmHeadLoss on_gpu("auto", 0, {}, {c10::Device(c10::kCUDA, 0), at::kBFloat16, 151936});
    EXPECT_EQ(on_gpu.variant(), kLossFused);
    EXPECT_NE(on_gpu.describe().find("auto: fused (CUDA); 1760 rows per chunk"), std::string::npos)
        << on_gpu.describe();
  }
}

TEST(LmHeadLoss, AutoChunkKeepsFloat32LogitsNearHalfAGiB) {
  const int64_t rows = auto_chunk_rows(151936);
  EXPECT_EQ(rows % 16, 0);
  EXPECT_LE(rows * 151936 * 4, int64_t(1) << 29);
  EXPECT_GT(rows * 151936 * 4, (int64_t(1) << 29) - 16 * 151936 * 4);
  EXPECT_EQ(auto_chunk_rows(1 << 30), 16);  // at least 16 rows
}

TEST(LmHeadLoss, ChunkedWithoutGradientHasNoGraph) {
  const Problem p = random_problem(20, 16, 50, at::kFloat, c10::kCPU, 15);
  const LmHeadLossOutput out = lm_head_loss_chunked(input_of(p, p.hidden), 8);
  EXPECT_FALSE(out.loss.requires_grad());
  const LmHeadLossOutput ref = lm_head_loss_reference(input_of(p, p.hidden));
  EXPECT_NEAR(out.loss.item<double>(), ref.loss.item<double>(), 1e-6 * ref.loss.item<double>());
  EXPECT_TRUE(out.argmax.equal(ref.argmax));
}

TEST(LmHeadLoss, BadInputsAreRefusedWithASentence) {
  const Problem p = random_problem(8, 16, 50, at::kFloat, c10::kCPU, 16);
  auto message = [&](LmHeadLossInput in) {
    try {
      lm_head_loss_chunked(in, 4);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  LmHeadLossInput in = input_of(p, p.hidden);
  in.weight = at::randn({50, 17});
  EXPECT_NE(message(in).find("the LM head must be [V, 16], got [50, 17]"), std::string::npos) << message(in);
  in = input_of(p, p.hidden);
  in.labels = p.labels.narrow(0, 0, 5);
  EXPECT_NE(message(in).find("labels must be int64 [8], got [5]"), std::string::npos) << message(in);
  in = input_of(p, p.hidden);
  in.weight_sum = 0;
  EXPECT_NE(message(in).find("weight_sum must be positive"), std::string::npos) << message(in);
  in = input_of(p, p.hidden);
  in.weight = p.weight.to(at::kBFloat16);
  EXPECT_NE(message(in).find("hidden is Float but the LM head is BFloat16"), std::string::npos) << message(in);
}

TEST(LmHeadLoss, SecondBackwardSaysWhy) {
  const Problem p = random_problem(8, 16, 50, at::kFloat, c10::kCPU, 17);
  at::Tensor h = p.hidden.clone().set_requires_grad(true);
  LmHeadLossOutput out = lm_head_loss_chunked(input_of(p, h), 4);
  out.loss.backward({}, /*retain_graph=*/false);
  try {
    out.loss.backward();
    FAIL() << "a second backward ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("backward"), std::string::npos) << e.what();
  }
}

TEST(LmHeadLoss, LedgerRecordsEachVariantForwardAndBackward) {
  for (const std::string variant : {"chunked", "reference"}) {
    std::vector<std::string> recorded;
    LmHeadLoss op(variant, 4,
                  [&](bool backward, const std::string& v) { recorded.push_back((backward ? "bwd " : "fwd ") + v); });
    const Problem p = random_problem(10, 16, 40, at::kFloat, c10::kCPU, 18);
    at::Tensor h0 = p.hidden.clone().set_requires_grad(true);
    at::Tensor h = h0 * 1.0;  // a non-leaf, as in a drafter
    LmHeadLossOutput out = op(input_of(p, h));
    ASSERT_EQ(recorded.size(), 1u);
    EXPECT_EQ(recorded[0], "fwd lm_head_ce/" + variant);
    out.loss.backward();
    ASSERT_EQ(recorded.size(), 2u) << variant;
    EXPECT_EQ(recorded[1], "bwd lm_head_ce/" + variant);
  }
  EXPECT_THROW(LmHeadLoss("fastest", 0, {}), std::invalid_argument);
}

TEST(LmHeadLoss, NoRowsGiveAZeroLossStillInTheGraph) {
  // A batch with no labelled row (a data-parallel rank whose batch has no valid anchor)
  // still runs the op: loss 0, a zero gradient, the same variant recorded.
  const Problem p = random_problem(6, 16, 40, at::kFloat, c10::kCPU, 19);
  for (const std::string variant : {"chunked", "reference"}) {
    std::vector<std::string> recorded;
    LmHeadLoss op(variant, 4, [&](bool backward, const std::string& v) { recorded.push_back(v); });
    at::Tensor h0 = p.hidden.clone().set_requires_grad(true);
    const at::Tensor none = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    LmHeadLossInput in;
    in.hidden = h0.index_select(0, none);
    in.weight = p.weight;
    in.labels = none;
    in.row_weights = at::empty({0});
    in.weight_sum = 0.0;
    LmHeadLossOutput out = op(in);
    EXPECT_EQ(out.loss.item<double>(), 0.0) << variant;
    EXPECT_EQ(out.argmax.numel(), 0);
    out.loss.backward();
    ASSERT_TRUE(h0.grad().defined()) << variant;
    EXPECT_EQ(h0.grad().abs().max().item<double>(), 0.0) << variant;
    EXPECT_EQ(recorded, (std::vector<std::string>{"lm_head_ce/" + variant, "lm_head_ce/" + variant}));
  }
}

// top_k: each row's top-k logits and tokens from the op's own logits, against at::topk of the
// plain logits (float64 product of the same inputs), for every variant the machine runs, with
// chunks that split the rows unevenly; the loss and gradient unchanged by asking.
namespace {

void check_top_k(c10::Device device, at::ScalarType dtype, double tol) {
  const Problem p = random_problem(83, 48, 301, dtype, device, 21);
  const int64_t k = 7;
  const at::Tensor plain = at::mm(p.hidden.to(at::kDouble), p.weight.to(at::kDouble).t());
  const auto [want_values, want_indices] = at::topk(plain, k, -1, true, true);
  std::vector<std::pair<std::string, std::function<LmHeadLossOutput(const LmHeadLossInput&)>>> variants = {
      {"reference", [](const LmHeadLossInput& in) { return lm_head_loss_reference(in); }},
      {"chunked", [](const LmHeadLossInput& in) { return lm_head_loss_chunked(in, 32); }}};
  if (device.is_cuda())
    variants.push_back({"fused", [](const LmHeadLossInput& in) { return lm_head_loss_fused(in, 32); }});
  for (const auto& [name, variant] : variants) {
    at::Tensor h = p.hidden.detach().clone().set_requires_grad(true);
    LmHeadLossInput in = input_of(p, h);
    const LmHeadLossOutput plain_out = variant(in);
    in.top_k = k;
    LmHeadLossOutput out = variant(in);
    ASSERT_TRUE(out.top_values.defined() && out.top_indices.defined()) << name;
    ASSERT_EQ(out.top_values.sizes(), (std::vector<int64_t>{83, k})) << name;
    EXPECT_FALSE(out.top_values.requires_grad()) << name;
    // Values: the logits at the tokens it names, and those tokens' plain logits in order.
    const at::Tensor at_tokens = plain.gather(1, out.top_indices.to(plain.device()));
    EXPECT_LE(max_rel(out.top_values.to(at::kDouble), at_tokens), tol) << name;
    EXPECT_LE(max_rel(at_tokens, want_values), tol) << name;  // the same top k, up to the dtype's ties
    const double same = out.top_indices.eq(want_indices).to(at::kDouble).mean().item<double>();
    EXPECT_GE(same, dtype == at::kFloat ? 1.0 : 0.9) << name;
    if (dtype == at::kFloat) {
      EXPECT_TRUE(out.top_indices.select(1, 0).equal(out.argmax)) << name;
    }
    EXPECT_EQ(out.loss.item<double>(), plain_out.loss.item<double>()) << name;
  }
}

}  // namespace

TEST(LmHeadLoss, TopKFromTheOpsOwnLogitsCpu) { check_top_k(c10::kCPU, at::kFloat, 1e-5); }

TEST(LmHeadLoss, TopKFromTheOpsOwnLogitsCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  check_top_k(c10::Device(c10::kCUDA, 0), at::kFloat, 1e-5);
  check_top_k(c10::Device(c10::kCUDA, 0), at::kBFloat16, 2e-2);
}

// Given distributions (soft_labels, EAGLE-3's loss) and a trained LM head: every variant
// against the definition written here in float64 on fresh random inputs:
// loss = sum_r w_r (-sum_v p_r,v log softmax(h_r W^T)_v) / weight_sum, the gradients with
// respect to h and W by autograd, target_argmax = argmax p. Rows share distributions through
// target_index (repeated and skipped ones), and the hard-label and target-logit losses are
// checked for W's gradient too.
namespace {

struct HeadResult {
  double loss;
  at::Tensor grad_h, grad_w, argmax, target_argmax;
};

enum class Labels { hard, target_kl, probs };

struct HeadProblem {
  Problem p;
  at::Tensor probs, index, target_hidden;
};

HeadProblem head_problem(int64_t rows, int64_t hidden, int64_t vocab, at::ScalarType dtype, c10::Device device,
                         uint64_t seed) {
  HeadProblem hp{random_problem(rows, hidden, vocab, dtype, device, seed), {}, {}, {}};
  const int64_t U = rows / 2 + 3;
  // Peaked, uneven distributions (a target's over a draft vocabulary), float32.
  hp.probs = at::softmax(at::randn({U, vocab}) * 3.0, -1).to(device);
  hp.index = at::randint(U, {rows}, at::TensorOptions().dtype(at::kLong)).to(device);
  hp.target_hidden = at::randn({U, hidden}).to(device, dtype);
  return hp;
}

LmHeadLossInput head_input(const HeadProblem& hp, Labels labels, const at::Tensor& h, const at::Tensor& w) {
  LmHeadLossInput in = input_of(hp.p, h);
  in.weight = w;
  if (labels == Labels::hard) return in;
  in.labels = at::Tensor();
  in.target_index = hp.index;
  if (labels == Labels::probs)
    in.soft_labels = hp.probs;
  else {
    in.target_hidden = hp.target_hidden;
    in.target_soft = true;
  }
  return in;
}

HeadResult head_definition(const HeadProblem& hp, Labels labels) {
  const auto d = [](const at::Tensor& t) { return t.detach().to(at::kCPU, at::kDouble); };
  at::Tensor h = d(hp.p.hidden).set_requires_grad(true), w = d(hp.p.weight).set_requires_grad(true);
  const at::Tensor logq = at::log_softmax(h.mm(w.t()), -1);
  const at::Tensor index = hp.index.to(at::kCPU);
  at::Tensor per_row, target_argmax;
  if (labels == Labels::hard) {
    per_row = -logq.gather(1, hp.p.labels.to(at::kCPU).unsqueeze(1)).squeeze(1);
  } else if (labels == Labels::probs) {
    const at::Tensor p = d(hp.probs).index_select(0, index);
    per_row = -(p * logq).sum(-1);
    target_argmax = p.argmax(-1);
  } else {
    const at::Tensor t = d(hp.target_hidden).mm(d(hp.p.weight).t()).index_select(0, index);
    const at::Tensor logp = at::log_softmax(t, -1);
    per_row = (logp.exp() * (logp - logq)).sum(-1);
    target_argmax = t.argmax(-1);
  }
  const at::Tensor loss = (per_row * d(hp.p.row_weights)).sum() / hp.p.weight_sum;
  loss.backward();
  return {loss.item<double>(), h.grad().to(at::kFloat), w.grad().to(at::kFloat), logq.argmax(-1), target_argmax};
}

template <class F>
HeadResult run_head(const HeadProblem& hp, Labels labels, F&& variant) {
  at::Tensor h = hp.p.hidden.detach().clone().set_requires_grad(true);
  at::Tensor w = hp.p.weight.detach().clone().set_requires_grad(true);
  LmHeadLossOutput out = variant(head_input(hp, labels, h * 1.0, w));  // hidden a non-leaf, as in a drafter
  out.loss.backward();
  const auto cpu = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCPU) : t; };
  return {out.loss.item<double>(), h.grad().to(at::kCPU, at::kFloat), w.grad().to(at::kCPU, at::kFloat),
          cpu(out.argmax), cpu(out.target_argmax)};
}

void compare_head(const HeadProblem& hp, const std::vector<std::string>& variants, double loss_tol, double grad_tol,
                  double agree) {
  for (const Labels labels : {Labels::probs, Labels::hard, Labels::target_kl}) {
    const HeadResult def = head_definition(hp, labels);
    // Not vacuous: a real loss, both gradients non-zero.
    EXPECT_GT(def.loss, 0.1);
    EXPECT_GT(def.grad_h.abs().max().item<double>(), 0.0);
    EXPECT_GT(def.grad_w.abs().max().item<double>(), 0.0);
    for (const std::string& v : variants) {
      const HeadResult got = run_head(hp, labels, [&v](const LmHeadLossInput& in) {
        if (v == "reference") return lm_head_loss_reference(in);
        return v == "fused" ? lm_head_loss_fused(in, 16) : lm_head_loss_chunked(in, 16);  // several chunks
      });
      const std::string what = v + ", labels " + std::to_string(int(labels));
      EXPECT_NEAR(got.loss, def.loss, loss_tol * std::abs(def.loss)) << what;
      EXPECT_LE(max_rel(got.grad_h, def.grad_h), grad_tol) << what;
      EXPECT_LE(max_rel(got.grad_w, def.grad_w), grad_tol) << what << " (the LM head's gradient)";
      EXPECT_GE(got.argmax.eq(def.argmax).to(at::kDouble).mean().item<double>(), agree) << what;
      if (labels == Labels::probs) {
        EXPECT_TRUE(got.target_argmax.equal(def.target_argmax)) << what << ": the distributions' argmax";
      }
    }
  }
}

}  // namespace

TEST(LmHeadLoss, SoftLabelsAndTrainedHeadMatchTheDefinitionCpu) {
  compare_head(head_problem(50, 24, 70, at::kFloat, c10::kCPU, 31), {"reference", "chunked"}, 1e-5, 1e-4, 1.0);
}

TEST(LmHeadLoss, SoftLabelsAndTrainedHeadMatchTheDefinitionCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (!cuda_ops::cuda_ops_built()) GTEST_SKIP() << "this engine was built without its CUDA kernels";
  const c10::Device cuda(c10::kCUDA, 0);
  // float32: every variant close to the definition; a vocabulary that is not a multiple of
  // the kernels' vector width, rows over several chunks.
  compare_head(head_problem(50, 64, 1003, at::kFloat, cuda, 32), {"reference", "chunked", "fused"}, 1e-5, 1e-4, 1.0);
  // bf16 logits and gradient (the draft head of EAGLE-3 at a real draft vocabulary width).
  compare_head(head_problem(40, 128, 32000, at::kBFloat16, cuda, 33), {"reference", "chunked", "fused"}, 2e-3, 3e-2,
               0.97);
}

TEST(LmHeadLoss, SoftLabelsAreCheckedWithASentence) {
  const HeadProblem hp = head_problem(8, 16, 30, at::kFloat, c10::kCPU, 34);
  LmHeadLossInput in = head_input(hp, Labels::probs, hp.p.hidden, hp.p.weight);
  in.soft_labels = hp.probs.to(at::kDouble);
  try {
    lm_head_loss_chunked(in, 4);
    FAIL() << "float64 soft labels were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("soft_labels must be float32 [U, 30]"), std::string::npos) << e.what();
  }
  in = head_input(hp, Labels::probs, hp.p.hidden, hp.p.weight);
  in.target_hidden = hp.target_hidden;
  EXPECT_THROW(lm_head_loss_reference(in), std::invalid_argument);  // both kinds of labels
}

// The selection stage of the loss: the first supporting preference, reasons for the others,
// the fallback policy of [loss] on_fallback, unknown names refused with the accepted ones.
TEST(LmHeadLoss, ChooseLossTakesTheFirstSupportedPreference) {
  const LossProblem cpu{c10::kCPU, at::kFloat, 151936};
  const LossChoice c = choose_loss({"chunked", "reference"}, 0, cpu, "error");
  EXPECT_EQ(c.name(), "chunked");
  EXPECT_FALSE(c.fallback);
  EXPECT_NE(c.report().find("reference: supported, not needed"), std::string::npos) << c.report();
  try {
    choose_loss({"fused", "chunked"}, 0, cpu, "error");
    FAIL() << "a fallback from fused was allowed under on_fallback = error";
  } catch (const FallbackError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fused: refused: runs on CUDA, and this run is on cpu"), std::string::npos) << m;
    EXPECT_NE(m.find("[loss].on_fallback = \"error\""), std::string::npos) << m;
  }
  const LossChoice w = choose_loss({"fused", "chunked"}, 0, cpu, "warn");
  EXPECT_EQ(w.name(), "chunked");
  EXPECT_TRUE(w.fallback);
  EXPECT_NE(w.report().find("chunked: selected (FALLBACK: not the first preference)"), std::string::npos) << w.report();
  EXPECT_THROW(choose_loss({"fused"}, 0, cpu, "warn"), FallbackError);  // none supports it
  EXPECT_THROW(choose_loss({"fastest"}, 0, cpu, "warn"), std::invalid_argument);
  EXPECT_THROW(choose_loss({}, 0, cpu, "warn"), std::invalid_argument);
  EXPECT_EQ(choose_loss({"auto"}, 0, cpu, "error").name(), "auto");
  EXPECT_NE(choose_loss({"auto"}, 0, cpu, "error").report().find("auto: chunked (cpu)"), std::string::npos);
}

TEST(LmHeadLoss, OnlyTheHeadTrainedGetsItsGradient) {
  // Rows that need no gradient (a frozen feature) and a trained head: the op's backward gives
  // the head's gradient alone, equal to the reference's, and says why on a second backward.
  const HeadProblem hp = head_problem(30, 16, 40, at::kFloat, c10::kCPU, 36);
  at::Tensor w1 = hp.p.weight.detach().clone().set_requires_grad(true);
  at::Tensor w2 = hp.p.weight.detach().clone().set_requires_grad(true);
  LmHeadLossOutput a = lm_head_loss_chunked(head_input(hp, Labels::probs, hp.p.hidden, w1), 8);
  LmHeadLossOutput b = lm_head_loss_reference(head_input(hp, Labels::probs, hp.p.hidden, w2));
  a.loss.backward();
  b.loss.backward();
  EXPECT_LE(max_rel(w1.grad(), w2.grad()), 1e-5);
  EXPECT_GT(w2.grad().abs().max().item<double>(), 0.0);
  EXPECT_THROW(a.loss.backward(), std::runtime_error);
}

// DFlash-2's one hand-written backward (plugins/dflash2/candidate_logits.hpp): the candidates'
// unary logits and their gradient against plain autograd through h . W[c] on fresh random
// inputs, float32 on the CPU and, where a GPU is, bfloat16 and float32 on it.
#include <candidate_logits.hpp>

#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/types.h>

namespace {

// Served logits (output_multiplier `scale`, final_logit_softcapping `cap`): cap tanh(scale z / cap).
at::Tensor served(const at::Tensor& z, double scale, double cap) {
  return cap > 0 ? at::tanh(z * scale / cap) * cap : z * scale;
}

void check(c10::Device device, c10::ScalarType dtype, double tol, double scale = 1.0, double cap = 0.0) {
  at::manual_seed(7);
  const int64_t R = 37, H = 64, V = 301, K = 8;
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor weight = at::randn({V, H}, opts) * 0.5;
  const at::Tensor h0 = at::randn({R, H}, opts);
  const at::Tensor logits = at::linear(h0, weight);
  at::Tensor candidates = std::get<1>(at::topk(logits, K, 1));
  // A row with a repeated-free set that includes a token outside its top-K (as the selector's
  // training candidates do where the wanted token took the last place).
  candidates.select(1, K - 1).copy_(at::randint(V, {R}, opts.dtype(at::kLong)));
  const at::Tensor values = served(logits.gather(1, candidates), scale, cap);
  const at::Tensor upstream = at::randn({R, K}, opts);

  const at::Tensor h = h0.clone().requires_grad_(true);
  const at::Tensor ours = flashdraft::dflash2::candidate_logits(h, values, weight, candidates, scale, cap);
  (ours * upstream).sum().backward();

  const at::Tensor hr = h0.to(at::kDouble).requires_grad_(true);
  const at::Tensor rows = weight.to(at::kDouble).index_select(0, candidates.reshape({-1})).view({R, K, H});
  const at::Tensor plain = served((hr.unsqueeze(1) * rows).sum(-1), scale, cap);
  (plain * upstream.to(at::kDouble)).sum().backward();

  const double value_err = (ours.to(at::kDouble) - plain).abs().max().item<double>() / plain.abs().max().item<double>();
  const double grad_err =
      (h.grad().to(at::kDouble) - hr.grad()).abs().max().item<double>() / hr.grad().abs().max().item<double>();
  EXPECT_LE(value_err, tol) << c10::toString(dtype) << " on " << device;
  EXPECT_LE(grad_err, tol) << c10::toString(dtype) << " on " << device;
  EXPECT_GT(hr.grad().abs().max().item<double>(), 1.0);  // not vacuous: a gradient of size
  std::cout << c10::toString(dtype) << " on " << device << ", scale " << scale << ", cap " << cap
            << ": values max rel err " << value_err << ", gradient max rel err " << grad_err << "\n";
}

TEST(DFlash2, CandidateLogitsMatchAutogradCpu) { check(c10::kCPU, at::kFloat, 1e-5); }
// z-lab's compute_logits: times output_multiplier, capped at final_logit_softcapping (a cap the
// logits reach: |h W| runs to ~10 here).
TEST(DFlash2, ServedCandidateLogitsMatchAutogradCpu) { check(c10::kCPU, at::kFloat, 1e-5, 1.7, 4.0); }

TEST(DFlash2, CandidateLogitsMatchAutogradCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  check(c10::Device(c10::kCUDA, 0), at::kFloat, 1e-5);
  check(c10::Device(c10::kCUDA, 0), at::kBFloat16, 2e-2);
}

}  // namespace

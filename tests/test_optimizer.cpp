// The engine's AdamW implementations: the fused one (ATen's multi-tensor kernel, sync-free
// clipping through grad_scale) against torch::optim::AdamW with clip_grad_norm_, in
// float32; float32 master weights for bfloat16 weights against a float32 run fed the same
// gradients; and the state's save/load round trip and refusals.
#include "train/optimizer.hpp"

#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <gtest/gtest.h>

using namespace flashdraft;

namespace {

std::vector<at::Tensor> random_params(uint64_t seed, at::ScalarType dtype) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (auto shape : {std::vector<int64_t>{7, 5}, {13}, {3, 4, 2}})
    out.push_back(at::randn(shape).to(dtype).set_requires_grad(true));
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ps, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(dtype).clone().set_requires_grad(true));
  return out;
}

// Gradients of step k: fresh random values (large enough that clipping at 1.0 acts).
void set_grads(std::vector<at::Tensor>& ps, int k) {
  at::manual_seed(1000 + k);
  for (auto& p : ps) p.mutable_grad() = (at::randn(p.sizes()) * 3.0).to(p.scalar_type());
}

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, (a[i].detach().to(at::kFloat) - b[i].detach().to(at::kFloat)).abs().max().item<double>());
  return m;
}

const AdamWSettings kSettings{0.9, 0.95, 1e-8, 0.1};

}  // namespace

TEST(FusedAdamW, MatchesTorchAdamWWithClippingFloat32) {
  std::vector<at::Tensor> a = random_params(1, at::kFloat), b = clones(a, at::kFloat);
  auto fused = make_fused_adamw(a, kSettings, at::kFloat);
  auto torch_opt = make_torch_adamw(b, kSettings);
  for (int k = 0; k < 6; ++k) {
    set_grads(a, k);
    set_grads(b, k);
    const double lr = 1e-2 * (k + 1);
    const double na = fused->step(lr, 1.0).item<double>(), nb = torch_opt->step(lr, 1.0).item<double>();
    EXPECT_NEAR(na, nb, 1e-5 * nb) << "step " << k;
    EXPECT_GT(na, 1.0);  // the clip acted
    fused->zero_grad();
    torch_opt->zero_grad();
    EXPECT_LE(max_diff(a, b), 1e-6) << "step " << k;
  }
  EXPECT_FALSE(a[0].grad().defined());
  EXPECT_GT(max_diff(a, random_params(1, at::kFloat)), 1e-2);  // the weights moved
}

TEST(FusedAdamW, Float32MasterWeightsForBFloat16) {
  // bf16 weights with float32 masters, against a float32 run from the same start fed the
  // same (bf16-representable) gradients: the masters follow the float32 run, and the
  // bf16 weights are the masters rounded.
  std::vector<at::Tensor> w16 = random_params(2, at::kBFloat16), w32 = clones(w16, at::kFloat);
  auto mixed = make_fused_adamw(w16, kSettings, at::kFloat);
  auto plain = make_fused_adamw(w32, kSettings, at::kFloat);
  for (int k = 0; k < 5; ++k) {
    set_grads(w16, k);
    for (size_t i = 0; i < w32.size(); ++i) w32[i].mutable_grad() = w16[i].grad().to(at::kFloat);
    mixed->step(3e-3, 1.0);
    plain->step(3e-3, 1.0);
    mixed->zero_grad();
    plain->zero_grad();
  }
  // bf16 weights equal the float32 run rounded (a pure-bf16 update would drift: 3e-3
  // steps are below bf16's resolution near 1).
  for (size_t i = 0; i < w16.size(); ++i) EXPECT_TRUE(w16[i].detach().equal(w32[i].detach().to(at::kBFloat16))) << i;
}

TEST(FusedAdamW, SaveLoadContinuesIdentically) {
  std::vector<at::Tensor> a = random_params(3, at::kBFloat16);
  auto opt = make_fused_adamw(a, kSettings, at::kFloat);
  for (int k = 0; k < 3; ++k) {
    set_grads(a, k);
    opt->step(1e-2, 1.0);
    opt->zero_grad();
  }
  torch::serialize::OutputArchive out;
  opt->save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  // A fresh optimizer over copies of the weights, loaded from the archive.
  std::vector<at::Tensor> b = clones(a, at::kBFloat16);
  auto loaded = make_fused_adamw(b, kSettings, at::kFloat);
  torch::serialize::InputArchive in;
  std::istringstream is(bytes.str());
  in.load_from(is);
  loaded->load(in);
  for (int k = 3; k < 6; ++k) {
    set_grads(a, k);
    set_grads(b, k);
    opt->step(1e-2, 1.0);
    loaded->step(1e-2, 1.0);
    opt->zero_grad();
    loaded->zero_grad();
  }
  EXPECT_EQ(max_diff(a, b), 0.0);
  // The torch implementation refuses a fused state, with a sentence.
  std::vector<at::Tensor> c = clones(a, at::kBFloat16);
  auto other = make_torch_adamw(c, kSettings);
  torch::serialize::InputArchive again;
  std::istringstream is2(bytes.str());
  again.load_from(is2);
  try {
    other->load(again);
    FAIL() << "a fused state was accepted by torch::optim::AdamW";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fused AdamW state"), std::string::npos) << e.what();
  }
  // A state written for other shapes is refused, naming the tensor.
  std::vector<at::Tensor> d = {at::zeros({7, 6}, at::kBFloat16).set_requires_grad(true)};
  auto mismatched = make_fused_adamw(d, kSettings, at::kFloat);
  torch::serialize::InputArchive third;
  std::istringstream is3(bytes.str());
  third.load_from(is3);
  try {
    mismatched->load(third);
    FAIL() << "a state of another shape was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg/0"), std::string::npos) << e.what();
  }
}

// The engine's own fused ops against plain references on fresh random inputs:
//   - flashdraft::swiglu and flashdraft::rope (flashdraft/ops.hpp) against ATen's composite
//     autograd in float64 on the CPU, and on CUDA (the fused kernels) against a float64
//     reference of the same math, in float32, bfloat16 and float16, with vector tails,
//     misaligned views (SwiGLU's scalar paths), shared and per-sequence RoPE tables and a
//     transposed input;
//   - the LM-head cross-entropy row pass (cuda_ops::ce_rows) against float64 log-softmax:
//     log-sum-exp, NLL, the first argmax, and the in-place gradient, for a real vocabulary
//     (151936), a ragged one, rows whose stride breaks 16-byte alignment, and an
//     out-of-range label (NaN);
//   - the mixed-precision AdamW kernel against a float64 evaluation of the update, with the
//     clip factor and the skip flag; and the optimizer's guard (a non-finite loss or norm
//     skips that update and every later one) on the CPU and on CUDA.
// The CUDA cases skip where there is no CUDA device or the engine has no CUDA kernels.
#include "dispatch/cuda_ops.hpp"
#include "train/optimizer.hpp"

#include <flashdraft/ops.hpp>

#include <torch/cuda.h>
#include <torch/types.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

using namespace flashdraft;

namespace {

bool cuda_here() { return torch::cuda::is_available() && cuda_ops::cuda_ops_built(); }
#define REQUIRE_CUDA_OPS()                                                                        \
  do {                                                                                            \
    if (!cuda_here()) {                                                                           \
      GTEST_SKIP() << (torch::cuda::is_available()                                                \
                           ? "this engine was built without its CUDA kernels"                     \
                           : "no CUDA device here: the engine's CUDA kernels run only on a GPU"); \
    }                                                                                             \
  } while (0)

double rel_err(const at::Tensor& got, const at::Tensor& ref) {
  const at::Tensor g = got.to(at::kCPU, at::kDouble), r = ref.to(at::kCPU, at::kDouble);
  return ((g - r).norm() / r.norm().clamp_min(1e-300)).item<double>();
}

// The bound on ||got - ref|| / ||ref|| for values rounded once to `dtype` after float32
// arithmetic (METHOD: float32 far under 1e-3; bf16 between 1e-3 and 1e-2).
double tolerance(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 6e-3 : dtype == at::kHalf ? 8e-4 : 2e-6; }

const c10::Device kCuda(c10::kCUDA, 0);

}  // namespace

// ---------------------------------------------------------------- CPU: the ATen paths

TEST(Ops, SwiGLUMatchesAutogradCompositeCpu) {
  at::manual_seed(1);
  const auto d = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor g0 = at::randn({37, 19}, d) * 3, u0 = at::randn({37, 19}, d), dy = at::randn({37, 19}, d);
  at::Tensor g = g0.clone().set_requires_grad(true), u = u0.clone().set_requires_grad(true);
  at::Tensor gr = g0.clone().set_requires_grad(true), ur = u0.clone().set_requires_grad(true);
  const at::Tensor y = swiglu(g, u), yr = at::silu(gr) * ur;
  EXPECT_LT(rel_err(y, yr), 1e-14);
  y.backward(dy);
  yr.backward(dy);
  EXPECT_LT(rel_err(g.grad(), gr.grad()), 1e-13);
  EXPECT_LT(rel_err(u.grad(), ur.grad()), 1e-13);
  EXPECT_GT(gr.grad().abs().max().item<double>(), 0.1);
}

// The hf target writes each state into its slot of a [B, S, E, H] result: add_rms_norm's sum
// into a slice (and x read from one), on the ATen path here (the kernels': FrozenDecoderOps...).
TEST(Ops, FrozenAddRmsNormIntoASliceCpu) {
  at::manual_seed(3);
  const auto f = at::TensorOptions().dtype(at::kFloat);
  const int64_t B = 2, T = 5, H = 24;
  const at::Tensor wide = at::randn({B, T, 3, H}, f), delta = at::randn({B, T, H}, f), w = 1 + 0.1 * at::randn({H}, f);
  at::Tensor result = at::full({B, T, 2, H}, 7.0, f);
  const at::Tensor x = wide.select(2, 1), into = result.select(2, 1);
  EXPECT_EQ(cuda_ops::row_stride(x), 3 * H);
  EXPECT_EQ(cuda_ops::row_stride(into), 2 * H);
  EXPECT_EQ(cuda_ops::row_stride(wide.transpose(1, 2)), -1);
  EXPECT_EQ(cuda_ops::row_stride(x.transpose(-1, -2)), -1);
  const auto [sum, normed] = frozen::add_rms_norm(x, delta, w, 1e-6, true, into);
  EXPECT_EQ(sum.data_ptr(), into.data_ptr());
  const at::Tensor s = x + delta;
  EXPECT_TRUE(at::equal(into, s));
  EXPECT_TRUE(at::allclose(normed, w * (s * at::rsqrt(s.pow(2).mean(-1, true) + 1e-6)), 1e-6, 1e-6));
  EXPECT_TRUE(at::equal(result.select(2, 0), at::full({B, T, H}, 7.0, f))) << "wrote outside its slice";
  // A slot of the wrong shape, or one with no delta to add, is refused with the shapes.
  try {
    frozen::add_rms_norm(x, delta, w, 1e-6, true, result.select(2, 0).narrow(1, 0, 2));
    FAIL() << "a sum_into of another shape was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("must have x's shape"), std::string::npos) << e.what();
  }
  EXPECT_THROW(frozen::add_rms_norm(x, at::Tensor(), w, 1e-6, true, into), std::invalid_argument);
}

TEST(Ops, RopeAndTablesMatchTheDefinitionCpu) {
  at::manual_seed(2);
  const auto d = at::TensorOptions().dtype(at::kDouble);
  const int64_t D = 16, T = 29;
  const at::Tensor pos = at::randint(0, 5000, {2, T}, at::TensorOptions().dtype(at::kLong));
  const auto [cos, sin] = rope_tables(pos, 10000.0, D, at::kDouble);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{2, T, D}));
  // The definition, element by element: angle pos * theta^(-2i/D) for i < D/2, both halves.
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < T; t += 7)
      for (int64_t j = 0; j < D; ++j) {
        const double ang =
            double(pos[b][t].item<int64_t>()) * std::pow(10000.0, -2.0 * double(j % (D / 2)) / double(D));
        EXPECT_NEAR(cos[b][t][j].item<double>(), std::cos(ang), 1e-12);
        EXPECT_NEAR(sin[b][t][j].item<double>(), std::sin(ang), 1e-12);
      }
  const at::Tensor x0 = at::randn({2, 3, T, D}, d), dy = at::randn({2, 3, T, D}, d);
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  at::Tensor x = x0.clone().set_requires_grad(true), xr = x0.clone().set_requires_grad(true);
  const at::Tensor y = rope(x, c, s);
  const at::Tensor yr = xr * c + at::cat({-xr.narrow(-1, D / 2, D / 2), xr.narrow(-1, 0, D / 2)}, -1) * s;
  EXPECT_LT(rel_err(y, yr), 1e-14);
  y.backward(dy);
  yr.backward(dy);
  EXPECT_LT(rel_err(x.grad(), xr.grad()), 1e-13);
  // A rotation: norms of every (x1_i, x2_i) pair are kept.
  EXPECT_LT(rel_err(y.pow(2).narrow(-1, 0, D / 2) + y.pow(2).narrow(-1, D / 2, D / 2),
                    x0.pow(2).narrow(-1, 0, D / 2) + x0.pow(2).narrow(-1, D / 2, D / 2)),
            1e-13);
}

namespace {

std::vector<at::Tensor> params_on(c10::Device device, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (auto shape : {std::vector<int64_t>{64, 33}, {1001}, {4, 4, 3}})
    out.push_back(at::randn(shape).to(device, dtype).set_requires_grad(true));
  return out;
}

void fill_grads(std::vector<at::Tensor>& ps, int k, double value = 0) {
  at::manual_seed(500 + k);
  for (auto& p : ps) {
    at::Tensor g = at::randn(p.sizes()) * 2.0;
    if (value != 0) g.view(-1)[3] = value;
    p.mutable_grad() = g.to(p.device(), p.scalar_type());
  }
}

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone());
  return out;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].detach().equal(b[i].detach())) return false;
  return true;
}

// Guarded steps: a finite guard updates; a non-finite guard, or a non-finite gradient
// norm, skips that update and every later one.
void check_guard(c10::Device device, at::ScalarType dtype) {
  const AdamWSettings s{0.9, 0.95, 1e-8, 0.1};
  const auto f = at::TensorOptions().dtype(at::kFloat).device(device);
  for (const bool bad_norm : {false, true}) {
    std::vector<at::Tensor> w = params_on(device, dtype, 3);
    auto opt = make_fused_adamw(w, s, at::kFloat);
    ASSERT_TRUE(opt->guards());
    fill_grads(w, 0);
    std::vector<at::Tensor> before = snapshot(w);
    opt->step(1e-2, 1.0, at::scalar_tensor(2.5, f));
    opt->zero_grad();
    EXPECT_FALSE(same(before, w)) << "a finite guard must update";
    before = snapshot(w);
    if (bad_norm) {
      fill_grads(w, 1, std::numeric_limits<double>::infinity());
      const double norm = opt->step(1e-2, 1.0, at::scalar_tensor(2.5, f)).item<double>();
      EXPECT_FALSE(std::isfinite(norm));
    } else {
      fill_grads(w, 1);
      opt->step(1e-2, 1.0, at::scalar_tensor(std::nan(""), f));
    }
    opt->zero_grad();
    EXPECT_TRUE(same(before, w)) << "a non-finite " << (bad_norm ? "norm" : "guard") << " must skip the update";
    fill_grads(w, 2);
    opt->step(1e-2, 1.0, at::scalar_tensor(1.0, f));
    opt->zero_grad();
    EXPECT_TRUE(same(before, w)) << "every later update is skipped too";
  }
}

}  // namespace

TEST(FusedAdamWGuard, NonFiniteLossOrNormSkipsThisAndLaterUpdatesCpu) { check_guard(c10::kCPU, at::kFloat); }

// ---------------------------------------------------------------- CUDA: the fused kernels

TEST(CudaOps, SwiGLUMatchesFloat64Reference) {
  REQUIRE_CUDA_OPS();
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const int64_t n : {int64_t(8192) * 123 + 5, int64_t(7)})
      for (const bool misaligned : {false, true}) {
        at::manual_seed(10 + n % 97 + misaligned);
        // A view starting one element into its storage breaks 16-byte alignment.
        const at::Tensor gs = (at::randn({n + 1}) * 4).to(kCuda, dtype), us = at::randn({n + 1}).to(kCuda, dtype),
                         ds = at::randn({n + 1}).to(kCuda, dtype);
        const int64_t o = misaligned ? 1 : 0;
        at::Tensor g = gs.narrow(0, o, n), u = us.narrow(0, o, n), dy = ds.narrow(0, o, n);
        if (!misaligned) {
          g = g.clone();
          u = u.clone();
          dy = dy.clone();
        }
        const at::Tensor gd = g.to(at::kCPU, at::kDouble), ud = u.to(at::kCPU, at::kDouble),
                         dd = dy.to(at::kCPU, at::kDouble);
        const at::Tensor sig = at::sigmoid(gd);
        const at::Tensor y = cuda_ops::swiglu_forward(g, u);
        EXPECT_LT(rel_err(y, gd * sig * ud), tolerance(dtype)) << dtype << " n " << n << " misaligned " << misaligned;
        const auto [dg, du] = cuda_ops::swiglu_backward(g, u, dy);
        EXPECT_LT(rel_err(dg, dd * ud * sig * (1 + gd * (1 - sig))), tolerance(dtype)) << dtype << " n " << n;
        EXPECT_LT(rel_err(du, dd * gd * sig), tolerance(dtype)) << dtype << " n " << n;
        // Through the autograd op (what drafters call), on the same inputs.
        at::Tensor ga = g.detach().clone().set_requires_grad(true), ua = u.detach().clone().set_requires_grad(true);
        swiglu(ga, ua).backward(dy);
        EXPECT_TRUE(ga.grad().equal(dg) && ua.grad().equal(du));
      }
}

TEST(CudaOps, RopeMatchesFloat64Reference) {
  REQUIRE_CUDA_OPS();
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat})
    for (const int64_t D : {int64_t(64), int64_t(128)})
      for (const int64_t table_batch : {int64_t(1), int64_t(2)}) {
        at::manual_seed(60 + D + table_batch);
        const int64_t B = 2, H = 3, T = 37;
        const at::Tensor pos = at::randint(0, 9000, {table_batch, T}, at::TensorOptions().dtype(at::kLong));
        auto [c64, s64] = rope_tables(pos, 1e6, D, at::kDouble);
        const at::Tensor cos = c64.unsqueeze(1).to(kCuda, dtype), sin = s64.unsqueeze(1).to(kCuda, dtype);
        // x as a drafter makes it: a transposed view of [B, T, H, D] (not contiguous).
        const at::Tensor x = at::randn({B, T, H, D}).to(kCuda, dtype).transpose(1, 2);
        const at::Tensor dy = at::randn({B, H, T, D}).to(kCuda, dtype);
        ASSERT_TRUE(cuda_ops::rope_runs(x, cos, sin));
        at::Tensor xg = x.detach().clone().set_requires_grad(true);
        const at::Tensor y = rope(xg, cos, sin);
        y.backward(dy);
        // float64 reference from the tables and inputs as stored.
        const at::Tensor xd = x.to(at::kCPU, at::kDouble), dd = dy.to(at::kCPU, at::kDouble);
        const at::Tensor cd = cos.to(at::kCPU, at::kDouble), sd = sin.to(at::kCPU, at::kDouble);
        const int64_t h = D / 2;
        auto rot = [h](const at::Tensor& v) { return at::cat({-v.narrow(-1, h, h), v.narrow(-1, 0, h)}, -1); };
        auto rot_t = [h](const at::Tensor& v) { return at::cat({v.narrow(-1, h, h), -v.narrow(-1, 0, h)}, -1); };
        const std::string what = std::string(c10::toString(dtype)) + " D " + std::to_string(D) + " table batch " +
                                 std::to_string(table_batch);
        EXPECT_LT(rel_err(y, xd * cd + rot(xd) * sd), tolerance(dtype)) << what;
        EXPECT_LT(rel_err(xg.grad(), dd * cd + rot_t(dd * sd)), tolerance(dtype)) << what;
      }
}

namespace {

struct CeCase {
  at::ScalarType dtype;
  int64_t rows, vocab, pad;  // pad: extra columns of the row stride (ld = vocab + pad)
};

void check_ce(const CeCase& c, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t ld = c.vocab + c.pad;
  at::Tensor storage = (at::randn({c.rows, ld}) * 3).to(kCuda, c.dtype);
  at::Tensor logits = storage.narrow(1, 0, c.vocab);
  const at::Tensor padding = storage.narrow(1, c.vocab, c.pad).clone();
  const at::Tensor x = logits.to(at::kCPU, at::kDouble);  // the values as stored
  at::Tensor labels = at::randint(c.vocab, {c.rows}, at::TensorOptions().dtype(at::kLong));
  labels[c.rows / 2] = c.vocab;  // out of range: NaN
  const at::Tensor w = at::rand({c.rows}) + 0.5;
  const double scale = 1.0 / 37.0;
  // Reference in float64.
  const at::Tensor logp = at::log_softmax(x, -1);
  const at::Tensor lse = at::logsumexp(x, -1);
  const at::Tensor first_max = x.eq(std::get<0>(x.max(-1, true))).to(at::kInt).argmax(-1);
  const cuda_ops::CeRows out = cuda_ops::ce_rows(logits, labels.to(kCuda), w.to(kCuda), scale, /*write_grad=*/true);
  const at::Tensor nll = out.nll.to(at::kCPU, at::kDouble), am = out.argmax.to(at::kCPU);
  const std::string what = std::string(c10::toString(c.dtype)) + " rows " + std::to_string(c.rows) + " V " +
                           std::to_string(c.vocab) + " ld " + std::to_string(ld);
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t lab = labels[r].item<int64_t>();
    if (lab >= c.vocab) {
      EXPECT_TRUE(std::isnan(nll[r].item<double>())) << what << ": an out-of-range label must give NaN";
      continue;
    }
    const double ref = lse[r].item<double>() - x[r][lab].item<double>();
    EXPECT_NEAR(nll[r].item<double>(), ref, 2e-5 * std::max(1.0, std::abs(ref))) << what << " row " << r;
  }
  EXPECT_TRUE(am.equal(first_max)) << what << ": argmax must be the first index of the row's maximum";
  // The gradient, written over the logits.
  const at::Tensor in_range = labels.lt(c.vocab);
  const at::Tensor onehot =
      at::zeros_like(x).scatter_(1, labels.clamp_max(c.vocab - 1).unsqueeze(1), in_range.to(at::kDouble).unsqueeze(1));
  const at::Tensor ref_grad = (logp.exp() - onehot) * (w.to(at::kDouble) * scale).unsqueeze(1);
  const at::Tensor got = logits.to(at::kCPU, at::kDouble);
  const at::Tensor keep = in_range.nonzero().squeeze(1);
  EXPECT_LT(rel_err(got.index_select(0, keep), ref_grad.index_select(0, keep)), tolerance(c.dtype)) << what;
  // The padding columns beyond V are untouched.
  EXPECT_TRUE(storage.narrow(1, c.vocab, c.pad).equal(padding)) << what;
}

}  // namespace

TEST(CudaOps, CeRowsMatchesFloat64LogSoftmax) {
  REQUIRE_CUDA_OPS();
  uint64_t seed = 20;
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    check_ce({dtype, 24, 151936, 0}, seed++);  // a real vocabulary, 16-byte vectors throughout
    check_ce({dtype, 33, 1001, 0}, seed++);    // a ragged tail, rows misaligned after the first
    check_ce({dtype, 17, 515, 3}, seed++);     // row stride breaking alignment
    check_ce({dtype, 5, 3, 0}, seed++);        // fewer values than one vector
  }
}

TEST(CudaOps, CeRowsWithoutGradientLeavesLogitsAlone) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(30);
  at::Tensor logits = at::randn({9, 4099}).to(kCuda, at::kBFloat16);
  const at::Tensor before = logits.clone();
  const at::Tensor labels = at::randint(4099, {9}, at::TensorOptions().dtype(at::kLong)).to(kCuda);
  const cuda_ops::CeRows out = cuda_ops::ce_rows(logits, labels, at::Tensor(), 1.0, false);
  EXPECT_TRUE(logits.equal(before));
  const at::Tensor x = before.to(at::kCPU, at::kDouble);
  const at::Tensor ref = at::logsumexp(x, -1) - x.gather(1, labels.to(at::kCPU).unsqueeze(1)).squeeze(1);
  EXPECT_LT(rel_err(out.nll, ref), 1e-6);
}

TEST(CudaOps, AdamWMixedMatchesFloat64Update) {
  REQUIRE_CUDA_OPS();
  const cuda_ops::AdamWHyper h{3e-3, 0.9, 0.95, 1e-8, 0.1};
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat})
    for (const int64_t n : {int64_t(4099), int64_t(1) << 20}) {
      at::manual_seed(40 + n % 13);
      const auto f = at::TensorOptions().dtype(at::kFloat).device(kCuda);
      at::Tensor master = at::randn({n}, f), m = at::randn({n}, f) * 0.1, v = at::rand({n}, f) * 0.01;
      at::Tensor param = master.to(dtype), grad = (at::randn({n}) * 2).to(kCuda, dtype);
      const at::Tensor step = at::full({}, 7.0, f), scale = at::full({}, 1.75, f);
      // float64 reference of the update (the gradient as stored, over the clip factor).
      const at::Tensor w0 = master.to(at::kCPU, at::kDouble), m0 = m.to(at::kCPU, at::kDouble),
                       v0 = v.to(at::kCPU, at::kDouble), g = grad.to(at::kCPU, at::kDouble) / 1.75;
      const double bc1 = 1 - std::pow(0.9, 7.0), bc2 = 1 - std::pow(0.95, 7.0);
      const at::Tensor w1 = w0 * (1 - h.lr * h.weight_decay);
      const at::Tensor m1 = 0.9 * m0 + 0.1 * g, v1 = 0.95 * v0 + 0.05 * g * g;
      const at::Tensor w2 = w1 - (h.lr / bc1) * m1 / (v1.sqrt() / std::sqrt(bc2) + h.eps);
      const at::Tensor p = dtype == at::kFloat ? master : param;
      cuda_ops::adamw_mixed(p, grad, master, m, v, h, step, scale, at::Tensor());
      const std::string what = std::string(c10::toString(dtype)) + " n " + std::to_string(n);
      EXPECT_LT(rel_err(master, w2), 2e-7) << what;
      EXPECT_LT(rel_err(m, m1), 1e-6) << what;
      EXPECT_LT(rel_err(v, v1), 1e-6) << what;
      if (dtype != at::kFloat) {
        EXPECT_TRUE(param.equal(master.to(dtype))) << what << ": the weight is the master rounded";
      }
      // The skip flag: nothing is written.
      const at::Tensor keep = master.clone(), keep_m = m.clone();
      cuda_ops::adamw_mixed(p, grad, master, m, v, h, step, scale, at::ones({}, f));
      EXPECT_TRUE(master.equal(keep) && m.equal(keep_m)) << what;
    }
}

TEST(CudaOps, MixedAdamWOptimizerFollowsTheFloat32Run) {
  REQUIRE_CUDA_OPS();
  // bf16 weights with float32 masters (the engine's kernel) against float32 weights (ATen's
  // fused AdamW), fed the same bf16-representable gradients: the masters agree to float32
  // rounding, so the bf16 weights are the float32 run's weights rounded but for ties.
  const AdamWSettings s{0.9, 0.95, 1e-8, 0.1};
  std::vector<at::Tensor> w16 = params_on(kCuda, at::kBFloat16, 5), w32;
  for (const auto& p : w16) w32.push_back(p.detach().to(at::kFloat).clone().set_requires_grad(true));
  auto mixed = make_fused_adamw(w16, s, at::kFloat), plain = make_fused_adamw(w32, s, at::kFloat);
  EXPECT_NE(mixed->name().find("flashdraft CUDA kernel"), std::string::npos) << mixed->name();
  EXPECT_EQ(plain->name().find("flashdraft CUDA kernel"), std::string::npos) << plain->name();
  for (int k = 0; k < 6; ++k) {
    fill_grads(w16, k);
    for (size_t i = 0; i < w32.size(); ++i) w32[i].mutable_grad() = w16[i].grad().to(at::kFloat);
    const double n16 = mixed->step(3e-3, 1.0).item<double>(), n32 = plain->step(3e-3, 1.0).item<double>();
    EXPECT_NEAR(n16, n32, 1e-6 * n32);
    mixed->zero_grad();
    plain->zero_grad();
  }
  int64_t differ = 0, total = 0;
  for (size_t i = 0; i < w16.size(); ++i) {
    const at::Tensor a = w16[i].detach().to(at::kFloat), b = w32[i].detach().to(at::kBFloat16).to(at::kFloat);
    differ += a.ne(b).sum().item<int64_t>();
    total += a.numel();
    // Where they differ, by one bf16 step at most.
    EXPECT_LE(((a - b).abs() / b.abs().clamp_min(1e-3)).max().item<double>(), 1.0 / 128) << i;
  }
  EXPECT_LE(differ, total / 200) << differ << " of " << total << " weights differ after rounding";
  const at::Tensor moved =
      w16[0].detach().to(at::kFloat) - params_on(kCuda, at::kBFloat16, 5)[0].detach().to(at::kFloat);
  EXPECT_GT(moved.abs().max().item<double>(), 1e-3);  // the weights moved
}

TEST(FusedAdamWGuard, NonFiniteLossOrNormSkipsThisAndLaterUpdatesCuda) {
  REQUIRE_CUDA_OPS();
  check_guard(kCuda, at::kBFloat16);  // the engine's kernel
  check_guard(kCuda, at::kFloat);     // ATen's fused AdamW with found_inf
}

// ---- Frozen decoder layers (flashdraft::frozen, the online target's forward) ---------------
// The fused kernels against transformers' separate ATen ops (the `fused = false` path, run on
// the same device and dtype) on fresh random inputs: every value equal, except where a
// float32 reduction's order moves one rounding (the norms' mean of squares). Differences are
// counted in units in the last place of max(|value|, the tensor's RMS) (RoPE's sum of two
// rounded products may cancel: a last-bit change of an operand is measured at the operands'
// scale): 16-bit dtypes at most 2 units on at most 1% of values; float32, where every value
// of a row moves with its norm's last bit, at most 8.
namespace {

struct Agreement {
  double max_ulps = 0, share_differing = 0;
};

// Differences in units of the dtype's spacing at each reference value.
Agreement agreement(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const int mant = want.scalar_type() == at::kBFloat16 ? 7 : want.scalar_type() == at::kHalf ? 10 : 23;
  const double rms = w.pow(2).mean().sqrt().item<double>();
  const at::Tensor ulp = at::pow(2.0, at::floor(at::log2(w.abs().clamp_min(rms))) - mant);
  const at::Tensor d = (g - w).abs() / ulp;
  return {d.max().item<double>(), d.gt(0).to(at::kDouble).mean().item<double>()};
}

void expect_agree(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_TRUE(got.is_contiguous()) << what;
  const Agreement a = agreement(got, want);
  std::cout << what << ": max " << a.max_ulps << " ulp, " << 100 * a.share_differing << "% of values differ\n";
  const bool f32 = want.scalar_type() == at::kFloat;
  EXPECT_LE(a.max_ulps, f32 ? 8.0 : 2.0) << what;
  EXPECT_LE(a.share_differing, f32 ? 1.0 : 0.01) << what;
}

}  // namespace

// Shapes: the kernels' fast paths (16-byte vectors: H, I multiples of 8; the q|k|v RoPE at
// D = 64, 128, 256) and their general ones (H = 1100 and I = 1001 break the vectors, D = 96, and
// an unaligned q|k|v buffer).
struct FrozenShape {
  int64_t H, D, I, Hq, Hkv;
};

// gpt-oss's MXFP4 experts: the engine's kernel against ATen's ops on random codes and scales (the
// powers 2^-24..2^8 around the published experts' ~2^-8), every value equal; shapes of gpt-oss-20b's
// gate / up rows (2880 columns: 90 groups) and an odd count of groups.
TEST(CudaOps, DequantizeMxfp4EqualsAtenOps) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(5);
  const auto bytes = at::TensorOptions().device(at::kCUDA).dtype(at::kByte);
  for (const std::vector<int64_t>& groups : {std::vector<int64_t>{3, 64, 90}, std::vector<int64_t>{2, 7, 3}})
    for (at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
      std::vector<int64_t> block_shape = groups;
      block_shape.push_back(16);
      const at::Tensor blocks = at::randint(0, 256, block_shape, bytes);
      const at::Tensor scales = at::randint(127 - 24, 127 + 9, groups, bytes);
      const at::Tensor fused = frozen::dequantize_mxfp4(blocks, scales, dtype, true);
      const at::Tensor plain = frozen::dequantize_mxfp4(blocks, scales, dtype, false);
      const std::string what = std::string(c10::toString(dtype)) + " " + c10::str(groups) + " groups";
      ASSERT_EQ(fused.sizes(), plain.sizes()) << what;
      EXPECT_EQ(fused.size(-1), 32 * groups.back()) << what;
      EXPECT_TRUE(at::equal(fused, plain)) << what;
      // not vacuous: random codes give values of both signs, of many magnitudes (the codes' magnitudes are
      // 2^k and 1.5 x 2^k, so 33 scales give about 70 distinct ones: 67-72 on an H100)
      const at::Tensor f = fused.to(at::kFloat);
      EXPECT_GT(f.gt(0).sum().item<int64_t>(), f.numel() / 3) << what;
      EXPECT_GT(f.lt(0).sum().item<int64_t>(), f.numel() / 3) << what;
      EXPECT_GT(std::get<0>(at::_unique(f.abs())).numel(), 60) << what;
      std::cout << what << ": equal, " << std::get<0>(at::_unique(f.abs())).numel() << " distinct magnitudes\n";
    }
}

// The gated delta rule's two kernels (frozen::gated_delta_chunks) against the rule's definition, one position
// after another in float64 on the CPU (transformers' torch_recurrent_gated_delta_rule): S = exp(g_t) S; S += k_t
// (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t. Three sequences of three chunks, from zeros and from a random state
// (its output and final state); decays of 0.5-1 a position and betas of 0.1-0.9, so that every chunk's system,
// decays and carried state move the output. transformers' own float32 chunked rule is 5e-07 from the same
// reference at this shape (its CPU path); the bound allows 10x that.
TEST(CudaOps, GatedDeltaChunksMatchTheRecurrence) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(41);
  const int64_t N = 3, T = 192, D = 128;
  const auto l2 = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
  const at::Tensor q = l2(at::randn({N, T, D})) / std::sqrt(double(D)), k = l2(at::randn({N, T, D}));
  const at::Tensor v = at::randn({N, T, D});
  const at::Tensor g = -at::softplus(at::randn({N, T})) * 0.5, beta = at::sigmoid(at::randn({N, T}) * 1.5);
  const at::Tensor initial = at::randn({N, D, D}) * 0.3;
  for (bool from_state : {false, true}) {
    const std::string what = from_state ? "from a random state" : "from zeros";
    // the reference, in float64
    at::Tensor S = from_state ? initial.to(at::kDouble).clone() : at::zeros({N, D, D}, at::kDouble);
    at::Tensor ref = at::empty({N, T, D}, at::kDouble);
    const at::Tensor qd = q.to(at::kDouble), kd = k.to(at::kDouble), vd = v.to(at::kDouble);
    const at::Tensor gd = g.to(at::kDouble), bd = beta.to(at::kDouble);
    for (int64_t t = 0; t < T; ++t) {
      S = S * gd.select(1, t).exp().view({N, 1, 1});
      const at::Tensor kt = kd.select(1, t), memory = at::bmm(kt.unsqueeze(1), S).squeeze(1);  // S^T k
      const at::Tensor delta = (vd.select(1, t) - memory) * bd.select(1, t).unsqueeze(1);
      S = S + at::bmm(kt.unsqueeze(2), delta.unsqueeze(1));
      ref.select(1, t).copy_(at::bmm(qd.select(1, t).unsqueeze(1), S).squeeze(1));
    }
    const auto cuda = [](const at::Tensor& x) { return x.to(kCuda); };
    const auto [out, last] = frozen::gated_delta_chunks(cuda(q), cuda(k), cuda(v), cuda(g), cuda(beta),
                                                        from_state ? cuda(initial) : at::Tensor(), true);
    ASSERT_TRUE(out.defined() && last.defined()) << what;
    ASSERT_EQ(out.sizes(), v.sizes()) << what;
    EXPECT_EQ(out.scalar_type(), at::kFloat) << what;
    const double e_out = rel_err(out, ref), e_state = rel_err(last, S);
    std::cout << "gated delta rule " << what << ": out rel err " << e_out << ", final state " << e_state << "\n";
    EXPECT_LE(e_out, 5e-6) << what;
    EXPECT_LE(e_state, 5e-6) << what;
  }
  // where the kernels do not run: undefined, and the caller runs ATen's ops
  EXPECT_FALSE(frozen::gated_delta_chunks(q.to(kCuda), k.to(kCuda), v.to(kCuda), g.to(kCuda), beta.to(kCuda),
                                          at::Tensor(), false)
                   .first.defined());
  const at::Tensor k64 = k.narrow(2, 0, 64).contiguous().to(kCuda);
  EXPECT_FALSE(frozen::gated_delta_chunks(k64, k64, v.to(kCuda), g.to(kCuda), beta.to(kCuda)).first.defined());
  EXPECT_FALSE(frozen::gated_delta_chunks(q, k, v, g, beta).first.defined());  // the CPU
}

// Mamba-2's state-space rule in two kernels (frozen::ssd_chunks) against its definition, one position after another
// in float64 on the CPU: S = exp(g_t) S + k_t v_t^T; o_t = S^T q_t, per head, with k and q its group's (B and C). Two
// rows of 200 positions (three chunks and a part: positions past T read as zeros), 4 heads in 2 groups, a state of
// 128 x 64; decays of 0.55-1 a position, from zeros and from a random state (its output).
TEST(CudaOps, SsdChunksMatchTheRecurrence) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(43);
  const int64_t B = 2, T = 200, G = 2, H = 4, N = 128, P = 64;
  const at::Tensor q = at::randn({B, T, G, N}) * 0.3, k = at::randn({B, T, G, N}) * 0.3;
  const at::Tensor v = at::randn({B, T, H, P});
  const at::Tensor g = -at::softplus(at::randn({B, T, H})) * 0.3;
  const at::Tensor initial = at::randn({B, H, N, P});
  for (bool from_state : {false, true}) {
    const std::string what = from_state ? "from a random state" : "from zeros";
    at::Tensor S = from_state ? initial.to(at::kDouble).clone() : at::zeros({B, H, N, P}, at::kDouble);
    at::Tensor ref = at::empty({B, T, H, P}, at::kDouble);
    const at::Tensor qh = q.to(at::kDouble).repeat_interleave(H / G, 2),
                     kh = k.to(at::kDouble).repeat_interleave(H / G, 2);
    const at::Tensor vd = v.to(at::kDouble), gd = g.to(at::kDouble);
    for (int64_t t = 0; t < T; ++t) {
      S = S * gd.select(1, t).exp().view({B, H, 1, 1}) + kh.select(1, t).unsqueeze(-1) * vd.select(1, t).unsqueeze(2);
      ref.select(1, t).copy_((S * qh.select(1, t).unsqueeze(-1)).sum(2));
    }
    const auto cuda = [](const at::Tensor& x) { return x.to(kCuda); };
    const at::Tensor out =
        frozen::ssd_chunks(cuda(q), cuda(k), cuda(v), cuda(g), from_state ? cuda(initial) : at::Tensor(), true);
    ASSERT_TRUE(out.defined()) << what;
    ASSERT_EQ(out.sizes(), v.sizes()) << what;
    EXPECT_EQ(out.scalar_type(), at::kFloat) << what;
    const double e = rel_err(out, ref);
    std::cout << "Mamba-2 rule " << what << ": out rel err " << e << "\n";
    EXPECT_LE(e, 5e-6) << what;
  }
  // a bf16 input is read as float32; where the kernels do not run: undefined, and the caller runs ATen's ops
  const auto bf16 = [](const at::Tensor& x) { return x.to(kCuda, at::kBFloat16); };
  EXPECT_TRUE(frozen::ssd_chunks(bf16(q), bf16(k), v.to(kCuda), g.to(kCuda)).defined());
  EXPECT_FALSE(frozen::ssd_chunks(q.to(kCuda), k.to(kCuda), v.to(kCuda), g.to(kCuda), at::Tensor(), false).defined());
  const at::Tensor k64 = k.narrow(3, 0, 64).contiguous().to(kCuda);
  EXPECT_FALSE(frozen::ssd_chunks(k64, k64, v.to(kCuda), g.to(kCuda)).defined());
  EXPECT_FALSE(frozen::ssd_chunks(q, k, v, g).defined());  // the CPU
}

// gpt-oss's clamped GLU with each row's expert's bias: the engine's pass against ATen's ops, with
// and without biases, vectorised (I = 2880, gpt-oss's width; 96) and general (I = 1001; an
// unaligned gate_up), and a limit that clamps a good share of the values (not vacuous).
TEST(CudaOps, ClampedGluEqualsAtenOps) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(9);
  for (const int64_t I : {2880, 96, 1001})
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      const int64_t rows = 300, E = 8;
      const at::Tensor gate_up = at::randn({rows, 2 * I}, opts) * 3, bias = at::randn({E, 2 * I}, opts);
      const at::Tensor expert = at::randint(0, E, {rows}, opts.dtype(at::kLong));
      const std::string name = std::string(c10::toString(dtype)) + " I " + std::to_string(I);
      for (double limit : {2.0, 7.0}) {
        const std::string tag = name + " limit " + std::to_string(limit).substr(0, 3);
        expect_agree(frozen::clamped_glu(gate_up, bias, expert, 1.702, limit, true),
                     frozen::clamped_glu(gate_up, bias, expert, 1.702, limit, false), tag + " clamped_glu, biases");
        expect_agree(frozen::clamped_glu(gate_up, at::Tensor(), at::Tensor(), 1.702, limit, true),
                     frozen::clamped_glu(gate_up, at::Tensor(), at::Tensor(), 1.702, limit, false),
                     tag + " clamped_glu");
      }
      const double clamped =
          (gate_up + bias.index_select(0, expert)).abs().gt(2.0).to(at::kDouble).mean().item<double>();
      EXPECT_GT(clamped, 0.2) << name;
      const at::Tensor shifted =
          at::empty({gate_up.numel() + 1}, opts).narrow(0, 1, gate_up.numel()).view(gate_up.sizes()).copy_(gate_up);
      expect_agree(cuda_ops::clamped_glu(shifted, bias, expert, 1.702, 2.0),
                   frozen::clamped_glu(gate_up, bias, expert, 1.702, 2.0, false), name + " clamped_glu unaligned");
    }
}

TEST(CudaOps, FrozenDecoderOpsEqualTransformersOps) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(11);
  // Qwen3-8B's heads (32 / 8 at D = 128: 48 head slots per token), and smaller ones (12 / 3: odd head
  // counts; D = 96: the RoPE kernel's general form).
  for (const FrozenShape shape :
       {FrozenShape{4096, 128, 1000, 32, 8}, FrozenShape{1024, 64, 512, 8, 2}, FrozenShape{2048, 256, 512, 16, 4},
        FrozenShape{1100, 96, 1001, 8, 2}, FrozenShape{1536, 128, 512, 12, 3}})
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      const std::string name = std::string(c10::toString(dtype)) + " H " + std::to_string(shape.H) + " D " +
                               std::to_string(shape.D) + " I " + std::to_string(shape.I) + " heads " +
                               std::to_string(shape.Hq) + "/" + std::to_string(shape.Hkv);
      const int64_t B = 2, T = 37, H = shape.H, Hq = shape.Hq, Hkv = shape.Hkv, D = shape.D, I = shape.I;
      const at::Tensor x = at::randn({B, T, H}, opts), delta = at::randn({B, T, H}, opts);
      const at::Tensor w = 1 + 0.1 * at::randn({H}, opts);
      const auto [s_f, n_f] = frozen::add_rms_norm(x, delta, w, 1e-6, true);
      const auto [s_p, n_p] = frozen::add_rms_norm(x, delta, w, 1e-6, false);
      expect_agree(s_f, s_p, name + " add_rms_norm sum");
      expect_agree(n_f, n_p, name + " add_rms_norm normed");
      expect_agree(frozen::add_rms_norm(x, at::Tensor(), w, 1e-6, true).second,
                   frozen::add_rms_norm(x, at::Tensor(), w, 1e-6, false).second, name + " rms_norm");
      if (dtype != at::kFloat) {
        // A float32 weight (gpt-oss's norms): applied in float32 and rounded once, in the kernel as in
        // ATen's ops; not the weight rounded to the dtype first (that moves many values by an ulp).
        const at::Tensor w32 = 1 + 0.1 * at::randn({H}, opts.dtype(at::kFloat));
        const at::Tensor n32 = frozen::add_rms_norm(x, delta, w32, 1e-6, true).second;
        ASSERT_EQ(n32.scalar_type(), dtype) << name;
        expect_agree(n32, frozen::add_rms_norm(x, delta, w32, 1e-6, false).second,
                     name + " add_rms_norm normed, float32 weight");
        expect_agree(frozen::add_rms_norm(x, at::Tensor(), w32, 1e-6, true).second,
                     frozen::add_rms_norm(x, at::Tensor(), w32, 1e-6, false).second,
                     name + " rms_norm, float32 weight");
        const double apart =
            agreement(n32, frozen::add_rms_norm(x, delta, w32.to(dtype), 1e-6, false).second).share_differing;
        std::cout << name << " float32 weight against it rounded first: " << 100 * apart << "% of values differ\n";
        EXPECT_GT(apart, 0.05) << name;
      }
      {
        // x read from, and the sum written into, slices of wider buffers (the hf target's states [B, T, E, H]).
        const at::Tensor wide_x = at::randn({B, T, 3, H}, opts), wide_sum = at::full({B, T, 2, H}, 7.0, opts);
        const at::Tensor xs = wide_x.select(2, 1), into = wide_sum.select(2, 0);
        const auto [s_s, n_s] = frozen::add_rms_norm(xs, delta, w, 1e-6, true, into);
        const auto [s_c, n_c] = frozen::add_rms_norm(xs.contiguous(), delta, w, 1e-6, false);
        EXPECT_EQ(s_s.data_ptr(), into.data_ptr()) << name << " strided add_rms_norm: the sum is not in sum_into";
        expect_agree(into.contiguous(), s_c, name + " strided add_rms_norm sum");
        expect_agree(n_s, n_c, name + " strided add_rms_norm normed");
        EXPECT_TRUE(at::equal(wide_sum.select(2, 1), at::full({B, T, H}, 7.0, opts)))
            << name << " strided add_rms_norm wrote outside its slice";
      }
      const at::Tensor qkv = at::randn({B, T, (Hq + 2 * Hkv) * D}, opts) * 3;
      const at::Tensor qn = 1 + 0.1 * at::randn({D}, opts), kn = 1 + 0.1 * at::randn({D}, opts);
      const at::Tensor pos = at::arange(T, at::TensorOptions().device(at::kCUDA).dtype(at::kLong)) * 37 + 5;
      const auto [cos, sin] = rope_tables(pos, 1e6, D, dtype);  // [T, D]
      for (bool norms : {true, false}) {
        const at::Tensor a = norms ? qn : at::Tensor(), b = norms ? kn : at::Tensor();
        const frozen::Qkv f = frozen::qkv_rope(qkv, Hq, Hkv, a, b, 1e-6, cos, sin, true);
        const frozen::Qkv p = frozen::qkv_rope(qkv, Hq, Hkv, a, b, 1e-6, cos, sin, false);
        const std::string tag = name + (norms ? " qkv_rope (q/k norms)" : " qkv_rope");
        expect_agree(f.q, p.q, tag + " q");
        expect_agree(f.k, p.k, tag + " k");
        EXPECT_TRUE(at::equal(f.v, p.v)) << tag << " v";
      }
      {
        // A q|k|v buffer one element off 16-byte alignment takes the general (unvectorised) kernel.
        const at::Tensor shifted =
            at::empty({qkv.numel() + 1}, opts).narrow(0, 1, qkv.numel()).view(qkv.sizes()).copy_(qkv);
        ASSERT_NE(reinterpret_cast<uintptr_t>(shifted.data_ptr()) % 16, 0u);
        const frozen::Qkv f = frozen::qkv_rope(shifted, Hq, Hkv, qn, kn, 1e-6, cos, sin, true);
        const frozen::Qkv p = frozen::qkv_rope(qkv, Hq, Hkv, qn, kn, 1e-6, cos, sin, false);
        expect_agree(f.q, p.q, name + " qkv_rope unaligned q");
        expect_agree(f.k, p.k, name + " qkv_rope unaligned k");
        EXPECT_TRUE(at::equal(f.v, p.v)) << name << " qkv_rope unaligned v";
      }
      // Per-sequence tables [B, 1, T, D] (packed rows: positions from each document's start).
      const at::Tensor bpos = at::stack({pos, pos.flip(0)});
      const auto [bc, bs] = rope_tables(bpos, 1e4, D, dtype);
      const frozen::Qkv f = frozen::qkv_rope(qkv, Hq, Hkv, qn, kn, 1e-6, bc.unsqueeze(1), bs.unsqueeze(1), true);
      const frozen::Qkv p = frozen::qkv_rope(qkv, Hq, Hkv, qn, kn, 1e-6, bc.unsqueeze(1), bs.unsqueeze(1), false);
      expect_agree(f.q, p.q, name + " qkv_rope per-sequence tables q");
      // A partial rotary factor (GLM-4.5: each head's first R dimensions rotate, the rest pass on,
      // normed where the norms are): the engine's kernel, called directly (vectorised at R = D / 2;
      // the general kernel at R = D / 2 - 2 and on an unaligned buffer), against ATen's ops.
      for (const int64_t R : {D / 2, D / 2 - 2}) {
        const auto [pc, ps] = rope_tables(pos, 1e6, R, dtype);  // [T, R]
        const at::Tensor heads_q = qkv.narrow(-1, 0, Hq * D).view({B, T, Hq, D}).transpose(1, 2);
        for (bool norms : {true, false}) {
          const at::Tensor a = norms ? qn : at::Tensor(), b = norms ? kn : at::Tensor();
          const cuda_ops::Qkv f = cuda_ops::qkv_rope(qkv, Hq, Hkv, a, b, 1e-6, pc, ps);
          const frozen::Qkv p = frozen::qkv_rope(qkv, Hq, Hkv, a, b, 1e-6, pc, ps, false);
          const std::string tag =
              name + " qkv_rope R " + std::to_string(R) + " of " + std::to_string(D) + (norms ? " (q/k norms)" : "");
          expect_agree(f.q, p.q, tag + " q");
          expect_agree(f.k, p.k, tag + " k");
          EXPECT_TRUE(at::equal(f.v, p.v)) << tag << " v";
          // the columns past R are passed on as they are (no norm), the first R are not
          if (!norms) {
            EXPECT_TRUE(at::equal(f.q.narrow(-1, R, D - R), heads_q.narrow(-1, R, D - R))) << tag;
            EXPECT_FALSE(at::equal(f.q.narrow(-1, 0, R), heads_q.narrow(-1, 0, R))) << tag;
          }
        }
        const at::Tensor shifted =
            at::empty({qkv.numel() + 1}, opts).narrow(0, 1, qkv.numel()).view(qkv.sizes()).copy_(qkv);
        const cuda_ops::Qkv f = cuda_ops::qkv_rope(shifted, Hq, Hkv, qn, kn, 1e-6, pc, ps);
        const frozen::Qkv p = frozen::qkv_rope(qkv, Hq, Hkv, qn, kn, 1e-6, pc, ps, false);
        expect_agree(f.q, p.q, name + " qkv_rope R " + std::to_string(R) + " unaligned q");
        expect_agree(f.k, p.k, name + " qkv_rope R " + std::to_string(R) + " unaligned k");
      }
      const at::Tensor gate_up = at::randn({B, T, 2 * I}, opts) * 2;
      const at::Tensor sw_f = frozen::swiglu_packed(gate_up, true), sw_p = frozen::swiglu_packed(gate_up, false);
      ASSERT_EQ(sw_f.sizes(), sw_p.sizes());
      expect_agree(sw_f, sw_p.contiguous(), name + " swiglu_packed");
      // Gemma 3's GLU: GELU's tanh approximation of the gate (ATen's gelu(gate, "tanh") * up)
      const at::Tensor ge_f = frozen::gelu_tanh_packed(gate_up, true), ge_p = frozen::gelu_tanh_packed(gate_up, false);
      expect_agree(ge_f, ge_p.contiguous(), name + " gelu_tanh_packed");
      EXPECT_FALSE(at::equal(ge_f, sw_f)) << name << " gelu_tanh_packed is not SiLU's";
      {
        // A mixture of experts' rows back to their tokens (8 experts a token, rows in a random
        // order as the sort by expert leaves them; weights summing to 1 per token, as renormalised);
        // the sum over k in float32 in the kernel's order and ATen's.
        const int64_t N = B * T, k = 8;
        const at::Tensor rows = at::randn({N * k, H}, opts) * 3;
        const at::Tensor weights = at::softmax(at::randn({N, k}, opts.dtype(at::kFloat)), -1).to(dtype);
        const at::Tensor slot =
            at::randperm(N * k, at::TensorOptions().device(at::kCUDA).dtype(at::kLong)).view({N, k});
        expect_agree(frozen::combine_experts(rows, weights, slot, true),
                     frozen::combine_experts(rows, weights, slot, false), name + " combine_experts");
        // Mixtral's router: the weights stay in float32, so no product is rounded to the dtype.
        const at::Tensor float_weights = at::softmax(at::randn({N, k}, opts.dtype(at::kFloat)), -1);
        const at::Tensor fused = frozen::combine_experts(rows, float_weights, slot, true);
        ASSERT_EQ(fused.scalar_type(), dtype);
        expect_agree(fused, frozen::combine_experts(rows, float_weights, slot, false),
                     name + " combine_experts (float32 weights)");
        if (dtype != at::kFloat) {  // not vacuous: the products rounded to the dtype give other sums
          const at::Tensor rounded = frozen::combine_experts(rows, float_weights.to(dtype), slot, true);
          EXPECT_FALSE(at::equal(fused, rounded)) << name << " float32 weights summed as the dtype's";
        }
      }
    }
}

// x += a w^T in the product's epilogue (the hf target's residual adds on the engine's path), in
// place, on fresh random inputs, against the float64 sum and the separate add it replaces,
// x + linear(a, w) (transformers' ops, on the same device). cuBLAS's kernel decides the roundings:
// at Qwen3-8B's shapes every value equals the separate add's (on an H100), at 74 rows the sum is
// rounded once. 16-bit dtypes, in units in the last place of the float64 sum (at max(|value|,
// RMS)): at most half a unit (one rounding) further than the separate add, and on average no
// further than 1.5x it; float32 within the accumulation's error bound K eps (|a| |w|^T + |x|) plus
// a rounding. Off the engine's path it touches nothing.
TEST(CudaOps, FrozenAddLinearAddsInTheProduct) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(12);
  struct Shape {
    int64_t B, T, K, N;
  };
  // Odd sizes at 74 and 256 rows; Qwen3-8B's o_proj and down at S = 3072.
  for (const Shape sh :
       {Shape{2, 37, 1000, 1100}, Shape{2, 128, 1000, 1100}, Shape{1, 3072, 4096, 4096}, Shape{1, 3072, 12288, 4096}})
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const int64_t B = sh.B, T = sh.T, K = sh.K, N = sh.N;
      const auto opts = at::TensorOptions().device(at::kCUDA).dtype(dtype);
      const std::string name = std::string(c10::toString(dtype)) + " add_linear_ " + std::to_string(B * T) + " x " +
                               std::to_string(K) + " x " + std::to_string(N);
      const at::Tensor x = at::randn({B, T, N}, opts) * 4, a = at::randn({B, T, K}, opts),
                       w = at::randn({N, K}, opts) * 0.05;
      const at::Tensor want = x.to(at::kDouble) + at::matmul(a.to(at::kDouble), w.to(at::kDouble).t());
      at::Tensor got = x.clone();
      const void* where = got.data_ptr();
      ASSERT_TRUE(frozen::add_linear_(got, a, w, true)) << name;
      EXPECT_EQ(got.data_ptr(), where) << name << ": not in place";
      if (dtype == at::kFloat) {
        const at::Tensor bound =
            K * std::ldexp(1.0, -24) * (at::matmul(a.to(at::kDouble).abs(), w.to(at::kDouble).abs().t()) + x.abs()) +
            want.abs() * std::ldexp(1.0, -24);
        const double worst = ((got.to(at::kDouble) - want).abs() / bound).max().item<double>();
        std::cout << name << ": worst error / bound " << worst << "\n";
        EXPECT_LE(worst, 1.0) << name;
      } else {
        // Errors in units in the last place of the float64 sum (at max(|value|, RMS)), ours and the
        // separate add's (x + linear(a, w): transformers' ops, on the same device).
        const int mant = dtype == at::kBFloat16 ? 7 : 10;
        const double rms = want.pow(2).mean().sqrt().item<double>();
        const at::Tensor ulp = at::pow(2.0, at::floor(at::log2(want.abs().clamp_min(rms))) - mant);
        const at::Tensor separate = x + at::linear(a, w);
        const at::Tensor ours = (got.to(at::kDouble) - want).abs() / ulp,
                         apart = (separate.to(at::kDouble) - want).abs() / ulp;
        const double max_ours = ours.max().item<double>(), mean_ours = ours.mean().item<double>(),
                     max_apart = apart.max().item<double>(), mean_apart = apart.mean().item<double>();
        std::cout << name << ": max " << max_ours << " ulp, mean " << mean_ours << " (the separate add: max "
                  << max_apart << ", mean " << mean_apart << "); equal to the separate add "
                  << 100 * got.eq(separate).to(at::kDouble).mean().item<double>() << "%\n";
        EXPECT_LE(max_ours, max_apart + 0.5) << name;
        EXPECT_LE(mean_ours, 1.5 * mean_apart) << name;
      }
      at::Tensor cpu = x.cpu(), kept = cpu.clone();
      EXPECT_FALSE(frozen::add_linear_(cpu, a.cpu(), w.cpu(), true)) << name << " on the CPU";
      const at::Tensor before = got.clone();
      EXPECT_FALSE(frozen::add_linear_(got, a, w, false)) << name << " not fused";
      EXPECT_TRUE(at::equal(cpu, kept)) << name << ": the CPU path changed x";
      EXPECT_TRUE(at::equal(got, before)) << name << ": not fused, x changed";
    }
}

// The gate / up product with SwiGLU in its epilogue (cuda_ops::linear_swiglu, the engine's Hopper
// kernel): on a compute capability 9.0 device it must be as close to the float32 product rounded
// and put through swiglu_packed as cuBLAS's product followed by the pass is. frozen::linear_swiglu
// takes it only with FLASHDRAFT_GEMM_SWIGLU=1 (not set here): it is that product and pass.
TEST(CudaOps, LinearSwigluMatchesTheProductThenThePass) {
  REQUIRE_CUDA_OPS();
  at::manual_seed(41);
  const bool hopper = cuda_ops::compute_capability(kCuda) == 90;
  struct Shape {
    int64_t B, T, K, I;
  };
  // rows ending inside a 128-row tile (1, 77, 2 x 333), one and several column blocks, and
  // Qwen3-8B's MLP at S = 3072; K = 100 and I = 200 are shapes the kernel does not take.
  for (const Shape sh : {Shape{1, 1, 64, 128}, Shape{1, 77, 512, 384}, Shape{2, 333, 1024, 256},
                         Shape{1, 3072, 4096, 12288}, Shape{1, 50, 100, 128}, Shape{1, 50, 128, 200}}) {
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    const at::Tensor x = at::randn({sh.B, sh.T, sh.K}, opts),
                     w = at::randn({2 * sh.I, sh.K}, opts).mul_(1.0 / std::sqrt(double(sh.K)));
    const std::string name =
        "linear_swiglu " + std::to_string(sh.B * sh.T) + " x " + std::to_string(sh.K) + " x " + std::to_string(sh.I);
    const bool takes = sh.K % 64 == 0 && sh.I % 128 == 0;
    const at::Tensor apart = frozen::swiglu_packed(at::linear(x, w), true);
    EXPECT_TRUE(at::equal(frozen::linear_swiglu(x, w, true), apart)) << name << ": the product and the pass";
    EXPECT_EQ(cuda_ops::linear_swiglu_applies(x, w), hopper && takes) << name;
    if (!(hopper && takes)) {
      EXPECT_THROW(cuda_ops::linear_swiglu(x, w), std::exception) << name;
      continue;
    }
    const at::Tensor got = cuda_ops::linear_swiglu(x, w);
    ASSERT_EQ(got.sizes(), apart.sizes()) << name;
    const at::Tensor ref =
        frozen::swiglu_packed(at::matmul(x.to(at::kFloat), w.to(at::kFloat).t()).to(at::kBFloat16), true);
    const double e_got = rel_err(got, ref), e_apart = rel_err(apart, ref);
    const double eq_got = got.eq(ref).to(at::kDouble).mean().item<double>(),
                 eq_apart = apart.eq(ref).to(at::kDouble).mean().item<double>();
    std::cout << name << ": against the float32 product, the kernel " << e_got << " (" << 100 * eq_got
              << "% equal), cuBLAS + the pass " << e_apart << " (" << 100 * eq_apart << "% equal)\n";
    EXPECT_LE(e_got, 1.5 * e_apart + 1e-4) << name;
    EXPECT_GE(eq_got, eq_apart - 0.01) << name;
    EXPECT_GT(got.abs().max().item<double>(), 0.1) << name;  // not a zero result that happens to agree
  }
}

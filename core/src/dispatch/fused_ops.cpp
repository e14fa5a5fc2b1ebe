// flashdraft/ops.hpp: drafter building blocks on the engine's CUDA kernels or ATen.
#include <flashdraft/ops.hpp>

#include "dispatch/cuda_ops.hpp"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include <ATen/CPUGeneratorImpl.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

namespace flashdraft {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// silu(g) * u saving g and u only (the product and silu(g) are recomputed in the
// backward: two [tokens, ffn] tensors fewer than autograd's composite keeps).
struct SwiGLU : public torch::autograd::Function<SwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    if (cuda_ops::runs_on(g)) return cuda_ops::swiglu_forward(g, u);
    return at::silu(g) * u;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    const at::Tensor& dy = grads[0];
    if (cuda_ops::runs_on(g)) {
      auto [dg, du] = cuda_ops::swiglu_backward(g, u, dy);
      return {dg, du};
    }
    const at::Tensor sig = at::sigmoid(g);
    // d silu(g) / dg = sig * (1 + g * (1 - sig))
    return {dy * u * (sig * (1 + g * (1 - sig))), dy * (g * sig)};
  }
};

// RoPE saving only the tables. Forward halves y1 = x1 c - x2 s, y2 = x2 c + x1 s; so
// dx1 = dy1 c + dy2 s and dx2 = dy2 c - dy1 s, i.e. dy * cos + rotate_half^T(dy * sin)
// with rotate_half^T(v) = [v2, -v1].
struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    if (cuda_ops::rope_runs(x, cos, sin)) return cuda_ops::rope(x, cos, sin, /*transpose=*/false);
    const int64_t half = x.size(-1) / 2;
    return x * cos + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& cos = saved[0];
    const at::Tensor& sin = saved[1];
    const at::Tensor& dy = grads[0];
    if (cuda_ops::rope_runs(dy, cos, sin))
      return {cuda_ops::rope(dy, cos, sin, /*transpose=*/true), at::Tensor(), at::Tensor()};
    const at::Tensor ds = dy * sin;
    const int64_t half = ds.size(-1) / 2;
    return {dy * cos + at::cat({ds.narrow(-1, half, half), -ds.narrow(-1, 0, half)}, -1), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return Rope::apply(x, cos, sin); }

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, double theta, int64_t head_dim,
                                              at::ScalarType dtype) {
  const auto dopts = at::TensorOptions().dtype(at::kDouble).device(positions.device());
  const at::Tensor inv = at::pow(theta, -at::arange(0, head_dim, 2, dopts) / double(head_dim));
  const at::Tensor ang = positions.to(at::kDouble).unsqueeze(-1) * inv;  // [..., D/2]
  const at::Tensor full = at::cat({ang, ang}, -1);                       // [..., D]
  return {full.cos().to(dtype), full.sin().to(dtype)};
}

at::Tensor rope_inv_freq(double theta, int64_t dim, const RopeScaling& r) {
  const at::Tensor exponents = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
  const at::Tensor pos_freqs = at::pow(at::tensor(theta, at::kFloat), exponents / double(dim));
  const at::Tensor inv = 1.0 / pos_freqs;
  if (r.type == "linear") return inv / r.factor;
  if (r.type == "yarn") {
    // extrapolated (1 / theta^(2i/D)) for the fast dimensions, interpolated (also / factor) for the slow ones, a
    // linear ramp between the dimensions that turn beta_fast and beta_slow times over the pretraining length
    const auto correction_dim = [&](double rotations) {
      return double(dim) * std::log(double(r.original_max_position) / (rotations * 2 * M_PI)) / (2 * std::log(theta));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, double(dim) - 1);
    if (low == high) high += 0.001;  // as transformers: no zero-width ramp
    const at::Tensor ramp =
        ((at::arange(dim / 2, at::TensorOptions().dtype(at::kFloat)) - low) / (high - low)).clamp(0, 1);
    const at::Tensor extrapolation = 1 - ramp;
    const at::Tensor inv_interpolated = 1.0 / (r.factor * pos_freqs);
    return inv_interpolated * (1 - extrapolation) + inv * extrapolation;
  }
  if (r.type != "llama3") return inv;
  const double low_wavelen = double(r.original_max_position) / r.low_freq_factor;
  const double high_wavelen = double(r.original_max_position) / r.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv;
  const at::Tensor out = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  const at::Tensor smooth =
      (double(r.original_max_position) / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * out / r.factor + smooth * out;
  const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
  return at::where(medium, smoothed, out);
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq,
                                              double attention_factor, at::ScalarType dtype) {
  const at::Tensor inv = inv_freq.to(positions.device(), at::kDouble);
  const at::Tensor ang = positions.to(at::kDouble).unsqueeze(-1) * inv;  // [..., D/2]
  const at::Tensor full = at::cat({ang, ang}, -1);                       // [..., D]
  if (attention_factor == 1.0) return {full.cos().to(dtype), full.sin().to(dtype)};
  return {(full.cos() * attention_factor).to(dtype), (full.sin() * attention_factor).to(dtype)};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) { return SwiGLU::apply(gate, up); }

namespace frozen {

namespace {

bool kernels_take(bool fused, const at::Tensor& t) {  // (runs_on: float32, bfloat16, float16 on CUDA)
  return fused && cuda_ops::runs_on(t);
}

bool adds_in_products() {  // add_linear_ on the engine's path, unless FLASHDRAFT_GEMM_ADD=0
  static const bool on = [] {
    const char* v = std::getenv("FLASHDRAFT_GEMM_ADD");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

// linear_swiglu's Hopper kernel, with FLASHDRAFT_GEMM_SWIGLU=1 (off by default: measured level with
// cuBLAS's product and the separate pass, not faster; bench/RESULTS.md "target_forward v6")
bool swiglu_in_product() {
  static const bool on = [] {
    const char* v = std::getenv("FLASHDRAFT_GEMM_SWIGLU");
    return v && std::string(v) == "1";
  }();
  return on;
}

at::Tensor plain_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  // a float32 weight on a narrower x (gpt-oss's): applied in float32, one rounding after it
  if (w.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat) return (w * normed).to(x.scalar_type());
  return w * normed.to(x.scalar_type());
}

at::Tensor plain_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
}

// Tables [T, D] or [Bt, T, D] as [Bt, 1, T, D] (broadcast over heads); [Bt, 1, T, D] as given.
at::Tensor per_head(const at::Tensor& table) {
  if (table.dim() == 2) return table.unsqueeze(0).unsqueeze(0);
  if (table.dim() == 3) return table.unsqueeze(1);
  return table;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                               double eps, bool fused, const at::Tensor& sum_into) {
  if (sum_into.defined() && !(delta.defined() && sum_into.sizes() == x.sizes() &&
                              sum_into.scalar_type() == x.scalar_type() && sum_into.device() == x.device()))
    throw std::invalid_argument("add_rms_norm: sum_into " + c10::str(sum_into.sizes()) + " must have x's shape " +
                                c10::str(x.sizes()) + ", dtype and device, and come with a delta to add");
  const int64_t H = x.size(-1);
  const bool rows = cuda_ops::row_stride(x) >= H && (!sum_into.defined() || cuda_ops::row_stride(sum_into) >= H);
  if (kernels_take(fused, x) && rows && (!delta.defined() || delta.is_contiguous()) &&
      (w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat)) {
    if (!delta.defined()) return {x, cuda_ops::add_rms_norm(x, delta, at::Tensor(), w, eps)};
    at::Tensor sum = sum_into.defined() ? sum_into : at::empty_like(delta);
    at::Tensor normed = cuda_ops::add_rms_norm(x, delta, sum, w, eps);
    return {sum, normed};
  }
  if (!delta.defined()) return {x, plain_rms_norm(x, w, eps)};
  at::Tensor sum = sum_into;
  if (sum.defined())
    at::add_out(sum, x, delta);
  else
    sum = x + delta;
  return {sum, plain_rms_norm(sum, w, eps)};
}

Qkv qkv_rope(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm, const at::Tensor& k_norm,
             double eps, const at::Tensor& cos, const at::Tensor& sin, bool fused) {
  const int64_t D = qkv.size(-1) / (heads + 2 * kv_heads), R = cos.size(-1);
  // (the kernel applies norm weights in qkv's dtype; float32 ones, Qwen3.5's 1 + w, take ATen's ops)
  const auto kernel_norm = [&](const at::Tensor& w) { return !w.defined() || w.scalar_type() == qkv.scalar_type(); };
  if (kernels_take(fused, qkv) && qkv.is_contiguous() && qkv.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() &&
      R <= D && R % 2 == 0 && kernel_norm(q_norm) && kernel_norm(k_norm)) {
    const cuda_ops::Qkv r = cuda_ops::qkv_rope(qkv, heads, kv_heads, q_norm, k_norm, eps, cos, sin);
    return {r.q, r.k, r.v};
  }
  const int64_t B = qkv.size(0), T = qkv.size(1);
  auto split = [&](int64_t first, int64_t n) {
    return qkv.narrow(-1, first * D, n * D).view({B, T, n, D}).transpose(1, 2);
  };
  at::Tensor q = split(0, heads), k = split(heads, kv_heads);
  if (q_norm.defined()) q = plain_rms_norm(q, q_norm, eps);
  if (k_norm.defined()) k = plain_rms_norm(k, k_norm, eps);
  const at::Tensor c = per_head(cos), s = per_head(sin);
  // tables narrower than a head (a partial rotary factor): the first R dimensions rotate, the rest pass
  const auto rope = [&](const at::Tensor& x) {
    if (R == D) return plain_rope(x, c, s).contiguous();
    return at::cat({plain_rope(x.narrow(-1, 0, R), c, s), x.narrow(-1, R, D - R)}, -1);
  };
  return {rope(q), rope(k), split(heads + kv_heads, kv_heads).contiguous()};
}

std::string kernels_on(const c10::Device& device, bool fused) {
  if (!fused || !device.is_cuda() || !cuda_ops::cuda_ops_built()) return "transformers' ATen ops";
  std::string s = "the engine's CUDA kernels";
  if (cuda_ops::programmatic_launch(device)) s += ", launched with programmatic dependent launch";
  if (adds_in_products()) s += "; residual adds in the matrix products";
  if (swiglu_in_product() && cuda_ops::linear_swiglu_device(device)) s += "; SwiGLU in the gate / up product";
  return s;
}

bool add_linear_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& w, bool fused) {
  if (!adds_in_products() || !kernels_take(fused, x) || !x.is_contiguous() || a.scalar_type() != x.scalar_type() ||
      w.scalar_type() != x.scalar_type())
    return false;
  x.view({-1, x.size(-1)}).addmm_(a.reshape({-1, a.size(-1)}), w.t());
  return true;
}

at::Tensor swiglu_packed(const at::Tensor& gate_up, bool fused) {
  if (kernels_take(fused, gate_up) && gate_up.is_contiguous()) return cuda_ops::swiglu_packed(gate_up);
  const int64_t I = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, I)) * gate_up.narrow(-1, I, I);
}

at::Tensor gelu_tanh_packed(const at::Tensor& gate_up, bool fused) {
  if (kernels_take(fused, gate_up) && gate_up.is_contiguous()) return cuda_ops::gelu_tanh_packed(gate_up);
  const int64_t I = gate_up.size(-1) / 2;
  return at::gelu(gate_up.narrow(-1, 0, I), "tanh") * gate_up.narrow(-1, I, I);
}

at::Tensor linear_swiglu(const at::Tensor& x, const at::Tensor& gate_up, bool fused) {
  if (swiglu_in_product() && kernels_take(fused, x) && cuda_ops::linear_swiglu_applies(x, gate_up))
    return cuda_ops::linear_swiglu(x, gate_up);
  return swiglu_packed(at::linear(x, gate_up), fused);
}

at::Tensor combine_experts(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& slot, bool fused) {
  if (kernels_take(fused, rows) && rows.is_contiguous())
    return cuda_ops::combine_experts(rows, weights.contiguous(), slot.contiguous());
  const int64_t k = weights.size(1), H = rows.size(1);
  const at::Tensor weighted = rows.index_select(0, slot.reshape({-1})) * weights.reshape({-1, 1});
  return weighted.view({-1, k, H}).sum(1, /*keepdim=*/false, at::kFloat).to(rows.scalar_type());
}

std::pair<at::Tensor, at::Tensor> gated_delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& g, const at::Tensor& beta,
                                                     const at::Tensor& initial, bool fused) {
  if (!fused || !cuda_ops::gated_delta_runs(k, v) || k.size(1) % 64 != 0 || k.size(1) == 0) return {};
  const auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; };
  const cuda_ops::GatedDelta r = cuda_ops::gated_delta_chunks(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(initial));
  return {r.out, r.state};
}

at::Tensor ssd_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& initial, bool fused) {
  static const bool on = [] {  // FLASHDRAFT_SSD=0: ATen's ops instead, for measuring the kernels against them
    const char* v = std::getenv("FLASHDRAFT_SSD");
    return !(v && std::string(v) == "0");
  }();
  if (!fused || !on || !cuda_ops::ssd_runs(k, v) || k.size(1) == 0) return {};
  const auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; };
  return cuda_ops::ssd_chunks(f32(q), f32(k), f32(v), f32(g), f32(initial));
}

at::Tensor clamped_glu(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert, double alpha,
                       double limit, bool fused) {
  if (kernels_take(fused, gate_up) && gate_up.dim() == 2 && gate_up.is_contiguous())
    return cuda_ops::clamped_glu(gate_up, bias.defined() ? bias.contiguous() : bias,
                                 expert.defined() ? expert.contiguous() : expert, alpha, limit);
  const at::Tensor gu = bias.defined() ? gate_up + bias.index_select(0, expert) : gate_up;
  const int64_t I = gu.size(-1) / 2;
  const at::Tensor gate = gu.narrow(-1, 0, I).clamp_max(limit);
  const at::Tensor up = gu.narrow(-1, I, I).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, c10::ScalarType dtype, bool fused) {
  const at::Tensor probe = at::empty({0}, blocks.options().dtype(dtype));  // the kernels take this dtype there
  if (kernels_take(fused, probe)) return cuda_ops::dequantize_mxfp4(blocks.contiguous(), scales.contiguous(), dtype);
  const at::Tensor lut = at::tensor(std::vector<float>{0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f,
                                                       -2.f, -3.f, -4.f, -6.f})
                             .to(blocks.device());
  std::vector<int64_t> shape(scales.sizes().begin(), scales.sizes().end());
  shape.back() *= 32;
  at::Tensor out = at::empty(shape, blocks.options().dtype(dtype));
  // a leading index at a time: the codes' int64 indices are 8 bytes a value
  const at::Tensor b = blocks.reshape({blocks.size(0), -1}), s = scales.reshape({scales.size(0), -1});
  const at::Tensor o = out.view({out.size(0), -1});
  for (int64_t e = 0; e < b.size(0); ++e) {
    const at::Tensor codes = b[e].to(at::kLong);
    const at::Tensor lo = lut.index_select(0, codes.bitwise_and(15)),
                     hi = lut.index_select(0, codes.bitwise_right_shift(4));
    const at::Tensor values = at::stack({lo, hi}, -1).view({-1, 32});  // [G, 32]
    o[e].copy_((values * at::pow(2.0, s[e].to(at::kFloat) - 127).unsqueeze(-1)).view({-1}));
  }
  return out;
}

at::Tensor grouped_linear(const at::Tensor& rows, const at::Tensor& w, const at::Tensor& ends) {
  const int64_t item = static_cast<int64_t>(rows.element_size());
  const bool aligned = (w.size(1) * item) % 16 == 0 && (w.size(2) * item) % 16 == 0;
  const bool runs =
      rows.is_cpu() || (rows.scalar_type() == at::kBFloat16 && cuda_ops::compute_capability(rows.device()) >= 80);
  if (aligned && runs) return at::_grouped_mm(rows, w.transpose(-2, -1), ends);
  at::Tensor out = at::empty({rows.size(0), w.size(1)}, rows.options());
  const at::Tensor host = ends.to(at::kCPU, at::kLong);  // (waits for the device once)
  int64_t start = 0;
  for (int64_t g = 0; g < w.size(0); ++g) {
    const int64_t end = host.data_ptr<int64_t>()[g];
    if (end > start) {
      at::Tensor part = out.narrow(0, start, end - start);
      at::mm_out(part, rows.narrow(0, start, end - start), w[g].t());
    }
    start = end;
  }
  return out;
}

}  // namespace frozen

ParamMaker::ParamMaker(std::vector<std::pair<std::string, at::Tensor>>& params, uint64_t seed, uint64_t salt,
                       c10::Device device, c10::ScalarType dtype, double init_std)
    : params_(params),
      gen_(at::make_generator<at::CPUGeneratorImpl>(seed * 0x9E3779B97F4A7C15ULL + salt)),
      device_(device),
      dtype_(dtype),
      init_std_(init_std) {}

at::Tensor ParamMaker::linear(const std::string& name, int64_t out, int64_t in) {
  at::Tensor w = at::randn({out, in}, gen_, at::TensorOptions().dtype(at::kFloat)).mul_(init_std_);
  w = w.to(device_, dtype_).set_requires_grad(true);
  params_.emplace_back(name, w);
  return w;
}

at::Tensor ParamMaker::norm(const std::string& name, int64_t n) {
  at::Tensor w = at::ones({n}, at::TensorOptions().dtype(dtype_).device(device_)).set_requires_grad(true);
  params_.emplace_back(name, w);
  return w;
}

}  // namespace flashdraft

// The Llama / Qwen3 decoder blocks of layers.hpp.
#include <flashdraft/layers.hpp>
#include <flashdraft/ops.hpp>

#include <ATen/ATen.h>

namespace flashdraft::layers {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return at::rms_norm(x, {x.size(-1)}, w, eps);
}

at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim) {
  return x.view({x.size(0), x.size(1), heads, head_dim}).transpose(1, 2);
}

at::Tensor merge_heads(const at::Tensor& a) {
  return a.transpose(1, 2).reshape({a.size(0), a.size(2), a.size(1) * a.size(3)});
}

namespace {
at::Tensor normed_heads(const at::Tensor& x, const at::Tensor& proj, const at::Tensor& norm, int64_t heads,
                        int64_t head_dim, double eps) {
  const at::Tensor h = split_heads(at::linear(x, proj), heads, head_dim);
  return norm.defined() ? rms_norm(h, norm, eps) : h;
}
}  // namespace

at::Tensor SelfAttention::queries(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  return rope(normed_heads(x, q_proj, q_norm, heads, head_dim, eps), cos, sin);
}

at::Tensor SelfAttention::keys(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  return rope(normed_heads(x, k_proj, k_norm, kv_heads, head_dim, eps), cos, sin);
}

at::Tensor SelfAttention::values(const at::Tensor& x) const {
  return split_heads(at::linear(x, v_proj), kv_heads, head_dim);
}

at::Tensor SelfAttention::output(const at::Tensor& a) const { return at::linear(merge_heads(a), o_proj); }

at::Tensor SwiGluMlp::operator()(const at::Tensor& x) const {
  return at::linear(swiglu(at::linear(x, gate_proj), at::linear(x, up_proj)), down_proj);
}

}  // namespace flashdraft::layers

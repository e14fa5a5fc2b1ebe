// Tensor-level wrappers of the engine's CUDA kernels (cuda_ops.hpp).
#include "dispatch/cuda_ops.hpp"

#include <ATen/ATen.h>

#include <stdexcept>

#if FLASHDRAFT_CUDA_OPS
#include "engine_ops.cuh"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace flashdraft::cuda_ops {

int64_t row_stride(const at::Tensor& t) {
  if (t.dim() == 0 || t.stride(-1) != 1) return -1;
  if (t.dim() == 1) return t.size(0);
  for (int64_t d = 0; d + 2 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) != t.stride(d + 1) * t.size(d + 1)) return -1;
  return t.stride(-2);
}

#if FLASHDRAFT_CUDA_OPS

namespace {

DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default:
      throw std::invalid_argument(std::string(what) + " is " + c10::toString(t.scalar_type()) +
                                  "; the engine's CUDA kernels take float32, bfloat16 or float16");
  }
}

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

void same_device(const at::Tensor& a, const at::Tensor& b, const char* an, const char* bn) {
  require(b.device() == a.device(),
          std::string(bn) + " is on " + b.device().str() + " but " + an + " is on " + a.device().str());
}

// The row kernels' logits: a CUDA [rows, V] tensor with contiguous rows.
void check_logits(const at::Tensor& logits, const char* op, const char* what) {
  require(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
          std::string(op) + ": " + what + " must be a CUDA [rows, V] tensor with contiguous rows, got " +
              c10::str(logits.sizes()));
}

// A per-row vector the row kernels read beside `logits` (labels, a row index, row weights):
// contiguous [rows] of `dtype` on the logits' device.
void check_per_row(const at::Tensor& logits, const at::Tensor& v, at::ScalarType dtype, const char* op,
                   const char* what) {
  const int64_t rows = logits.size(0);
  require(v.dim() == 1 && v.size(0) == rows && v.scalar_type() == dtype && v.is_contiguous(),
          std::string(op) + ": " + what + " must be contiguous " + (dtype == at::kLong ? "int64" : "float32") + " [" +
              std::to_string(rows) + "]");
  same_device(logits, v, "the logits", what);
}

// The second operand of the two-distribution row kernels (the target's logits, given
// distributions): [rows, V] of `dtype` with contiguous rows, or [any, V] read through
// `index` ([rows] int64), on the draft logits' device.
void check_targets(const at::Tensor& draft, const at::Tensor& t, at::ScalarType dtype, const at::Tensor& index,
                   const char* op, const char* what, const char* index_what) {
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  require(t.dim() == 2 && t.size(1) == vocab && t.stride(1) == 1 && t.scalar_type() == dtype &&
              (index.defined() || t.size(0) == rows),
          std::string(op) + ": " + what + " must be " + c10::toString(dtype) + " [rows or indexed, " +
              std::to_string(vocab) + "] with contiguous rows, got " + c10::str(t.sizes()) + " " +
              c10::toString(t.scalar_type()));
  same_device(draft, t, "the draft logits", what);
  if (index.defined()) check_per_row(draft, index, at::kLong, op, index_what);
}

}  // namespace

bool cuda_ops_built() { return true; }

bool programmatic_launch(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  const int index = device.index() >= 0 ? device.index() : static_cast<int>(c10::cuda::current_device());
  return cuda_ops::programmatic_launch(index);  // engine_ops.cuh
}

bool runs_on(const at::Tensor& t) {
  return t.defined() && t.is_cuda() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

CeRows ce_rows(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_weights, double grad_scale,
               bool write_grad) {
  check_logits(logits, "ce_rows", "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_per_row(logits, labels, at::kLong, "ce_rows", "labels");
  if (write_grad) check_per_row(logits, row_weights, at::kFloat, "ce_rows", "row weights");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto f = logits.options().dtype(at::kFloat);
  CeRows out{at::empty({rows}, f), at::empty({rows}, logits.options().dtype(at::kLong))};
  cuda_ops::ce_rows(dtype_of(logits, "the logits"), logits.data_ptr(), rows, vocab, logits.stride(0),
                    labels.data_ptr<int64_t>(), write_grad ? row_weights.data_ptr<float>() : nullptr,
                    static_cast<float>(grad_scale), write_grad, out.nll.data_ptr<float>(),
                    out.argmax.data_ptr<int64_t>(), stream_of(logits));
  return out;
}

KlRows kl_rows(at::Tensor& draft, const at::Tensor& target, const at::Tensor& target_rows, double temperature,
               const at::Tensor& row_weights, double grad_scale, bool write_grad) {
  check_logits(draft, "kl_rows", "draft logits");
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  check_targets(draft, target, draft.scalar_type(), target_rows, "kl_rows", "the target logits", "target_rows");
  if (write_grad) check_per_row(draft, row_weights, at::kFloat, "kl_rows", "row weights");
  const c10::cuda::CUDAGuard guard(draft.device());
  const auto l = draft.options().dtype(at::kLong);
  KlRows out{at::empty({rows}, draft.options().dtype(at::kFloat)), at::empty({rows}, l), at::empty({rows}, l)};
  cuda_ops::kl_rows(dtype_of(draft, "the draft logits"), draft.data_ptr(), target.data_ptr(),
                    target_rows.defined() ? target_rows.data_ptr<int64_t>() : nullptr, rows, vocab, draft.stride(0),
                    target.stride(0), static_cast<float>(temperature),
                    write_grad ? row_weights.data_ptr<float>() : nullptr, static_cast<float>(grad_scale), write_grad,
                    out.kl.data_ptr<float>(), out.argmax.data_ptr<int64_t>(), out.target_argmax.data_ptr<int64_t>(),
                    stream_of(draft));
  return out;
}

ProbRows prob_rows(at::Tensor& draft, const at::Tensor& probs, const at::Tensor& rows_of, const at::Tensor& row_weights,
                   double grad_scale, bool write_grad) {
  check_logits(draft, "prob_rows", "draft logits");
  const int64_t rows = draft.size(0), vocab = draft.size(1);
  check_targets(draft, probs, at::kFloat, rows_of, "prob_rows", "the distributions", "the distributions' row index");
  if (write_grad) check_per_row(draft, row_weights, at::kFloat, "prob_rows", "row weights");
  const c10::cuda::CUDAGuard guard(draft.device());
  const auto l = draft.options().dtype(at::kLong);
  ProbRows out{at::empty({rows}, draft.options().dtype(at::kFloat)), at::empty({rows}, l), at::empty({rows}, l)};
  cuda_ops::prob_rows(dtype_of(draft, "the draft logits"), draft.data_ptr(), probs.data_ptr<float>(),
                      rows_of.defined() ? rows_of.data_ptr<int64_t>() : nullptr, rows, vocab, draft.stride(0),
                      probs.stride(0), write_grad ? row_weights.data_ptr<float>() : nullptr,
                      static_cast<float>(grad_scale), write_grad, out.ce.data_ptr<float>(),
                      out.argmax.data_ptr<int64_t>(), out.target_argmax.data_ptr<int64_t>(), stream_of(draft));
  return out;
}

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  require(
      gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
      "swiglu: gate " + c10::str(gate.sizes()) + " and up " + c10::str(up.sizes()) + " must match in shape and dtype");
  same_device(gate, up, "gate", "up");
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor y = at::empty_like(g);
  cuda_ops::swiglu_forward(dtype_of(g, "gate"), g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), stream_of(g));
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dy) {
  require(gate.sizes() == up.sizes() && gate.sizes() == dy.sizes(),
          "swiglu backward: gate, up and the incoming gradient must have one shape");
  const at::Tensor g = gate.contiguous(), u = up.contiguous(), d = dy.to(gate.scalar_type()).contiguous();
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
  cuda_ops::swiglu_backward(dtype_of(g, "gate"), g.data_ptr(), u.data_ptr(), d.data_ptr(), dg.data_ptr(), du.data_ptr(),
                            g.numel(), stream_of(g));
  return {dg, du};
}

bool rope_runs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!runs_on(x) || x.dim() != 4 || !cos.defined() || !sin.defined() || cos.dim() != 4 || sin.sizes() != cos.sizes())
    return false;
  if (cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type() || cos.device() != x.device() ||
      sin.device() != x.device() || !cos.is_contiguous() || !sin.is_contiguous())
    return false;
  const int64_t B = x.size(0), T = x.size(2), D = x.size(3);
  if (cos.size(1) != 1 || cos.size(2) != T || cos.size(3) != D || (cos.size(0) != 1 && cos.size(0) != B)) return false;
  // x itself is made contiguous (a fresh, aligned buffer) when it is not already.
  const void* xp = x.is_contiguous() ? x.data_ptr() : cos.data_ptr();
  return cuda_ops::rope_supported(dtype_of(x, "x"), D, xp, cos.data_ptr(), sin.data_ptr(), cos.data_ptr());
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transpose) {
  require(rope_runs(x, cos, sin), "rope: the CUDA kernel does not take x " + c10::str(x.sizes()) + " with tables " +
                                      c10::str(cos.sizes()) + " (see cuda_ops::rope_runs)");
  const at::Tensor xc = x.contiguous();
  const c10::cuda::CUDAGuard guard(xc.device());
  at::Tensor out = at::empty_like(xc);
  cuda_ops::rope(dtype_of(xc, "x"), xc.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), xc.size(0),
                 xc.size(1), xc.size(2), xc.size(3), cos.size(0), transpose, stream_of(xc));
  return out;
}

void adamw_mixed(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const AdamWHyper& h, const at::Tensor& step,
                 const at::Tensor& grad_scale, const at::Tensor& skip) {
  const int64_t n = param.numel();
  require(param.is_cuda() && param.is_contiguous() && grad.is_contiguous() && grad.numel() == n &&
              grad.scalar_type() == param.scalar_type(),
          "adamw: the gradient must be a contiguous tensor of the parameter's dtype and size");
  for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq})
    require(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n && t->device() == param.device(),
            "adamw: master weights and moments must be contiguous float32 tensors of the parameter's size and device");
  require(step.defined() && step.scalar_type() == at::kFloat && step.numel() == 1 && step.device() == param.device(),
          "adamw: the step counter must be a float32 scalar on the parameter's device");
  AdamWArgs a;
  a.lr = h.lr;
  a.beta1 = h.beta1;
  a.beta2 = h.beta2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  a.step = step.data_ptr<float>();
  a.grad_scale = grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr;
  a.skip = skip.defined() ? skip.data_ptr<float>() : nullptr;
  const c10::cuda::CUDAGuard guard(param.device());
  cuda_ops::adamw_mixed(dtype_of(param, "the parameter"), param.data_ptr(), grad.data_ptr(), master.data_ptr<float>(),
                        exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n, a, stream_of(param));
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& sum, const at::Tensor& w,
                        double eps) {
  const int64_t H = x.size(-1), x_ld = row_stride(x);
  const bool w_float = w.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  require(runs_on(x) && x_ld >= H && w.dim() == 1 && w.size(0) == H &&
              (w.scalar_type() == x.scalar_type() || w_float) && w.is_contiguous(),
          "add_rms_norm: x must be a CUDA tensor [..., H] with rows at one stride and w [H] of its dtype or float32, "
          "got x " +
              c10::str(x.sizes()) + " (strides " + c10::str(x.strides()) + "), w " + c10::str(w.sizes()));
  const int64_t sum_ld = delta.defined() && sum.defined() ? row_stride(sum) : 0;
  if (delta.defined())
    require(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous() &&
                sum.defined() && sum.sizes() == x.sizes() && sum.scalar_type() == x.scalar_type() && sum_ld >= H,
            "add_rms_norm: delta must be contiguous and sum have rows at one stride, both of x's shape " +
                c10::str(x.sizes()));
  same_device(x, w, "x", "w");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  cuda_ops::add_rms_norm(dtype_of(x, "x"), x.data_ptr(), x_ld, delta.defined() ? delta.data_ptr() : nullptr,
                         delta.defined() ? sum.data_ptr() : nullptr, sum_ld, w.data_ptr(), w_float, out.data_ptr(),
                         x.numel() / H, H, static_cast<float>(eps), stream_of(x));
  return out;
}

Qkv qkv_rope(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_norm, const at::Tensor& k_norm,
             double eps, const at::Tensor& cos, const at::Tensor& sin) {
  require(runs_on(qkv) && qkv.dim() == 3 && qkv.is_contiguous(),
          "qkv_rope: qkv must be a contiguous CUDA tensor [B, T, (Hq + 2 Hkv) D], got " + c10::str(qkv.sizes()));
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (heads + 2 * kv_heads);
  require(D * (heads + 2 * kv_heads) == qkv.size(2) && D % 2 == 0,
          "qkv_rope: the last axis " + std::to_string(qkv.size(2)) + " is not (Hq + 2 Hkv) x an even head size");
  const at::Tensor c = cos.dim() == 4 ? cos.squeeze(1) : cos, s = sin.dim() == 4 ? sin.squeeze(1) : sin;
  const int64_t Bt = c.dim() == 3 ? c.size(0) : 1, R = c.size(-1);
  require(c.is_contiguous() && s.is_contiguous() && c.sizes() == s.sizes() && R > 0 && R <= D && R % 2 == 0 &&
              c.size(-2) == T && (Bt == 1 || Bt == B) && c.scalar_type() == qkv.scalar_type() &&
              s.scalar_type() == qkv.scalar_type(),
          "qkv_rope: tables " + c10::str(cos.sizes()) + " do not fit qkv " + c10::str(qkv.sizes()));
  for (const at::Tensor* n : {&q_norm, &k_norm})
    if (n->defined())
      require(n->dim() == 1 && n->size(0) == D && n->scalar_type() == qkv.scalar_type() && n->is_contiguous(),
              "qkv_rope: a q/k norm weight must be [" + std::to_string(D) + "] in qkv's dtype");
  const c10::cuda::CUDAGuard guard(qkv.device());
  const auto opts = qkv.options();
  Qkv out{at::empty({B, heads, T, D}, opts), at::empty({B, kv_heads, T, D}, opts),
          at::empty({B, kv_heads, T, D}, opts)};
  cuda_ops::qkv_rope(dtype_of(qkv, "qkv"), qkv.data_ptr(), q_norm.defined() ? q_norm.data_ptr() : nullptr,
                     k_norm.defined() ? k_norm.data_ptr() : nullptr, static_cast<float>(eps), c.data_ptr(),
                     s.data_ptr(), Bt, out.q.data_ptr(), out.k.data_ptr(), out.v.data_ptr(), B, T, heads, kv_heads, D,
                     R, stream_of(qkv));
  return out;
}

namespace {
using GluKernel = void (*)(DType, const void*, void*, int64_t, int64_t, void*);
at::Tensor glu_packed(const at::Tensor& gate_up, GluKernel kernel, const char* name) {
  require(
      runs_on(gate_up) && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
      std::string(name) + ": gate_up must be a contiguous CUDA tensor [..., 2 I], got " + c10::str(gate_up.sizes()));
  const int64_t I = gate_up.size(-1) / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out = at::empty(shape, gate_up.options());
  kernel(dtype_of(gate_up, "gate_up"), gate_up.data_ptr(), out.data_ptr(), gate_up.numel() / (2 * I), I,
         stream_of(gate_up));
  return out;
}
}  // namespace

at::Tensor swiglu_packed(const at::Tensor& gate_up) {
  return glu_packed(gate_up, &cuda_ops::swiglu_packed, "swiglu_packed");
}

at::Tensor gelu_tanh_packed(const at::Tensor& gate_up) {
  return glu_packed(gate_up, &cuda_ops::gelu_tanh_packed, "gelu_tanh_packed");
}

at::Tensor combine_experts(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& slot) {
  const int64_t k = weights.dim() == 2 ? weights.size(1) : 0;
  require(runs_on(rows) && rows.dim() == 2 && rows.is_contiguous() && k > 0 && weights.is_contiguous() &&
              (weights.scalar_type() == rows.scalar_type() || weights.scalar_type() == at::kFloat) &&
              weights.device() == rows.device() && weights.numel() == rows.size(0) && slot.scalar_type() == at::kLong &&
              slot.is_contiguous() && slot.device() == rows.device() && slot.numel() == rows.size(0),
          "combine_experts: rows [T k, H] contiguous on CUDA, weights [T, k] in rows' dtype or float32 and slot "
          "[T, k] int64 on its device expected, got rows " +
              c10::str(rows.sizes()) + ", weights " + c10::str(weights.sizes()) + " " +
              c10::str(weights.scalar_type()) + ", slot " + c10::str(slot.sizes()) + " " +
              c10::str(slot.scalar_type()));
  const int64_t T = weights.size(0), H = rows.size(1);
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor out = at::empty({T, H}, rows.options());
  cuda_ops::combine_experts(dtype_of(rows, "rows"), rows.data_ptr(), weights.data_ptr(),
                            weights.scalar_type() != rows.scalar_type(), slot.data_ptr<int64_t>(), out.data_ptr(), T, k,
                            H, stream_of(rows));
  return out;
}

at::Tensor clamped_glu(const at::Tensor& gate_up, const at::Tensor& bias, const at::Tensor& expert, double alpha,
                       double limit) {
  const int64_t I = gate_up.dim() == 2 ? gate_up.size(1) / 2 : 0;
  require(runs_on(gate_up) && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() &&
              bias.defined() == expert.defined() &&
              (!bias.defined() || (bias.dim() == 2 && bias.size(1) == 2 * I && bias.is_contiguous() &&
                                   bias.scalar_type() == gate_up.scalar_type() && bias.device() == gate_up.device() &&
                                   expert.scalar_type() == at::kLong && expert.is_contiguous() &&
                                   expert.numel() == gate_up.size(0) && expert.device() == gate_up.device())),
          "clamped_glu: gate_up [rows, 2 I] contiguous on CUDA, bias [E, 2 I] of its dtype and expert [rows] int64 on "
          "its device (or neither) expected, got gate_up " +
              c10::str(gate_up.sizes()) + (bias.defined() ? ", bias " + c10::str(bias.sizes()) : std::string()));
  const c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out = at::empty({gate_up.size(0), I}, gate_up.options());
  cuda_ops::clamped_glu(dtype_of(gate_up, "gate_up"), gate_up.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr,
                        expert.defined() ? expert.data_ptr<int64_t>() : nullptr, out.data_ptr(), gate_up.size(0), I,
                        static_cast<float>(alpha), static_cast<float>(limit), stream_of(gate_up));
  return out;
}

at::Tensor dequantize_mxfp4(const at::Tensor& blocks_in, const at::Tensor& scales, c10::ScalarType dtype) {
  // (the kernel reads each group's 16 bytes in one load: a view off 16-byte alignment is copied)
  const at::Tensor blocks = reinterpret_cast<uintptr_t>(blocks_in.data_ptr()) % 16 == 0 ? blocks_in : blocks_in.clone();
  require(blocks.is_cuda() && blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() >= 2 &&
              blocks.size(-1) == 16 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
              scales.device() == blocks.device() && scales.sizes() == blocks.sizes().slice(0, blocks.dim() - 1),
          "dequantize_mxfp4: blocks [..., G, 16] and scales [..., G], uint8, contiguous on one CUDA device expected, "
          "got blocks " +
              c10::str(blocks.sizes()) + " " + c10::str(blocks.scalar_type()) + ", scales " + c10::str(scales.sizes()) +
              " " + c10::str(scales.scalar_type()));
  std::vector<int64_t> shape(scales.sizes().begin(), scales.sizes().end());
  shape.back() *= 32;
  const c10::cuda::CUDAGuard guard(blocks.device());
  at::Tensor out = at::empty(shape, blocks.options().dtype(dtype));
  cuda_ops::dequantize_mxfp4(dtype_of(out, "the output"), blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                             out.data_ptr(), scales.numel(), stream_of(blocks));
  return out;
}

bool linear_swiglu_applies(const at::Tensor& x, const at::Tensor& w) {
  if (!runs_on(x) || x.dim() < 1 || w.dim() != 2 || w.size(0) % 2 != 0 || x.size(-1) != w.size(1) ||
      !x.is_contiguous() || !w.is_contiguous() || w.device() != x.device() || w.scalar_type() != x.scalar_type() ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0 || reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 != 0)
    return false;
  return cuda_ops::gate_up_swiglu_applies(dtype_of(x, "x"), x.numel() / x.size(-1), x.size(-1), w.size(0) / 2,
                                          x.device().index());
}

bool linear_swiglu_device(const c10::Device& device) {
  return device.is_cuda() && cuda_ops::gate_up_swiglu_device(
                                 device.index() >= 0 ? device.index() : static_cast<int>(c10::cuda::current_device()));
}

int compute_capability(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  return cuda_ops::compute_capability(device.index() >= 0 ? device.index()
                                                          : static_cast<int>(c10::cuda::current_device()));
}

at::Tensor linear_swiglu(const at::Tensor& x, const at::Tensor& w) {
  require(linear_swiglu_applies(x, w),
          "linear_swiglu: x " + c10::str(x.sizes()) + " " + c10::str(x.scalar_type()) + " and w " +
              c10::str(w.sizes()) + " " + c10::str(w.scalar_type()) +
              " are not a bf16 product with K % 64 == 0 and I % 128 == 0 on an sm_90 device");
  const int64_t K = x.size(-1), I = w.size(0) / 2, M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(shape, x.options());
  cuda_ops::gate_up_swiglu(x.data_ptr(), w.data_ptr(), out.data_ptr(), M, K, I, stream_of(x));
  return out;
}

bool gated_delta_runs(const at::Tensor& k, const at::Tensor& v) {
  return k.is_cuda() && k.dim() == 3 && v.dim() == 3 && cuda_ops::gated_delta_supported(k.size(2), v.size(2));
}

GatedDelta gated_delta_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, const at::Tensor& initial) {
  const int64_t N = k.size(0), T = k.size(1);
  const auto f32 = [&](const at::Tensor& t, std::vector<int64_t> shape) {
    return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == k.device() &&
           t.sizes().vec() == shape;
  };
  require(gated_delta_runs(k, v) && T % 64 == 0 && T > 0 && f32(q, {N, T, k.size(2)}) && f32(k, {N, T, k.size(2)}) &&
              f32(v, {N, T, v.size(2)}) && f32(g, {N, T}) && f32(beta, {N, T}) &&
              (!initial.defined() || f32(initial, {N, k.size(2), v.size(2)})),
          "gated_delta_chunks: q, k [N, T, 128], v [N, T, 128], g, beta [N, T] (T a multiple of 64) and initial [N, "
          "128, 128] or none, float32 contiguous on one CUDA device expected, got q " +
              c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + " " + c10::str(k.scalar_type()) + ", v " +
              c10::str(v.sizes()) + ", g " + c10::str(g.sizes()) + ", beta " + c10::str(beta.sizes()));
  const c10::cuda::CUDAGuard guard(k.device());
  const int64_t chunks = T / 64;
  at::Tensor work = at::empty({static_cast<int64_t>(cuda_ops::gated_delta_work_floats(N, chunks))}, k.options());
  GatedDelta r;
  r.out = at::empty(v.sizes(), v.options());
  r.state = at::empty({N, k.size(2), v.size(2)}, v.options());
  cuda_ops::gated_delta_chunks(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                               beta.data_ptr<float>(), initial.defined() ? initial.data_ptr<float>() : nullptr, N,
                               chunks, work.data_ptr<float>(), r.out.data_ptr<float>(), r.state.data_ptr<float>(),
                               stream_of(k));
  return r;
}

bool ssd_runs(const at::Tensor& k, const at::Tensor& v) {
  return k.is_cuda() && k.dim() == 4 && v.dim() == 4 && cuda_ops::ssd_supported(k.size(3), v.size(3)) &&
         k.size(2) > 0 && v.size(2) % k.size(2) == 0;
}

at::Tensor ssd_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& initial) {
  const int64_t B = k.size(0), T = k.size(1), G = k.size(2), N = k.size(3), H = v.size(2), P = v.size(3);
  const auto f32 = [&](const at::Tensor& t, std::vector<int64_t> shape) {
    return t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == k.device() &&
           t.sizes().vec() == shape;
  };
  require(ssd_runs(k, v) && T > 0 && f32(q, {B, T, G, N}) && f32(k, {B, T, G, N}) && f32(v, {B, T, H, P}) &&
              f32(g, {B, T, H}) && (!initial.defined() || f32(initial, {B, H, N, P})),
          "ssd_chunks: q, k [B, T, G, 128], v [B, T, H, P] (P a multiple of 32, H of G), g [B, T, H] and initial [B, "
          "H, 128, P] or none, float32 contiguous on one CUDA device expected, got q " +
              c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + " " + c10::str(k.scalar_type()) + ", v " +
              c10::str(v.sizes()) + ", g " + c10::str(g.sizes()));
  const c10::cuda::CUDAGuard guard(k.device());
  at::Tensor work = at::empty({static_cast<int64_t>(cuda_ops::ssd_work_floats(B, G, T))}, k.options());
  at::Tensor out = at::empty(v.sizes(), v.options());
  cuda_ops::ssd_chunks(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                       initial.defined() ? initial.data_ptr<float>() : nullptr, B, T, H, G, P, work.data_ptr<float>(),
                       out.data_ptr<float>(), stream_of(k));
  return out;
}

#else  // built without the engine's CUDA kernels

namespace {
[[noreturn]] void absent() {
  throw std::runtime_error(
      "this flashdraft was built without its CUDA kernels (the LibTorch found has no CUDA, or no nvcc was found)");
}
}  // namespace

bool cuda_ops_built() { return false; }
bool programmatic_launch(const c10::Device&) { return false; }
bool runs_on(const at::Tensor&) { return false; }
CeRows ce_rows(at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool) { absent(); }
KlRows kl_rows(at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&, double, bool) { absent(); }
ProbRows prob_rows(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool) { absent(); }
at::Tensor swiglu_forward(const at::Tensor&, const at::Tensor&) { absent(); }
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&) { absent(); }
bool rope_runs(const at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor rope(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) { absent(); }
void adamw_mixed(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const AdamWHyper&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  absent();
}
at::Tensor add_rms_norm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  absent();
}
Qkv qkv_rope(const at::Tensor&, int64_t, int64_t, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
             const at::Tensor&) {
  absent();
}
at::Tensor swiglu_packed(const at::Tensor&) { absent(); }
at::Tensor gelu_tanh_packed(const at::Tensor&) { absent(); }
at::Tensor combine_experts(const at::Tensor&, const at::Tensor&, const at::Tensor&) { absent(); }
at::Tensor dequantize_mxfp4(const at::Tensor&, const at::Tensor&, c10::ScalarType) { absent(); }
at::Tensor clamped_glu(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double) { absent(); }
bool linear_swiglu_applies(const at::Tensor&, const at::Tensor&) { return false; }
bool linear_swiglu_device(const c10::Device&) { return false; }
int compute_capability(const c10::Device&) { return 0; }
at::Tensor linear_swiglu(const at::Tensor&, const at::Tensor&) { absent(); }
bool gated_delta_runs(const at::Tensor&, const at::Tensor&) { return false; }
GatedDelta gated_delta_chunks(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&) {
  absent();
}
bool ssd_runs(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor ssd_chunks(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  absent();
}

#endif

}  // namespace flashdraft::cuda_ops

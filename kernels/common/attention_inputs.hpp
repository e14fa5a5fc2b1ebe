// The input checks every attention kernel plugin makes, in one place so every kernel says
// them in the same sentences (header-only; kernels/CMakeLists.txt puts kernels/ on the
// include path: #include "common/attention_inputs.hpp").
//
// The contract (core/include/flashdraft/attention.hpp): q [B, Hq, Lq, D], k and v
// [B, Hkv, Lkv, D] with Hq % Hkv == 0, on one device; a mask whose batch and heads are 1
// or B and Hq, of Lq x Lkv; backward: dout and out like q, lse float32 [B, Hq, Lq].
// What a kernel accepts beyond it (a device type, dtypes, head dims) is one Accepted
// record, read both by supports() (reasons, before a run) and by the calls' checks
// (std::invalid_argument, for direct calls): a refusal and an exception say the same.
#pragma once

#include <flashdraft/attention.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft::kernel_inputs {

struct Accepted {
  std::string kernel;                     // the plugin's name: every message starts "<kernel>: "
  std::optional<c10::DeviceType> device;  // none: any device
  std::vector<at::ScalarType> dtypes;     // empty: any dtype, and q, k, v may differ
  std::function<bool(int64_t)> head_dim;  // empty: any head dim
  std::string head_dims;                  // the accepted head dims as text: "64, 128"
};

inline std::string dtype_names(const std::vector<at::ScalarType>& dtypes) {
  std::string s;
  for (at::ScalarType t : dtypes) s += (s.empty() ? "" : ", ") + std::string(c10::toString(t));
  return s;
}

// Each returns "" when the value is accepted, else the reason with the found and the
// supported values, without the kernel's name.
inline std::string device_refusal(const Accepted& a, const c10::Device& device) {
  if (!a.device || device.type() == *a.device) return "";
  return "device " + device.str() + " unsupported (supported: " + c10::DeviceTypeName(*a.device, true) + ")";
}
inline std::string dtype_refusal(const Accepted& a, at::ScalarType dtype) {
  if (a.dtypes.empty() || std::find(a.dtypes.begin(), a.dtypes.end(), dtype) != a.dtypes.end()) return "";
  return std::string("dtype ") + c10::toString(dtype) + " unsupported (supported: " + dtype_names(a.dtypes) + ")";
}
inline std::string head_dim_refusal(const Accepted& a, int64_t head_dim) {
  if (!a.head_dim || a.head_dim(head_dim)) return "";
  return "head_dim " + std::to_string(head_dim) + " unsupported (supported: " + a.head_dims + ")";
}
inline std::string heads_refusal(int64_t heads_q, int64_t heads_kv) {
  if (heads_q >= 1 && heads_kv >= 1 && heads_q % heads_kv == 0) return "";
  return "heads_q " + std::to_string(heads_q) + " is not a multiple of heads_kv " + std::to_string(heads_kv) +
         " (supported: GQA with Hq % Hkv == 0)";
}

// The reasons a kernel refuses a problem, joined by "; " into one Support::no("<kernel>: ...").
class Refusals {
 public:
  explicit Refusals(std::string kernel) : kernel_(std::move(kernel)) {}
  void add(const std::string& reason) {
    if (!reason.empty()) why_ += (why_.empty() ? "" : "; ") + reason;
  }
  bool any() const { return !why_.empty(); }
  // Support::no with the reasons, or yes with `note` (what was chosen, for the selection report).
  Support support(std::string note = "") const {
    return any() ? Support::no(kernel_ + ": " + why_) : Support{true, std::move(note)};
  }

 private:
  std::string kernel_, why_;
};

// The refusals every kernel's supports() starts from: device, dtype, head dim, GQA heads.
inline Refusals problem_refusals(const Accepted& a, const AttentionProblem& p) {
  Refusals r(a.kernel);
  r.add(device_refusal(a, p.device));
  r.add(dtype_refusal(a, p.dtype));
  r.add(head_dim_refusal(a, p.head_dim));
  r.add(heads_refusal(p.heads_q, p.heads_kv));
  return r;
}

// Throws std::invalid_argument naming the first input of a forward or backward call that
// does not fit the contract or what the kernel accepts.
inline void check_inputs(const Accepted& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const BlockMaskTensors& mask) {
  auto fail = [&](const std::string& why) { throw std::invalid_argument(a.kernel + ": " + why); };
  const std::string found =
      "; found q " + c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " + c10::str(v.sizes());
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) fail("q, k, v must be 4-D [B, H, L, D]" + found);
  if (k.sizes() != v.sizes() || k.size(0) != q.size(0) || k.size(3) != q.size(3) || k.size(1) < 1 ||
      q.size(1) % k.size(1) != 0)
    fail("shapes do not fit q [B, Hq, Lq, D], k = v [B, Hkv, Lkv, D] with Hq a multiple of Hkv" + found);
  if (k.device() != q.device() || v.device() != q.device())
    fail("q, k, v must be on one device; found " + q.device().str() + ", " + k.device().str() + ", " +
         v.device().str());
  if (const std::string why = device_refusal(a, q.device()); !why.empty()) fail(why);
  if (!a.dtypes.empty()) {
    if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
      fail(std::string("q, k, v must share one dtype (supported: ") + dtype_names(a.dtypes) + "); found " +
           c10::toString(q.scalar_type()) + ", " + c10::toString(k.scalar_type()) + ", " +
           c10::toString(v.scalar_type()));
    if (const std::string why = dtype_refusal(a, q.scalar_type()); !why.empty()) fail(why);
  }
  if (const std::string why = head_dim_refusal(a, q.size(3)); !why.empty()) fail(why);
  if (mask.host == nullptr) fail("the BlockMaskTensors carry no host mask");
  const BlockMask& m = *mask.host;
  if (m.q_len != q.size(2) || m.kv_len != k.size(2) || (m.batch != 1 && m.batch != q.size(0)) ||
      (m.heads != 1 && m.heads != q.size(1)) || m.block_q < 1 || m.block_kv < 1)
    fail("the mask (batch " + std::to_string(m.batch) + ", heads " + std::to_string(m.heads) + ", " +
         std::to_string(m.q_len) + " x " + std::to_string(m.kv_len) + ", blocks " + std::to_string(m.block_q) + "x" +
         std::to_string(m.block_kv) + ") does not fit q " + c10::str(q.sizes()) + " and k " + c10::str(k.sizes()) +
         " (mask batch and heads must be 1 or equal to B and Hq)");
}

// The backward's own inputs, after check_inputs(q, k, v, mask).
inline void check_backward_inputs(const Accepted& a, const at::Tensor& dout, const at::Tensor& out,
                                  const at::Tensor& lse, const at::Tensor& q) {
  auto fail = [&](const std::string& why) { throw std::invalid_argument(a.kernel + " backward: " + why); };
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"dout", dout}, {"out", out}})
    if (!t.defined() || t.sizes() != q.sizes() || t.scalar_type() != q.scalar_type() || t.device() != q.device())
      fail(std::string(name) + " must have q's shape " + c10::str(q.sizes()) + ", dtype " +
           c10::toString(q.scalar_type()) + " and device " + q.device().str() + "; found " +
           (t.defined() ? c10::str(t.sizes()) + " " + c10::toString(t.scalar_type()) + " on " + t.device().str()
                        : std::string("an undefined tensor")));
  if (!lse.defined() || lse.dim() != 3 || lse.size(0) != q.size(0) || lse.size(1) != q.size(1) ||
      lse.size(2) != q.size(2) || lse.scalar_type() != at::kFloat || lse.device() != q.device())
    fail("lse must be float32 [B, Hq, Lq] = [" + std::to_string(q.size(0)) + ", " + std::to_string(q.size(1)) + ", " +
         std::to_string(q.size(2)) + "] on " + q.device().str() + "; found " +
         (lse.defined() ? c10::str(lse.sizes()) + " " + c10::toString(lse.scalar_type()) + " on " + lse.device().str()
                        : std::string("an undefined tensor")));
}

}  // namespace flashdraft::kernel_inputs

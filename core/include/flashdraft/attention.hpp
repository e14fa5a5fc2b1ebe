// AttentionKernel: a fused or reference attention backend over a BlockMask.
//   q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lkv, D]; Hq % Hkv == 0 (GQA: head h reads kv
//   head h / (Hq / Hkv)). out: q's shape, any strides the kernel likes (not a view: it owns
//   its storage); lse: [B, Hq, Lq] float32, natural log of the softmax denominator of the
//   scaled scores (-inf for rows with no visible key, whose output is 0 and whose
//   gradients are 0). The backward's dout comes contiguous or with out's strides.
// A kernel answers supports() for a problem with a reason (data shown to the user and
// written to the log), and reports the concrete variant that ran on every call.
#pragma once

#include <flashdraft/block_mask.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace flashdraft {

// The mask lists as int32 tensors on the kernel's device (bits reinterpreted as
// int32), plus the host mask for CPU kernels and references.
struct BlockMaskTensors {
  const BlockMask* host = nullptr;
  at::Tensor full_offset, full_index, part_offset, part_index, bits;
  at::Tensor t_full_offset, t_full_index, t_part_offset, t_part_index, t_part_entry;
};
// Copies the lists to `device` (one transfer per list).
FLASHDRAFT_API BlockMaskTensors to_tensors(const BlockMask& mask, c10::Device device);
// The mask as a bool tensor [batch, heads, Lq, Lkv] (for references and tests).
FLASHDRAFT_API at::Tensor dense(const BlockMask& mask, c10::Device device = c10::kCPU);

// One immutable record of the problem; every field affects the choice of kernel.
struct FLASHDRAFT_API AttentionProblem {
  c10::Device device = c10::kCPU;
  c10::ScalarType dtype = c10::kFloat;
  int64_t batch = 1, heads_q = 1, heads_kv = 1, q_len = 0, kv_len = 0, head_dim = 0;
  bool needs_backward = true;
  std::string mask;  // generator name, e.g. "dflash"
  std::string str() const;
  // batch x heads_q query heads of q_len rows against heads_kv key/value heads of kv_len,
  // head_dim wide, masked by generator `mask` (empty: any).
  static AttentionProblem of(c10::Device device, c10::ScalarType dtype, int64_t batch, int64_t heads_q,
                             int64_t heads_kv, int64_t q_len, int64_t kv_len, int64_t head_dim, bool needs_backward,
                             std::string mask = {}) {
    return AttentionProblem{device, dtype,  batch,    heads_q,        heads_kv,
                            q_len,  kv_len, head_dim, needs_backward, std::move(mask)};
  }
};

struct Support {
  bool ok = true;
  std::string reason;  // why not, with the found and the supported values
  static Support yes() { return {true, ""}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
};

struct BlockSize {
  int64_t q = 128, kv = 128;
};

struct AttentionForward {
  at::Tensor out, lse;
  std::string variant;
};

struct AttentionBackward {
  at::Tensor dq, dk, dv;
  std::string variant;
};

class FLASHDRAFT_API AttentionKernel : public PluginObject {
 public:
  virtual Support supports(const AttentionProblem& problem) const = 0;
  // The tile size the kernel wants its BlockMask built at, for this problem.
  virtual BlockSize block_size(const AttentionProblem& problem) const = 0;
  virtual AttentionForward forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const BlockMaskTensors& mask, double scale) = 0;
  virtual AttentionBackward backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const BlockMaskTensors& mask, double scale) = 0;
};

// A variant is the kernel's own when it is the kernel's name or starts with
// "<name>/"; anything else reported by a call is a fallback.
inline bool variant_belongs_to(const std::string& variant, const std::string& kernel) {
  return variant == kernel || (variant.size() > kernel.size() && variant.compare(0, kernel.size(), kernel) == 0 &&
                               variant[kernel.size()] == '/');
}

}  // namespace flashdraft

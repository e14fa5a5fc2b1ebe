// How the kernel tests compare a fast kernel with the reference (dense_ref): the same
// forward and backward call on both, then the checks every comparison makes, in one place
// so test_kernels_cpu and test_flash_cuda hold every kernel to the same standard:
//   dtypes, shapes and device of every result; no NaN (an element left unwritten in
//   poisoned memory, or a 0/0) and no inf; relative errors (attention_error.hpp) within
//   the bound, printed on one line; and, from the mask's own predicate, rows that see no
//   key give out 0, lse -inf, dq 0 exactly, keys no query of their group sees give dk, dv 0.
#pragma once

#include "attention_error.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace test {

struct KernelResults {
  at::Tensor out, lse, dq, dk, dv;
  std::string fwd, bwd;  // the variants the calls reported
};

// One forward, then one backward from its out and lse. `before_each_call` runs before each
// of the two (the CUDA test fills the allocator's free memory with NaN there).
inline KernelResults run_kernel(flashdraft::AttentionKernel& kernel, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const at::Tensor& dout, const flashdraft::BlockMask& mask,
                                double scale, const std::function<void()>& before_each_call = {}) {
  const flashdraft::BlockMaskTensors tensors = flashdraft::to_tensors(mask, q.device());
  if (before_each_call) before_each_call();
  flashdraft::AttentionForward f = kernel.forward(q, k, v, tensors, scale);
  if (before_each_call) before_each_call();
  flashdraft::AttentionBackward g = kernel.backward(dout, q, k, v, f.out, f.lse, tensors, scale);
  return {f.out, f.lse, g.dq, g.dk, g.dv, f.variant, g.variant};
}

// `got` (from q, k, v in `dtype`) against the reference's `want`: the checks of the header
// above but the empty rows; prints "<label> rel err: out .. lse .. dq .. dk .. dv .. (bound ..)".
inline void expect_matches_reference(const KernelResults& got, const KernelResults& want, const at::Tensor& q,
                                     const at::Tensor& k, at::ScalarType dtype, double bound,
                                     const std::string& label) {
  for (const at::Tensor& t : {want.out, want.lse, want.dq, want.dk, want.dv}) ASSERT_FALSE(has_nan(t));
  EXPECT_EQ(got.out.scalar_type(), dtype);
  EXPECT_EQ(got.dq.scalar_type(), dtype);
  EXPECT_EQ(got.dk.scalar_type(), dtype);
  EXPECT_EQ(got.dv.scalar_type(), dtype);
  EXPECT_EQ(got.lse.scalar_type(), at::kFloat);
  for (const at::Tensor& t : {got.out, got.lse, got.dq, got.dk, got.dv}) EXPECT_EQ(t.device(), q.device());
  ASSERT_EQ(got.out.sizes(), q.sizes());
  ASSERT_EQ(got.lse.sizes().vec(), (std::vector<int64_t>{q.size(0), q.size(1), q.size(2)}));
  ASSERT_EQ(got.dq.sizes(), q.sizes());
  ASSERT_EQ(got.dk.sizes(), k.sizes());
  ASSERT_EQ(got.dv.sizes(), k.sizes());
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"out", got.out},
                                {"lse", got.lse},
                                {"dq", got.dq},
                                {"dk", got.dk},
                                {"dv", got.dv}})
    EXPECT_FALSE(has_nan(t)) << name << " has NaN (an element left unwritten, or a 0/0)";
  for (const auto& [name, t] :
       {std::pair<const char*, at::Tensor>{"out", got.out}, {"dq", got.dq}, {"dk", got.dk}, {"dv", got.dv}})
    EXPECT_FALSE(at::isinf(t).any().item<bool>()) << name << " has inf";

  const double e_out = relative_error(got.out, want.out), e_lse = lse_relative_error(got.lse, want.lse),
               e_dq = relative_error(got.dq, want.dq), e_dk = relative_error(got.dk, want.dk),
               e_dv = relative_error(got.dv, want.dv);
  std::printf("  %s rel err: out %.1e lse %.1e dq %.1e dk %.1e dv %.1e (bound %.0e)\n", label.c_str(), e_out, e_lse,
              e_dq, e_dk, e_dv, bound);
  EXPECT_LE(e_out, bound) << "out";
  EXPECT_LE(e_lse, bound) << "lse";
  EXPECT_LE(e_dq, bound) << "dq";
  EXPECT_LE(e_dk, bound) << "dk";
  EXPECT_LE(e_dv, bound) << "dv";
}

// From the predicate (indices of the problem: b < B, h < Hq): rows that see no key have
// out 0, lse -inf and dq 0 exactly; kv rows that no query head of their group sees have
// dk, dv 0 exactly. Returns the number of rows that see no key.
inline int64_t expect_unseen_exactly_zero(const KernelResults& got, int64_t heads_kv, const Visible& visible) {
  const int64_t batch = got.out.size(0), heads_q = got.out.size(1), q_len = got.out.size(2);
  const int64_t kv_len = got.dk.size(2), group = heads_q / heads_kv;
  const at::Tensor lse = got.lse.to(at::kFloat).cpu(), out_rows = got.out.abs().amax(-1).to(at::kFloat).cpu(),
                   dq_rows = got.dq.abs().amax(-1).to(at::kFloat).cpu(),
                   dk_rows = got.dk.abs().amax(-1).to(at::kFloat).cpu(),
                   dv_rows = got.dv.abs().amax(-1).to(at::kFloat).cpu();
  const auto L = lse.accessor<float, 3>();
  const auto O = out_rows.accessor<float, 3>(), dQ = dq_rows.accessor<float, 3>(), dK = dk_rows.accessor<float, 3>(),
             dV = dv_rows.accessor<float, 3>();
  std::vector<uint8_t> key_seen(static_cast<size_t>(batch * heads_kv * kv_len), 0);
  int64_t empty_rows = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads_q; ++h)
      for (int64_t qi = 0; qi < q_len; ++qi) {
        bool any = false;
        for (int64_t ki = 0; ki < kv_len; ++ki)
          if (visible(b, h, qi, ki)) {
            any = true;
            key_seen[static_cast<size_t>((b * heads_kv + h / group) * kv_len + ki)] = 1;
          }
        if (any) continue;
        ++empty_rows;
        EXPECT_EQ(L[b][h][qi], -std::numeric_limits<float>::infinity())
            << "lse of row b" << b << " h" << h << " q" << qi;
        EXPECT_EQ(O[b][h][qi], 0.f) << "out of row b" << b << " h" << h << " q" << qi << ", which sees no key";
        EXPECT_EQ(dQ[b][h][qi], 0.f) << "dq of row b" << b << " h" << h << " q" << qi << ", which sees no key";
      }
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < heads_kv; ++g)
      for (int64_t ki = 0; ki < kv_len; ++ki)
        if (!key_seen[static_cast<size_t>((b * heads_kv + g) * kv_len + ki)]) {
          EXPECT_EQ(dK[b][g][ki], 0.f) << "dk of key b" << b << " g" << g << " k" << ki << ", which no query sees";
          EXPECT_EQ(dV[b][g][ki], 0.f) << "dv of key b" << b << " g" << g << " k" << ki << ", which no query sees";
        }
  return empty_rows;
}

}  // namespace test

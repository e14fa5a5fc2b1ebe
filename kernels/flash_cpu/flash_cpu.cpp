// flash_cpu: FlashAttention-2 over a BlockMask, on CPU, forward and backward, with
// memory linear in the sequence lengths (no Lq x Lkv matrix ever exists).
//
// Notation per (batch b, query head h), kv head g = h / (Hq / Hkv) (GQA), tiles of
// BQ query rows x BKV key columns taken from the mask (mask.block_q, mask.block_kv):
//   S = scale * Q K^T, masked entries -inf;  P = exp(S - lse);  out = P V
//   lse[q] = log sum_k exp(S[q, k])  (natural log; -inf for a row with no visible key)
//
// Forward (per query tile i, one task): walk the tile's full and partial KV blocks in
// ascending order; for each, S_t = scale * Q_i K_j^T (Eigen GEMM), partial tiles clear
// their invisible entries to -inf from the bitmap (full tiles skip the bitmap), then
// the online softmax: m' = max(m, rowmax S_t), alpha = exp(m - m'), P_t = exp(S_t - m'),
// l = alpha l + rowsum P_t, acc = alpha acc + P_t V_j. At the end out = acc / l and
// lse = m + log l; a row whose m stayed -inf (nothing visible) gets out 0, lse -inf.
// Invariant that keeps NaN out: the shift used in exp is m' when finite and 0 when
// m' = -inf, so exp only ever sees -inf - finite or finite values; exp_shifted() makes
// exp(-inf) exactly 0 (Eigen's vectorised exp alone gives 1.2e-38 there, see below).
//
// Backward (FlashAttention-2, P recomputed tile by tile from the saved lse):
//   delta[q] = rowsum(dO * O)       (first, one pass over the rows)
//   dV_j += P^T dO_i;  dP = dO_i V_j^T;  dS = P o (dP - delta);  dK_j += scale dS^T Q_i
//   dQ_i += scale dS K_j
// dK/dV: one task per (b, kv head g, KV tile j), walking the TRANSPOSED lists (query
//   tiles that see KV tile j) of every query head of g's group, so a task owns its
//   dK_j, dV_j rows outright: no atomics, no reduction buffers, GQA summed in place.
// dQ: a separate pass, one task per (b, h, query tile i) over the FORWARD lists,
//   recomputing P and dP (2 extra GEMMs per tile: 7 GEMMs per visible tile in all
//   instead of 5) in exchange for owning dQ_i outright: no Lq x Lkv matrix and no
//   per-thread dQ copies; memory stays O(tile) per thread.
// Rows with lse = -inf get P = 0 without an exp, so dS and all three gradients are
// exactly 0 there; masked entries of the other rows get P = 0 from exp_shifted().
//
// Precision: fp32 or bf16 inputs; bf16 tiles are converted to fp32 when loaded, all
// accumulation is fp32, results are rounded to the input dtype once at the end.
// Parallelism: at::parallel_for over (batch, head, tile) tasks; Eigen itself runs
// single-threaded inside a task (EIGEN_DONT_PARALLELIZE). at::parallel_for is an inline
// OpenMP region here, so this file is compiled with OpenMP (CMakeLists.txt) and runs on
// LibTorch's thread pool (at::set_num_threads / OMP_NUM_THREADS).
// Scratch is allocated per parallel chunk as at::Tensor (so memory trackers see it).
//
// Variants: "flash_cpu/<fwd|bwd>/<fp32|bf16>/q<BQ>k<BKV>"; BQ x BKV is the mask's
// block size (block_size() asks for 64 x 64; any size works).
// Check: tests/test_kernels_cpu.cpp (against dense_ref); bench: bench/attention_cpu.cpp.
#define EIGEN_DONT_PARALLELIZE
#include "common/attention_inputs.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace flashdraft {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstTile = Eigen::Map<const RowMatrix>;
using Tile = Eigen::Map<RowMatrix>;

constexpr int64_t kMaxHeadDim = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Everything a task needs to find its rows and its mask lists.
struct Geometry {
  int64_t batch, heads_q, heads_kv, group, q_len, kv_len, dim;
  int64_t mask_batch, mask_heads, bq, bkv, q_blocks, kv_blocks, words_per_row, words_per_tile;
  double scale;

  Geometry(const at::Tensor& q, const at::Tensor& k, const BlockMask& m, double s)
      : batch(q.size(0)),
        heads_q(q.size(1)),
        heads_kv(k.size(1)),
        group(q.size(1) / k.size(1)),
        q_len(q.size(2)),
        kv_len(k.size(2)),
        dim(q.size(3)),
        mask_batch(m.batch),
        mask_heads(m.heads),
        bq(m.block_q),
        bkv(m.block_kv),
        q_blocks(m.q_blocks()),
        kv_blocks(m.kv_blocks()),
        words_per_row(m.words_per_row()),
        words_per_tile(m.words_per_tile()),
        scale(s) {}
  // CSR row of the forward lists for (b, h, query tile i); a shared mask has extent 1.
  int64_t mask_row(int64_t b, int64_t h, int64_t i) const {
    return ((mask_batch == 1 ? 0 : b) * mask_heads + (mask_heads == 1 ? 0 : h)) * q_blocks + i;
  }
  // CSR column of the transposed lists for (b, h, KV tile j).
  int64_t mask_col(int64_t b, int64_t h, int64_t j) const {
    return ((mask_batch == 1 ? 0 : b) * mask_heads + (mask_heads == 1 ? 0 : h)) * kv_blocks + j;
  }
  int64_t q_rows(int64_t i) const { return std::min(bq, q_len - i * bq); }
  int64_t kv_rows(int64_t j) const { return std::min(bkv, kv_len - j * bkv); }
};

std::string precision_name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : "fp32"; }

// What flash_cpu accepts beyond the contract; supports() and the calls' checks both read it.
const kernel_inputs::Accepted kAccepted{"flash_cpu",
                                        c10::DeviceType::CPU,
                                        {at::kFloat, at::kBFloat16},
                                        [](int64_t d) { return d >= 1 && d <= kMaxHeadDim; },
                                        "1 to " + std::to_string(kMaxHeadDim)};

// Rows [0, n) x [0, dim) of a tile as fp32: float input is used in place, bf16 input
// is converted into `scratch`.
template <class T>
const float* load_tile(const T* src, int64_t n, int64_t dim, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t x = 0; x < n * dim; ++x) scratch[x] = static_cast<float>(src[x]);
    return scratch;
  }
}

// Partial tile: entries whose bit is 0 become -inf (bit c % 32 of word r * wpr + c / 32).
void apply_bitmap(Tile& s, const uint32_t* words, int64_t words_per_row) {
  for (int64_t r = 0; r < s.rows(); ++r) {
    const uint32_t* w = words + r * words_per_row;
    float* row = s.data() + r * s.cols();
    for (int64_t c = 0; c < s.cols(); ++c)
      if (!((w[c >> 5] >> (c & 31)) & 1u)) row[c] = -kInf;
  }
}

// x[0, n) = exp(x - shift), with exp(-inf) = 0 exactly. Eigen's vectorised exp clamps its
// argument at about -88.4 and so returns the smallest normal float (1.2e-38), not 0, for a
// masked score: a row with nothing visible would then get l = n * 1.2e-38 > 0 and the mean
// of V as its output instead of 0.
inline void exp_shifted(float* x, int64_t n, float shift) {
  Eigen::Map<Eigen::ArrayXf> a(x, n);
  a = (a == -kInf).select(0.0f, (a - shift).exp());
}

// Calls f(kv_block, bitmap or nullptr) for the tiles of one forward row, ascending.
template <class F>
void for_each_kv_tile(const BlockMask& m, int64_t row, F&& f) {
  int32_t a = m.full_offset[row], a_end = m.full_offset[row + 1];
  int32_t p = m.part_offset[row], p_end = m.part_offset[row + 1];
  while (a < a_end || p < p_end) {
    if (p >= p_end || (a < a_end && m.full_index[a] < m.part_index[p])) {
      f(m.full_index[a++], static_cast<const uint32_t*>(nullptr));
    } else {
      f(m.part_index[p], m.bits.data() + static_cast<int64_t>(p) * m.words_per_tile());
      ++p;
    }
  }
}

// Calls f(q_block, bitmap or nullptr) for the query tiles that see one KV tile.
template <class F>
void for_each_q_tile(const BlockMask& m, int64_t col, F&& f) {
  for (int32_t e = m.t_full_offset[col]; e < m.t_full_offset[col + 1]; ++e)
    f(m.t_full_index[e], static_cast<const uint32_t*>(nullptr));
  for (int32_t e = m.t_part_offset[col]; e < m.t_part_offset[col + 1]; ++e)
    f(m.t_part_index[e], m.bits.data() + static_cast<int64_t>(m.t_part_entry[e]) * m.words_per_tile());
}

template <class T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMask& m, const Geometry& g,
                  at::Tensor& out, at::Tensor& lse) {
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  float* lsed = lse.data_ptr<float>();
  const int64_t D = g.dim, tasks = g.batch * g.heads_q * g.q_blocks;
  const float scale = static_cast<float>(g.scale);

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Scratch: Q, K, V tiles (bf16 only), scores, accumulator, m, l.
    at::Tensor scratch = at::empty({(g.bq + 2 * g.bkv) * D + g.bq * g.bkv + g.bq * D + 2 * g.bq}, at::kFloat);
    float* qbuf = scratch.data_ptr<float>();
    float* kbuf = qbuf + g.bq * D;
    float* vbuf = kbuf + g.bkv * D;
    float* sbuf = vbuf + g.bkv * D;
    float* abuf = sbuf + g.bq * g.bkv;
    float* mbuf = abuf + g.bq * D;
    float* lbuf = mbuf + g.bq;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % g.q_blocks, bh = task / g.q_blocks, h = bh % g.heads_q, b = bh / g.heads_q;
      const int64_t qn = g.q_rows(i), hk = h / g.group;
      const int64_t q_base = ((b * g.heads_q + h) * g.q_len + i * g.bq) * D;
      const int64_t kv_base = (b * g.heads_kv + hk) * g.kv_len * D;
      ConstTile qt(load_tile(qd + q_base, qn, D, qbuf), qn, D);
      Tile acc(abuf, qn, D);
      acc.setZero();
      std::fill(mbuf, mbuf + qn, -kInf);
      std::fill(lbuf, lbuf + qn, 0.0f);

      for_each_kv_tile(m, g.mask_row(b, h, i), [&](int64_t j, const uint32_t* bitmap) {
        const int64_t kn = g.kv_rows(j), off = kv_base + j * g.bkv * D;
        ConstTile kt(load_tile(kd + off, kn, D, kbuf), kn, D);
        ConstTile vt(load_tile(vd + off, kn, D, vbuf), kn, D);
        Tile s(sbuf, qn, kn);
        s.noalias() = scale * (qt * kt.transpose());
        if (bitmap) apply_bitmap(s, bitmap, g.words_per_row);
        for (int64_t r = 0; r < qn; ++r) {
          const float m_new = std::max(mbuf[r], s.row(r).maxCoeff());
          const float shift = m_new == -kInf ? 0.0f : m_new;  // see header: no -inf - -inf
          const float alpha = std::exp(mbuf[r] - shift);      // 0 while nothing was visible
          exp_shifted(s.data() + r * s.cols(), s.cols(), shift);
          lbuf[r] = alpha * lbuf[r] + s.row(r).sum();
          acc.row(r) *= alpha;
          mbuf[r] = m_new;
        }
        acc.noalias() += s * vt;
      });

      T* o = od + q_base;
      float* l_out = lsed + (b * g.heads_q + h) * g.q_len + i * g.bq;
      for (int64_t r = 0; r < qn; ++r) {
        const bool empty = !(lbuf[r] > 0.0f);
        const float inv = empty ? 0.0f : 1.0f / lbuf[r];
        for (int64_t d = 0; d < D; ++d) o[r * D + d] = static_cast<T>(acc(r, d) * inv);
        l_out[r] = empty ? -kInf : mbuf[r] + std::log(lbuf[r]);
      }
    }
  });
}

// P of one tile recomputed from the saved lse: P = exp(scale Q K^T - lse), masked
// entries 0; rows with lse = -inf (nothing visible) are 0.
inline void recompute_p(Tile& p, const ConstTile& qt, const ConstTile& kt, const float* lse_rows,
                        const uint32_t* bitmap, const Geometry& g) {
  p.noalias() = static_cast<float>(g.scale) * (qt * kt.transpose());
  if (bitmap) apply_bitmap(p, bitmap, g.words_per_row);
  for (int64_t r = 0; r < p.rows(); ++r) {
    if (lse_rows[r] == -kInf)
      p.row(r).setZero();
    else
      exp_shifted(p.data() + r * p.cols(), p.cols(), lse_rows[r]);
  }
}

// dS = P o (dP - delta), in place in dp.
inline void softmax_backward(Tile& dp, const Tile& p, const float* delta_rows) {
  for (int64_t r = 0; r < dp.rows(); ++r) dp.row(r) = (p.row(r).array() * (dp.row(r).array() - delta_rows[r])).matrix();
}

template <class T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const BlockMask& m, const Geometry& g, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv) {
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const T* dod = dout.data_ptr<T>();
  const T* od = out.data_ptr<T>();
  const float* lsed = lse.data_ptr<float>();
  const int64_t D = g.dim;
  const float scale = static_cast<float>(g.scale);

  // delta[b, h, q] = sum_d dO * O, in fp32 (the softmax backward's row term).
  at::Tensor delta = at::empty({g.batch, g.heads_q, g.q_len}, at::kFloat);
  float* deltad = delta.data_ptr<float>();
  at::parallel_for(0, g.batch * g.heads_q * g.q_len, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += static_cast<float>(dod[row * D + d]) * static_cast<float>(od[row * D + d]);
      deltad[row] = sum;
    }
  });

  // Scratch layout shared by both passes: Q, dO tiles [bq, D]; K, V tiles [bkv, D];
  // P and dP/dS [bq, bkv]; two gradient accumulators [max(bq, bkv), D].
  const int64_t acc_rows = std::max(g.bq, g.bkv);
  const int64_t scratch_size = 2 * g.bq * D + 2 * g.bkv * D + 2 * g.bq * g.bkv + 2 * acc_rows * D;
  struct Buffers {
    float *q, *dout, *k, *v, *p, *dp, *acc0, *acc1;
  };
  auto carve = [&](at::Tensor& scratch) {
    float* x = scratch.data_ptr<float>();
    Buffers b;
    b.q = x, x += g.bq * D;
    b.dout = x, x += g.bq * D;
    b.k = x, x += g.bkv * D;
    b.v = x, x += g.bkv * D;
    b.p = x, x += g.bq * g.bkv;
    b.dp = x, x += g.bq * g.bkv;
    b.acc0 = x, x += acc_rows * D;
    b.acc1 = x;
    return b;
  };
  // fn(task, buffers) for tasks 0 .. n - 1 over at::parallel_for, each thread with its own scratch.
  auto for_each_task = [&](int64_t n, auto&& fn) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      at::Tensor scratch = at::empty({scratch_size}, at::kFloat);
      const Buffers buf = carve(scratch);
      for (int64_t task = begin; task < end; ++task) fn(task, buf);
    });
  };

  // dK, dV: one task per (b, kv head, KV tile j), over the transposed lists of every
  // query head of the group.
  T* dkd = dk.data_ptr<T>();
  T* dvd = dv.data_ptr<T>();
  for_each_task(g.batch * g.heads_kv * g.kv_blocks, [&](int64_t task, const Buffers& buf) {
    const int64_t j = task % g.kv_blocks, bg = task / g.kv_blocks, hk = bg % g.heads_kv, b = bg / g.heads_kv;
    const int64_t kn = g.kv_rows(j), kv_off = ((b * g.heads_kv + hk) * g.kv_len + j * g.bkv) * D;
    ConstTile kt(load_tile(kd + kv_off, kn, D, buf.k), kn, D);
    ConstTile vt(load_tile(vd + kv_off, kn, D, buf.v), kn, D);
    Tile dk_acc(buf.acc0, kn, D), dv_acc(buf.acc1, kn, D);
    dk_acc.setZero();
    dv_acc.setZero();
    for (int64_t h = hk * g.group; h < (hk + 1) * g.group; ++h) {
      for_each_q_tile(m, g.mask_col(b, h, j), [&](int64_t i, const uint32_t* bitmap) {
        const int64_t qn = g.q_rows(i), row0 = (b * g.heads_q + h) * g.q_len + i * g.bq;
        ConstTile qt(load_tile(qd + row0 * D, qn, D, buf.q), qn, D);
        ConstTile dot(load_tile(dod + row0 * D, qn, D, buf.dout), qn, D);
        Tile p(buf.p, qn, kn), dp(buf.dp, qn, kn);
        recompute_p(p, qt, kt, lsed + row0, bitmap, g);
        dv_acc.noalias() += p.transpose() * dot;
        dp.noalias() = dot * vt.transpose();
        softmax_backward(dp, p, deltad + row0);
        dk_acc.noalias() += scale * (dp.transpose() * qt);
      });
    }
    // Every (b, kv head, tile) is a task, so every row of dK and dV is written,
    // including tiles no query sees (zeros).
    for (int64_t x = 0; x < kn * D; ++x) {
      dkd[kv_off + x] = static_cast<T>(buf.acc0[x]);
      dvd[kv_off + x] = static_cast<T>(buf.acc1[x]);
    }
  });

  // dQ: one task per (b, h, query tile i), over the forward lists.
  T* dqd = dq.data_ptr<T>();
  for_each_task(g.batch * g.heads_q * g.q_blocks, [&](int64_t task, const Buffers& buf) {
    const int64_t i = task % g.q_blocks, bh = task / g.q_blocks, h = bh % g.heads_q, b = bh / g.heads_q;
    const int64_t qn = g.q_rows(i), row0 = (b * g.heads_q + h) * g.q_len + i * g.bq;
    const int64_t kv_base = (b * g.heads_kv + h / g.group) * g.kv_len * D;
    ConstTile qt(load_tile(qd + row0 * D, qn, D, buf.q), qn, D);
    ConstTile dot(load_tile(dod + row0 * D, qn, D, buf.dout), qn, D);
    Tile dq_acc(buf.acc0, qn, D);
    dq_acc.setZero();
    for_each_kv_tile(m, g.mask_row(b, h, i), [&](int64_t j, const uint32_t* bitmap) {
      const int64_t kn = g.kv_rows(j), kv_off = kv_base + j * g.bkv * D;
      ConstTile kt(load_tile(kd + kv_off, kn, D, buf.k), kn, D);
      ConstTile vt(load_tile(vd + kv_off, kn, D, buf.v), kn, D);
      Tile p(buf.p, qn, kn), dp(buf.dp, qn, kn);
      recompute_p(p, qt, kt, lsed + row0, bitmap, g);
      dp.noalias() = dot * vt.transpose();
      softmax_backward(dp, p, deltad + row0);
      dq_acc.noalias() += scale * (dp * kt);
    });
    for (int64_t x = 0; x < qn * D; ++x) dqd[row0 * D + x] = static_cast<T>(buf.acc0[x]);
  });
}

std::string tile_name(const BlockMask& m) { return "q" + std::to_string(m.block_q) + "k" + std::to_string(m.block_kv); }

class FlashCpu : public flashdraft::AttentionKernel {
 public:
  explicit FlashCpu(const flashdraft::Config&) {}
  static void declare(flashdraft::Schema&) {}

  Support supports(const AttentionProblem& p) const override {
    return kernel_inputs::problem_refusals(kAccepted, p).support();
  }
  BlockSize block_size(const AttentionProblem&) const override { return {64, 64}; }

  AttentionForward forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const BlockMaskTensors& mask, double scale) override {
    kernel_inputs::check_inputs(kAccepted, q_in, k_in, v_in, mask);
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const BlockMask& m = *mask.host;
    const Geometry g(q, k, m, scale);
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({g.batch, g.heads_q, g.q_len}, q.options().dtype(at::kFloat));
    if (q.scalar_type() == at::kBFloat16)
      forward_impl<c10::BFloat16>(q, k, v, m, g, out, lse);
    else
      forward_impl<float>(q, k, v, m, g, out, lse);
    return {out, lse, "flash_cpu/fwd/" + precision_name(q.scalar_type()) + "/" + tile_name(m)};
  }

  AttentionBackward backward(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
                             const BlockMaskTensors& mask, double scale) override {
    kernel_inputs::check_inputs(kAccepted, q_in, k_in, v_in, mask);
    kernel_inputs::check_backward_inputs(kAccepted, dout_in, out_in, lse_in, q_in);
    const at::ScalarType t = q_in.scalar_type();
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const at::Tensor dout = dout_in.contiguous(), out = out_in.contiguous(), lse = lse_in.contiguous();
    const BlockMask& m = *mask.host;
    const Geometry g(q, k, m, scale);
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (t == at::kBFloat16)
      backward_impl<c10::BFloat16>(dout, q, k, v, out, lse, m, g, dq, dk, dv);
    else
      backward_impl<float>(dout, q, k, v, out, lse, m, g, dq, dk, dv);
    return {dq, dk, dv, "flash_cpu/bwd/" + precision_name(t) + "/" + tile_name(m)};
  }
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(kernel, "flash_cpu", "0.1.0",
                  "FlashAttention-2 over a BlockMask on CPU (Eigen tiles), fp32/bf16, O(N) memory",
                  flashdraft::FlashCpu)

// BlockMask -> int32 tensors on a device, and the dense bool form.
#include <flashdraft/attention.hpp>

#include <torch/types.h>

#include <sstream>

namespace flashdraft {

namespace {
at::Tensor ints(const std::vector<int32_t>& v, c10::Device device) {
  at::Tensor t = torch::empty({static_cast<int64_t>(v.size())}, torch::kInt32);
  if (!v.empty()) std::memcpy(t.data_ptr<int32_t>(), v.data(), v.size() * sizeof(int32_t));
  // Pinned and asynchronous: building a step's mask never waits for the device's queue
  // (the pinned block is not reused before its copy has run).
  return device.is_cpu() ? t : t.pin_memory().to(device, /*non_blocking=*/true);
}
}  // namespace

BlockMaskTensors to_tensors(const BlockMask& m, c10::Device device) {
  BlockMaskTensors t;
  t.host = &m;
  t.full_offset = ints(m.full_offset, device);
  t.full_index = ints(m.full_index, device);
  t.part_offset = ints(m.part_offset, device);
  t.part_index = ints(m.part_index, device);
  std::vector<int32_t> bits(m.bits.size());
  if (!bits.empty()) std::memcpy(bits.data(), m.bits.data(), bits.size() * sizeof(int32_t));
  t.bits = ints(bits, device);
  t.t_full_offset = ints(m.t_full_offset, device);
  t.t_full_index = ints(m.t_full_index, device);
  t.t_part_offset = ints(m.t_part_offset, device);
  t.t_part_index = ints(m.t_part_index, device);
  t.t_part_entry = ints(m.t_part_entry, device);
  return t;
}

at::Tensor dense(const BlockMask& m, c10::Device device) {
  at::Tensor out = torch::zeros({m.batch, m.heads, m.q_len, m.kv_len}, torch::kBool);
  auto acc = out.accessor<bool, 4>();
  const int64_t nq = m.q_blocks(), wpr = m.words_per_row();
  for (int64_t b = 0; b < m.batch; ++b)
    for (int64_t h = 0; h < m.heads; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t row = (b * m.heads + h) * nq + i;
        const int64_t q0 = i * m.block_q, q1 = std::min(q0 + m.block_q, m.q_len);
        for (int32_t e = m.full_offset[row]; e < m.full_offset[row + 1]; ++e) {
          const int64_t k0 = int64_t(m.full_index[e]) * m.block_kv, k1 = std::min(k0 + m.block_kv, m.kv_len);
          for (int64_t q = q0; q < q1; ++q)
            for (int64_t k = k0; k < k1; ++k) acc[b][h][q][k] = true;
        }
        for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e) {
          const int64_t k0 = int64_t(m.part_index[e]) * m.block_kv, k1 = std::min(k0 + m.block_kv, m.kv_len);
          const uint32_t* w = &m.bits[static_cast<size_t>(e * m.words_per_tile())];
          for (int64_t q = q0; q < q1; ++q)
            for (int64_t k = k0; k < k1; ++k)
              if ((w[(q - q0) * wpr + (k - k0) / 32] >> ((k - k0) % 32)) & 1u) acc[b][h][q][k] = true;
        }
      }
  return device.is_cpu() ? out : out.to(device);
}

std::string AttentionProblem::str() const {
  std::ostringstream os;
  os << device.str() << " " << c10::toString(dtype) << " B=" << batch << " Hq=" << heads_q << " Hkv=" << heads_kv
     << " Lq=" << q_len << " Lkv=" << kv_len << " D=" << head_dim << " mask=" << (mask.empty() ? "?" : mask)
     << (needs_backward ? " (forward+backward)" : " (forward only)");
  return os.str();
}

}  // namespace flashdraft

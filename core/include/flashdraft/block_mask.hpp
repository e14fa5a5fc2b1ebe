// BlockMask: the one mask structure every attention kernel consumes.
//
// The attention matrix of one (batch element, head) is cut into tiles of BQ query rows
// by BKV key columns. A tile is
//   - empty   : no element visible        -> not listed at all,
//   - full    : every in-range element visible -> listed in the "full" list, no bitmap,
//   - partial : some visible              -> listed in the "partial" list with a bitmap.
// Elements outside [0, q_len) x [0, kv_len) (the ragged edge tiles) never count: their
// bits are 0, and a tile is full when all of its in-range elements are visible.
//
// Storage is CSR, per (mask batch b, mask head h, query block i):
//   row = (b * heads + h) * q_blocks + i
//   full KV blocks    : full_index[full_offset[row] .. full_offset[row + 1])     sorted
//   partial KV blocks : part_index[part_offset[row] .. part_offset[row + 1])     sorted
//   bitmap of partial entry e : bits[e * words_per_tile .. (e + 1) * words_per_tile)
//     element (r, c) of the tile (0 <= r < BQ, 0 <= c < BKV) is bit (c % 32) of
//     word r * words_per_row + c / 32, with words_per_row = ceil(BKV / 32).
// The transpose (for backward: dK/dV walk query blocks per KV block), per
//   col = (b * heads + h) * kv_blocks + j:
//   full query blocks    : t_full_index[t_full_offset[col] .. t_full_offset[col + 1])
//   partial query blocks : t_part_index[...] and, aligned with it, t_part_entry[...] =
//                          the partial entry e (index into bits) of that tile.
//
// batch == 1 or heads == 1 means the mask is shared across batch elements or heads:
// a kernel reads mask batch (batch == 1 ? 0 : b) and mask head (heads == 1 ? 0 : h).
//
// This header is free of LibTorch on purpose: mask generators are plain C++.
#pragma once

#include <flashdraft/export.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft {

struct FLASHDRAFT_API BlockMask {
  int64_t batch = 1;     // mask batch extent (1 = shared across the batch)
  int64_t heads = 1;     // mask head extent (1 = shared across heads)
  int64_t q_len = 0;     // Lq
  int64_t kv_len = 0;    // Lkv
  int64_t block_q = 0;   // BQ
  int64_t block_kv = 0;  // BKV

  std::vector<int32_t> full_offset, full_index;
  std::vector<int32_t> part_offset, part_index;
  std::vector<uint32_t> bits;

  std::vector<int32_t> t_full_offset, t_full_index;
  std::vector<int32_t> t_part_offset, t_part_index, t_part_entry;

  int64_t q_blocks() const { return block_q > 0 ? (q_len + block_q - 1) / block_q : 0; }
  int64_t kv_blocks() const { return block_kv > 0 ? (kv_len + block_kv - 1) / block_kv : 0; }
  int64_t words_per_row() const { return (block_kv + 31) / 32; }
  int64_t words_per_tile() const { return block_q * words_per_row(); }
  int64_t full_count() const { return static_cast<int64_t>(full_index.size()); }
  int64_t partial_count() const { return static_cast<int64_t>(part_index.size()); }
  // Bytes held by the lists and bitmaps (what a kernel must read).
  int64_t bytes() const;

  // Visibility of one element, from the lists (slow; for tests and references).
  bool visible(int64_t b, int64_t h, int64_t q, int64_t kv) const;
  // Number of visible (q, kv) pairs summed over mask batch and heads.
  int64_t visible_pairs() const;

  // Throws std::invalid_argument with a sentence naming the first inconsistency:
  // offsets monotone and sized right, indices sorted and in range, no tile listed
  // twice, bitmaps consistent with their class (partial: at least one bit and not all
  // in-range bits; no bit outside the range), transposed lists the exact transpose.
  void validate() const;
};

// Assembles a BlockMask from per-row tile decisions. Generators call begin_row() for
// every (b, h, i) in order, then add_full / add_partial with ascending KV block
// indices, and finish() builds offsets and the transpose.
class FLASHDRAFT_API BlockMaskBuilder {
 public:
  BlockMaskBuilder(int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len, int64_t block_q, int64_t block_kv);
  void begin_row();  // next (b, h, i) row in order
  void add_full(int32_t kv_block);
  // Returns the tile's bitmap words (zeroed, words_per_tile() long) to fill.
  uint32_t* add_partial(int32_t kv_block);
  // Adds a tile, classifying it from a predicate over in-range elements; skips empty.
  template <class Pred>
  void add_tile(int32_t kv_block, Pred visible);
  BlockMask finish();
  const BlockMask& peek() const { return mask_; }

 private:
  BlockMask mask_;
  int64_t rows_begun_ = 0;
};

template <class Pred>
void BlockMaskBuilder::add_tile(int32_t kv_block, Pred visible) {
  const int64_t i = (rows_begun_ - 1) % mask_.q_blocks();
  const int64_t q0 = i * mask_.block_q, k0 = int64_t(kv_block) * mask_.block_kv;
  const int64_t q1 = std::min(q0 + mask_.block_q, mask_.q_len);
  const int64_t k1 = std::min(k0 + mask_.block_kv, mask_.kv_len);
  int64_t count = 0;
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t k = k0; k < k1; ++k) count += visible(q, k) ? 1 : 0;
  if (count == 0) return;
  if (count == (q1 - q0) * (k1 - k0)) {
    add_full(kv_block);
    return;
  }
  uint32_t* w = add_partial(kv_block);
  const int64_t wpr = mask_.words_per_row();
  for (int64_t q = q0; q < q1; ++q)
    for (int64_t k = k0; k < k1; ++k)
      if (visible(q, k)) w[(q - q0) * wpr + (k - k0) / 32] |= 1u << ((k - k0) % 32);
}

}  // namespace flashdraft

// The pure bookkeeping of a DFlash training step, free of LibTorch so that tests can
// check it against hand-worked numbers:
//   - which positions may start a block (anchor candidates),
//   - drawing N anchors without replacement, sorted, with padding blocks when a
//     sequence has fewer than N candidates,
//   - the label and the loss weight of every block position.
//
// Block b covers positions anchor_b + j, j = 0..BS-1. Position 0 holds the real token
// at anchor_b (the drafter is given it), positions 1..BS-1 hold MASK and are trained on
// the token at anchor_b + j with weight w_j = exp(-(j - 1) / gamma): the first
// predicted token weighs 1 and later ones decay, since a drafted token is only useful
// when every token before it in the block was accepted.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft::dflash {

// Anchors a with a whole block inside the valid length (a + BS - 1 < length) whose
// first trained position a + 1 may carry loss (loss_mask may be null: every position
// may). Ascending.
inline std::vector<int64_t> anchor_candidates(int64_t length, int64_t block_size,
                                              const uint8_t* loss_mask) {
  if (block_size < 1) throw std::invalid_argument("block size " + std::to_string(block_size) + " must be at least 1");
  std::vector<int64_t> out;
  for (int64_t a = 0; a + block_size - 1 < length; ++a)
    if (loss_mask == nullptr || block_size == 1 || loss_mask[a + 1] != 0) out.push_back(a);
  return out;
}

struct Anchors {
  std::vector<int64_t> anchors;  // N entries, non-decreasing; valid ones strictly increasing
  std::vector<uint8_t> valid;    // 1 = real block, 0 = padding block (no loss, sees nothing)
};

// Draws n of the candidates without replacement: a partial Fisher-Yates shuffle driven
// by draw(k), a uniform integer in [0, k). The chosen anchors are sorted. When there are
// fewer than n candidates, all of them are used and the remaining blocks are padding:
// they repeat the last real anchor (or 0 when there is none), so the list stays
// non-decreasing and inside the context, and carry valid = 0.
template <class Draw>
Anchors draw_anchors(std::vector<int64_t> candidates, int64_t n, Draw&& draw) {
  if (n < 1) throw std::invalid_argument("the number of anchors must be at least 1, got " + std::to_string(n));
  const int64_t count = static_cast<int64_t>(candidates.size());
  const int64_t take = count < n ? count : n;
  for (int64_t i = 0; i < take; ++i) {
    const int64_t r = i + static_cast<int64_t>(draw(count - i));  // uniform in [i, count)
    std::swap(candidates[static_cast<size_t>(i)], candidates[static_cast<size_t>(r)]);
  }
  Anchors out;
  out.anchors.assign(candidates.begin(), candidates.begin() + take);
  std::sort(out.anchors.begin(), out.anchors.end());
  out.valid.assign(static_cast<size_t>(take), 1);
  const int64_t pad = take > 0 ? out.anchors.back() : 0;
  while (static_cast<int64_t>(out.anchors.size()) < n) {
    out.anchors.push_back(pad);
    out.valid.push_back(0);
  }
  return out;
}

// Loss weight of block position j (0 for position 0, which is given, not predicted).
inline double position_weight(int64_t j, double gamma) {
  return j >= 1 ? std::exp(-static_cast<double>(j - 1) / gamma) : 0.0;
}

struct BlockLabels {
  std::vector<int64_t> labels;  // N * BS entries; -1 = no loss at this block position
  std::vector<double> weights;  // N * BS entries; 0 where labels == -1
};

// Labels of one sequence's blocks. tokens and loss_mask (nullable) have `length` valid
// entries. Position j of valid block b is trained on tokens[anchor_b + j] when
// 1 <= j, anchor_b + j < length and the loss mask allows it there.
inline BlockLabels block_labels(const int64_t* tokens, const uint8_t* loss_mask, int64_t length,
                                const Anchors& anchors, int64_t block_size, double gamma) {
  const size_t n = anchors.anchors.size();
  BlockLabels out;
  out.labels.assign(n * static_cast<size_t>(block_size), -1);
  out.weights.assign(n * static_cast<size_t>(block_size), 0.0);
  for (size_t b = 0; b < n; ++b) {
    if (!anchors.valid[b]) continue;
    for (int64_t j = 1; j < block_size; ++j) {
      const int64_t p = anchors.anchors[b] + j;
      if (p >= length || (loss_mask != nullptr && loss_mask[p] == 0)) continue;
      const size_t slot = b * static_cast<size_t>(block_size) + static_cast<size_t>(j);
      out.labels[slot] = tokens[p];
      out.weights[slot] = position_weight(j, gamma);
    }
  }
  return out;
}

}  // namespace flashdraft::dflash

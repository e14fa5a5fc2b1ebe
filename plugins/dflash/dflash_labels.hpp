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

// Which positions may start a block ([drafter] anchor_rule):
//   response    the anchor is a response token followed by another one (loss_mask at a and
//               at a + 1): the positions a server drafts from (its first block starts at
//               the first response token; it never drafts after the last prompt token), and
//               the rule of vLLM's speculators (anchors on loss-carrying tokens);
//   next_token  the token after the anchor carries loss (the anchor may be the last prompt
//               token): flashdraft's rule before 2026-12, kept to reproduce older runs.
enum class AnchorRule { response, next_token };

// A document of a row: positions [begin, end).
struct Document {
  int64_t begin = 0, end = 0;
};

// Anchors a whose whole block lies inside its document (a + BS - 1 < end: no block crosses
// a document's end) and that `rule` admits (loss_mask may be null: every position may carry
// loss). Ascending.
inline std::vector<int64_t> anchor_candidates(const std::vector<Document>& documents, int64_t block_size,
                                              const uint8_t* loss_mask, AnchorRule rule) {
  if (block_size < 1) throw std::invalid_argument("block size " + std::to_string(block_size) + " must be at least 1");
  std::vector<int64_t> out;
  for (const Document& d : documents)
    for (int64_t a = d.begin; a + block_size - 1 < d.end; ++a) {
      if (loss_mask == nullptr) {
        out.push_back(a);
        continue;
      }
      const bool next = block_size == 1 || loss_mask[a + 1] != 0;
      if (rule == AnchorRule::next_token ? next : loss_mask[a] != 0 && next) out.push_back(a);
    }
  return out;
}

// One document of `length` positions, the rule before 2026-12 (the tests of that rule).
inline std::vector<int64_t> anchor_candidates(int64_t length, int64_t block_size, const uint8_t* loss_mask) {
  return anchor_candidates({Document{0, length}}, block_size, loss_mask, AnchorRule::next_token);
}

// gamma of the loss weights when [drafter] gamma is not given: the DFlash paper's values,
// 7 for blocks of 16, 5 for 10, 4 for 8 (also SpecForge's recommendation), linear between
// them and beyond them along the nearest segment (at least 1).
inline double default_gamma(int64_t block_size) {
  const double b = static_cast<double>(block_size);
  const double g = b <= 10 ? 4.0 + (b - 8.0) * 0.5 : 5.0 + (b - 10.0) * (2.0 / 6.0);
  return g < 1.0 ? 1.0 : g;
}

// The reference's default target layers (z-lab dflash `build_target_layer_ids`): one per
// drafter layer, spread evenly from layer 1 to layer L - 3 (the middle layer for a
// one-layer drafter). Ids as flashdraft counts them (id l = transformers' hidden_states[l + 1]).
inline std::vector<int64_t> reference_layer_ids(int64_t target_layers, int64_t draft_layers) {
  if (draft_layers == 1) return {target_layers / 2};
  const double start = 1, span = static_cast<double>(target_layers - 3) - start;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < draft_layers; ++i) {
    // Python's round(): halves to even, as nearbyint in the default rounding mode.
    const double x = start + static_cast<double>(i) * span / static_cast<double>(draft_layers - 1);
    ids.push_back(static_cast<int64_t>(std::nearbyint(x)));
  }
  return ids;
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
// ends[n]: where the document of block n ends (no label past it).
inline BlockLabels block_labels(const int64_t* tokens, const uint8_t* loss_mask, const std::vector<int64_t>& ends,
                                const Anchors& anchors, int64_t block_size, double gamma) {
  const size_t n = anchors.anchors.size();
  BlockLabels out;
  out.labels.assign(n * static_cast<size_t>(block_size), -1);
  out.weights.assign(n * static_cast<size_t>(block_size), 0.0);
  for (size_t b = 0; b < n; ++b) {
    if (!anchors.valid[b]) continue;
    for (int64_t j = 1; j < block_size; ++j) {
      const int64_t p = anchors.anchors[b] + j;
      if (p >= ends[b] || (loss_mask != nullptr && loss_mask[p] == 0)) continue;
      const size_t slot = b * static_cast<size_t>(block_size) + static_cast<size_t>(j);
      out.labels[slot] = tokens[p];
      out.weights[slot] = position_weight(j, gamma);
    }
  }
  return out;
}

inline BlockLabels block_labels(const int64_t* tokens, const uint8_t* loss_mask, int64_t length, const Anchors& anchors,
                                int64_t block_size, double gamma) {
  return block_labels(tokens, loss_mask, std::vector<int64_t>(anchors.anchors.size(), length), anchors, block_size,
                      gamma);
}

}  // namespace flashdraft::dflash

// dflash: the DFlash training mask (DESIGN.md, "DFlash training semantics").
//   keys/values = [context (S = context_len) | blocks (N * BS)],  queries = blocks (N * BS)
//   Query q belongs to block n = q / BS (row j = q % BS inside it), of batch element b.
//   A valid block n sees
//     - the context strictly before its anchor:  kv < anchors[b][n],
//     - its own block:  S + n*BS <= kv < S + (n+1)*BS          (in_block = "bidirectional"),
//                       S + n*BS <= kv <= S + n*BS + j         (in_block = "causal"),
//   and never another block. A padding block (blocks.valid[b][n] = 0) sees nothing.
//   With blocks.lengths (a server's shorter last block), block n has len = blocks.lengths[b][n]
//   tokens: its own-block keys end at S + n*BS + len and its queries j >= len see nothing.
//   With doc_lengths (packed rows: the documents of each row's context, summing to S), the
//   context a block sees is only its anchor's document: start(anchor's document) <= kv <
//   anchor; and a valid block must lie inside that document (anchor + BS <= its end).
//   With window W > 0 (a sliding-window draft layer, as z-lab's DFlashDraftModel masks its
//   "sliding_attention" layers): row j of block n is at position anchor + j and sees only keys
//   within W positions of it: context kv > anchor + j - W, own-block rows j' with |j - j'| < W.
// Each row is two intervals (context, own block); per query block of BQ rows the
// context KV blocks left of the smallest anchor are full, the one or two under the
// spread of anchors get bitmaps, and the block region contributes the block-diagonal
// tiles (masks/row_intervals.hpp). The mask differs per batch element (mask batch = B).
//
// Input checks (std::invalid_argument naming the value): block size >= 1; for valid
// blocks 0 <= anchor <= S - BS (the anchor needs BS - 1 following context tokens, the
// labels of its block) and anchors strictly increasing; shapes of blocks.anchors/valid
// and Lq = N*BS, Lkv = S + N*BS.
//
// [mask] plugin = "dflash"
//   in_block = "bidirectional"   # or "causal"
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

std::string s(int64_t v) { return std::to_string(v); }

class DFlashMask final : public flashdraft::MaskGenerator {
 public:
  explicit DFlashMask(const flashdraft::Config& c) : causal_in_block_(c.string("in_block") == "causal") {}

  static void declare(flashdraft::Schema& s) {
    s.string("in_block", "attention inside a block: every block token sees the whole block, or only up to itself")
        .def(std::string("bidirectional"))
        .one_of({"bidirectional", "causal"});
  }

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    check(in);
    const int64_t S = in.blocks.context_len, BS = in.blocks.block_size;
    flashdraft::BlockMaskBuilder builder(in.batch, 1, in.q_len, in.kv_len, bq, bkv);
    flashdraft::masks::RowScratch scratch;
    const bool causal = causal_in_block_;
    const int64_t W = in.window;
    std::vector<int64_t> doc_start;  // per block of the row: where its anchor's document starts
    for (int64_t b = 0; b < in.batch; ++b) {
      const int64_t* anchor = in.blocks.anchors[static_cast<size_t>(b)].data();
      doc_start.assign(in.blocks.anchors[static_cast<size_t>(b)].size(), 0);
      if (!in.doc_lengths.empty())
        for (size_t n = 0; n < doc_start.size(); ++n) doc_start[n] = document_of(in, b, anchor[n]).first;
      const int64_t* first = doc_start.data();
      const uint8_t* valid = in.blocks.valid.empty() ? nullptr : in.blocks.valid[static_cast<size_t>(b)].data();
      const int64_t* length = in.blocks.lengths.empty() ? nullptr : in.blocks.lengths[static_cast<size_t>(b)].data();
      flashdraft::masks::add_slice<2>(
          builder, in.q_len, in.kv_len, bq, bkv,
          [=](int64_t q, int64_t* lo, int64_t* hi) {
            const int64_t n = q / BS, j = q - n * BS, len = length ? length[n] : BS;
            if ((valid && !valid[n]) || j >= len) {
              lo[0] = hi[0] = lo[1] = hi[1] = 0;
              return;
            }
            lo[0] = first[n];  // context before the anchor, in its document
            hi[0] = anchor[n];
            lo[1] = S + n * BS;  // own block
            hi[1] = causal ? S + n * BS + j + 1 : S + n * BS + len;
            if (W > 0) {  // keys within W positions of anchor + j
              lo[0] = std::min(hi[0], std::max(lo[0], anchor[n] + j - W + 1));
              lo[1] = std::max(lo[1], S + n * BS + j - W + 1);
              hi[1] = std::min(hi[1], S + n * BS + j + W);
            }
          },
          scratch);
    }
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t b, int64_t, int64_t q, int64_t kv) const override {
    if (q < 0 || q >= in.q_len || kv < 0 || kv >= in.kv_len || in.blocks.block_size < 1) return false;
    const int64_t n = q / in.blocks.block_size;
    if (!in.blocks.valid.empty() && !in.blocks.valid[static_cast<size_t>(b)][static_cast<size_t>(n)]) return false;
    const int64_t len = in.blocks.lengths.empty() ? in.blocks.block_size
                                                  : in.blocks.lengths[static_cast<size_t>(b)][static_cast<size_t>(n)];
    const int64_t j = q - n * in.blocks.block_size;
    if (j >= len) return false;  // past a short block's tokens
    const int64_t a = in.blocks.anchors[static_cast<size_t>(b)][static_cast<size_t>(n)];
    if (kv < in.blocks.context_len) {
      if (in.window > 0 && a + j - kv >= in.window) return false;  // outside the sliding window
      return kv < a && (in.doc_lengths.empty() || kv >= document_of(in, b, a).first);
    }
    const int64_t m = (kv - in.blocks.context_len) / in.blocks.block_size;  // block of the key
    const int64_t jk = kv - in.blocks.context_len - n * in.blocks.block_size;
    if (m != n || jk >= len) return false;
    if (in.window > 0 && (j - jk >= in.window || jk - j >= in.window)) return false;
    return !causal_in_block_ || kv - in.blocks.context_len <= q;
  }

 private:
  // [start, end) of the document of context position p in batch element b.
  static std::pair<int64_t, int64_t> document_of(const flashdraft::MaskInput& in, int64_t b, int64_t p) {
    int64_t start = 0;
    for (int64_t len : in.doc_lengths[static_cast<size_t>(b)]) {
      if (p < start + len) return {start, start + len};
      start += len;
    }
    return {start, start};
  }

  // Checks doc_lengths (given): one list per batch element, documents of length >= 1
  // covering the context exactly.
  static void check_doc_lengths(const flashdraft::MaskInput& in) {
    const int64_t S = in.blocks.context_len;
    if (static_cast<int64_t>(in.doc_lengths.size()) != in.batch)
      throw std::invalid_argument("dflash: doc_lengths has " + s(static_cast<int64_t>(in.doc_lengths.size())) +
                                  " lists for a batch of " + s(in.batch) + " (give one per batch element, or none)");
    for (int64_t b = 0; b < in.batch; ++b) {
      int64_t sum = 0;
      for (int64_t len : in.doc_lengths[static_cast<size_t>(b)]) {
        if (len < 1)
          throw std::invalid_argument("dflash: batch element " + s(b) + " has a document of length " + s(len) +
                                      "; documents hold at least one position");
        sum += len;
      }
      if (sum != S)
        throw std::invalid_argument("dflash: the documents of batch element " + s(b) + " cover " + s(sum) +
                                    " positions, the context has " + s(S) + " (they must cover it exactly)");
    }
  }

  // Checks batch element b's per-block lists: N anchors, N blocks.valid flags and N
  // blocks.lengths in 1..BS (those given).
  static void check_block_shapes(const flashdraft::MaskInput& in, int64_t b, int64_t N) {
    const int64_t BS = in.blocks.block_size;
    const auto& a = in.blocks.anchors[static_cast<size_t>(b)];
    if (static_cast<int64_t>(a.size()) != N)
      throw std::invalid_argument("dflash: batch element " + s(b) + " has " + s(static_cast<int64_t>(a.size())) +
                                  " anchors but element 0 has " + s(N) + "; every element needs the same count");
    if (!in.blocks.valid.empty() && static_cast<int64_t>(in.blocks.valid[static_cast<size_t>(b)].size()) != N)
      throw std::invalid_argument("dflash: blocks.valid of batch element " + s(b) + " has " +
                                  s(static_cast<int64_t>(in.blocks.valid[static_cast<size_t>(b)].size())) +
                                  " flags for " + s(N) + " anchors");
    if (!in.blocks.lengths.empty()) {
      const auto& len = in.blocks.lengths[static_cast<size_t>(b)];
      if (static_cast<int64_t>(len.size()) != N)
        throw std::invalid_argument("dflash: blocks.lengths of batch element " + s(b) + " has " +
                                    s(static_cast<int64_t>(len.size())) + " lengths for " + s(N) + " anchors");
      for (int64_t n = 0; n < N; ++n)
        if (len[static_cast<size_t>(n)] < 1 || len[static_cast<size_t>(n)] > BS)
          throw std::invalid_argument("dflash: block " + s(n) + " of batch element " + s(b) + " has length " +
                                      s(len[static_cast<size_t>(n)]) + "; a block holds 1.." + s(BS) + " tokens");
    }
  }

  // Checks the anchors of batch element b's valid blocks: inside the context with room for
  // a block after them, strictly increasing, and (with doc_lengths) each block inside its
  // anchor's document.
  static void check_anchors(const flashdraft::MaskInput& in, int64_t b, int64_t N) {
    const int64_t S = in.blocks.context_len, BS = in.blocks.block_size;
    const auto& a = in.blocks.anchors[static_cast<size_t>(b)];
    int64_t prev = -1, prev_n = -1;
    for (int64_t n = 0; n < N; ++n) {
      if (!in.blocks.valid.empty() && !in.blocks.valid[static_cast<size_t>(b)][static_cast<size_t>(n)]) continue;
      const int64_t x = a[static_cast<size_t>(n)];
      const std::string where = " of batch element " + s(b) + ", block " + s(n);
      if (x < 0 || x >= S)
        throw std::invalid_argument("dflash: anchor " + s(x) + where + " is outside the context [0, " + s(S) + ")");
      if (x > S - BS)
        throw std::invalid_argument("dflash: anchor " + s(x) + where + " leaves no room for the " + s(BS - 1) +
                                    " tokens after it in a context of " + s(S) + "; anchors must be <= " + s(S - BS));
      if (x <= prev)
        throw std::invalid_argument("dflash: anchor " + s(x) + where + " is not after anchor " + s(prev) +
                                    " of block " + s(prev_n) + "; anchors must be strictly increasing");
      if (!in.doc_lengths.empty()) {
        const auto [d0, d1] = document_of(in, b, x);
        const int64_t len =
            in.blocks.lengths.empty() ? BS : in.blocks.lengths[static_cast<size_t>(b)][static_cast<size_t>(n)];
        if (x + len > d1)
          throw std::invalid_argument("dflash: the block at anchor " + s(x) + where + " runs past the end " + s(d1) +
                                      " of its document [" + s(d0) + ", " + s(d1) +
                                      "); a block must stay inside its document");
      }
      prev = x;
      prev_n = n;
    }
  }

  static void check(const flashdraft::MaskInput& in) {
    const int64_t S = in.blocks.context_len, BS = in.blocks.block_size;
    if (BS < 1) throw std::invalid_argument("dflash: block size " + s(BS) + " is not accepted; it must be at least 1");
    if (S < 0) throw std::invalid_argument("dflash: context length " + s(S) + " is negative");
    if (in.window < 0) throw std::invalid_argument("dflash: window " + s(in.window) + " is negative (0 = none)");
    if (in.batch < 1 || static_cast<int64_t>(in.blocks.anchors.size()) != in.batch)
      throw std::invalid_argument("dflash: the batch gives " + s(static_cast<int64_t>(in.blocks.anchors.size())) +
                                  " anchor lists for a batch of " + s(in.batch) +
                                  "; one list per batch element is needed");
    const int64_t N = static_cast<int64_t>(in.blocks.anchors[0].size());
    if (!in.doc_lengths.empty()) check_doc_lengths(in);
    if (!in.blocks.lengths.empty() && static_cast<int64_t>(in.blocks.lengths.size()) != in.batch)
      throw std::invalid_argument("dflash: blocks.lengths has " + s(static_cast<int64_t>(in.blocks.lengths.size())) +
                                  " lists for a batch of " + s(in.batch) + " (give one per batch element, or none)");
    if (!in.blocks.valid.empty() && static_cast<int64_t>(in.blocks.valid.size()) != in.batch)
      throw std::invalid_argument("dflash: blocks.valid has " + s(static_cast<int64_t>(in.blocks.valid.size())) +
                                  " lists for a batch of " + s(in.batch) + " (give one per batch element, or none)");
    if (in.q_len != N * BS)
      throw std::invalid_argument("dflash: query length " + s(in.q_len) + " is not anchors x block size = " + s(N) +
                                  " x " + s(BS) + " = " + s(N * BS));
    if (in.kv_len != S + N * BS)
      throw std::invalid_argument("dflash: key length " + s(in.kv_len) + " is not context + blocks = " + s(S) + " + " +
                                  s(N * BS) + " = " + s(S + N * BS));
    for (int64_t b = 0; b < in.batch; ++b) {
      check_block_shapes(in, b, N);
      check_anchors(in, b, N);
    }
  }
  bool causal_in_block_;
};

}  // namespace

FLASHDRAFT_PLUGIN(mask, "dflash", "0.1.0",
                  "DFlash training mask: each block sees the context before its anchor and itself, never another block",
                  DFlashMask)

// causal: query q sees key kv when kv <= diag(q), with
//   diag(q) = q + offset + (bottom_right ? Lkv - Lq : 0).
// With bottom_right = true (default) and offset = 0, the last query sees the last key
// (the usual alignment when the queries are the tail of the keys, e.g. Lq < Lkv with a
// cache in front); with bottom_right = false the first query sees the first key. Rows
// with diag(q) < 0 see nothing. Each row is one interval [0, diag(q) + 1), so the mask
// is built by the shared row-interval builder (masks/row_intervals.hpp): per query
// block, KV blocks left of the first row's diagonal are full, the one or two blocks
// under the diagonal get bitmaps.
//
// Cached decoding (MaskInput::q_offsets, one per batch element): the queries are positions
// q_offsets[b] + q of the keys, so diag(q) = q + q_offsets[b] + offset (bottom_right does not
// apply); the mask then differs per batch element. A sliding window W (MaskInput::window > 0:
// a target's sliding layers) keeps only keys with diag(q) - kv < W.
//
// [mask] plugin = "causal"
//   offset      = 0      # shift of the diagonal (positive: see further right)
//   bottom_right = true  # align the diagonal to the last query/key
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace {

class CausalMask final : public flashdraft::MaskGenerator {
 public:
  explicit CausalMask(const flashdraft::Config& c)
      : offset_(c.integer("offset")), bottom_right_(c.boolean("bottom_right")) {}

  static void declare(flashdraft::Schema& s) {
    s.integer("offset", "diagonal shift: query q sees kv <= q + offset (+ Lkv - Lq when bottom_right)").def(int64_t{0});
    s.boolean("bottom_right", "align the diagonal so the last query sees the last key (adds Lkv - Lq)").def(true);
  }

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    if (!in.q_offsets.empty() && static_cast<int64_t>(in.q_offsets.size()) != in.batch)
      throw std::invalid_argument("causal: q_offsets has " + std::to_string(in.q_offsets.size()) +
                                  " entries for a batch of " + std::to_string(in.batch) +
                                  " (give one per batch element, or none)");
    const int64_t rows = in.q_offsets.empty() ? 1 : in.batch;
    flashdraft::BlockMaskBuilder builder(rows, 1, in.q_len, in.kv_len, bq, bkv);
    flashdraft::masks::RowScratch scratch;
    const int64_t W = flashdraft::masks::window(in, "causal");
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t shift = diagonal_shift(in, b);
      flashdraft::masks::add_slice<1>(
          builder, in.q_len, in.kv_len, bq, bkv,
          [shift, W](int64_t q, int64_t* lo, int64_t* hi) {
            lo[0] = W > 0 ? std::max<int64_t>(0, q + shift - W + 1) : 0;
            hi[0] = q + shift + 1;
          },
          scratch);
    }
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t b, int64_t, int64_t q, int64_t kv) const override {
    return q >= 0 && q < in.q_len && kv >= 0 && kv < in.kv_len && kv <= q + diagonal_shift(in, b) &&
           (in.window <= 0 || q + diagonal_shift(in, b) - kv < in.window);
  }

 private:
  int64_t diagonal_shift(const flashdraft::MaskInput& in, int64_t b) const {
    if (!in.q_offsets.empty()) return offset_ + in.q_offsets[static_cast<size_t>(b)];
    return offset_ + (bottom_right_ ? in.kv_len - in.q_len : 0);
  }
  int64_t offset_;
  bool bottom_right_;
};

}  // namespace

FLASHDRAFT_PLUGIN(mask, "causal", "0.1.0",
                  "causal mask: query q sees kv <= q + offset (bottom-right aligned by default)", CausalMask)

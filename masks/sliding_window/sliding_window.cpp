// sliding_window: a band of width `window` around the diagonal
//   diag(q) = q + offset + (bottom_right ? Lkv - Lq : 0)   (as in the causal mask).
//   causal    (two_sided = false): q sees kv with  0 <= diag(q) - kv < window
//                                  (the window keys ending at the diagonal);
//   two-sided (two_sided = true) : q sees kv with |diag(q) - kv| < window
//                                  (window - 1 keys on each side of the diagonal).
// Each row is one interval; lo and hi grow with q, so per query block the full KV
// blocks are those inside [lo(last row), hi(first row)) and the ones at the two band
// edges get bitmaps (masks/row_intervals.hpp).
//
// [mask] plugin = "sliding_window"
//   window = 256         # required, 1 <= window <= Lkv
//   two_sided = false
//   offset = 0
//   bottom_right = true
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <stdexcept>
#include <string>

namespace {

class SlidingWindowMask final : public flashdraft::MaskGenerator {
 public:
  explicit SlidingWindowMask(const flashdraft::Config& c)
      : window_(c.integer("window")),
        two_sided_(c.boolean("two_sided")),
        offset_(c.integer("offset")),
        bottom_right_(c.boolean("bottom_right")) {}

  static void declare(flashdraft::Schema& s) {
    s.integer("window", "band width: causal sees kv in (diag - window, diag]; two-sided sees |kv - diag| < window")
        .at_least(1);
    s.boolean("two_sided", "see window - 1 keys on both sides of the diagonal instead of only before it").def(false);
    s.integer("offset", "diagonal shift: diag(q) = q + offset (+ Lkv - Lq when bottom_right)").def(int64_t{0});
    s.boolean("bottom_right", "align the diagonal so the last query sees the last key (adds Lkv - Lq)").def(true);
  }

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    if (window_ > in.kv_len)
      throw std::invalid_argument("sliding_window: window " + std::to_string(window_) +
                                  " is larger than the key sequence (Lkv = " + std::to_string(in.kv_len) +
                                  "); a window must be between 1 and Lkv");
    flashdraft::BlockMaskBuilder builder(1, 1, in.q_len, in.kv_len, bq, bkv);
    const int64_t shift = diagonal_shift(in), w = window_, right = two_sided_ ? window_ : 1;
    flashdraft::masks::RowScratch scratch;
    flashdraft::masks::add_slice<1>(
        builder, in.q_len, in.kv_len, bq, bkv,
        [=](int64_t q, int64_t* lo, int64_t* hi) {
          const int64_t diag = q + shift;
          lo[0] = diag - w + 1;
          hi[0] = diag + right;
        },
        scratch);
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t, int64_t, int64_t q, int64_t kv) const override {
    if (q < 0 || q >= in.q_len || kv < 0 || kv >= in.kv_len) return false;
    const int64_t d = q + diagonal_shift(in) - kv;  // distance behind the diagonal
    return two_sided_ ? (d < window_ && -d < window_) : (d >= 0 && d < window_);
  }

 private:
  int64_t diagonal_shift(const flashdraft::MaskInput& in) const {
    return offset_ + (bottom_right_ ? in.kv_len - in.q_len : 0);
  }
  int64_t window_;
  bool two_sided_;
  int64_t offset_;
  bool bottom_right_;
};

}  // namespace

FLASHDRAFT_PLUGIN(mask, "sliding_window", "0.1.0",
                  "sliding-window mask: a band of `window` keys before (or around) the diagonal", SlidingWindowMask)

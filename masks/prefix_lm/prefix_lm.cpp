// prefix_lm: the first `prefix` keys are seen by every query (bidirectional prefix);
// after it, attention is causal. Query q sees key kv when kv < prefix or kv <= diag(q),
// diag(q) = q + Lkv - Lq (bottom-right aligned; diag(q) = q when Lq = Lkv).
// Row q is the interval [0, max(prefix, diag(q) + 1)), growing with q
// (masks/row_intervals.hpp lists the blocks).
//
// [mask] plugin = "prefix_lm"
//   prefix = 128   # required, 0 <= prefix <= Lkv
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace {

class PrefixLmMask final : public flashdraft::MaskGenerator {
 public:
  explicit PrefixLmMask(const flashdraft::Config& c) : prefix_(c.integer("prefix")) {}

  static void declare(flashdraft::Schema& s) {
    s.integer("prefix", "length of the bidirectional prefix (seen by every query); causal after it").at_least(0);
  }

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    if (prefix_ > in.kv_len)
      throw std::invalid_argument("prefix_lm: prefix " + std::to_string(prefix_) +
                                  " is longer than the key sequence (Lkv = " + std::to_string(in.kv_len) +
                                  "); it must be between 0 and Lkv");
    flashdraft::BlockMaskBuilder builder(1, 1, in.q_len, in.kv_len, bq, bkv);
    const int64_t shift = in.kv_len - in.q_len, p = prefix_;
    flashdraft::masks::RowScratch scratch;
    flashdraft::masks::add_slice<1>(
        builder, in.q_len, in.kv_len, bq, bkv,
        [=](int64_t q, int64_t* lo, int64_t* hi) {
          lo[0] = 0;
          hi[0] = std::max(p, q + shift + 1);
        },
        scratch);
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t, int64_t, int64_t q, int64_t kv) const override {
    if (q < 0 || q >= in.q_len || kv < 0 || kv >= in.kv_len) return false;
    return kv < prefix_ || kv <= q + in.kv_len - in.q_len;
  }

 private:
  int64_t prefix_;
};

}  // namespace

FLASHDRAFT_PLUGIN(mask, "prefix_lm", "0.1.0", "prefix LM: bidirectional prefix of length `prefix`, causal after",
                  PrefixLmMask)

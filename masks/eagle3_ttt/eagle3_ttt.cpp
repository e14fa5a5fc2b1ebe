// eagle3_ttt: the attention pattern of EAGLE-3's training-time test (plugins/eagle3).
//   The drafter is unrolled for n steps over a sequence of S positions. The queries of
//   unroll step i are its S states (q_len = S); the keys/values are every step's states so
//   far, step after step: kv = [step 0 (S) | step 1 (S) | ... | step i (S)], kv_len =
//   (i + 1) * S, so the number of unroll blocks is kv_len / q_len.
//   Query t (a position, the state of column t) sees key (j, s) = j * S + s iff
//     j == 0 and s <= t and s lies in t's document   (the causal target context), or
//     j >= 1 and s == t                              (its own earlier unroll states).
//   That is what chain drafting from position t sees: the context's keys, then the keys
//   of its own drafted tokens, one per earlier step.
// Documents: MaskInput.doc_lengths, one list per batch element (or one shared list), each
//   summing to S; none = one document per row. The mask differs per batch element when
//   the documents do.
// Building: per query block, the step-0 region is the causal-within-document band (rows
//   are intervals [start of t's document, t + 1)), the regions of steps j >= 1 are
//   diagonals. The candidate KV tiles are those the rows' intervals and diagonal entries
//   fall in (deduplicated: a tile may straddle two regions when S is not a multiple of
//   BKV); each is classified by counting its visible elements row by row (empty, full, or
//   partial with a bitmap). Cost O(BQ * steps) per query block and candidate tile;
//   nothing scans Lq x Lkv.
// Input checks (std::invalid_argument naming the value): q_len >= 1, kv_len a positive
//   multiple of q_len, document lists of the right count and sums.
//
// [mask] plugin = "eagle3_ttt"   (no keys)
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::string s(int64_t v) { return std::to_string(v); }

class Eagle3TttMask final : public flashdraft::MaskGenerator {
 public:
  explicit Eagle3TttMask(const flashdraft::Config&) {}
  static void declare(flashdraft::Schema&) {}

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    check(in);
    const int64_t S = in.q_len, steps = in.kv_len / S;
    const int64_t mb = in.doc_lengths.size() > 1 ? in.batch : 1;
    flashdraft::BlockMaskBuilder builder(mb, 1, in.q_len, in.kv_len, bq, bkv);
    const int64_t nq = (S + bq - 1) / bq, wpr = (bkv + 31) / 32;
    std::vector<int64_t> start(static_cast<size_t>(S));
    std::vector<int64_t> tiles;
    for (int64_t b = 0; b < mb; ++b) {
      doc_starts(in, b, start);
      for (int64_t i = 0; i < nq; ++i) {
        builder.begin_row();
        const int64_t q0 = i * bq, qn = std::min(bq, S - q0);
        // Candidate tiles: the step-0 band, then each step's diagonal.
        tiles.clear();
        int64_t lo = q0;
        for (int64_t r = 0; r < qn; ++r) lo = std::min(lo, start[static_cast<size_t>(q0 + r)]);
        for (int64_t k = lo / bkv; k <= (q0 + qn - 1) / bkv; ++k) tiles.push_back(k);
        for (int64_t j = 1; j < steps; ++j)
          for (int64_t k = (j * S + q0) / bkv; k <= (j * S + q0 + qn - 1) / bkv; ++k) tiles.push_back(k);
        std::sort(tiles.begin(), tiles.end());
        tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
        for (int64_t k : tiles) {
          const int64_t k0 = k * bkv, k1 = std::min(k0 + bkv, in.kv_len);
          int64_t set = 0;
          for (int64_t r = 0; r < qn; ++r) set += row_count(start, q0 + r, S, steps, k0, k1);
          if (set == 0) continue;
          if (set == qn * (k1 - k0)) {
            builder.add_full(static_cast<int32_t>(k));
            continue;
          }
          uint32_t* bits = builder.add_partial(static_cast<int32_t>(k));
          for (int64_t r = 0; r < qn; ++r) {
            const int64_t t = q0 + r;
            const int64_t a = std::max(start[static_cast<size_t>(t)], k0), e = std::min(t + 1, k1);
            if (a < e) flashdraft::masks::set_bit_range(bits + r * wpr, a - k0, e - k0);
            for (int64_t j = std::max<int64_t>(1, k0 / S); j < steps && j * S + t < k1; ++j) {
              const int64_t p = j * S + t;
              if (p >= k0) flashdraft::masks::set_bit_range(bits + r * wpr, p - k0, p - k0 + 1);
            }
          }
        }
      }
    }
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t b, int64_t, int64_t q, int64_t kv) const override {
    if (in.q_len < 1 || q < 0 || q >= in.q_len || kv < 0 || kv >= in.kv_len) return false;
    const int64_t S = in.q_len, j = kv / S, pos = kv - j * S;
    if (j >= 1) return pos == q;
    if (pos > q) return false;
    if (in.doc_lengths.empty()) return true;
    const std::vector<int64_t>& lens = in.doc_lengths[in.doc_lengths.size() == 1 ? 0 : static_cast<size_t>(b)];
    int64_t begin = 0;
    for (int64_t len : lens) {
      if (q < begin + len) return pos >= begin;
      begin += len;
    }
    return false;
  }

 private:
  // Visible keys of row t inside [k0, k1): its step-0 band and its diagonal entries.
  static int64_t row_count(const std::vector<int64_t>& start, int64_t t, int64_t S, int64_t steps, int64_t k0,
                           int64_t k1) {
    const int64_t a = std::max(start[static_cast<size_t>(t)], k0), e = std::min(t + 1, k1);
    int64_t n = a < e ? e - a : 0;
    for (int64_t j = std::max<int64_t>(1, k0 / S); j < steps && j * S + t < k1; ++j) n += j * S + t >= k0;
    return n;
  }

  static void doc_starts(const flashdraft::MaskInput& in, int64_t b, std::vector<int64_t>& start) {
    if (in.doc_lengths.empty()) {
      std::fill(start.begin(), start.end(), 0);
      return;
    }
    const std::vector<int64_t>& lens = in.doc_lengths[in.doc_lengths.size() == 1 ? 0 : static_cast<size_t>(b)];
    int64_t pos = 0;
    for (int64_t len : lens) {
      std::fill(start.begin() + pos, start.begin() + pos + len, pos);
      pos += len;
    }
  }

  static void check(const flashdraft::MaskInput& in) {
    if (in.q_len < 1)
      throw std::invalid_argument("eagle3_ttt: query length " + s(in.q_len) +
                                  " is not accepted; the queries are one unroll step's S >= 1 positions");
    if (in.kv_len < in.q_len || in.kv_len % in.q_len != 0)
      throw std::invalid_argument("eagle3_ttt: key length " + s(in.kv_len) +
                                  " is not a positive multiple of the query length " + s(in.q_len) +
                                  " (the keys are the states of unroll steps 0..i, S = " + s(in.q_len) +
                                  " each: accepted " + s(in.q_len) + ", " + s(2 * in.q_len) + ", ...)");
    if (in.doc_lengths.empty()) return;
    if (in.doc_lengths.size() != 1 && static_cast<int64_t>(in.doc_lengths.size()) != in.batch)
      throw std::invalid_argument("eagle3_ttt: doc_lengths has " + s(static_cast<int64_t>(in.doc_lengths.size())) +
                                  " lists for a batch of " + s(in.batch) +
                                  " (give one per batch element, one shared, or none)");
    for (size_t b = 0; b < in.doc_lengths.size(); ++b) {
      int64_t sum = 0;
      for (int64_t len : in.doc_lengths[b]) {
        if (len < 0)
          throw std::invalid_argument("eagle3_ttt: document length " + s(len) + " of batch element " + s(int64_t(b)) +
                                      " is negative");
        sum += len;
      }
      if (sum != in.q_len)
        throw std::invalid_argument("eagle3_ttt: the documents of batch element " + s(static_cast<int64_t>(b)) +
                                    " sum to " + s(sum) + ", not to the sequence length " + s(in.q_len));
    }
  }
};

}  // namespace

FLASHDRAFT_PLUGIN(
    mask, "eagle3_ttt", "0.1.0",
    "EAGLE-3 training-time test: causal target context in step 0, each position's own states in later steps",
    Eagle3TttMask)

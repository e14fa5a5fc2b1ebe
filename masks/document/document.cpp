// document: packed sequences. Each batch element is a concatenation of documents of
// the given lengths (sum = Lq = Lkv); query q sees key kv when both lie in the same
// document and kv <= q (causal within a document, nothing across documents).
// The lengths come from the batch (MaskInput.doc_lengths: one list per batch element,
// or one list shared by all) or, when the batch carries none, from the `lengths` key.
// Row q is the interval [start of q's document, q + 1); both ends grow with q, so the
// shared row-interval builder lists the blocks (masks/row_intervals.hpp). With a sliding
// window W (MaskInput::window > 0: a target's sliding layers) the row starts no earlier than
// q - W + 1 either.
//
// [mask] plugin = "document"
//   lengths = [100, 412, 12]   # used only when the batch gives no doc_lengths
#include <flashdraft/mask_generator.hpp>

#include "../row_intervals.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

class DocumentMask final : public flashdraft::MaskGenerator {
 public:
  explicit DocumentMask(const flashdraft::Config& c) : lengths_(c.integers("lengths")) {}

  static void declare(flashdraft::Schema& s) {
    s.integers("lengths", "document lengths (sum = sequence length), used when the batch gives no doc_lengths")
        .def(std::vector<int64_t>{})
        .at_least(0);
  }

  flashdraft::BlockMask build(const flashdraft::MaskInput& in, int64_t bq, int64_t bkv) const override {
    const std::vector<std::vector<int64_t>> docs = documents(in);
    const int64_t mb = static_cast<int64_t>(docs.size());
    flashdraft::BlockMaskBuilder builder(mb, 1, in.q_len, in.kv_len, bq, bkv);
    std::vector<int64_t> start(static_cast<size_t>(in.q_len));
    flashdraft::masks::RowScratch scratch;
    const int64_t W = flashdraft::masks::window(in, "document");
    for (int64_t b = 0; b < mb; ++b) {
      // start[q] = first position of q's document (O(Lq) per batch element).
      int64_t pos = 0;
      for (int64_t len : docs[static_cast<size_t>(b)]) {
        std::fill(start.begin() + pos, start.begin() + pos + len, pos);
        pos += len;
      }
      flashdraft::masks::add_slice<1>(
          builder, in.q_len, in.kv_len, bq, bkv,
          [&start, W](int64_t q, int64_t* lo, int64_t* hi) {
            lo[0] = W > 0 ? std::max(start[static_cast<size_t>(q)], q - W + 1) : start[static_cast<size_t>(q)];
            hi[0] = q + 1;
          },
          scratch);
    }
    return builder.finish();
  }

  bool visible(const flashdraft::MaskInput& in, int64_t b, int64_t, int64_t q, int64_t kv) const override {
    if (q < 0 || q >= in.q_len || kv < 0 || kv >= in.kv_len || kv > q) return false;
    if (in.window > 0 && q - kv >= in.window) return false;
    const std::vector<int64_t>& lens =
        !in.doc_lengths.empty() ? in.doc_lengths[in.doc_lengths.size() == 1 ? 0 : static_cast<size_t>(b)] : lengths_;
    int64_t start = 0;  // walk to q's document; kv must not be before its start
    for (int64_t len : lens) {
      if (q < start + len) return kv >= start;
      start += len;
    }
    return false;
  }

 private:
  // The document lengths per mask batch element, checked against the sequence.
  std::vector<std::vector<int64_t>> documents(const flashdraft::MaskInput& in) const {
    if (in.q_len != in.kv_len)
      throw std::invalid_argument("document: query length " + std::to_string(in.q_len) + " and key length " +
                                  std::to_string(in.kv_len) + " differ; packed documents need Lq = Lkv");
    std::vector<std::vector<int64_t>> docs;
    std::string from;
    if (!in.doc_lengths.empty()) {
      if (in.doc_lengths.size() != 1 && static_cast<int64_t>(in.doc_lengths.size()) != in.batch)
        throw std::invalid_argument("document: the batch gives " + std::to_string(in.doc_lengths.size()) +
                                    " lists of document lengths for a batch of " + std::to_string(in.batch) +
                                    "; give one list per batch element, or one shared list");
      docs = in.doc_lengths;
      from = "the batch's doc_lengths";
    } else if (!lengths_.empty()) {
      docs.push_back(lengths_);
      from = "the [mask] key lengths";
    } else {
      throw std::invalid_argument(
          "document: no document lengths; the batch gives no doc_lengths and the [mask] key lengths is empty");
    }
    for (size_t b = 0; b < docs.size(); ++b) {
      int64_t sum = 0;
      for (int64_t len : docs[b]) {
        if (len < 0)
          throw std::invalid_argument("document: length " + std::to_string(len) + " in " + from + " (list " +
                                      std::to_string(b) + ") is negative; lengths must be >= 0");
        sum += len;
      }
      if (sum != in.q_len)
        throw std::invalid_argument("document: lengths in " + from + " (list " + std::to_string(b) + ") sum to " +
                                    std::to_string(sum) + ", but the sequence has " + std::to_string(in.q_len) +
                                    " positions; they must sum to the sequence length");
    }
    return docs;
  }
  std::vector<int64_t> lengths_;
};

}  // namespace

FLASHDRAFT_PLUGIN(mask, "document", "0.1.0", "packed documents: causal within each document, nothing across",
                  DocumentMask)

// Validation by the target (see target_verify.hpp).
#include "eval/target_verify.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace flashdraft {

at::Tensor target_verified_labels(Target& target, const Batch& batch, const StepResult& r) {
  if (!r.drafts.defined()) return {};
  const at::Tensor tokens = batch.tokens.to(at::kCPU, at::kLong).contiguous();
  const int64_t B = tokens.size(0), S = tokens.size(1);
  const at::Tensor rows = r.drafts.rows.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor starts = r.drafts.starts.to(at::kCPU, at::kLong).contiguous();  // in range: check_drafts
  const at::Tensor drafted = r.drafts.tokens.to(at::kCPU, at::kLong).contiguous();
  const int64_t D = drafted.size(0), K = drafted.size(1);
  if (D == 0) return at::full({0, K}, -1, at::kLong);
  // The drafts of each row as that row's blocks (Target::verify's layout): block n of row b
  // is [the token at its start, drafted 0 .. K-1]; rows with fewer drafts are padded with
  // blocks at position 0, whose choices are not read.
  std::vector<int64_t> slot(static_cast<size_t>(D)), per_row(static_cast<size_t>(B), 0);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t d = 0; d < D; ++d) slot[size_t(d)] = per_row[size_t(row[d])]++;
  const int64_t N = *std::max_element(per_row.begin(), per_row.end());
  at::Tensor anchors = at::zeros({B, N}, at::kLong), blocks = at::zeros({B, N, K + 1}, at::kLong);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* draft = drafted.data_ptr<int64_t>();
  int64_t* anchor = anchors.data_ptr<int64_t>();
  int64_t* block = blocks.data_ptr<int64_t>();
  for (int64_t d = 0; d < D; ++d) {
    const int64_t b = row[d], n = b * N + slot[size_t(d)];
    anchor[n] = start[d];
    block[n * (K + 1)] = tok[b * S + start[d]];
    // A position without a label (a masked token, past the sequence) has no proposal; the
    // acceptance ends there (its label is -1 too), so any valid id stands in for it: the
    // target must never look up row -1 of its embedding.
    for (int64_t j = 0; j < K; ++j) block[n * (K + 1) + 1 + j] = std::max<int64_t>(draft[d * K + j], 0);
  }
  at::Tensor choices;
  {
    at::NoGradGuard frozen;
    choices = target.verify(batch, anchors, blocks);
  }
  if (!choices.defined()) return {};
  choices = choices.to(at::kCPU, at::kLong).contiguous();
  at::Tensor out = at::empty({D, K}, at::kLong);
  const int64_t* choice = choices.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = 0; j < K; ++j) o[d * K + j] = choice[(row[d] * N + slot[size_t(d)]) * (K + 1) + 1 + j];
  const at::Tensor labels = r.drafts.labels.to(at::kCPU, at::kLong);
  return at::where(labels.lt(0), at::full_like(labels, -1), out);
}

}  // namespace flashdraft

// Acceptance length of drafts: what speculative decoding with greedy verification would
// accept. Used by the engine's validation and by drafters' metrics
// (one definition, header-only so plugins share it).
#pragma once

#include <cstdint>
#include <vector>

namespace flashdraft {

// tau_sim = 1 + sum_k prod_{j<=k} acc_j: the acceptance length if block positions were
// accepted independently with their marginal accuracies acc_1, acc_2, ...
inline double simulated_tau(const std::vector<double>& accuracy) {
  double tau = 1.0, run = 1.0;
  for (double a : accuracy) {
    run *= a;
    tau += run;
  }
  return tau;
}

// Exact greedy acceptance of drafts (model.hpp's Drafts): in each draft the target accepts
// drafted tokens j = 0, 1, ... while tokens[d][j] == labels[d][j] (a label < 0 ends the
// draft: no target token to verify against); a draft whose first label is < 0 is not
// counted. tau = 1 + accepted / drafts (the +1 is the token the target emits itself after
// the last accepted one). tokens, labels: [drafts, width], row-major.
struct Acceptance {
  int64_t drafts = 0;
  int64_t accepted = 0;
  double tau() const { return drafts > 0 ? 1.0 + double(accepted) / double(drafts) : 0.0; }
};

inline Acceptance greedy_acceptance(const int64_t* tokens, const int64_t* labels, int64_t drafts, int64_t width) {
  Acceptance out;
  for (int64_t d = 0; d < drafts; ++d) {
    const int64_t* tok = tokens + d * width;
    const int64_t* lab = labels + d * width;
    if (width < 1 || lab[0] < 0) continue;
    int64_t accepted = 0;
    for (int64_t j = 0; j < width && lab[j] >= 0 && tok[j] == lab[j]; ++j) ++accepted;
    ++out.drafts;
    out.accepted += accepted;
  }
  return out;
}

}  // namespace flashdraft

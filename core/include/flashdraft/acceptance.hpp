// Acceptance length of block proposals: what speculative decoding with greedy
// verification would accept. Used by the engine's validation and by drafters' metrics
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

// Exact greedy acceptance: in each valid block (block_valid[b] != 0, labels[b][1] >= 0)
// the target accepts drafted tokens j = 1, 2, ... while predictions[b][j] == labels[b][j]
// (labels < 0 end the block: no target token to verify against). tau = 1 + accepted /
// blocks (the +1 is the token the target emits itself after the last accepted one).
// predictions, labels: [blocks, block_size]; block_valid: [blocks] (null: all valid).
struct Acceptance {
  int64_t blocks = 0;
  int64_t accepted = 0;
  double tau() const { return blocks > 0 ? 1.0 + double(accepted) / double(blocks) : 0.0; }
};

inline Acceptance greedy_acceptance(const int64_t* predictions, const int64_t* labels, const uint8_t* block_valid,
                                    int64_t blocks, int64_t block_size) {
  Acceptance out;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t* pred = predictions + b * block_size;
    const int64_t* lab = labels + b * block_size;
    if ((block_valid && !block_valid[b]) || block_size < 2 || lab[1] < 0) continue;
    int64_t accepted = 0;
    for (int64_t j = 1; j < block_size && lab[j] >= 0 && pred[j] == lab[j]; ++j) ++accepted;
    ++out.blocks;
    out.accepted += accepted;
  }
  return out;
}

}  // namespace flashdraft

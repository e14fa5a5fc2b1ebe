// Every rank's share of a step, gathered.
#include "distributed/rank_stats.hpp"

#include "dispatch/dispatch.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace flashdraft {

namespace {

// Row layout of the gathered vector.
enum Field : size_t {
  kWeight,
  kLoss,
  kTokens,
  kInputTokens,
  kSeconds,
  kPeakForward,
  kPeakBackward,
  kPeakOptimizer,
  kHashLow,
  kHashHigh,
  kSum,
  kSumSq,
  kSignal,
  kFields
};

// The variants this rank ran in the step: per phase, per layer, "" for no call.
std::string variant_text(const KernelLedger& ledger) {
  std::string out;
  for (const Phase phase : {Phase::forward, Phase::backward}) {
    for (const int32_t id : ledger.ids(phase)) out += (id >= 0 ? ledger.names()[static_cast<size_t>(id)] : "") + "\n";
    out += "|\n";
  }
  return out;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

// Parses variant_text back into per-phase lists of names.
std::vector<std::vector<std::string>> parse_variants(const std::string& text) {
  std::vector<std::vector<std::string>> phases(1);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line == "|") {
      phases.emplace_back();
      continue;
    }
    phases.back().push_back(line);
  }
  phases.resize(2);
  return phases;
}

std::string describe_difference(int rank, const std::vector<std::vector<std::string>>& mine,
                                const std::vector<std::vector<std::string>>& root) {
  for (size_t p = 0; p < 2; ++p)
    for (size_t l = 0; l < std::max(mine[p].size(), root[p].size()); ++l) {
      const std::string a = l < mine[p].size() ? mine[p][l] : "", b = l < root[p].size() ? root[p][l] : "";
      if (a != b)
        return "rank " + std::to_string(rank) + " ran '" + (a.empty() ? "no call" : a) + "' in attention call " +
               std::to_string(l) + " (" + (p == 0 ? "forward" : "backward") + ") where rank 0 ran '" +
               (b.empty() ? "no call" : b) + "'";
    }
  return "rank " + std::to_string(rank) + " ran other kernel variants than rank 0";
}

// This rank's row of the gathered vector: the fields, then the per-position accuracy and
// the drafter's scalars.
std::vector<double> local_row(const StepOutcome& o, const GradientSync& grads, uint64_t hash, double sum, double sumsq,
                              int signal) {
  std::vector<double> mine(kFields);
  mine[kWeight] = grads.local_weight();
  mine[kLoss] = grads.local_loss();
  mine[kTokens] = double(o.tokens);
  mine[kInputTokens] = double(o.input_tokens);
  mine[kSeconds] = o.seconds;
  mine[kPeakForward] = double(o.peak_forward);
  mine[kPeakBackward] = double(o.peak_backward);
  mine[kPeakOptimizer] = double(o.peak_optimizer);
  mine[kHashLow] = double(hash & 0xffffffffULL);
  mine[kHashHigh] = double(hash >> 32);
  mine[kSum] = sum;
  mine[kSumSq] = sumsq;
  mine[kSignal] = signal;
  for (double a : o.position_accuracy) mine.push_back(a);
  for (const auto& s : o.scalars) mine.push_back(s.second);
  return mine;
}

// Every rank's row into the per-rank columns of r and the global metrics of o (tokens
// summed, accuracy and scalars token-weighted, memory peaks the largest, the first signal).
void merge_rows(const std::vector<std::vector<double>>& rows, StepOutcome& o, RankStep& r) {
  double tokens = 0, input_tokens = 0;
  std::vector<double> acc(o.position_accuracy.size(), 0.0), scal(o.scalars.size(), 0.0);
  for (const auto& row : rows) {
    r.seconds.push_back(row[kSeconds]);
    r.tokens.push_back(row[kTokens]);
    r.loss.push_back(row[kLoss]);
    r.weights_sum.push_back(row[kSum]);
    r.weights_sumsq.push_back(row[kSumSq]);
    r.memory.push_back(static_cast<int64_t>(std::max({row[kPeakForward], row[kPeakBackward], row[kPeakOptimizer]})));
    o.peak_forward = std::max(o.peak_forward, static_cast<int64_t>(row[kPeakForward]));
    o.peak_backward = std::max(o.peak_backward, static_cast<int64_t>(row[kPeakBackward]));
    o.peak_optimizer = std::max(o.peak_optimizer, static_cast<int64_t>(row[kPeakOptimizer]));
    if (row[kSignal] != 0 && r.signal == 0) r.signal = static_cast<int>(row[kSignal]);
    tokens += row[kTokens];
    input_tokens += row[kInputTokens];
    for (size_t j = 0; j < acc.size(); ++j) acc[j] += row[kTokens] * row[kFields + j];
    for (size_t j = 0; j < scal.size(); ++j) scal[j] += row[kTokens] * row[kFields + acc.size() + j];
  }
  o.tokens = static_cast<int64_t>(tokens);
  o.input_tokens = static_cast<int64_t>(input_tokens);
  for (size_t j = 0; j < acc.size() && tokens > 0; ++j) o.position_accuracy[j] = acc[j] / tokens;
  for (size_t j = 0; j < scal.size() && tokens > 0; ++j) o.scalars[j].second = scal[j] / tokens;
}

// Stops the run when a rank's weight checksums differ from rank 0's.
void check_same_weights(const std::vector<std::vector<double>>& rows, int64_t step) {
  for (size_t k = 1; k < rows.size(); ++k)
    if (rows[k][kSum] != rows[0][kSum] || rows[k][kSumSq] != rows[0][kSumSq])
      throw std::runtime_error("distributed: the weights of rank " + std::to_string(k) +
                               " differ from rank 0's after step " + std::to_string(step) + " (checksums " +
                               std::to_string(rows[k][kSum]) + " and " + std::to_string(rows[0][kSum]) +
                               "): the ranks no longer train one model; the run stops");
}

}  // namespace

std::pair<double, double> weight_checksums(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  if (params.empty()) return {0.0, 0.0};
  // Reductions accumulated in float64 on the weights' device, one read back for all.
  std::vector<at::Tensor> parts;
  for (const auto& p : params) {
    parts.push_back(at::sum(p.detach(), at::kDouble));
    parts.push_back(at::linalg_vector_norm(p.detach(), 2, std::nullopt, false, at::kDouble).square());
  }
  const at::Tensor all = at::stack(parts).view({-1, 2}).sum(0).to(at::kCPU);
  return {all[0].item<double>(), all[1].item<double>()};
}

RankStep gather_step(Distributed& dist, StepOutcome& o, const GradientSync& grads, KernelLedger& ledger,
                     const std::vector<at::Tensor>& params, int signal, const std::string& on_fallback) {
  const std::string variants = variant_text(ledger);
  const uint64_t hash = fnv1a(variants);
  const auto [sum, sumsq] = weight_checksums(params);
  const std::vector<double> mine = local_row(o, grads, hash, sum, sumsq, signal);
  const auto rows = dist.all_gather(mine, "the exchange of the step's metrics");

  RankStep r;
  const size_t world = rows.size();
  merge_rows(rows, o, r);
  check_same_weights(rows, o.step);

  // Kernel variants: rank 0's ids for every rank that ran the same; the names otherwise.
  bool same = true;
  for (size_t k = 1; k < world; ++k)
    same = same && rows[k][kHashLow] == rows[0][kHashLow] && rows[k][kHashHigh] == rows[0][kHashHigh];
  std::vector<std::vector<std::vector<std::string>>> names;
  if (!same) {
    for (const auto& text : dist.all_gather(variants, "the exchange of the kernel variants"))
      names.push_back(parse_variants(text));
    for (size_t k = 1; k < world; ++k)
      if (names[k] != names[0]) {
        r.kernel_difference +=
            (r.kernel_difference.empty() ? "" : "; ") + describe_difference(static_cast<int>(k), names[k], names[0]);
      }
  }
  for (size_t k = 0; k < world; ++k)
    for (const Phase phase : {Phase::forward, Phase::backward}) {
      auto& out = phase == Phase::forward ? r.kernels_forward : r.kernels_backward;
      if (same || k == 0) {
        const auto& ids = ledger.ids(phase);
        out.insert(out.end(), ids.begin(), ids.end());
        continue;
      }
      const auto& list = names[k][phase == Phase::forward ? 0 : 1];
      for (size_t l = 0; l < ledger.ids(phase).size(); ++l)
        out.push_back(l < list.size() && !list[l].empty() ? ledger.id(list[l]) : -1);
    }
  if (!r.kernel_difference.empty() && on_fallback == "error")
    throw FallbackError("kernel variants differ between ranks at step " + std::to_string(o.step) + ": " +
                        r.kernel_difference + " ([attention] on_fallback = \"error\" stops every rank)");
  return r;
}

void record_ranks(RunLog& log, const RankStep& r) {
  log.append("ranks/step_time_s", r.seconds);
  log.append("ranks/tokens", r.tokens);
  log.append("ranks/loss", r.loss);
  log.append("ranks/memory_step", r.memory);
  log.append("ranks/weights_sum", r.weights_sum);
  log.append("ranks/weights_sumsq", r.weights_sumsq);
  log.append("ranks/kernels_forward", r.kernels_forward);
  log.append("ranks/kernels_backward", r.kernels_backward);
}

}  // namespace flashdraft

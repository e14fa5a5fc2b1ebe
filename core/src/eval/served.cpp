// The served acceptance length (see served.hpp).
#include "eval/served.hpp"

#include "train/device_mark.hpp"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <tuple>

namespace flashdraft {

std::vector<ServedSequence> served_sequences(const Batch& batch, int64_t first_source) {
  const at::Tensor tokens = batch.tokens.to(at::kCPU, at::kLong).contiguous();
  const int64_t B = tokens.size(0), S = tokens.size(1);
  const at::Tensor mask =
      batch.loss_mask.defined() ? batch.loss_mask.to(at::kCPU, at::kByte).contiguous() : at::ones({B, S}, at::kByte);
  const at::Tensor lengths =
      batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::full({B}, S, at::kLong);
  std::vector<ServedSequence> out;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t length = std::min(lengths.data_ptr<int64_t>()[b], S);
    std::vector<int64_t> docs;
    if (static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[static_cast<size_t>(b)].empty())
      docs = batch.documents[static_cast<size_t>(b)];
    else
      docs = {length};
    const int64_t* tok = tokens.data_ptr<int64_t>() + b * S;
    const uint8_t* lm = mask.data_ptr<uint8_t>() + b * S;
    int64_t d0 = 0;
    for (int64_t len : docs) {
      const int64_t d1 = std::min(d0 + len, length);
      for (int64_t p = d0; p < d1;) {
        if (!lm[p]) {
          ++p;
          continue;
        }
        int64_t q = p;
        while (q < d1 && lm[q]) ++q;
        // [p, q) is a response; it needs a prompt token before it and one token to draft after
        // its first (a one-token response has no verification step).
        if (p > d0 && q - p >= 2) {
          ServedSequence s;
          s.tokens = std::vector<int64_t>(tok + d0, tok + q);
          s.prompt = p - d0;
          s.end = q - d0;
          if (batch.hidden.defined()) s.features = batch.hidden[b].narrow(0, d0, q - d0);
          s.source = first_source + b;
          out.push_back(std::move(s));
        }
        p = q;
      }
      d0 += len;
    }
  }
  return out;
}

double ServedTally::standard_error() const {
  // tau = sum a_i / sum s_i over responses i (tokens a_i, steps s_i); the ratio estimator's
  // standard error: sqrt(sum (a_i - tau s_i)^2 / (n (n - 1))) / mean(s).
  const int64_t n = static_cast<int64_t>(acceptance.size());
  if (n < 2 || steps == 0) return std::nan("");
  const double t = tau();
  double sq = 0.0;
  for (const auto& a : acceptance) {
    const double ai = std::accumulate(a.begin(), a.end(), 0.0), si = double(a.size());
    sq += (ai - t * si) * (ai - t * si);
  }
  const double mean_steps = double(steps) / double(n);
  return std::sqrt(sq / (double(n) * double(n - 1))) / mean_steps;
}

namespace {

bool is_stop(int64_t token, const std::vector<int64_t>& stop) {
  return std::find(stop.begin(), stop.end(), token) != stop.end();
}

// Device time of one target forward, added to the tally once read.
struct ForwardTimer {
  DeviceMark start, end;
};

// One batch of responses decoded together.
class ServedBatch {
 public:
  ServedBatch(const ServedContext& c, const std::vector<const ServedSequence*>& rows, bool by_target,
              const Sampling& sampling, ServedTally& tally)
      : c_(c), rows_(rows), by_target_(by_target), sampling_(sampling), tally_(tally) {
    B_ = static_cast<int64_t>(rows.size());
    K_ = c.drafter.max_proposals();
    int64_t longest = 0;
    for (const ServedSequence* s : rows) longest = std::max(longest, s->end);
    capacity_ = served_capacity(longest, K_);
    tokens_.resize(static_cast<size_t>(B_));
    start_.assign(static_cast<size_t>(B_), 0);
    stopped_.assign(static_cast<size_t>(B_), 0);
    acceptance_.resize(static_cast<size_t>(B_));
    for (int64_t b = 0; b < B_; ++b) tokens_[static_cast<size_t>(b)] = rows[static_cast<size_t>(b)]->tokens;
  }

  void run() {
    drafter_ = c_.drafter.decoder(B_, capacity_, c_.draft_attention);
    if (!drafter_) throw std::logic_error("served validation: the drafter made no decoder");
    if (by_target_) {
      target_ = c_.target->decoder(B_, capacity_, c_.target_layers, *c_.target_attention);
      if (!target_) throw std::logic_error("served validation: the target made no decoder");
    }
    const DeviceMark begin(c_.device);
    const auto t0 = std::chrono::steady_clock::now();
    prefill();
    while (step()) {
    }
    const DeviceMark end(c_.device);
    tally_.seconds += c_.device.is_cuda()
                          ? end.seconds_since(begin)
                          : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const ForwardTimer& t : timers_) tally_.target_seconds += t.end.seconds_since(t.start);
    if (c_.replay_floor && by_target_) replay();
    for (int64_t b = 0; b < B_; ++b) {
      const ServedSequence& s = *rows_[static_cast<size_t>(b)];
      const auto& acc = acceptance_[static_cast<size_t>(b)];
      tally_.acceptance.push_back(acc);
      tally_.source.push_back(s.source);
      tally_.prompt.push_back(s.prompt);
      tally_.end.push_back(s.end);
      tally_.generated.emplace_back(tokens_[static_cast<size_t>(b)].begin() + s.prompt,
                                    tokens_[static_cast<size_t>(b)].begin() + start_[static_cast<size_t>(b)] + 1);
      tally_.steps += static_cast<int64_t>(acc.size());
      for (int64_t n : acc) {
        tally_.tokens += n;
        ++tally_.histogram[static_cast<size_t>(n)];
      }
    }
    tally_.sequences += B_;
  }

 private:
  at::Tensor device_tokens(const std::vector<std::vector<int64_t>>& rows, int64_t width) const {
    at::Tensor t = at::zeros({B_, width}, at::TensorOptions().dtype(at::kLong));
    int64_t* p = t.data_ptr<int64_t>();
    for (int64_t b = 0; b < B_; ++b) {
      const auto& r = rows[static_cast<size_t>(b)];
      std::copy(r.begin(), r.begin() + std::min<int64_t>(width, static_cast<int64_t>(r.size())), p + b * width);
    }
    return t.to(c_.device);
  }

  // The recorded target forwards again, alone, back to back, on a fresh cache.
  void replay() {
    drafter_.reset();
    target_.reset();
    std::unique_ptr<TargetDecoder> target = c_.target->decoder(B_, capacity_, c_.target_layers, *c_.target_attention);
    const DeviceMark before(c_.device);
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& [tokens, start, real] : calls_) target->forward(tokens, start, real);
    const DeviceMark after(c_.device);
    tally_.floor_seconds += c_.device.is_cuda()
                                ? after.seconds_since(before)
                                : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // (real: each row's real tokens, the first of its row; the rest is padding)
  at::Tensor target_forward(const at::Tensor& tokens, const std::vector<int64_t>& start,
                            const std::vector<int64_t>& real, TargetDecoder::Output* out) {
    if (c_.replay_floor) calls_.emplace_back(tokens.clone(), start, real);
    DeviceMark before(c_.device);
    *out = target_->forward(tokens, start, real);
    timers_.push_back(ForwardTimer{std::move(before), DeviceMark(c_.device)});
    ++tally_.target_forwards;
    tally_.target_tokens += tokens.numel();
    return out->last;
  }

  // The prompts into both caches and the first response token of every row.
  void prefill() {
    std::vector<int64_t> prompt(static_cast<size_t>(B_)), zero(static_cast<size_t>(B_), 0);
    int64_t longest = 0;
    for (int64_t b = 0; b < B_; ++b) {
      prompt[static_cast<size_t>(b)] = rows_[static_cast<size_t>(b)]->prompt;
      longest = std::max(longest, prompt[static_cast<size_t>(b)]);
    }
    if (by_target_) {
      const at::Tensor tokens = device_tokens(tokens_, longest);
      TargetDecoder::Output out;
      target_forward(tokens, zero, prompt, &out);
      const at::Tensor at_last = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).to(c_.device) - 1;
      const at::Tensor last = out.last.gather(1, at_last.view({B_, 1, 1}).expand({B_, 1, out.last.size(2)}));
      const at::Tensor logits = target_logits(last.squeeze(1));
      const at::Tensor first = choose_tokens(logits, sampling_).to(at::kCPU).contiguous();
      for (int64_t b = 0; b < B_; ++b)
        tokens_[static_cast<size_t>(b)][static_cast<size_t>(prompt[static_cast<size_t>(b)])] =
            first.data_ptr<int64_t>()[b];
      drafter_->extend(tokens, out.features, zero, prompt);
    } else {
      // The data's hidden states are known for every position: the whole response's
      // context goes into the drafter's cache at once (each position's keys/values depend
      // on that position alone; a proposal sees only the positions before its start).
      int64_t longest_end = 0;
      std::vector<int64_t> ends(static_cast<size_t>(B_));
      for (int64_t b = 0; b < B_; ++b) {
        ends[static_cast<size_t>(b)] = rows_[static_cast<size_t>(b)]->end;
        longest_end = std::max(longest_end, ends[static_cast<size_t>(b)]);
      }
      const ServedSequence& s0 = *rows_[0];
      if (!s0.features.defined())
        throw std::logic_error("served validation on the data's tokens: the held-out batch carries no hidden states");
      std::vector<int64_t> shape = {B_, longest_end};
      for (int64_t d = 1; d < s0.features.dim(); ++d) shape.push_back(s0.features.size(d));
      at::Tensor features = at::zeros(shape, s0.features.options());
      for (int64_t b = 0; b < B_; ++b) {
        const ServedSequence& s = *rows_[static_cast<size_t>(b)];
        features[b].narrow(0, 0, s.end).copy_(s.features);
      }
      drafter_->extend(device_tokens(tokens_, longest_end), features, zero, ends);
    }
    for (int64_t b = 0; b < B_; ++b) {
      start_[static_cast<size_t>(b)] = prompt[static_cast<size_t>(b)];
      stopped_[static_cast<size_t>(b)] =
          is_stop(tokens_[static_cast<size_t>(b)][static_cast<size_t>(prompt[static_cast<size_t>(b)])], c_.stop_tokens);
    }
  }

  bool active(int64_t b) const {
    const int64_t end = rows_[static_cast<size_t>(b)]->end;
    return !stopped_[static_cast<size_t>(b)] && start_[static_cast<size_t>(b)] + 1 < end;
  }

  // One verification step of every active row; false when none is left.
  bool step() {
    std::vector<int64_t> count(static_cast<size_t>(B_), 0);
    std::vector<int64_t> last(static_cast<size_t>(B_), 0);
    bool any = false;
    for (int64_t b = 0; b < B_; ++b) {
      const size_t i = static_cast<size_t>(b);
      last[i] = tokens_[i][static_cast<size_t>(std::min<int64_t>(start_[i], rows_[i]->end - 1))];
      if (!active(b)) continue;
      count[i] = std::min(K_ + 1, rows_[i]->end - start_[i]) - 1;  // the block: this token and its proposals
      any = true;
    }
    if (!any) return false;
    DraftRequest request;
    request.last = at::tensor(last, at::TensorOptions().dtype(at::kLong)).to(c_.device);
    request.start = start_;
    request.count = count;
    request.sampling = sampling_;
    const DraftProposal proposal = drafter_->propose(request);
    const at::Tensor drafts = proposal.tokens.to(at::kCPU, at::kLong).contiguous();
    TargetDecoder::Output out;
    at::Tensor block;
    const Verdict verdict =
        by_target_ ? verify_by_target(request, proposal, count, &block, &out) : verify_on_data(drafts, count);
    const std::vector<int64_t> produced = produce(verdict, drafts, count);
    // By the target: the verified positions start .. start + n - 1 join the drafter's
    // context, with the target's hidden states from this forward (the data's way put every
    // position in the cache at the start).
    if (by_target_) drafter_->extend(block, out.features, start_, produced);
    for (int64_t b = 0; b < B_; ++b) start_[static_cast<size_t>(b)] += produced[static_cast<size_t>(b)];
    return true;
  }

  // Per row: the proposals accepted and the token that follows them.
  struct Verdict {
    std::vector<int64_t> accepted, next;
  };

  // The target reads this token and the proposals (one block per row, padding past a row's
  // count) and accepts the leading ones equal to its greedy choices (or by rejection
  // sampling); `next` is its own token after them.
  Verdict verify_by_target(const DraftRequest& request, const DraftProposal& proposal,
                           const std::vector<int64_t>& count, at::Tensor* block, TargetDecoder::Output* out) {
    const int64_t K = proposal.tokens.size(1);
    *block = at::zeros({B_, K_ + 1}, at::TensorOptions().dtype(at::kLong).device(c_.device));
    block->select(1, 0).copy_(request.last);
    block->narrow(1, 1, K).copy_(proposal.tokens);
    std::vector<int64_t> real(count.size());  // this token and its proposals (0 for a row done)
    for (size_t b = 0; b < count.size(); ++b) real[b] = active(static_cast<int64_t>(b)) ? count[b] + 1 : 0;
    const at::Tensor last_states = target_forward(*block, start_, real, out);
    const at::Tensor logits = target_logits(last_states);  // [B, K_ + 1, V]
    const at::Tensor counts = at::tensor(count, at::TensorOptions().dtype(at::kLong)).to(c_.device);
    at::Tensor acc, next;
    if (sampling_.greedy()) {
      const at::Tensor posterior = logits.argmax(-1);  // [B, K_ + 1]
      const at::Tensor j = at::arange(K, counts.options());
      const at::Tensor match = proposal.tokens.eq(posterior.narrow(1, 0, K)) & j.unsqueeze(0).lt(counts.unsqueeze(1));
      acc = match.to(at::kLong).cumprod(1).sum(1);
      next = posterior.gather(1, acc.unsqueeze(1)).squeeze(1);
    } else {
      std::tie(acc, next) = rejection_sample(logits, proposal, counts);
    }
    const at::Tensor both = at::stack({acc, next}, 0).to(at::kCPU).contiguous();
    Verdict v;
    v.accepted.assign(both.data_ptr<int64_t>(), both.data_ptr<int64_t>() + B_);
    v.next.assign(both.data_ptr<int64_t>() + B_, both.data_ptr<int64_t>() + 2 * B_);
    return v;
  }

  // The data's response stands for the target's greedy text: the leading proposals equal to
  // it, then the data's next token (none when every remaining position was accepted).
  Verdict verify_on_data(const at::Tensor& drafts, const std::vector<int64_t>& count) const {
    const int64_t K = drafts.size(1);
    const int64_t* d = drafts.data_ptr<int64_t>();
    Verdict v;
    v.accepted.assign(static_cast<size_t>(B_), 0);
    v.next.assign(static_cast<size_t>(B_), -1);
    for (int64_t b = 0; b < B_; ++b) {
      const size_t i = static_cast<size_t>(b);
      if (!count[i]) continue;
      int64_t a = 0;
      while (a < count[i] && d[b * K + a] == tokens_[i][static_cast<size_t>(start_[i] + 1 + a)]) ++a;
      v.accepted[i] = a;
      const int64_t at = start_[i] + 1 + a;
      if (at < rows_[i]->end) v.next[i] = tokens_[i][static_cast<size_t>(at)];
    }
    return v;
  }

  // What each row produced: its accepted proposals and the token after them, up to the
  // response's end, cut after a stop token; written into the rows' tokens and counted.
  std::vector<int64_t> produce(const Verdict& v, const at::Tensor& drafts, const std::vector<int64_t>& count) {
    const int64_t K = drafts.size(1);
    const int64_t* d = drafts.data_ptr<int64_t>();
    std::vector<int64_t> produced(static_cast<size_t>(B_), 0);
    for (int64_t b = 0; b < B_; ++b) {
      const size_t i = static_cast<size_t>(b);
      if (!count[i]) continue;
      int64_t n = std::min(v.accepted[i] + 1, rows_[i]->end - start_[i] - 1);
      std::vector<int64_t> fresh;  // the tokens at start + 1 .. start + n
      for (int64_t k = 0; k < n; ++k) fresh.push_back(k < v.accepted[i] ? d[b * K + k] : v.next[i]);
      for (int64_t k = 0; k < n; ++k)
        if (is_stop(fresh[static_cast<size_t>(k)], c_.stop_tokens)) {
          n = k + 1;
          stopped_[i] = 1;
          break;
        }
      for (int64_t k = 0; k < n; ++k)
        tokens_[i][static_cast<size_t>(start_[i] + 1 + k)] = fresh[static_cast<size_t>(k)];
      produced[i] = n;
      acceptance_[i].push_back(n);
    }
    return produced;
  }

  // Rejection sampling of every row at once (the reference's _rejection_sample): proposal j
  // is accepted while u_j q(x_j) < p(x_j) (u uniform), all of them when every one passes;
  // the next token is drawn from p after the last proposal when all were accepted, else
  // from max(p - q, 0) renormalised at the first rejected one (p where that is all zero).
  // The target's served logits of its final-normed states (its logit scale and soft cap applied).
  at::Tensor target_logits(const at::Tensor& states) const {
    const TargetModel& t = c_.target_model;
    return served_logits(at::linear(states, t.lm_head), t.logit_scale, t.logit_softcap);
  }

  std::pair<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& logits, const DraftProposal& proposal,
                                                     const at::Tensor& counts) {
    const int64_t K = proposal.tokens.size(1);
    const at::Tensor p = sampling_probs(logits, sampling_.temperature, sampling_.top_p);  // [B, K_ + 1, V]
    const at::Tensor x = proposal.tokens.unsqueeze(-1);
    const at::Tensor px = p.narrow(1, 0, K).gather(-1, x).squeeze(-1);
    const at::Tensor qx = proposal.probs.gather(-1, x).squeeze(-1);
    const at::Tensor u = sampling_.generator ? at::rand(px.sizes(), *sampling_.generator, px.options())
                                             : at::rand(px.sizes(), px.options());
    const at::Tensor j = at::arange(K, counts.options());
    const at::Tensor ok = (u * qx).lt(px) & j.unsqueeze(0).lt(counts.unsqueeze(1));
    const at::Tensor acc = ok.to(at::kLong).cumprod(1).sum(1);  // [B]
    const int64_t V = p.size(-1);
    const at::Tensor p_at = p.gather(1, acc.view({-1, 1, 1}).expand({-1, 1, V})).squeeze(1);
    const at::Tensor q_at =
        proposal.probs.gather(1, acc.clamp_max(K - 1).view({-1, 1, 1}).expand({-1, 1, V})).squeeze(1);
    at::Tensor residual = at::where(acc.lt(counts).unsqueeze(1), (p_at - q_at).clamp_min(0.0), p_at);
    const at::Tensor total = residual.sum(-1, true);
    residual = at::where(total.gt(0), residual / total.clamp_min(std::numeric_limits<float>::min()), p_at);
    return {acc, sample_tokens(residual, sampling_.generator)};
  }

  const ServedContext& c_;
  std::vector<const ServedSequence*> rows_;
  bool by_target_;
  Sampling sampling_;
  ServedTally& tally_;
  int64_t B_ = 0, K_ = 0, capacity_ = 0;
  std::unique_ptr<DraftDecoder> drafter_;
  std::unique_ptr<TargetDecoder> target_;
  std::vector<std::vector<int64_t>> tokens_;  // each row's tokens: the prompt, then what was produced
  std::vector<int64_t> start_;                // the current position (its token is known)
  std::vector<uint8_t> stopped_;
  std::vector<std::vector<int64_t>> acceptance_;
  std::vector<ForwardTimer> timers_;
  // replay_floor: every target forward (tokens, start, real)
  std::vector<std::tuple<at::Tensor, std::vector<int64_t>, std::vector<int64_t>>> calls_;
};

}  // namespace

ServedTally serve(const ServedContext& c, const std::vector<ServedSequence>& sequences, bool by_target,
                  const Sampling& sampling) {
  if (by_target && (!c.target || !c.target_attention))
    throw std::logic_error("served validation by the target without a target decoder");
  if (!by_target && !sampling.greedy())
    throw std::invalid_argument("served validation on the data's tokens is greedy only (temperature " +
                                std::to_string(sampling.temperature) + " needs an online target)");
  const int64_t K = c.drafter.max_proposals();
  if (K < 1) throw std::logic_error("served validation: the drafter proposes no token (max_proposals() < 1)");
  ServedTally tally;
  tally.method = by_target ? "target" : "data tokens";
  tally.histogram.assign(static_cast<size_t>(K + 2), 0);
  // Longest first, so each batch holds responses of similar lengths.
  std::vector<int64_t> order(sequences.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return sequences[static_cast<size_t>(a)].end > sequences[static_cast<size_t>(b)].end;
  });
  c10::InferenceMode inference;
  for (size_t first = 0; first < order.size(); first += static_cast<size_t>(c.batch)) {
    std::vector<const ServedSequence*> rows;
    for (size_t i = first; i < std::min(order.size(), first + static_cast<size_t>(c.batch)); ++i) {
      rows.push_back(&sequences[static_cast<size_t>(order[i])]);
      tally.order.push_back(order[i]);
    }
    ServedBatch(c, rows, by_target, sampling, tally).run();
  }
  return tally;
}

}  // namespace flashdraft

#include "recurrent.hpp"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft::hf {

namespace {

// A row's documents as (start, length), padding past them one more: the spans no state crosses.
std::vector<std::pair<int64_t, int64_t>> spans(const std::vector<int64_t>& documents, int64_t S) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t start = 0;
  for (int64_t len : documents)
    if (len > 0) out.emplace_back(start, len), start += len;
  if (start < S) out.emplace_back(start, S - start);
  return out;
}

// Every part of p through f (the same slice or reshape of each).
template <class F>
Projected each_part(const Projected& p, F f) {
  Projected out{f(p.x), {}};
  for (const at::Tensor& t : p.rest) out.rest.push_back(f(t));
  return out;
}

}  // namespace

at::Tensor state_at(const at::Tensor& S, const at::Tensor& k, const at::Tensor& v, const at::Tensor& c,
                    const at::Tensor& r_in) {
  const int64_t M = S.size(0), H = S.size(1), C = c.size(2);
  const at::Tensor r = r_in.view({M, 1, 1});
  const at::Tensor c_r = c.gather(2, (r - 1).clamp_min(0).expand({M, H, 1}));  // [M, H, 1]
  const at::Tensor seen = at::arange(C, r.options()).view({1, 1, C}).lt(r);    // j < r
  const at::Tensor weight = at::where(seen, (c_r - c).exp(), at::zeros_like(c));
  const at::Tensor factor = at::where(r.gt(0), c_r.exp(), at::ones_like(c_r)).unsqueeze(-1);
  return S * factor + at::matmul((k * weight.unsqueeze(-1)).transpose(-1, -2), v);
}

void take_chunks(RuleRun& run, const at::Tensor& S_all, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& log_decay, const at::Tensor& capture, bool every_chunk) {
  if (every_chunk) run.chunk_state = S_all, run.keys = keys, run.values = values, run.log_decay = log_decay;
  if (!capture.defined()) return;
  const auto at_chunk = [&](const at::Tensor& t) {  // [B, H, n, ...] -> [B, H, ...] at each row's captured chunk
    std::vector<int64_t> view(static_cast<size_t>(t.dim()), 1), shape = t.sizes().vec();
    view[0] = t.size(0), shape[2] = 1;
    return t.gather(2, capture.view(view).expand(shape)).squeeze(2);
  };
  run.chunk_state = at_chunk(S_all), run.keys = at_chunk(keys), run.values = at_chunk(values);
  run.log_decay = at_chunk(log_decay);
}

at::Tensor Recurrent::convolve(const at::Tensor& x, int64_t zeros) const {
  const std::vector<int64_t> stride = {1}, padding = {zeros}, dilation = {1};
  const at::Tensor y =
      at::conv1d(x.transpose(1, 2), conv.unsqueeze(1), conv_bias, stride, padding, dilation, x.size(2));
  return at::silu(y).transpose(1, 2);
}

// One document from a zero state: transformers' causal_conv1d_fn (conv1d over [B, C, T] with taps - 1 zeros of
// history), its activation, then the rule.
RuleRun Recurrent::mix_document(const Projected& p, bool every_chunk) const {
  const int64_t T = p.x.size(1), taps = conv.size(1);
  const at::Tensor u = convolve(p.x, taps - 1).narrow(1, 0, T);
  return rule(u, p, at::Tensor(), at::Tensor(), every_chunk);
}

at::Tensor Recurrent::mix(const at::Tensor& h, const std::vector<std::vector<int64_t>>& documents) const {
  const int64_t B = h.size(0), S = h.size(1);
  const Projected p = project(h);
  bool whole_rows = true;  // every row one document (padding after it changes no real position)
  for (const auto& d : documents) whole_rows = whole_rows && d.size() <= 1;
  if (whole_rows) return finish(mix_document(p, false).out, p);
  at::Tensor out = at::empty({B, S, width()}, h.options());
  for (int64_t r = 0; r < B; ++r)
    for (const auto& [start, len] : spans(documents[static_cast<size_t>(r)], S)) {
      const auto part = [&, start = start, len = len](const at::Tensor& x) {
        return x.narrow(0, r, 1).narrow(1, start, len);
      };
      const Projected doc = each_part(p, part);
      part(out).copy_(finish(mix_document(doc, false).out, doc));
    }
  return out;
}

std::pair<at::Tensor, at::Tensor> Recurrent::verify(const at::Tensor& hc,
                                                    const std::vector<std::vector<int64_t>>& documents,
                                                    const at::Tensor& anchors, const at::Tensor& hb, int64_t BS) const {
  const int64_t B = hc.size(0), S = hc.size(1), N = anchors.size(1), taps = conv.size(1);
  const Projected pc = project(hc), pb = project(hb);
  const int64_t Cc = pc.x.size(2);
  std::vector<int64_t> shape = state_shape();
  shape.insert(shape.begin(), {B, N});
  at::Tensor context = at::empty({B, S, width()}, hc.options());
  at::Tensor states = at::zeros(shape, pc.x.options().dtype(at::kFloat));
  at::Tensor history = at::zeros({B, N, taps - 1, Cc}, pc.x.options());
  const at::Tensor host_anchors = anchors.to(at::kCPU, at::kLong).contiguous();
  const int64_t* at_anchor = host_anchors.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    for (const auto& [start, len] : spans(documents[static_cast<size_t>(r)], S)) {
      const auto part = [&, start = start, len = len](const at::Tensor& x) {
        return x.narrow(0, r, 1).narrow(1, start, len);
      };
      const Projected doc = each_part(pc, part);
      const RuleRun run = mix_document(doc, /*every_chunk=*/true);
      part(context).copy_(finish(run.out, doc));
      // this document's anchors: the state after the tokens before each, and the convolution's inputs there
      std::vector<int64_t> blocks, offsets;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t a = at_anchor[r * N + n];
        if (a >= start && a < start + len) blocks.push_back(n), offsets.push_back(a - start);
      }
      if (blocks.empty()) continue;
      const auto opts = at::TensorOptions().dtype(at::kLong).device(doc.x.device());
      const at::Tensor off = at::tensor(offsets, at::TensorOptions().dtype(at::kLong)).to(doc.x.device());
      const at::Tensor at_chunk = at::floor_divide(off, chunk), within = off - at_chunk * chunk;
      // [1, H, n, ...] -> [M, H, ...] at each anchor's chunk
      const auto pick = [&](const at::Tensor& t) { return t[0].index_select(1, at_chunk).transpose(0, 1); };
      const at::Tensor at_blocks = at::tensor(blocks, opts);
      states[r].index_copy_(
          0, at_blocks, state_at(pick(run.chunk_state), pick(run.keys), pick(run.values), pick(run.log_decay), within));
      const at::Tensor padded = at::constant_pad_nd(doc.x[0], {0, 0, taps - 1, 0});  // [taps - 1 + len, C]
      const at::Tensor idx = off.view({-1, 1}) + at::arange(taps - 1, opts).view({1, -1});
      history[r].index_copy_(0, at_blocks, padded.index_select(0, idx.reshape({-1})).view({-1, taps - 1, Cc}));
    }
  }
  // every block alone, from its state: [B N, BS] sequences
  const Projected blocks = each_part(pb, [&](const at::Tensor& t) {
    std::vector<int64_t> s = t.sizes().vec();
    s.erase(s.begin(), s.begin() + 2);
    s.insert(s.begin(), {B * N, BS});
    return t.reshape(s);
  });
  const at::Tensor full = at::cat({history.view({B * N, taps - 1, Cc}), blocks.x}, 1);
  std::vector<int64_t> flat = state_shape();
  flat.insert(flat.begin(), B * N);
  const RuleRun run = rule(convolve(full, 0), blocks, states.view(flat), at::Tensor(), false);
  return {context, finish(run.out, blocks).view({B, N * BS, width()})};
}

RecurrentCache::RecurrentCache(const Recurrent& w, int64_t batch, c10::ScalarType dtype, c10::Device device)
    : w_(w),
      batch_(batch),
      taps_(w.conv.size(1)),
      base_(static_cast<size_t>(batch), -1),
      real_(static_cast<size_t>(batch), 0),
      chunk_start_(static_cast<size_t>(batch), 0) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  std::vector<int64_t> shape = w.state_shape();
  shape.insert(shape.begin(), batch);
  state_ = at::zeros(shape, f32);
  history_ = at::zeros({batch, taps_ - 1, w.conv.size(0)}, f32.dtype(dtype));
}

void RecurrentCache::commit(const std::vector<int64_t>& start) {
  const int64_t B = batch_;
  std::vector<int64_t> offset(static_cast<size_t>(B), 0);  // into the row's captured chunk
  std::vector<uint8_t> fresh(static_cast<size_t>(B), 0);
  bool any_run = false;
  for (int64_t b = 0; b < B; ++b) {
    const size_t i = static_cast<size_t>(b);
    if (start[i] == 0) {
      fresh[i] = 1;
      continue;
    }
    const int64_t o = start[i] - base_[i];
    if (base_[i] < 0 || o < chunk_start_[i] || o > real_[i])
      throw std::logic_error(
          std::string("hf target decoder (") + w_.name() + "): row " + std::to_string(b) + " starts at position " +
          std::to_string(start[i]) + ", but its state can be rolled to positions " +
          (base_[i] < 0 ? std::string("0 only (nothing has run for it)")
                        : std::to_string(base_[i] + chunk_start_[i]) + ".." + std::to_string(base_[i] + real_[i]) +
                              " (its last call's real tokens) or 0"));
    offset[i] = o - chunk_start_[i];
    any_run = true;
  }
  if (any_run) {
    const at::Tensor r = at::tensor(offset, at::TensorOptions().dtype(at::kLong)).to(state_.device()).view({B, 1, 1});
    state_ = state_at(chunk_state_, keys_, values_, log_decay_, r);
    // the convolution's inputs at the taps - 1 positions before the new start
    const at::Tensor at_r = r.view({B, 1, 1}) + at::arange(taps_ - 1, r.options()).view({1, taps_ - 1, 1});
    history_ = inputs_.gather(1, at_r.expand({B, taps_ - 1, inputs_.size(2)}));
  }
  for (int64_t b = 0; b < B; ++b)
    if (fresh[static_cast<size_t>(b)]) {
      state_[b].zero_();
      history_[b].zero_();
    }
}

at::Tensor RecurrentCache::forward(const at::Tensor& h, const std::vector<int64_t>& start,
                                   const std::vector<int64_t>& real) {
  const int64_t B = h.size(0), T = h.size(1), C = w_.chunk;
  const std::string who = std::string("hf target decoder (") + w_.name() + "): ";
  if (B != batch_ || static_cast<int64_t>(start.size()) != B || static_cast<int64_t>(real.size()) != B)
    throw std::invalid_argument(who + std::to_string(B) + " rows, " + std::to_string(start.size()) + " starts and " +
                                std::to_string(real.size()) + " real counts for a decoder of " +
                                std::to_string(batch_) + " rows");
  commit(start);
  const Projected p = w_.project(h);
  const int64_t Cc = p.x.size(2), K = taps_;
  const at::Tensor full = at::cat({history_, p.x}, 1);  // [B, K - 1 + T, C]: the inputs the convolution reads
  std::vector<int64_t> chunk(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = real[static_cast<size_t>(b)];
    if (n < 0 || n > T)
      throw std::invalid_argument(who + "row " + std::to_string(b) + " has " + std::to_string(n) + " real tokens of " +
                                  std::to_string(T));
    chunk[static_cast<size_t>(b)] = n > 0 ? (n - 1) / C : 0;
  }
  const at::Tensor capture = at::tensor(chunk, at::TensorOptions().dtype(at::kLong)).to(h.device());
  RuleRun run = w_.rule(w_.convolve(full, 0), p, state_, capture, false);
  chunk_state_ = run.chunk_state, keys_ = run.keys, values_ = run.values, log_decay_ = run.log_decay;
  // the convolution's inputs from each row's captured chunk's start - (K - 1) on: C + K - 1 of them
  const int64_t window = C + K - 1;
  const at::Tensor padded = at::constant_pad_nd(full, {0, 0, 0, window});
  const at::Tensor from = (capture * C).view({B, 1, 1}) + at::arange(window, capture.options()).view({1, window, 1});
  inputs_ = padded.gather(1, from.expand({B, window, Cc}));
  for (int64_t b = 0; b < B; ++b) chunk_start_[static_cast<size_t>(b)] = chunk[static_cast<size_t>(b)] * C;
  base_ = start, real_ = real;
  return w_.finish(run.out, p);
}

}  // namespace flashdraft::hf

#include "gated_delta.hpp"

#include <flashdraft/ops.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft::hf {

namespace {

constexpr int64_t kChunk = 64;

// x / sqrt(sum(x^2) + 1e-6) over the last dimension (float32)
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); }

// [B, T, H, D] -> [B, H, T, D] float32, contiguous
at::Tensor heads_first(const at::Tensor& x) { return x.transpose(1, 2).to(at::kFloat).contiguous(); }

// The rule's run: its output and, for each row's chunk that `capture` names ([B] int64, chunk index), the state at
// that chunk's start, its keys (l2-normed), new values and log decays from the chunk's start; with every_chunk,
// those of every chunk (a chunk dimension after the heads': [B, Hv, n, ...]).
struct RuleRun {
  at::Tensor out;                                       // [B, T, Hv, Dv] in v's dtype
  at::Tensor chunk_state, keys, new_values, log_decay;  // [B, Hv, Dk, Dv], [B, Hv, C, Dk], [B, Hv, C, Dv], [B, Hv, C]
};

// The state after the first r[m] positions of a chunk ([M] int64, 0..C) from its start state S [M, H, Dk, Dv],
// keys k [M, H, C, Dk], new values u [M, H, C, Dv] and log decays c [M, H, C] (cumulative from the chunk's start):
// S exp(c[r - 1]) + sum_{j < r} exp(c[r - 1] - c[j]) k_j u_j^T (r = 0: S), as the chunk's end update is at r = C.
at::Tensor state_at(const at::Tensor& S, const at::Tensor& k, const at::Tensor& u, const at::Tensor& c,
                    const at::Tensor& r_in) {
  const int64_t M = S.size(0), H = S.size(1), C = c.size(2);
  const at::Tensor r = r_in.view({M, 1, 1});
  const at::Tensor c_r = c.gather(2, (r - 1).clamp_min(0).expand({M, H, 1}));  // [M, H, 1]
  const at::Tensor seen = at::arange(C, r.options()).view({1, 1, C}).lt(r);    // j < r
  const at::Tensor weight = at::where(seen, (c_r - c).exp(), at::zeros_like(c));
  const at::Tensor factor = at::where(r.gt(0), c_r.exp(), at::ones_like(c_r)).unsqueeze(-1);
  return S * factor + at::matmul((k * weight.unsqueeze(-1)).transpose(-1, -2), u);
}

// The gated delta rule in chunks of kChunk positions from `initial` ([B, Hv, Dk, Dv] float32; undefined: zeros),
// as transformers' torch_chunk_gated_delta_rule computes it. `fused`: where nothing but the output is asked for
// (no capture, not every_chunk), the engine's two kernels where they run (frozen::gated_delta_chunks), else
// ATen's ops below.
RuleRun run_rule(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                 const at::Tensor& beta_in, const at::Tensor& initial, const at::Tensor& capture, bool fused,
                 bool every_chunk = false) {
  const int64_t B = k_in.size(0), T = k_in.size(1), Hk = k_in.size(2), Dk = k_in.size(3);
  const int64_t Hv = v_in.size(2), Dv = v_in.size(3);
  at::Tensor q = q_in, k = k_in;
  if (Hk != Hv) {  // each q / k head serves Hv / Hk consecutive value heads
    q = q.repeat_interleave(Hv / Hk, 2);
    k = k.repeat_interleave(Hv / Hk, 2);
  }
  q = l2norm(heads_first(q)) * std::pow(double(Dk), -0.5);  // (Python's d ** -0.5)
  k = l2norm(heads_first(k));
  at::Tensor v = heads_first(v_in), beta = heads_first(beta_in.unsqueeze(-1)).squeeze(-1);
  at::Tensor g = heads_first(g_in.unsqueeze(-1)).squeeze(-1);  // [B, H, T]
  const int64_t pad = (kChunk - T % kChunk) % kChunk, n = (T + pad) / kChunk;
  if (pad > 0) {
    q = at::constant_pad_nd(q, {0, 0, 0, pad});
    k = at::constant_pad_nd(k, {0, 0, 0, pad});
    v = at::constant_pad_nd(v, {0, 0, 0, pad});
    beta = at::constant_pad_nd(beta, {0, pad});
    g = at::constant_pad_nd(g, {0, pad});
  }
  if (!every_chunk && !capture.defined()) {
    const int64_t Tp = T + pad;
    const auto rows = [&](const at::Tensor& x) { return x.reshape({B * Hv, Tp, x.size(-1)}); };
    const auto [o, last] =
        frozen::gated_delta_chunks(rows(q), rows(k), rows(v), g.reshape({B * Hv, Tp}), beta.reshape({B * Hv, Tp}),
                                   initial.defined() ? initial.reshape({B * Hv, Dk, Dv}) : at::Tensor(), fused);
    if (o.defined()) {
      RuleRun run;
      run.out = o.view({B, Hv, Tp, Dv}).narrow(2, 0, T).transpose(1, 2).contiguous().to(v_in.scalar_type());
      return run;
    }
  }
  const auto chunks = [&](const at::Tensor& x) { return x.reshape({B, Hv, n, kChunk, x.size(-1)}); };
  const at::Tensor k_beta = chunks(k * beta.unsqueeze(-1)), v_beta = chunks(v * beta.unsqueeze(-1));
  q = chunks(q), k = chunks(k);
  const at::Tensor cum = g.reshape({B, Hv, n, kChunk}).cumsum(-1);  // log decay from the chunk's start
  const at::Tensor upper = at::ones({kChunk, kChunk}, q.options().dtype(at::kBool)).triu(1);
  const at::Tensor decay =
      (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, -std::numeric_limits<double>::infinity()).exp();
  const at::Tensor system = at::matmul(k_beta, k.transpose(-1, -2)) * decay;  // unit lower triangular with it
  const at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * decay;
  const at::Tensor values = at::linalg_solve_triangular(system, v_beta, /*upper=*/false, /*left=*/true,
                                                        /*unitriangular=*/true);
  const at::Tensor k_cumdecay = at::linalg_solve_triangular(system, k_beta * cum.exp().unsqueeze(-1),
                                                            /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor q_decayed = q * cum.exp().unsqueeze(-1);
  const at::Tensor last = cum.narrow(-1, kChunk - 1, 1);              // [B, H, n, 1]
  const at::Tensor k_decayed = k * (last - cum).exp().unsqueeze(-1);  // to the chunk's end
  const at::Tensor chunk_decay = last.exp().unsqueeze(-1);            // [B, H, n, 1, 1]
  // The scan over chunks, four launches a chunk (it is sequential): each chunk's start state into S_all, its new
  // values (u - W S) in place of its values, the state decayed and updated in place; both outputs' products after
  // it, over every chunk at once: out = (q exp(cum)) S_chunk + intra u_chunk.
  at::Tensor state = (initial.defined() ? initial.to(at::kFloat) : at::zeros({B, Hv, Dk, Dv}, v.options()))
                         .reshape({B * Hv, Dk, Dv})
                         .clone();
  // chunk-major copies [n, B H, ...] of what the scan reads and writes: every step's operands contiguous (strided
  // batches would make the in-place products copy)
  const auto chunk_major = [&](const at::Tensor& t) {
    return t.reshape({B * Hv, n, t.size(-2), t.size(-1)}).transpose(0, 1).contiguous();
  };
  const at::Tensor u_n = chunk_major(values), w_n = chunk_major(k_cumdecay);  // (u_n: the values, then u in place)
  const at::Tensor kdT_n = chunk_major(k_decayed.transpose(-1, -2));          // [n, B H, Dk, C]
  const at::Tensor decay_n = chunk_decay.reshape({B * Hv, n, 1, 1}).transpose(0, 1).contiguous();
  const at::Tensor S_n = at::empty({n, B * Hv, Dk, Dv}, v.options());
  for (int64_t i = 0; i < n; ++i) {
    S_n[i].copy_(state);
    at::Tensor u = u_n[i];
    u.baddbmm_(w_n[i], state, /*beta=*/1, /*alpha=*/-1);  // u - W S
    state.mul_(decay_n[i]);
    state.baddbmm_(kdT_n[i], u);
  }
  const auto heads_major = [&](const at::Tensor& t) {
    return t.transpose(0, 1).reshape({B, Hv, n, t.size(-2), t.size(-1)});
  };
  const at::Tensor S_all = heads_major(S_n), u_all = heads_major(u_n);
  const at::Tensor out = at::matmul(q_decayed, S_all) + at::matmul(intra, u_all);  // [B, H, n, C, Dv]
  RuleRun run;
  if (every_chunk) run.chunk_state = S_all, run.new_values = u_all, run.keys = k, run.log_decay = cum;
  if (capture.defined()) {
    const at::Tensor at_chunk = capture.view({B, 1, 1, 1, 1});
    run.chunk_state = S_all.gather(2, at_chunk.expand({B, Hv, 1, Dk, Dv})).squeeze(2);
    run.new_values = u_all.gather(2, at_chunk.expand({B, Hv, 1, kChunk, Dv})).squeeze(2);
    run.keys = k.gather(2, at_chunk.expand({B, Hv, 1, kChunk, Dk})).squeeze(2);
    run.log_decay = cum.gather(2, capture.view({B, 1, 1, 1}).expand({B, Hv, 1, kChunk})).squeeze(2);
  }
  run.out = out.reshape({B, Hv, n * kChunk, Dv}).narrow(2, 0, T).transpose(1, 2).contiguous().to(v_in.scalar_type());
  return run;
}

// q, k, v, g, beta from the convolution's output mixed [B, T, C] (after SiLU) and the projections b, a.
struct RuleInputs {
  at::Tensor q, k, v, g, beta;
};
RuleInputs rule_inputs(const GatedDeltaNet& w, const at::Tensor& mixed, const at::Tensor& b, const at::Tensor& a) {
  const int64_t B = mixed.size(0), T = mixed.size(1), kd = w.k_heads * w.k_dim, vd = w.v_heads * w.v_dim;
  RuleInputs in;
  in.q = mixed.narrow(-1, 0, kd).reshape({B, T, w.k_heads, w.k_dim});
  in.k = mixed.narrow(-1, kd, kd).reshape({B, T, w.k_heads, w.k_dim});
  in.v = mixed.narrow(-1, 2 * kd, vd).reshape({B, T, w.v_heads, w.v_dim});
  in.beta = at::sigmoid(b);
  in.g = w.neg_A * at::softplus(a.to(at::kFloat) + w.dt_bias);  // float32
  return in;
}

// Qwen3_5RMSNormGated on the rule's output o [B, T, Hv, Dv]: normed in float32, rounded, times w; times silu(z)
// in float32, rounded: [B, T, Hv Dv].
at::Tensor gated_norm(const GatedDeltaNet& w, const at::Tensor& o, const at::Tensor& z) {
  const int64_t B = o.size(0), T = o.size(1);
  const at::Tensor of = o.to(at::kFloat);
  const at::Tensor normed = (of * at::rsqrt(of.pow(2).mean(-1, true) + w.eps)).to(o.scalar_type());
  const at::Tensor gated = (w.norm * normed) * at::silu(z.reshape({B, T, w.v_heads, w.v_dim}).to(at::kFloat));
  return gated.to(o.scalar_type()).reshape({B, T, w.v_heads * w.v_dim});
}

// conv1d over x [B, T, C] (as [B, C, T]) with one filter of w [C, taps] a channel, `zeros` zeros of history on the
// left: [B, C, T + zeros - taps + 1].
at::Tensor depthwise_conv(const at::Tensor& x, const at::Tensor& w, int64_t zeros) {
  const std::vector<int64_t> stride = {1}, padding = {zeros}, dilation = {1};
  return at::conv1d(x.transpose(1, 2), w.unsqueeze(1), at::Tensor(), stride, padding, dilation, x.size(2));
}

// The projection h W_in^T split: the convolution's inputs, z, b, a.
struct Projected {
  at::Tensor x, z, b, a;
};
Projected project(const GatedDeltaNet& w, const at::Tensor& h) {
  const int64_t kd = w.k_heads * w.k_dim, vd = w.v_heads * w.v_dim, C = 2 * kd + vd;
  const at::Tensor proj = at::linear(h, w.in_proj);  // [B, S, C + vd + 2 Hv]
  return {proj.narrow(-1, 0, C), proj.narrow(-1, C, vd), proj.narrow(-1, C + vd, w.v_heads),
          proj.narrow(-1, C + vd + w.v_heads, w.v_heads)};
}

// One document from a zero state: transformers' causal_conv1d_fn (conv1d over [B, C, T] with taps - 1 zeros
// of history), then SiLU and the rule (every_chunk: see RuleRun); the gated norm's input is run.out.
RuleRun mix_document(const GatedDeltaNet& w, const Projected& p, bool every_chunk = false) {
  const int64_t T = p.x.size(1), taps = w.conv.size(1);
  const at::Tensor conv = depthwise_conv(p.x, w.conv, taps - 1).narrow(-1, 0, T);
  const RuleInputs in = rule_inputs(w, at::silu(conv).transpose(1, 2), p.b, p.a);
  return run_rule(in.q, in.k, in.v, in.g, in.beta, at::Tensor(), at::Tensor(), w.fused, every_chunk);
}

// A row's documents as (start, length), padding past them one more: the spans no state crosses.
std::vector<std::pair<int64_t, int64_t>> spans(const std::vector<int64_t>& documents, int64_t S) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t start = 0;
  for (int64_t len : documents)
    if (len > 0) out.emplace_back(start, len), start += len;
  if (start < S) out.emplace_back(start, S - start);
  return out;
}

}  // namespace

at::Tensor gated_delta_mix(const GatedDeltaNet& w, const at::Tensor& h,
                           const std::vector<std::vector<int64_t>>& documents) {
  const int64_t B = h.size(0), S = h.size(1);
  const Projected p = project(w, h);
  bool whole_rows = true;  // every row one document (padding after it changes no real position)
  for (const auto& d : documents) whole_rows = whole_rows && d.size() <= 1;
  if (whole_rows) return gated_norm(w, mix_document(w, p).out, p.z);
  at::Tensor out = at::empty({B, S, w.v_heads * w.v_dim}, h.options());
  for (int64_t r = 0; r < B; ++r)
    for (const auto& [start, len] : spans(documents[static_cast<size_t>(r)], S)) {
      const auto part = [&, start = start, len = len](const at::Tensor& x) {
        return x.narrow(0, r, 1).narrow(1, start, len);
      };
      const Projected doc{part(p.x), part(p.z), part(p.b), part(p.a)};
      part(out).copy_(gated_norm(w, mix_document(w, doc).out, doc.z));
    }
  return out;
}

std::pair<at::Tensor, at::Tensor> gated_delta_verify(const GatedDeltaNet& w, const at::Tensor& hc,
                                                     const std::vector<std::vector<int64_t>>& documents,
                                                     const at::Tensor& anchors, const at::Tensor& hb, int64_t BS) {
  const int64_t B = hc.size(0), S = hc.size(1), N = anchors.size(1), taps = w.conv.size(1);
  const int64_t vd = w.v_heads * w.v_dim;
  const Projected pc = project(w, hc), pb = project(w, hb);
  const int64_t Cc = pc.x.size(2);
  const auto f32 = pc.x.options().dtype(at::kFloat);
  at::Tensor context = at::empty({B, S, vd}, hc.options());
  at::Tensor states = at::zeros({B, N, w.v_heads, w.k_dim, w.v_dim}, f32);
  at::Tensor history = at::zeros({B, N, taps - 1, Cc}, pc.x.options());
  const at::Tensor host_anchors = anchors.to(at::kCPU, at::kLong).contiguous();
  const int64_t* at_anchor = host_anchors.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    for (const auto& [start, len] : spans(documents[static_cast<size_t>(r)], S)) {
      const auto part = [&, start = start, len = len](const at::Tensor& x) {
        return x.narrow(0, r, 1).narrow(1, start, len);
      };
      const Projected doc{part(pc.x), part(pc.z), part(pc.b), part(pc.a)};
      const at::Tensor& x = doc.x;
      const RuleRun run = mix_document(w, doc, /*every_chunk=*/true);
      part(context).copy_(gated_norm(w, run.out, doc.z));
      // this document's anchors: the state after the tokens before each, and the convolution's inputs there
      std::vector<int64_t> blocks, offsets;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t a = at_anchor[r * N + n];
        if (a >= start && a < start + len) blocks.push_back(n), offsets.push_back(a - start);
      }
      if (blocks.empty()) continue;
      const auto opts = at::TensorOptions().dtype(at::kLong).device(x.device());
      const at::Tensor off = at::tensor(offsets, at::TensorOptions().dtype(at::kLong)).to(x.device());
      const at::Tensor chunk = at::floor_divide(off, kChunk), within = off - chunk * kChunk;
      // [1, H, n, ...] -> [M, H, ...] at each anchor's chunk
      const auto pick = [&](const at::Tensor& t) { return t[0].index_select(1, chunk).transpose(0, 1); };
      const at::Tensor at_blocks = at::tensor(blocks, opts);
      states[r].index_copy_(
          0, at_blocks,
          state_at(pick(run.chunk_state), pick(run.keys), pick(run.new_values), pick(run.log_decay), within));
      const at::Tensor padded = at::constant_pad_nd(x[0], {0, 0, taps - 1, 0});  // [taps - 1 + len, C]
      const at::Tensor idx = off.view({-1, 1}) + at::arange(taps - 1, opts).view({1, -1});
      history[r].index_copy_(0, at_blocks, padded.index_select(0, idx.reshape({-1})).view({-1, taps - 1, Cc}));
    }
  }
  // every block alone, from its state: [B N, BS] sequences
  const auto per_block = [&](const at::Tensor& t) { return t.reshape({B * N, BS, t.size(-1)}); };
  const at::Tensor full = at::cat({history.view({B * N, taps - 1, Cc}), per_block(pb.x)}, 1);
  const RuleInputs in =
      rule_inputs(w, at::silu(depthwise_conv(full, w.conv, 0)).transpose(1, 2), per_block(pb.b), per_block(pb.a));
  const RuleRun run = run_rule(in.q, in.k, in.v, in.g, in.beta, states.view({B * N, w.v_heads, w.k_dim, w.v_dim}),
                               at::Tensor(), w.fused);
  return {context, gated_norm(w, run.out, per_block(pb.z)).view({B, N * BS, vd})};
}

GatedDeltaCache::GatedDeltaCache(const GatedDeltaNet& w, int64_t batch, c10::ScalarType dtype, c10::Device device)
    : w_(w),
      batch_(batch),
      taps_(w.conv.size(1)),
      base_(static_cast<size_t>(batch), -1),
      real_(static_cast<size_t>(batch), 0),
      chunk_start_(static_cast<size_t>(batch), 0) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  state_ = at::zeros({batch, w.v_heads, w.k_dim, w.v_dim}, f32);
  history_ = at::zeros({batch, taps_ - 1, w.conv.size(0)}, f32.dtype(dtype));
}

void GatedDeltaCache::commit(const std::vector<int64_t>& start) {
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
      throw std::logic_error("hf target decoder (Gated DeltaNet): row " + std::to_string(b) + " starts at position " +
                             std::to_string(start[i]) + ", but its state can be rolled to positions " +
                             (base_[i] < 0
                                  ? std::string("0 only (nothing has run for it)")
                                  : std::to_string(base_[i] + chunk_start_[i]) + ".." +
                                        std::to_string(base_[i] + real_[i]) + " (its last call's real tokens) or 0"));
    offset[i] = o - chunk_start_[i];
    any_run = true;
  }
  if (any_run) {
    const at::Tensor r = at::tensor(offset, at::TensorOptions().dtype(at::kLong)).to(state_.device()).view({B, 1, 1});
    state_ = state_at(chunk_state_, keys_, new_values_, log_decay_, r);
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

at::Tensor GatedDeltaCache::forward(const at::Tensor& h, const std::vector<int64_t>& start,
                                    const std::vector<int64_t>& real) {
  const int64_t B = h.size(0), T = h.size(1);
  if (B != batch_ || static_cast<int64_t>(start.size()) != B || static_cast<int64_t>(real.size()) != B)
    throw std::invalid_argument("hf target decoder (Gated DeltaNet): " + std::to_string(B) + " rows, " +
                                std::to_string(start.size()) + " starts and " + std::to_string(real.size()) +
                                " real counts for a decoder of " + std::to_string(batch_) + " rows");
  commit(start);
  const Projected p = project(w_, h);
  const int64_t Cc = p.x.size(2), K = taps_;
  const at::Tensor full = at::cat({history_, p.x}, 1);  // [B, K - 1 + T, C]: the inputs the convolution reads
  const at::Tensor conv = depthwise_conv(full, w_.conv, 0);
  const RuleInputs in = rule_inputs(w_, at::silu(conv).transpose(1, 2), p.b, p.a);
  std::vector<int64_t> chunk(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = real[static_cast<size_t>(b)];
    if (n < 0 || n > T)
      throw std::invalid_argument("hf target decoder (Gated DeltaNet): row " + std::to_string(b) + " has " +
                                  std::to_string(n) + " real tokens of " + std::to_string(T));
    chunk[static_cast<size_t>(b)] = n > 0 ? (n - 1) / kChunk : 0;
  }
  const at::Tensor capture = at::tensor(chunk, at::TensorOptions().dtype(at::kLong)).to(h.device());
  RuleRun run = run_rule(in.q, in.k, in.v, in.g, in.beta, state_, capture, w_.fused);
  chunk_state_ = run.chunk_state, keys_ = run.keys, new_values_ = run.new_values, log_decay_ = run.log_decay;
  // the convolution's inputs from each row's captured chunk's start - (K - 1) on: kChunk + K - 1 of them
  const int64_t window = kChunk + K - 1;
  const at::Tensor padded = at::constant_pad_nd(full, {0, 0, 0, window});
  const at::Tensor from =
      (capture * kChunk).view({B, 1, 1}) + at::arange(window, capture.options()).view({1, window, 1});
  inputs_ = padded.gather(1, from.expand({B, window, Cc}));
  for (int64_t b = 0; b < B; ++b) chunk_start_[static_cast<size_t>(b)] = chunk[static_cast<size_t>(b)] * kChunk;
  base_ = start, real_ = real;
  return gated_norm(w_, run.out, p.z);
}

}  // namespace flashdraft::hf

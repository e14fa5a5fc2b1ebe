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
  take_chunks(run, S_all, k, u_all, cum, capture, every_chunk);
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

}  // namespace

Projected GatedDeltaNet::project(const at::Tensor& h) const {
  const int64_t kd = k_heads * k_dim, vd = v_heads * v_dim, C = 2 * kd + vd;
  const at::Tensor proj = at::linear(h, in_proj);  // [B, S, C + vd + 2 Hv]
  return {proj.narrow(-1, 0, C),
          {proj.narrow(-1, C, vd), proj.narrow(-1, C + vd, v_heads), proj.narrow(-1, C + vd + v_heads, v_heads)}};
}

RuleRun GatedDeltaNet::rule(const at::Tensor& u, const Projected& p, const at::Tensor& initial,
                            const at::Tensor& capture, bool every_chunk) const {
  const RuleInputs in = rule_inputs(*this, u, p.rest[1], p.rest[2]);
  return run_rule(in.q, in.k, in.v, in.g, in.beta, initial, capture, fused, every_chunk);
}

at::Tensor GatedDeltaNet::finish(const at::Tensor& out, const Projected& p) const {
  return gated_norm(*this, out, p.rest[0]);
}

}  // namespace flashdraft::hf

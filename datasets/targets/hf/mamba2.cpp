#include "mamba2.hpp"

#include <flashdraft/ops.hpp>

#include <ATen/ATen.h>

#include <limits>
#include <vector>

namespace flashdraft::hf {

Projected Mamba2::project(const at::Tensor& h) const {
  const int64_t inner = heads * head_dim, conv_dim = inner + 2 * groups * state;
  const at::Tensor proj = at::linear(h, in_proj, in_bias);  // [B, S, inner + conv_dim + heads]
  return {proj.narrow(-1, inner, conv_dim), {proj.narrow(-1, 0, inner), proj.narrow(-1, inner + conv_dim, heads)}};
}

RuleRun Mamba2::rule(const at::Tensor& u, const Projected& p, const at::Tensor& initial, const at::Tensor& capture,
                     bool every_chunk) const {
  const int64_t B = u.size(0), T = u.size(1), H = heads, P = head_dim, N = state, inner = H * P;
  const int64_t C = chunk, pad = (C - T % C) % C, n = (T + pad) / C;
  // [B, T, ...] -> [B, H, T (padded), ...] float32
  const auto heads_first = [&](const at::Tensor& t) {
    return at::constant_pad_nd(t.transpose(1, 2).to(at::kFloat), {0, 0, 0, pad}).contiguous();
  };
  const auto per_head = [&](const at::Tensor& t) {  // [B, T, G, N] -> each head's group's B or C
    return t.repeat_interleave(H / groups, 2);
  };
  const at::Tensor x = u.narrow(-1, 0, inner).reshape({B, T, H, P}), xf = x.to(at::kFloat);
  // B and C [B, T, G, N] (views of u)
  const at::Tensor keys = u.narrow(-1, inner, groups * N).reshape({B, T, groups, N});
  const at::Tensor queries = u.narrow(-1, inner + groups * N, groups * N).reshape({B, T, groups, N});
  // dt in the model's dtype as transformers rounds it, then float32; the values dt x and log decays dt A
  const at::Tensor dt = at::softplus(p.rest[1] + dt_bias).clamp(dt_min, dt_max).to(at::kFloat);  // [B, T, H]
  const at::Tensor values = xf * dt.unsqueeze(-1), log_decay = dt * neg_A;                       // [B, T, H, (P)]
  const auto skip = [&](const at::Tensor& y) {  // y [B, T, H, P] + D x, as the model's [B, T, d_inner]
    return (y + D.to(at::kFloat).view({1, 1, H, 1}) * xf).reshape({B, T, inner});
  };
  if (!every_chunk && !capture.defined()) {  // only the output asked for: the engine's kernels where they run
    const at::Tensor y = frozen::ssd_chunks(queries, keys, values, log_decay, initial, fused);
    if (y.defined()) {
      RuleRun run;
      run.out = skip(y);
      return run;
    }
  }
  const at::Tensor xdt = heads_first(values).view({B, H, n, C, P});
  const at::Tensor k = heads_first(per_head(keys)).view({B, H, n, C, N});
  const at::Tensor q = heads_first(per_head(queries)).view({B, H, n, C, N});
  const at::Tensor a = at::constant_pad_nd(log_decay.transpose(1, 2), {0, pad});  // [B, H, T (padded)]
  const at::Tensor cum = a.reshape({B, H, n, C}).cumsum(-1);                      // log decay from the chunk's start
  const at::Tensor upper = at::ones({C, C}, cum.options().dtype(at::kBool)).triu(1);
  const at::Tensor decay =
      (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, -std::numeric_limits<double>::infinity()).exp();
  const at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * decay;  // [B, H, n, C, C]
  const at::Tensor last = cum.narrow(-1, C - 1, 1);                     // [B, H, n, 1]
  // each chunk's own addition to the state at its end, and the decay over it
  const at::Tensor added = at::matmul((k * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2), xdt);  // [.., N, P]
  const at::Tensor chunk_decay = last.exp().unsqueeze(-1);                                             // [.., 1, 1]
  // The scan over chunks (sequential; chunk-major copies keep every step's operands contiguous): each chunk's start
  // state into S_n.
  const auto chunk_major = [&](const at::Tensor& t) {
    return t.reshape({B * H, n, t.size(-2), t.size(-1)}).transpose(0, 1).contiguous();
  };
  const at::Tensor added_n = chunk_major(added), decay_n = chunk_major(chunk_decay);
  at::Tensor S = (initial.defined() ? initial.to(at::kFloat) : at::zeros({B, H, N, P}, xdt.options()))
                     .reshape({B * H, N, P})
                     .clone();
  const at::Tensor S_n = at::empty({n, B * H, N, P}, xdt.options());
  for (int64_t i = 0; i < n; ++i) {
    S_n[i].copy_(S);
    S.mul_(decay_n[i]).add_(added_n[i]);
  }
  const at::Tensor S_all = S_n.transpose(0, 1).reshape({B, H, n, N, P});
  const at::Tensor y = at::matmul(q * cum.exp().unsqueeze(-1), S_all) + at::matmul(intra, xdt);  // [B, H, n, C, P]
  RuleRun run;
  run.out = skip(y.reshape({B, H, n * C, P}).narrow(2, 0, T).transpose(1, 2));
  take_chunks(run, S_all, k, xdt, cum, capture, every_chunk);
  return run;
}

// GraniteMoeHybridRMSNormGated: y * silu(z) in float32, normed per group of d_inner / G, times w in float32; rounded
// once, to the model's dtype.
at::Tensor Mamba2::finish(const at::Tensor& out, const Projected& p) const {
  const at::Tensor z = p.rest[0];
  const int64_t inner = heads * head_dim;
  std::vector<int64_t> grouped = out.sizes().vec();
  grouped.back() = groups, grouped.push_back(inner / groups);
  const at::Tensor g = (out.to(at::kFloat) * at::silu(z.to(at::kFloat))).view(grouped);
  const at::Tensor normed = (g * at::rsqrt(g.pow(2).mean(-1, true) + eps)).view(out.sizes());
  return (norm.to(at::kFloat) * normed).to(z.scalar_type());
}

}  // namespace flashdraft::hf

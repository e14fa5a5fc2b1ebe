#include "gated_delta.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace flashdraft::hf {

namespace {

constexpr int64_t kChunk = 64;

// x / sqrt(sum(x^2) + 1e-6) over the last dimension (float32)
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); }

// [B, T, H, D] -> [B, H, T, D] float32, contiguous
at::Tensor heads_first(const at::Tensor& x) { return x.transpose(1, 2).to(at::kFloat).contiguous(); }

// One document: the projections' slices [B, T, ...] through the convolution, the rule and the norm.
at::Tensor mix_document(const GatedDeltaNet& w, const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b,
                        const at::Tensor& a) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2), taps = w.conv.size(1);
  // transformers' causal_conv1d_fn: conv1d over [B, C, T] with taps - 1 zeros of history, then SiLU
  const at::Tensor conv =
      at::conv1d(qkv.transpose(1, 2), w.conv.unsqueeze(1), at::Tensor(), 1, taps - 1, 1, C).narrow(-1, 0, T);
  const at::Tensor mixed = at::silu(conv).transpose(1, 2);  // [B, T, C]
  const int64_t kd = w.k_heads * w.k_dim, vd = w.v_heads * w.v_dim;
  const at::Tensor q = mixed.narrow(-1, 0, kd).reshape({B, T, w.k_heads, w.k_dim});
  const at::Tensor k = mixed.narrow(-1, kd, kd).reshape({B, T, w.k_heads, w.k_dim});
  const at::Tensor v = mixed.narrow(-1, 2 * kd, vd).reshape({B, T, w.v_heads, w.v_dim});
  const at::Tensor beta = at::sigmoid(b);
  const at::Tensor g = w.neg_A * at::softplus(a.to(at::kFloat) + w.dt_bias);  // float32
  const at::Tensor o = chunk_gated_delta_rule(q, k, v, g, beta);            // [B, T, Hv, Dv]
  // Qwen3_5RMSNormGated: normed in float32, rounded, times w; times silu(z) in float32, rounded
  const at::Tensor of = o.to(at::kFloat);
  const at::Tensor normed = (of * at::rsqrt(of.pow(2).mean(-1, true) + w.eps)).to(o.scalar_type());
  const at::Tensor gated = (w.norm * normed) * at::silu(z.reshape({B, T, w.v_heads, w.v_dim}).to(at::kFloat));
  return gated.to(o.scalar_type()).reshape({B, T, vd});
}

}  // namespace

at::Tensor chunk_gated_delta_rule(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                  const at::Tensor& g_in, const at::Tensor& beta_in) {
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
  const at::Tensor last = cum.narrow(-1, kChunk - 1, 1);                   // [B, H, n, 1]
  const at::Tensor k_decayed = k * (last - cum).exp().unsqueeze(-1);       // to the chunk's end
  const at::Tensor chunk_decay = last.exp().unsqueeze(-1);                 // [B, H, n, 1, 1]
  at::Tensor state = at::zeros({B, Hv, Dk, Dv}, v.options());
  at::Tensor out = at::empty_like(values);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor v_new = values.select(2, i) - at::matmul(k_cumdecay.select(2, i), state);
    out.select(2, i).copy_(at::matmul(q_decayed.select(2, i), state) + at::matmul(intra.select(2, i), v_new));
    state = state * chunk_decay.select(2, i) + at::matmul(k_decayed.select(2, i).transpose(-1, -2), v_new);
  }
  return out.reshape({B, Hv, n * kChunk, Dv}).narrow(2, 0, T).transpose(1, 2).contiguous().to(v_in.scalar_type());
}

at::Tensor gated_delta_mix(const GatedDeltaNet& w, const at::Tensor& h,
                           const std::vector<std::vector<int64_t>>& documents) {
  const int64_t B = h.size(0), S = h.size(1);
  const int64_t kd = w.k_heads * w.k_dim, vd = w.v_heads * w.v_dim, C = 2 * kd + vd;
  const at::Tensor proj = at::linear(h, w.in_proj);  // [B, S, C + vd + 2 Hv]
  const at::Tensor qkv = proj.narrow(-1, 0, C), z = proj.narrow(-1, C, vd);
  const at::Tensor b = proj.narrow(-1, C + vd, w.v_heads), a = proj.narrow(-1, C + vd + w.v_heads, w.v_heads);
  bool whole_rows = true;  // every row one document (padding after it changes no real position)
  for (const auto& d : documents) whole_rows = whole_rows && d.size() <= 1;
  if (whole_rows) return mix_document(w, qkv, z, b, a);
  at::Tensor out = at::empty({B, S, vd}, h.options());
  for (int64_t r = 0; r < B; ++r) {
    std::vector<int64_t> lengths = documents[static_cast<size_t>(r)];
    int64_t used = 0;
    for (int64_t len : lengths) used += len;
    if (used < S) lengths.push_back(S - used);
    int64_t start = 0;
    for (int64_t len : lengths) {
      if (len <= 0) continue;
      const auto part = [&](const at::Tensor& x) { return x.narrow(0, r, 1).narrow(1, start, len); };
      out.narrow(0, r, 1).narrow(1, start, len).copy_(mix_document(w, part(qkv), part(z), part(b), part(a)));
      start += len;
    }
  }
  return out;
}

}  // namespace flashdraft::hf

// DFlash-2 drafter: DFlash (plugins/dflash) with two additions, as z-lab's DFlash2DraftModel
// (dflash/model.py) and vLLM speculators' dflash2 define them:
//
//   convolutions  every decoder layer wraps its attention and its MLP in a grouped dynamic
//                 causal convolution along the block's tokens. For a sublayer input u
//                 [T, H] (a block's T = BS tokens), P = u W_kp^T viewed [T, 2, K, H/G]:
//                   y[t, c] = sum_{o<K} (base[side][o, c] + P[t, side, o, c / G]) x[t - o, c]
//                 with x = 0 before the block's first token; side 0 convolves u before the
//                 sublayer, side 1 its output (both kernels from u):
//                   h = h + conv1(attn(conv0(norm(h)))),  h = h + conv1'(mlp(conv0'(norm(h))))
//   selector      a low-rank candidate selector re-ranks the LM head's top-Kc tokens of each
//                 block position with the token before it:
//                   score_k = unary_k + <E_pred[previous] * (W_hp h), E_succ[candidate_k]>
//                 (unary: the LM head's logits as served, times output_multiplier and capped
//                 at final_logit_softcapping, z-lab's compute_logits)
//                 Serving walks the block left to right, the previous token being the one
//                 chosen at the position before (the block's known token first), greedy or
//                 drawn from softmax(score / temperature) (z-lab's propose: no top_p).
//
// Training (speculators' dflash2 loss): the unary loss is DFlash's (the engine's LM-head op:
// CE against the data's or the target's token, or KL to the target's distribution), plus
// selector_loss_alpha x the Kc-way cross-entropy of the scores against the wanted token,
// teacher-forced (the previous token is the data's at anchor + j - 1); the wanted token
// replaces the last (lowest) candidate when the top-Kc lacks it. Both terms use the same
// position weights and normaliser. The candidates' unary logits come from the top-Kc pass
// (no [rows, vocab] tensor is kept); their gradient is a weighted sum of LM-head rows.
//
// Initial weights as speculators makes them: identity convolutions (base[:, 0] = 1, the rest
// and W_kp zero: DFlash-2 starts as the DFlash of the same seed), codebooks and W_hp normal.
#include "candidate_logits.hpp"

#include <dflash_drafter.hpp>
#include <hf_format.hpp>

#include <flashdraft/plugin.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {
namespace {

struct Conv {
  at::Tensor base;        // [2, K, H]
  at::Tensor projection;  // [2 K H/G, H]
};

class DFlash2Drafter final : public dflash::DFlashDrafter {
 public:
  static void declare(Schema& s) {
    DFlashDrafter::declare(s);
    s.integer("conv_kernel_size",
              "taps K of each grouped dynamic causal convolution (tap 0 = the token itself; at most block_size)")
        .def(int64_t{2})
        .range(1, 4096);
    s.integer("conv_group_size", "channels G sharing one dynamic tap (the hidden size must be a multiple)")
        .def(int64_t{16})
        .range(1, 1 << 20);
    s.integer("selector_rank", "rank R of the candidate selector's codebooks").def(int64_t{256}).range(1, 1 << 16);
    s.integer("selector_top_k", "candidates Kc the selector re-ranks per block position (at most the vocabulary)")
        .def(int64_t{16})
        .range(1, 1 << 16);
    s.real("selector_loss_alpha", "weight of the selector's cross-entropy in the loss (speculators: 1)")
        .def(1.0)
        .at_least(0.0);
  }

  explicit DFlash2Drafter(const Config& config)
      : DFlashDrafter(config),
        kernel_(config.integer("conv_kernel_size")),
        group_(config.integer("conv_group_size")),
        rank_(config.integer("selector_rank")),
        top_k_(config.integer("selector_top_k")),
        alpha_(config.real("selector_loss_alpha")) {}

  std::vector<std::string> scalar_names() const override { return {"tau_sim", "selector_acc", "candidate_recall"}; }
  const DrafterFormat* format() const override {
    static const hf_drafter::Format hf(variant());
    return &hf;
  }

 protected:
  void make_more_parameters(ParamMaker& make) override {
    check_sizes();
    const int64_t H = hidden_, taps = 2 * kernel_ * (hidden_ / group_);
    const auto opts = at::TensorOptions().dtype(dtype_).device(device_);
    convs_.clear();
    for (int64_t l = 0; l < layers_n_; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      for (const char* side : {"attention_conv", "mlp_conv"}) {
        Conv c;
        c.base = at::zeros({2, kernel_, H}, opts);
        c.base.select(1, 0).fill_(1.0);
        c.base.requires_grad_(true);
        c.projection = at::zeros({taps, H}, opts).requires_grad_(true);
        params_.emplace_back(p + side + ".base_kernel", c.base);
        params_.emplace_back(p + side + ".kernel_projection.weight", c.projection);
        convs_.push_back(c);
      }
    }
    // Stored without ".weight" (speculators' parameters, the reference's canonical names).
    predecessor_ = make.linear("candidate_selector.predecessor_codebook", vocab_, rank_);
    successor_ = make.linear("candidate_selector.successor_codebook", vocab_, rank_);
    projection_ = make.linear("candidate_selector.hidden_projection.weight", rank_, H);
  }

  at::Tensor layer(int64_t l, const at::Tensor& x, const Attend& attend) const override {
    const dflash::Layer& P = layers_[static_cast<size_t>(l)];
    const Conv& ca = convs_[static_cast<size_t>(2 * l)];
    const Conv& cm = convs_[static_cast<size_t>(2 * l + 1)];
    const at::Tensor u = rms_norm(x, P.input_norm);
    const at::Tensor ka = kernels(u, ca);
    const at::Tensor y = x + convolve(attend(convolve(u, ka.select(2, 0), ca.base[0])), ka.select(2, 1), ca.base[1]);
    const at::Tensor v = rms_norm(y, P.post_norm);
    const at::Tensor km = kernels(v, cm);
    return y + convolve(mlp(l, convolve(v, km.select(2, 0), cm.base[0])), km.select(2, 1), cm.base[1]);
  }

  // The candidates come with the loss: the LM-head op's own logits' top-Kc.
  int64_t loss_top_k() const override { return top_k_; }
  bool wants_previous_tokens() const override { return true; }

  LossExtra extra_loss(const LossRows& rows, bool training) const override {
    (void)training;
    const at::Tensor& h = rows.in.hidden;  // [R, H]
    const int64_t R = h.size(0);
    Candidates c;
    {
      at::NoGradGuard frozen;
      c = top_candidates(h.detach(), rows.wanted, rows.out);
    }
    const at::Tensor& candidates = c.indices;
    // The wanted token's place among the candidates: the first where the LM head's top-Kc has
    // it, else the last, which it took.
    const at::Tensor contains = c.contains;
    const at::Tensor position = candidates.eq(rows.wanted.unsqueeze(1)).to(at::kByte).argmax(1);
    const at::Tensor unary =
        dflash2::candidate_logits(h, c.values, target_head_, candidates, output_multiplier_, softcap_);
    const at::Tensor context = selector_context(h, rows.previous);
    const at::Tensor scores = unary + transition(context, candidates);
    const at::Tensor ce = at::cross_entropy_loss(scores.to(at::kFloat), position, {}, at::Reduction::None);  // [R]
    const at::Tensor weights = rows.in.row_weights.to(at::kFloat);
    LossExtra extra;
    extra.loss = (ce * weights).sum() * (alpha_ / rows.in.weight_sum);
    // What the selector proposes from the LM head's own top-Kc (the last candidate back where
    // the wanted token took its place): the token a server would draft after the data's.
    at::Tensor own = scores.detach().clone();
    {
      at::NoGradGuard frozen;
      const at::Tensor last = c.last_values + transition(context.detach(), c.last_indices.unsqueeze(1)).squeeze(1);
      own.select(1, top_k_ - 1).copy_(at::where(contains, own.select(1, top_k_ - 1), last.to(own.scalar_type())));
    }
    const at::Tensor own_pick = own.argmax(1);
    const at::Tensor own_candidates = candidates.clone();
    own_candidates.select(1, top_k_ - 1).copy_(c.last_indices);
    extra.chosen = own_candidates.gather(1, own_pick.unsqueeze(1)).squeeze(1);
    const at::Tensor n = at::full({}, static_cast<double>(std::max<int64_t>(R, 1)), weights.options());
    const at::Tensor right = scores.detach().argmax(1).eq(position).logical_and(contains);
    extra.scalars = {{"selector_acc", right.to(at::kFloat).sum() / contains.to(at::kFloat).sum().clamp_min(1.0)},
                     {"candidate_recall", contains.to(at::kFloat).sum() / n}};
    return extra;
  }

  DraftProposal choose(const at::Tensor& states, const at::Tensor& last, const Sampling& sampling) const override {
    const int64_t B = states.size(0), K = states.size(1);
    const at::Tensor logits =
        served_logits(at::linear(states, target_head_), output_multiplier_, softcap_);  // [B, K, V], as served
    auto [unary, candidates] = at::topk(logits, top_k_, -1, true, true);
    const at::Tensor hp = at::linear(states, projection_);  // [B, K, R]
    at::Tensor previous = last.to(at::kLong);
    std::vector<at::Tensor> path, probs;
    for (int64_t p = 0; p < K; ++p) {
      const at::Tensor cand = candidates.select(1, p);  // [B, Kc]
      const at::Tensor context = predecessor_.index_select(0, previous) * hp.select(1, p);
      const at::Tensor scores = unary.select(1, p) + transition(context, cand);
      at::Tensor pick;
      if (sampling.greedy()) {
        pick = scores.argmax(1);
      } else {
        const at::Tensor q = sampling_probs(scores, sampling.temperature, 1.0);
        pick = sample_tokens(q, sampling.generator);
        probs.push_back(at::zeros({B, vocab_}, q.options()).scatter_(1, cand, q));
      }
      previous = cand.gather(1, pick.unsqueeze(1)).squeeze(1);
      path.push_back(previous);
    }
    DraftProposal out;
    out.tokens = at::stack(path, 1);
    if (!probs.empty()) out.probs = at::stack(probs, 1);
    return out;
  }

 private:
  void check_sizes() const {
    if (hidden_ % group_ != 0)
      config().fail("conv_group_size", "conv_group_size = " + std::to_string(group_) +
                                           " does not divide the hidden size " + std::to_string(hidden_) +
                                           " (accepted: a divisor of it, e.g. 16)");
    if (kernel_ > block_size_)
      config().fail("conv_kernel_size", "conv_kernel_size = " + std::to_string(kernel_) + " is longer than a block (" +
                                            "block_size = " + std::to_string(block_size_) + "); accepted: 1.." +
                                            std::to_string(block_size_));
    if (top_k_ > vocab_)
      config().fail("selector_top_k", "selector_top_k = " + std::to_string(top_k_) +
                                          " is more candidates than the target's vocabulary of " +
                                          std::to_string(vocab_) + " tokens");
  }

  // The sublayer's dynamic kernels from its input u [B, T, H]: [B, T, 2, K, H/G].
  at::Tensor kernels(const at::Tensor& u, const Conv& c) const {
    return at::linear(u, c.projection).view({u.size(0), u.size(1), 2, kernel_, hidden_ / group_});
  }

  // y[t] = sum_o (base[o] + d[t, o]) x[t - o] within each block of block_size_ tokens
  // (x [B, T, H], d [B, T, K, H/G], base [K, H]), accumulated as the reference does.
  at::Tensor convolve(const at::Tensor& x, const at::Tensor& d, const at::Tensor& base) const {
    const int64_t B = x.size(0), T = x.size(1), BS = block_size_, N = T / BS, NG = hidden_ / group_;
    const at::Tensor blocks = x.reshape({B, N, BS, NG, group_});
    const at::Tensor dyn = d.reshape({B, N, BS, kernel_, NG, 1});
    at::Tensor out = at::zeros_like(blocks);
    for (int64_t o = 0; o < kernel_; ++o) {
      const at::Tensor values = o == 0 ? blocks : at::constant_pad_nd(blocks.narrow(2, 0, BS - o), {0, 0, 0, 0, o, 0});
      out = out + base[o].view({1, 1, 1, NG, group_}) * values;
      out = at::addcmul(out, dyn.select(3, o), values);
    }
    return out.view({B, T, hidden_});
  }

  // E_pred[previous] * (W_hp h) of each row: [R, rank].
  at::Tensor selector_context(const at::Tensor& h, const at::Tensor& previous) const {
    return predecessor_.index_select(0, previous) * at::linear(h, projection_);
  }

  // The selector's term <context, E_succ[candidate]> of each row's candidates [R, k]: [R, k].
  at::Tensor transition(const at::Tensor& context, const at::Tensor& candidates) const {
    const int64_t R = context.size(0), k = candidates.size(1);
    const at::Tensor succ = successor_.index_select(0, candidates.reshape({-1})).view({R, k, rank_});
    return at::bmm(succ, context.unsqueeze(2)).squeeze(2);
  }

  // Each row's top-Kc tokens under the LM head, highest first, and their logits (from the
  // LM-head op, which made those logits for the loss: loss_top_k()), the wanted token in the
  // last place where it is not among them (the place's own token and logit kept aside).
  struct Candidates {
    at::Tensor values, indices;            // [R, Kc]
    at::Tensor last_values, last_indices;  // [R]: the LM head's own Kc-th candidate
    at::Tensor contains;                   // [R] bool: the LM head's top-Kc has the wanted token
  };
  Candidates top_candidates(const at::Tensor& h, const at::Tensor& wanted, const LmHeadLossOutput& op) const {
    const int64_t R = h.size(0);
    if (!op.top_values.defined() || !op.top_indices.defined() || op.top_values.size(0) != R ||
        op.top_values.size(1) != top_k_)
      throw std::logic_error("dflash2: the LM-head loss op returned no top-" + std::to_string(top_k_) +
                             " candidates for its " + std::to_string(R) + " rows (LmHeadLossInput::top_k)");
    Candidates c;
    c.values = op.top_values.to(h.scalar_type()).clone();
    c.indices = op.top_indices.clone();
    c.last_values = c.values.select(1, top_k_ - 1).clone();
    c.last_indices = c.indices.select(1, top_k_ - 1).clone();
    const at::Tensor missing = c.indices.eq(wanted.unsqueeze(1)).any(1).logical_not();
    c.contains = missing.logical_not();
    // The wanted token's logit h . W[wanted] (as served) where it takes the last place.
    const at::Tensor wanted_logit = served_logits(
        (h.to(at::kFloat) * target_head_.index_select(0, wanted).to(at::kFloat)).sum(-1), output_multiplier_, softcap_);
    c.indices.select(1, top_k_ - 1).copy_(at::where(missing, wanted, c.last_indices));
    c.values.select(1, top_k_ - 1).copy_(at::where(missing, wanted_logit.to(c.values.scalar_type()), c.last_values));
    return c;
  }

  static hf_drafter::Variant variant() {
    hf_drafter::Variant v;
    v.architecture = "DFlash2DraftModel";
    v.display = "DFlash-2";
    v.plugin = "dflash2";
    v.keys = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"};
    v.tensors = [](const hf_drafter::Layout& l) {
      const int64_t H = l.hidden, K = l.value("conv_kernel_size"), G = l.value("conv_group_size");
      const int64_t R = l.value("selector_rank");
      hf_drafter::TensorShapes out;
      for (int64_t i = 0; i < l.layers; ++i)
        for (const char* side : {"attention_conv", "mlp_conv"}) {
          const std::string p = "layers." + std::to_string(i) + "." + side + ".";
          out.push_back({p + "base_kernel", {2, K, H}});
          out.push_back({p + "kernel_projection.weight", {2 * K * (G > 0 ? H / G : 0), H}});
        }
      out.push_back({"candidate_selector.predecessor_codebook", {l.vocab, R}});
      out.push_back({"candidate_selector.successor_codebook", {l.vocab, R}});
      out.push_back({"candidate_selector.hidden_projection.weight", {R, H}});
      return out;
    };
    return v;
  }

  int64_t kernel_, group_, rank_, top_k_;
  double alpha_;
  std::vector<Conv> convs_;  // per layer: attention's, then the MLP's
  at::Tensor predecessor_, successor_, projection_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(drafter, "dflash2", "0.1.0",
                  "DFlash-2 drafter: DFlash with grouped dynamic causal convolutions and a candidate selector",
                  flashdraft::DFlash2Drafter)

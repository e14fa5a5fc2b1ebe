// Test oracle for DFlash drafter tests: an AttentionContext that builds the dense DFlash
// mask from its plain definition and runs plain softmax attention (autograd through
// ordinary tensor ops). Independent of the mask generator and kernel plugins.
//   query i belongs to block n = i / BS; it sees context key kv < S iff block n is
//   valid and kv < anchor_n, and block key kv >= S iff block n is valid and
//   (kv - S) / BS == n. Rows that see nothing give 0 (and zero gradients).
#pragma once

#include <flashdraft/model.hpp>

#include "built_plugins.hpp"
#include "dispatch/lm_head_loss.hpp"
#include "registry/registry.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <memory>
#include <string>

namespace flashdraft::dflash_test {

class OracleAttention : public DrafterContext {
 public:
  void set_mask(const MaskInput& input) override {
    input_ = input;
    ++masks_set;
  }

  at::Tensor attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale) override {
    calls.push_back(layer);
    last_q_shape = q.sizes().vec();
    last_k_shape = k.sizes().vec();
    const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), Hkv = k.size(1), Lkv = k.size(2);
    const int64_t S = input_.blocks.context_len, BS = input_.blocks.block_size;
    at::Tensor mask = at::zeros({B, 1, Lq, Lkv}, at::kBool);
    auto acc = mask.accessor<bool, 4>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t n = i / BS;
        if (!input_.blocks.valid[b][n]) continue;
        // Packed rows: the context of the anchor's document only.
        const int64_t a = input_.blocks.anchors[b][n];
        int64_t doc0 = 0;
        if (!input_.doc_lengths.empty()) {
          int64_t start = 0;
          for (const int64_t len : input_.doc_lengths[b]) {
            if (a >= start && a < start + len) doc0 = start;
            start += len;
          }
        }
        for (int64_t kv = 0; kv < Lkv; ++kv) acc[b][0][i][kv] = kv < S ? kv < a && kv >= doc0 : (kv - S) / BS == n;
      }
    mask = mask.to(q.device());
    const at::Tensor kr = k.repeat_interleave(Hq / Hkv, 1), vr = v.repeat_interleave(Hq / Hkv, 1);
    // Masked scores get a huge finite negative value (not -inf), so a row that sees
    // nothing has finite softmax values; multiplying by the mask then zeroes it.
    const at::Tensor scores = at::matmul(q, kr.transpose(-1, -2)).mul(scale).masked_fill(~mask, -1e30);
    const at::Tensor p = at::softmax(scores, -1) * mask.to(q.scalar_type());
    return at::matmul(p, vr);
  }

  // The loss by its definition: full logits, float32 log-softmax, weighted NLL (labels from
  // a target: the engine's reference definition; the Python cross-check is their oracle).
  LmHeadLossOutput lm_head_loss(const LmHeadLossInput& in) override {
    ++loss_calls;
    labels_from_target = in.target_hidden.defined();
    soft_labels = in.target_soft;
    if (in.target_hidden.defined()) return lm_head_loss_reference(in);
    at::Tensor logits = at::matmul(in.hidden, in.weight.t());
    if (logits.scalar_type() != at::kDouble) logits = logits.to(at::kFloat);  // float64 checks stay float64
    LmHeadLossOutput out;
    out.argmax = logits.detach().argmax(-1);
    const at::Tensor logp = at::log_softmax(logits, -1);
    at::Tensor total = at::zeros({}, logp.options());
    for (int64_t r = 0; r < in.hidden.size(0); ++r)
      total = total - logp[r][in.labels[r].item<int64_t>()] * in.row_weights[r].item<double>();
    out.loss = total / in.weight_sum;
    return out;
  }

  MaskInput input_;
  int64_t masks_set = 0, loss_calls = 0;
  bool labels_from_target = false, soft_labels = false;  // what the last loss call was given
  std::vector<int64_t> calls;
  std::vector<int64_t> last_q_shape, last_k_shape;
};

// A Config for a plugin: schema defaults, with `overrides` given "in the file".
inline Config make_config(const Schema& schema, const std::map<std::string, Value>& overrides) {
  Config c("test", SourcePosition{"test.toml", 1, 1});
  for (const KeySpec& k : schema.keys()) {
    auto it = overrides.find(k.name);
    if (it != overrides.end())
      c.set(k.name, it->second, SourcePosition{"test.toml", 2, 1});
    else
      c.set(k.name, *k.fallback, std::nullopt);
  }
  return c;
}

// Loads the dflash drafter plugin from the build's plugin folder.
inline std::unique_ptr<Drafter> make_drafter(const std::map<std::string, Value>& overrides) {
  static Registry registry({built_plugin_dir()});
  const FoundPlugin& p = registry.get(PluginKind::drafter, "dflash");
  return create_as<Drafter>(registry, p, make_config(registry.schema(p), overrides));
}

// A random target (embedding, LM head) and a random batch with the given shapes.
struct Problem {
  TargetModel target;
  Batch batch;
};
inline Problem random_problem(int64_t vocab, int64_t hidden, std::vector<int64_t> exported, int64_t B, int64_t S,
                              c10::ScalarType dtype, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto o = at::TensorOptions().dtype(dtype);
  Problem p;
  p.target.vocab = vocab;
  p.target.hidden = hidden;
  p.target.layers = 1 + *std::max_element(exported.begin(), exported.end());
  p.target.exported_layers = exported;
  p.target.embedding = at::randn({vocab, hidden}, g, o);
  p.target.lm_head = at::randn({vocab, hidden}, g, o).div_(std::sqrt(double(hidden)));
  const int64_t E = static_cast<int64_t>(exported.size());
  p.batch.tokens = at::randint(vocab, {B, S}, g, at::kLong);
  p.batch.hidden = at::randn({B, S, E, hidden}, g, o);
  p.batch.loss_mask = at::ones({B, S}, at::kBool);
  p.batch.loss_mask.narrow(1, 0, 2).fill_(false);  // a short "prompt" without loss
  p.batch.lengths = at::full({B}, S, at::kLong);
  return p;
}

}  // namespace flashdraft::dflash_test

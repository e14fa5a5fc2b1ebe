// DFlash drafter (dflash_drafter.hpp): the definitions.
#include "dflash_drafter.hpp"

#include "hf_format.hpp"

#include <flashdraft/acceptance.hpp>
#include <flashdraft/rope_config.hpp>
#include <flashdraft/text.hpp>

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>

namespace flashdraft::dflash {

namespace {

// The documents of row b of a batch within its length (packed rows: Batch::documents;
// else one), and the padding after them as a document of its own when `with_padding`.
std::vector<dflash::Document> documents_of(const Batch& batch, int64_t b, int64_t length, int64_t S,
                                           bool with_padding) {
  std::vector<dflash::Document> docs;
  int64_t begin = 0;
  if (static_cast<int64_t>(batch.documents.size()) > b && !batch.documents[static_cast<size_t>(b)].empty()) {
    for (int64_t len : batch.documents[static_cast<size_t>(b)]) {
      const int64_t end = std::min(begin + len, length);
      if (end > begin) docs.push_back({begin, end});
      begin += len;
    }
  } else if (length > 0) {
    docs.push_back({0, length});
  }
  begin = docs.empty() ? 0 : docs.back().end;
  if (with_padding && begin < S) docs.push_back({begin, S});
  return docs;
}

// Each position's document start (0 outside every document).
std::vector<int64_t> document_starts(const std::vector<dflash::Document>& docs, int64_t S) {
  std::vector<int64_t> start_of(static_cast<size_t>(S), 0);
  for (const dflash::Document& d : docs)
    for (int64_t p = d.begin; p < d.end; ++p) start_of[static_cast<size_t>(p)] = d.begin;
  return start_of;
}

// Where each block's document ends (its labels stop there); `length` outside every document.
// Blocks [from, from + n) of a draw.
dflash::Anchors part_of(const dflash::Anchors& a, int64_t from, int64_t n) {
  dflash::Anchors p;
  p.anchors.assign(a.anchors.begin() + from, a.anchors.begin() + from + n);
  p.valid.assign(a.valid.begin() + from, a.valid.begin() + from + n);
  return p;
}

// Per column j, the labelled entries of drafts' labels [D, K] (-1: none).
std::vector<int64_t> position_counts(const at::Tensor& labels) {
  const at::Tensor c = labels.ge(0).sum(0).to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Validation's drafts (model.hpp): the valid blocks, row by row in block order, each the
// proposals and labels of block positions 1 .. BS-1 of predictions and labels [B, N, BS].
Drafts block_drafts(const at::Tensor& predictions, const at::Tensor& labels, const MaskBlocks& blocks) {
  std::vector<int64_t> rows, starts, picked;
  const int64_t N = predictions.size(1), BS = predictions.size(2);
  for (size_t b = 0; b < blocks.valid.size(); ++b)
    for (size_t n = 0; n < blocks.valid[b].size(); ++n)
      if (blocks.valid[b][n]) {
        rows.push_back(static_cast<int64_t>(b));
        starts.push_back(blocks.anchors[b][n]);
        picked.push_back(static_cast<int64_t>(b) * N + static_cast<int64_t>(n));
      }
  const auto opts = at::TensorOptions().dtype(at::kLong);
  const at::Tensor index = at::tensor(picked, opts);
  Drafts d;
  d.rows = at::tensor(rows, opts);
  d.starts = at::tensor(starts, opts);
  d.tokens = predictions.to(at::kCPU, at::kLong).reshape({-1, BS}).index_select(0, index).narrow(1, 1, BS - 1);
  d.labels = labels.to(at::kCPU, at::kLong).reshape({-1, BS}).index_select(0, index).narrow(1, 1, BS - 1);
  return d;
}

// Drafts of the parts of one step joined in the order of one part's: by row, each row's
// blocks part after part (a stable sort by row of the parts side by side).
Drafts join_drafts(const std::vector<Drafts>& parts) {
  std::vector<at::Tensor> rows, starts, tokens, labels;
  for (const Drafts& p : parts) {
    rows.push_back(p.rows);
    starts.push_back(p.starts);
    tokens.push_back(p.tokens);
    labels.push_back(p.labels);
  }
  const at::Tensor all_rows = at::cat(rows);
  const at::Tensor order = std::get<1>(at::sort(all_rows, std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  Drafts d;
  d.rows = all_rows.index_select(0, order);
  d.starts = at::cat(starts).index_select(0, order);
  d.tokens = at::cat(tokens).index_select(0, order);
  d.labels = at::cat(labels).index_select(0, order);
  return d;
}

std::vector<int64_t> block_ends(const dflash::Anchors& a, const std::vector<dflash::Document>& real, int64_t N,
                                int64_t length) {
  std::vector<int64_t> ends(static_cast<size_t>(N), length);
  for (int64_t n = 0; n < N; ++n)
    for (const dflash::Document& d : real)
      if (a.anchors[static_cast<size_t>(n)] >= d.begin && a.anchors[static_cast<size_t>(n)] < d.end)
        ends[static_cast<size_t>(n)] = d.end;
  return ends;
}

}  // namespace

void DFlashDrafter::declare(Schema& s) {
  s.integer("layers", "number of drafter decoder layers").def(int64_t{2}).range(1, 256);
  s.integer("hidden", "drafter width; must equal the target's hidden size (0 = the target's)")
      .def(int64_t{0})
      .range(0, 1 << 20);
  s.integer("heads", "query heads").def(int64_t{4}).range(1, 1024);
  s.integer("kv_heads", "key/value heads (GQA: heads must be a multiple)").def(int64_t{2}).range(1, 1024);
  s.integer("head_dim", "width of one head (0 = hidden / heads)").def(int64_t{0}).range(0, 1024);
  s.integer("ffn", "SwiGLU inner width (0 = 3 x hidden)").def(int64_t{0}).range(0, 1 << 22);
  s.integer("block_size", "tokens per block, anchor included (BS)").def(int64_t{16}).range(2, 4096);
  s.integer("mask_token", "token id of MASK in the target vocabulary (-1 = the last id)").def(int64_t{-1}).at_least(-1);
  s.integers("target_layer_ids",
             "target layers whose hidden states form the context; id L = the output of decoder layer L, "
             "transformers' hidden_states[L + 1] (empty = for an online target the reference's rule, one id per "
             "drafter layer spread from 1 to L - 3 (z-lab dflash build_target_layer_ids); for offline data every "
             "layer the data exports)")
      .def(std::vector<int64_t>{});
  s.real("rope_theta", "RoPE base").def(10000.0).at_least(1.0);
  declare_rope_keys(s);
  s.real("rms_eps", "RMSNorm epsilon").def(1e-6).range(0.0, 1.0);
  s.integer("anchors", "blocks per sequence (N)").def(int64_t{8}).at_least(0);
  s.integer("anchor_parts",
            "training steps in this many parts of anchors / anchor_parts blocks per sequence, each part's forward "
            "and backward before the next (the activation memory of one part; the context's keys and values are "
            "computed again per part; the same step and gradient); anchors must be a multiple")
      .def(int64_t{1})
      .range(1, 1 << 16);
  s.real("gamma",
         "loss weight decay: w_j = exp(-(j-1)/gamma) (0 = the DFlash paper's value for the block "
         "size: 7 for 16, 5 for 10, 4 for 8, linear between and beyond)")
      .def(0.0)
      .at_least(0.0);
  s.string("normalisation",
           "the loss's denominator: \"positions\" = the count of labelled block positions (vLLM speculators), "
           "\"weights\" = the sum of their weights w_j (flashdraft before 2026-12)")
      .def(std::string("positions"))
      .one_of({"positions", "weights"});
  s.string("anchor_rule",
           "where a block may start: \"response\" = on a response token followed by another (where a server "
           "drafts from; speculators' rule), \"next_token\" = before any loss-carrying token, the last prompt "
           "token included (flashdraft before 2026-12)")
      .def(std::string("response"))
      .one_of({"response", "next_token"});
  s.string("documents",
           "packed rows ([dataset] pack = true): \"separate\" = a block sees only its own conversation's context, "
           "stays inside it, and counts positions from its start, as a server decoding that conversation alone; "
           "\"joined\" = the whole row before the anchor, blocks may run into the next conversation, positions "
           "from the row's start (flashdraft before 2026-12: other conversations leak in; for comparisons only)")
      .def(std::string("separate"))
      .one_of({"separate", "joined"});
  s.string("labels",
           "what block position j is trained towards: \"data\" = the data's token at anchor + j; "
           "\"target_argmax\" = the target's greedy token there (its logits at anchor + j - 1); \"target_kl\" = "
           "the target's distribution there (KL divergence, as speculators trains). The target ones need the "
           "target's last layer: an online target, or data exporting it. \"auto\" = target_argmax where the "
           "target's last layer is there (what greedy verification accepts), else data (the console says which)")
      .def(std::string("auto"))
      .one_of({"auto", "data", "target_argmax", "target_kl"});
  s.real("label_temperature", "labels = \"target_kl\": the target's distribution is softmax(logits / this)")
      .def(1.0)
      .range(1e-3, 100.0);
  s.strings("layer_types",
            "each drafter layer's attention, as transformers' layer_types: \"full_attention\" (the context before "
            "the anchor and the block) or \"sliding_attention\" (only keys within sliding_window positions of the "
            "query, as z-lab's DFlashDraftModel masks its sliding layers; exported as layer_types / sliding_window); "
            "empty = every layer full")
      .def(std::vector<std::string>{});
  s.integer("sliding_window", "the window of the \"sliding_attention\" layers, in positions (0 = none is sliding)")
      .def(int64_t{0})
      .at_least(0);
  s.real("input_embedding_scale",
         "the block's token embeddings (the target's embedding rows, unscaled) times this, as z-lab's reference "
         "scales them (its input_embedding_scale: e.g. sqrt(hidden) for a Gemma target, whose own embedding is "
         "scaled so); exported with the folder")
      .def(1.0)
      .range(1e-6, 1e6);
  s.real("output_multiplier",
         "the drafter's logits (its final state times the target's LM head) times this, before the cap (the "
         "reference's output_multiplier: e.g. 1 / logits_scaling for a Granite target); exported with the folder")
      .def(1.0)
      .range(1e-6, 1e6);
  s.real("final_logit_softcapping",
         "> 0: the drafter's logits are cap tanh(logits / cap), in training and serving (the reference's "
         "final_logit_softcapping: e.g. a Gemma target's own); 0 = none; exported with the folder")
      .def(0.0)
      .range(0.0, 1e6);
  s.real("init_std", "standard deviation of the initial projection weights").def(0.02).at_least(0.0);
  s.string("init",
           "a Hugging Face DFlash drafter folder (config.json + model.safetensors, as `flashdraft export "
           "--format hf` writes) whose weights replace the random ones, to continue training or to validate "
           "it; its config must match this table and the target (empty = random initial weights)")
      .def(std::string());
}

DFlashDrafter::DFlashDrafter(const Config& config) : config_(config) {
  layers_n_ = config.integer("layers");
  hidden_ = config.integer("hidden");
  heads_ = config.integer("heads");
  kv_heads_ = config.integer("kv_heads");
  head_dim_ = config.integer("head_dim");
  ffn_ = config.integer("ffn");
  block_size_ = config.integer("block_size");
  mask_token_ = config.integer("mask_token");
  layer_ids_ = config.integers("target_layer_ids");
  rope_theta_ = config.real("rope_theta");
  rope_ = rope_scaling(config);
  eps_ = config.real("rms_eps");
  anchors_ = config.integer("anchors");
  gamma_ = config.real("gamma");
  if (gamma_ == 0.0) gamma_ = dflash::default_gamma(block_size_);
  init_std_ = config.real("init_std");
  by_positions_ = config.string("normalisation") == "positions";
  anchor_rule_ =
      config.string("anchor_rule") == "response" ? dflash::AnchorRule::response : dflash::AnchorRule::next_token;
  labels_config_ = labels_ = config.string("labels");
  separate_documents_ = config.string("documents") == "separate";
  label_temperature_ = config.real("label_temperature");
  input_scale_ = config.real("input_embedding_scale");
  output_multiplier_ = config.real("output_multiplier");
  softcap_ = config.real("final_logit_softcapping");
  if (anchors_ == 0)
    config.fail("anchors", "anchors = 0 leaves no block to train on; give at least 1 anchor per sequence");
  anchor_parts_ = config.integer("anchor_parts");
  if (anchors_ % anchor_parts_ != 0)
    config.fail("anchor_parts", "anchors = " + std::to_string(anchors_) + " is not a multiple of anchor_parts = " +
                                    std::to_string(anchor_parts_) + " (every part takes the same number of blocks)");
  read_layer_types(config);
  if (heads_ % kv_heads_ != 0)
    config.fail("kv_heads", "heads = " + std::to_string(heads_) +
                                " is not a multiple of kv_heads = " + std::to_string(kv_heads_) +
                                " (GQA shares each kv head among heads / kv_heads query heads)");
  if (hidden_ > 0) check_hidden(hidden_);
}

void DFlashDrafter::bind(const TargetModel& target, const RunContext& ctx, int64_t batch_size, int64_t seq_len) {
  const int64_t hidden = hidden_ > 0 ? hidden_ : target.hidden;
  if (hidden_ > 0 && hidden_ != target.hidden)
    config_.fail("hidden", "hidden = " + std::to_string(hidden_) + " differs from the target's hidden size " +
                               std::to_string(target.hidden) +
                               " (the drafter shares the target's embedding and LM head; use " +
                               std::to_string(target.hidden) + " or 0)");
  check_hidden(hidden);
  hidden_ = hidden;
  if (head_dim_ == 0) head_dim_ = hidden_ / heads_;
  if (ffn_ == 0) ffn_ = 3 * hidden_;
  if (mask_token_ == -1) mask_token_ = target.vocab - 1;
  if (mask_token_ < 0 || mask_token_ >= target.vocab)
    config_.fail("mask_token", "mask_token = " + std::to_string(mask_token_) +
                                   " is outside the target vocabulary (ids 0.." + std::to_string(target.vocab - 1) +
                                   ", or -1 for the last id)");
  if (block_size_ > seq_len)
    config_.fail("block_size", "block_size = " + std::to_string(block_size_) + " is larger than the sequence length " +
                                   std::to_string(seq_len) + " of the data (a block must fit in a sequence)");
  if (layer_ids_.empty()) layer_ids_ = default_layer_ids(target);
  target_logit_scale_ = target.logit_scale;
  target_logit_softcap_ = target.logit_softcap;
  resolve_labels(target, ctx);
  resolve_features(target);
  bind_run(target, ctx, batch_size, seq_len);  // the frozen embedding and LM head among it
  if (rope_.type != "default") inv_freq_ = rope_inv_freq(rope_theta_, head_dim_, rope_).to(device_);

  make_parameters(target, ctx);
}

// labels = "auto" resolved against what the target gives: its last layer (after the final
// norm) for labels from the target, else the data's tokens.
void DFlashDrafter::resolve_labels(const TargetModel& target, const RunContext& ctx) {
  label_index_ = -1;
  labels_ = labels_config_;
  if (labels_ != "data") {
    for (size_t e = 0; e < target.exported_layers.size(); ++e)
      if (target.exported_layers[e] == target.layers - 1) label_index_ = static_cast<int64_t>(e);
    if (labels_ == "auto") {
      labels_ = label_index_ >= 0 ? "target_argmax" : "data";
      if (ctx.say)
        ctx.say("dflash: labels = \"" + labels_ + "\" (auto: " +
                (label_index_ >= 0 ? "the target's last layer " + std::to_string(target.layers - 1) +
                                         " is there, so blocks learn the target's own greedy tokens"
                                   : "the data does not export the target's last layer " +
                                         std::to_string(target.layers - 1) + ", so blocks learn the data's tokens") +
                ")");
    }
    if (labels_ != "data" && label_index_ < 0)
      config_.fail("labels", "labels = \"" + labels_ + "\" needs the target's logits, from its last layer " +
                                 std::to_string(target.layers - 1) + " (after its final norm), which the data " +
                                 "does not export (it exports " + list_str(target.exported_layers) +
                                 "); give an online [target], export that layer, or use labels = \"data\"");
  }
}

// The entry of each configured target layer among the layers the data exports.
void DFlashDrafter::resolve_features(const TargetModel& target) {
  feature_index_.clear();
  for (int64_t id : layer_ids_) {
    int64_t found = -1;
    for (size_t e = 0; e < target.exported_layers.size(); ++e)
      if (target.exported_layers[e] == id) found = static_cast<int64_t>(e);
    if (found < 0)
      config_.fail("target_layer_ids",
                   "target layer " + std::to_string(id) + " is not among the layers the data exports " +
                       list_str(target.exported_layers) + " (target has " + std::to_string(target.layers) + " layers)");
    feature_index_.push_back(found);
  }
}

// The drafter's weights, named as the Hugging Face folder names them.
void DFlashDrafter::make_parameters(const TargetModel& target, const RunContext& ctx) {
  // Initial weights from a generator of our own (seeded by the run): same seed, same
  // drafter, whatever else drew from the global generator.
  params_.clear();
  ParamMaker make(params_, ctx.seed, 0xdf1a5, device_, dtype_, init_std_);
  const int64_t features = static_cast<int64_t>(feature_index_.size()) * target.hidden;
  fc_ = make.linear("fc.weight", hidden_, features);
  hidden_norm_ = make.norm("hidden_norm.weight", hidden_);
  layers_.clear();
  for (int64_t l = 0; l < layers_n_; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Layer L;
    L.input_norm = make.norm(p + "input_layernorm.weight", hidden_);
    layers::SelfAttention& A = L.attn;
    A.q_proj = make.linear(p + "self_attn.q_proj.weight", heads_ * head_dim_, hidden_);
    A.k_proj = make.linear(p + "self_attn.k_proj.weight", kv_heads_ * head_dim_, hidden_);
    A.v_proj = make.linear(p + "self_attn.v_proj.weight", kv_heads_ * head_dim_, hidden_);
    A.o_proj = make.linear(p + "self_attn.o_proj.weight", hidden_, heads_ * head_dim_);
    A.q_norm = make.norm(p + "self_attn.q_norm.weight", head_dim_);
    A.k_norm = make.norm(p + "self_attn.k_norm.weight", head_dim_);
    A.heads = heads_;
    A.kv_heads = kv_heads_;
    A.head_dim = head_dim_;
    A.eps = eps_;
    L.post_norm = make.norm(p + "post_attention_layernorm.weight", hidden_);
    L.mlp.gate_proj = make.linear(p + "mlp.gate_proj.weight", ffn_, hidden_);
    L.mlp.up_proj = make.linear(p + "mlp.up_proj.weight", ffn_, hidden_);
    L.mlp.down_proj = make.linear(p + "mlp.down_proj.weight", hidden_, ffn_);
    layers_.push_back(L);
  }
  final_norm_ = make.norm("norm.weight", hidden_);
  make_more_parameters(make);
}

// Block position j = 1..BS-1 (position 0 is the given token).
std::vector<std::string> DFlashDrafter::position_names() const {
  std::vector<std::string> names;
  for (int64_t j = 1; j < block_size_; ++j) names.push_back("position " + std::to_string(j));
  return names;
}

std::vector<int64_t> DFlashDrafter::target_layers(const TargetModel& target) const {
  std::vector<int64_t> ids = layer_ids_.empty() ? default_layer_ids(target) : layer_ids_;
  // An online target computes any layer: labels from it (or "auto") ask for its last one too.
  const bool wants = labels_config_ != "data" && (labels_config_ != "auto" || target.online);
  if (wants && std::find(ids.begin(), ids.end(), target.layers - 1) == ids.end()) ids.push_back(target.layers - 1);
  return ids;
}

AttentionProblem DFlashDrafter::attention_problem() const {
  const int64_t L = part_anchors() * block_size_;
  return AttentionProblem::of(device_, dtype_, batch_, heads_, kv_heads_, L, seq_len_ + L, head_dim_,
                              /*needs_backward=*/true, "dflash");
}

const DrafterFormat* DFlashDrafter::format() const {
  static const hf_drafter::Format hf;
  return &hf;
}

std::vector<AttentionProblem> DFlashDrafter::decoder_problems(int64_t batch, int64_t capacity) const {
  AttentionProblem p = attention_problem();
  p.batch = batch;
  p.q_len = block_size_;
  p.kv_len = capacity + block_size_;
  p.needs_backward = false;
  return std::vector<AttentionProblem>(static_cast<size_t>(layers_n_), p);
}

// Per layer, keys and values [B, kv_heads, capacity + BS, D]: the context's at their
// positions (written by extend(), after k_norm and RoPE as in training), the proposal
// block's in the last BS slots (rewritten by every propose()).
class DFlashDrafter::Decoder final : public DraftDecoder {
 public:
  Decoder(const DFlashDrafter& d, int64_t batch, int64_t capacity, AttentionContext& attention)
      : d_(d), batch_(batch), capacity_(capacity), attention_(attention) {
    const auto opts = at::TensorOptions().dtype(d.dtype_).device(d.device_);
    for (int64_t l = 0; l < d.layers_n_; ++l) {
      k_.push_back(at::zeros({batch, d.kv_heads_, capacity + d.block_size_, d.head_dim_}, opts));
      v_.push_back(at::zeros({batch, d.kv_heads_, capacity + d.block_size_, d.head_dim_}, opts));
    }
  }

  void extend(const at::Tensor& tokens, const at::Tensor& features, const std::vector<int64_t>& start,
              const std::vector<int64_t>& count) override {
    (void)tokens;  // the context is the target's hidden states alone
    at::NoGradGuard frozen;
    const int64_t B = features.size(0), T = features.size(1);
    check_rows(B, start, T, "extend");
    (void)count;  // entries past a row's count land at positions it has not reached: never read
    const auto long_opts = at::TensorOptions().dtype(at::kLong);
    const at::Tensor index = at::tensor(d_.feature_index_, long_opts).to(features.device());
    const at::Tensor feats = features.index_select(2, index).reshape({B, T, -1}).to(d_.device_, d_.dtype_);
    const at::Tensor context = d_.rms_norm(at::linear(feats, d_.fc_), d_.hidden_norm_);
    const at::Tensor positions = positions_of(start, T);
    const auto [cos, sin] = d_.rope_tables(positions);
    const at::Tensor slot = positions.view({B, 1, T, 1}).expand({B, d_.kv_heads_, T, d_.head_dim_});
    for (int64_t l = 0; l < d_.layers_n_; ++l) {
      const layers::SelfAttention& A = d_.layers_[static_cast<size_t>(l)].attn;
      k_[static_cast<size_t>(l)].scatter_(2, slot, A.keys(context, cos, sin));
      v_[static_cast<size_t>(l)].scatter_(2, slot, A.values(context));
    }
  }

  DraftProposal propose(const DraftRequest& r) override {
    at::NoGradGuard frozen;
    const int64_t B = batch_, BS = d_.block_size_;
    check_rows(static_cast<int64_t>(r.count.size()), r.start, BS, "propose");
    int64_t K = 0;
    for (int64_t c : r.count) K = std::max(K, c);
    MaskInput mask;
    mask.batch = B;
    mask.q_len = BS;
    mask.kv_len = capacity_ + BS;
    mask.blocks.context_len = capacity_;
    mask.blocks.block_size = BS;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t c = r.count[static_cast<size_t>(b)];
      if (c < 0 || c > BS - 1)
        throw std::invalid_argument("dflash decoder: " + std::to_string(c) + " proposals asked of row " +
                                    std::to_string(b) + "; a block of " + std::to_string(BS) + " proposes 0.." +
                                    std::to_string(BS - 1));
      mask.blocks.anchors.push_back({r.start[static_cast<size_t>(b)]});
      mask.blocks.valid.push_back({static_cast<uint8_t>(c > 0)});
      mask.blocks.lengths.push_back({c + 1});
    }
    DraftProposal out;
    if (K == 0) {
      out.tokens = at::zeros({B, 0}, at::TensorOptions().dtype(at::kLong).device(d_.device_));
      return out;
    }
    int64_t window = -1;  // the mask set: per layer, its window (mask_for_layer)
    // The block: the known token, then MASK.
    at::Tensor tokens = at::full({B, BS}, d_.mask_token_, at::TensorOptions().dtype(at::kLong).device(d_.device_));
    tokens.select(1, 0).copy_(r.last.to(d_.device_, at::kLong));
    const at::Tensor positions = positions_of(r.start, BS);
    const std::pair<at::Tensor, at::Tensor> tables = d_.rope_tables(positions);
    const at::Tensor &cos = tables.first, &sin = tables.second;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d_.head_dim_));
    at::Tensor x = d_.embed(tokens);
    for (int64_t l = 0; l < d_.layers_n_; ++l) {
      const layers::SelfAttention& A = d_.layers_[static_cast<size_t>(l)].attn;
      mask_for_layer(attention_, mask, d_.windows_[static_cast<size_t>(l)], window);
      x = d_.layer(l, x, [&](const at::Tensor& h) {
        const at::Tensor q = A.queries(h, cos, sin);
        at::Tensor& k = k_[static_cast<size_t>(l)];
        at::Tensor& v = v_[static_cast<size_t>(l)];
        k.narrow(2, capacity_, BS).copy_(A.keys(h, cos, sin));
        v.narrow(2, capacity_, BS).copy_(A.values(h));
        return A.output(attention_.attention(l, q.contiguous(), k, v, scale));
      });
    }
    // Positions 1..K of the block: the proposals for start + 1 .. start + K.
    out = d_.choose(d_.rms_norm(x.narrow(1, 1, K), d_.final_norm_), tokens.select(1, 0), r.sampling);
    return out;
  }

 private:
  void check_rows(int64_t rows, const std::vector<int64_t>& start, int64_t T, const char* call) const {
    if (rows != batch_ || static_cast<int64_t>(start.size()) != batch_)
      throw std::invalid_argument(std::string("dflash decoder ") + call + ": " + std::to_string(rows) + " rows and " +
                                  std::to_string(start.size()) + " start positions for a decoder of " +
                                  std::to_string(batch_) + " rows");
    for (int64_t b = 0; b < batch_; ++b)
      if (start[static_cast<size_t>(b)] < 0 || start[static_cast<size_t>(b)] + T > capacity_)
        throw std::invalid_argument(std::string("dflash decoder ") + call + ": row " + std::to_string(b) +
                                    " at positions " + std::to_string(start[static_cast<size_t>(b)]) + ".." +
                                    std::to_string(start[static_cast<size_t>(b)] + T - 1) + ", outside its cache of " +
                                    std::to_string(capacity_) + " positions");
  }
  at::Tensor positions_of(const std::vector<int64_t>& start, int64_t T) const {
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(d_.device_);
    return at::tensor(start, at::TensorOptions().dtype(at::kLong)).to(d_.device_).unsqueeze(1) +
           at::arange(T, long_opts);
  }
  const DFlashDrafter& d_;
  int64_t batch_, capacity_;
  AttentionContext& attention_;
  std::vector<at::Tensor> k_, v_;
};

std::unique_ptr<DraftDecoder> DFlashDrafter::decoder(int64_t batch, int64_t capacity, AttentionContext& attention) {
  return std::make_unique<Decoder>(*this, batch, capacity, attention);
}

// The host side of a step: anchors, the mask's input, the block tokens and positions,
// and the rows that carry loss (label >= 0) with their labels, weights and positions.
struct DFlashDrafter::StepPlan {
  MaskInput input;
  at::Tensor block_tokens, block_pos;        // [B, L] int64 (tokens on the device); positions in the document
  at::Tensor context_pos;                    // [B, S] int64 positions in the document; undefined: 0..S-1
  at::Tensor labels;                         // [B, L] int64 on the host (the data's tokens)
  at::Tensor rows, row_labels, row_weights;  // [R] on the device: flat index into B*L, label, weight
  at::Tensor row_position;                   // [R] int64 on the device: block position j
  at::Tensor target_positions;               // [U] int64 on the device: flat b * S + p of every position whose
                                             // target logits predict a row's token (p = anchor + j - 1), once
  at::Tensor row_target;                     // [R] int64 on the device: row r's entry in target_positions
  at::Tensor row_previous;                   // [R] int64 on the device: the data's token at anchor + j - 1
  std::vector<int64_t> position_count;       // per j in 0..BS-1: rows that carry loss
  double weight_sum = 0;
  int64_t counted = 0;  // rows that carry loss

  // B rows of S tokens, L = blocks x BS block tokens per row.
  StepPlan(int64_t B, int64_t S, int64_t L, int64_t BS) : position_count(static_cast<size_t>(BS), 0) {
    input.batch = B;
    input.q_len = L;
    input.kv_len = S + L;
    input.blocks.context_len = S;
    input.blocks.block_size = BS;
  }
};

StepResult DFlashDrafter::step(const Batch& batch, DrafterContext& context, at::Generator& rng, bool training) {
  std::optional<at::NoGradGuard> no_grad;
  if (!training) no_grad.emplace();
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
  if (batch.hidden.dim() != 4 || batch.hidden.size(0) != B || batch.hidden.size(1) != S)
    throw std::invalid_argument("batch hidden states must be [B, S, E, H] = [" + std::to_string(B) + ", " +
                                std::to_string(S) + ", E, H]");
  if (block_size_ > S)
    throw std::invalid_argument("block_size " + std::to_string(block_size_) +
                                " is larger than the batch's sequence length " + std::to_string(S));
  if (!training && anchor_parts_ > 1) return validate_in_parts(batch, context, rng);
  return step_part(batch, context, rng, training, training ? batch.part : 0);
}

StepResult DFlashDrafter::step_part(const Batch& batch, DrafterContext& context, at::Generator& rng, bool training,
                                    int64_t part) const {
  if (part < 0 || part >= anchor_parts_)
    throw std::invalid_argument("batch.part " + std::to_string(part) + " is not one of this drafter's " +
                                std::to_string(anchor_parts_) + " parts");
  const StepPlan plan = plan_step(batch, rng, part);
  const at::Tensor x = decoder(batch, plan, context, training);
  StepResult r = loss_and_metrics(batch, x, plan, context, training);
  if (training && anchor_parts_ > 1 && part + 1 == anchor_parts_) r.more_roots = take_shared_roots();
  return r;
}

// Every part from the same anchor draw (the generator's state before the first), the
// results joined: blocks side by side, the loss weighted by each part's loss weight, the
// position accuracies by each part's counted rows.
StepResult DFlashDrafter::validate_in_parts(const Batch& batch, DrafterContext& context, at::Generator& rng) const {
  const at::Generator start = rng.clone();
  StepResult all;
  std::vector<Drafts> drafts;
  std::vector<double> hits, scalar_sums;
  double loss_sum = 0;
  all.loss_weight = 0;
  for (int64_t p = 0; p < anchor_parts_; ++p) {
    at::Generator g = start.clone();
    StepResult r = step_part(batch, context, g, /*training=*/false, p);
    if (p + 1 == anchor_parts_) rng.set_state(g.get_state());
    loss_sum += r.loss.item<double>() * r.loss_weight;
    all.loss_weight += r.loss_weight;
    drafts.push_back(r.drafts);
    hits.resize(r.position_accuracy.size(), 0.0);
    // Each position's counted rows: the part's accuracy times its count, summed exactly below.
    const std::vector<int64_t> counts = position_counts(r.drafts.labels);
    for (size_t j = 0; j < hits.size(); ++j) hits[j] += r.position_accuracy[j] * double(counts[j]);
    scalar_sums.resize(r.scalars.size(), 0.0);
    for (size_t k = 0; k < r.scalars.size(); ++k) scalar_sums[k] += r.scalars[k].second * double(r.tokens);
    all.tokens += r.tokens;
    all.scalars = r.scalars;
  }
  all.loss = at::scalar_tensor(all.loss_weight > 0 ? loss_sum / all.loss_weight : 0.0, at::kFloat);
  all.drafts = join_drafts(drafts);
  const std::vector<int64_t> counts = position_counts(all.drafts.labels);
  for (size_t j = 0; j < hits.size(); ++j)
    all.position_accuracy.push_back(counts[j] > 0 ? hits[j] / double(counts[j]) : 0.0);
  for (size_t k = 0; k < all.scalars.size(); ++k)
    all.scalars[k].second = all.tokens > 0 ? scalar_sums[k] / double(all.tokens) : 0.0;
  if (!all.scalars.empty() && all.scalars[0].first == "tau_sim")
    all.scalars[0].second = simulated_tau(all.position_accuracy);
  return all;
}

// Host tensor -> the run's device without waiting for the device's queue.
at::Tensor DFlashDrafter::to_device(const at::Tensor& t) const {
  return device_.is_cuda() ? t.pin_memory().to(device_, /*non_blocking=*/true) : t;
}

DFlashDrafter::StepPlan DFlashDrafter::plan_step(const Batch& batch, at::Generator& rng, int64_t part) const {
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1), N = part_anchors(), BS = block_size_, L = N * BS;
  const at::Tensor tokens_cpu = batch.tokens.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor mask_cpu =
      batch.loss_mask.defined() ? batch.loss_mask.to(at::kCPU, at::kByte).contiguous() : at::Tensor();
  const at::Tensor len_cpu =
      batch.lengths.defined() ? batch.lengths.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
  const bool packed = !batch.documents.empty() && separate_documents_;
  StepPlan plan(B, S, L, BS);
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor block_tokens = at::full({B * L}, mask_token_, long_opts), positions = at::empty({B * L}, long_opts);
  at::Tensor context_pos = packed ? at::empty({B, S}, long_opts) : at::Tensor();
  plan.labels = at::empty({B * L}, long_opts);
  int64_t* tok_out = block_tokens.data_ptr<int64_t>();
  int64_t* pos_out = positions.data_ptr<int64_t>();
  int64_t* lab_out = plan.labels.data_ptr<int64_t>();
  std::vector<int64_t> rows, row_labels, row_position, row_source, row_previous;
  const bool previous = wants_previous_tokens();
  std::vector<float> row_weights;
  auto draw = [&](int64_t k) { return at::randint(k, {1}, rng, at::kLong).item<int64_t>(); };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* tok = tokens_cpu.data_ptr<int64_t>() + b * S;
    const uint8_t* lm = mask_cpu.defined() ? mask_cpu.data_ptr<uint8_t>() + b * S : nullptr;
    const int64_t length = len_cpu.defined() ? std::min(len_cpu.data_ptr<int64_t>()[b], S) : S;
    const std::vector<dflash::Document> docs =
        packed ? documents_of(batch, b, length, S, true) : std::vector<dflash::Document>{{0, length}};
    // Each position's document start (packed rows: positions count from it, as a server
    // decoding that conversation alone counts them).
    const std::vector<int64_t> start_of = document_starts(docs, S);
    if (packed) {
      for (int64_t p = 0; p < S; ++p) context_pos[b][p] = p - start_of[static_cast<size_t>(p)];
      std::vector<int64_t> lengths;
      for (const dflash::Document& d : docs) lengths.push_back(d.end - d.begin);
      plan.input.doc_lengths.push_back(lengths);
    }
    std::vector<dflash::Document> real = docs;
    if (packed && !real.empty() && real.back().begin >= length) real.pop_back();  // the padding
    // Every part draws the row's anchors_ anchors alike (the same stream) and keeps its share.
    dflash::Anchors a = dflash::draw_anchors(dflash::anchor_candidates(real, BS, lm, anchor_rule_), anchors_, draw);
    if (anchor_parts_ > 1) a = part_of(a, part * N, N);
    dflash::BlockLabels bl = dflash::block_labels(tok, lm, block_ends(a, real, N, length), a, BS, gamma_);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t anchor = a.anchors[static_cast<size_t>(n)];
      const int64_t origin = start_of[static_cast<size_t>(std::min(anchor, S - 1))];
      for (int64_t j = 0; j < BS; ++j) {
        const int64_t slot = b * L + n * BS + j, k = n * BS + j;
        pos_out[slot] = anchor - origin + j;
        if (j == 0) tok_out[slot] = tok[std::min(anchor, S - 1)];
        lab_out[slot] = bl.labels[static_cast<size_t>(k)];
        if (lab_out[slot] < 0) continue;
        rows.push_back(slot);
        row_labels.push_back(lab_out[slot]);
        row_weights.push_back(static_cast<float>(bl.weights[static_cast<size_t>(k)]));
        row_position.push_back(j);
        row_source.push_back(b * S + anchor + j - 1);
        if (previous) row_previous.push_back(tok[anchor + j - 1]);
        plan.weight_sum += bl.weights[static_cast<size_t>(k)];
        ++plan.position_count[static_cast<size_t>(j)];
        ++plan.counted;
      }
    }
    plan.input.blocks.anchors.push_back(a.anchors);
    plan.input.blocks.valid.push_back(a.valid);
  }
  plan.block_tokens = to_device(block_tokens.view({B, L}));
  plan.block_pos = positions.view({B, L});
  if (packed) plan.context_pos = to_device(context_pos);
  plan.labels = plan.labels.view({B, L});
  plan.rows = to_device(at::tensor(rows, long_opts));
  plan.row_labels = to_device(at::tensor(row_labels, long_opts));
  plan.row_weights = to_device(at::tensor(row_weights, at::TensorOptions().dtype(at::kFloat)));
  plan.row_position = to_device(at::tensor(row_position, long_opts));
  if (previous) plan.row_previous = to_device(at::tensor(row_previous, long_opts));
  if (labels_ != "data") index_target_positions(plan, row_source);
  return plan;
}

// Labels from the target: blocks overlap, so the target's logits are needed once per
// position (plan.target_positions), not once per row (plan.row_target indexes them).
void DFlashDrafter::index_target_positions(StepPlan& plan, const std::vector<int64_t>& row_source) const {
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  std::vector<int64_t> unique = row_source;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  std::vector<int64_t> entry(row_source.size());
  for (size_t r = 0; r < row_source.size(); ++r)
    entry[r] = std::lower_bound(unique.begin(), unique.end(), row_source[r]) - unique.begin();
  plan.target_positions = to_device(at::tensor(unique, long_opts));
  plan.row_target = to_device(at::tensor(entry, long_opts));
}

// The context features and the decoder layers: the block tokens' final states [B, L, H].
at::Tensor DFlashDrafter::decoder(const Batch& batch, const StepPlan& plan, AttentionContext& attention,
                                  bool training) const {
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  // The context features (fc over the target's states): for every part, or only for part 0
  // of a training step in parts, whose later parts share its keys and values (context_kv).
  const bool shared = training && anchor_parts_ > 1;
  at::Tensor context;
  if (!shared || batch.part == 0) {
    // The layers read: consecutive exported ones (every one, or all but the last that labels
    // from the target add) are a view of the batch's states, rows of E x H with the n x H
    // read contiguous (no copy of [B, S, E, H] for fc's backward to hold); others are gathered.
    const int64_t first = feature_index_.front(), n = static_cast<int64_t>(feature_index_.size());
    bool run = true;
    for (int64_t e = 0; e < n; ++e) run = run && feature_index_[static_cast<size_t>(e)] == first + e;
    const at::Tensor index = run ? at::Tensor() : at::tensor(feature_index_, long_opts);
    const at::Tensor picked = run ? batch.hidden.narrow(2, first, n)
                                  : batch.hidden.index_select(2, batch.hidden.is_cuda() ? to_device(index) : index);
    const at::Tensor feats = picked.reshape({B, S, -1}).to(device_, dtype_);
    context = rms_norm(at::linear(feats, fc_), hidden_norm_);
  }
  const std::pair<at::Tensor, at::Tensor> packed_rope =
      plan.context_pos.defined() ? rope_tables(plan.context_pos) : std::pair<at::Tensor, at::Tensor>();
  const std::pair<at::Tensor, at::Tensor>& rope_c = plan.context_pos.defined() ? packed_rope : context_rope(B, S);
  const at::Tensor &cos_c = rope_c.first, &sin_c = rope_c.second;
  const std::pair<at::Tensor, at::Tensor> rope_b = rope_tables(to_device(plan.block_pos));
  const at::Tensor &cos_b = rope_b.first, &sin_b = rope_b.second;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  at::Tensor x = embed(plan.block_tokens);
  MaskInput mask = plan.input;
  int64_t window = -1;  // the mask set: per layer, its window (mask_for_layer)
  for (int64_t l = 0; l < layers_n_; ++l) {
    const layers::SelfAttention& A = layers_[static_cast<size_t>(l)].attn;
    mask_for_layer(attention, mask, windows_[static_cast<size_t>(l)], window);
    x = layer(l, x, [&](const at::Tensor& h) {
      const at::Tensor q = A.queries(h, cos_b, sin_b);
      const auto [kc, vc] = context_kv(l, context, cos_c, sin_c, batch, shared);
      const at::Tensor k = at::cat({kc, A.keys(h, cos_b, sin_b)}, 2);  // context first
      const at::Tensor v = at::cat({vc, A.values(h)}, 2);              // [B, Hkv, S + L, D]
      return A.output(attention.attention(l, q.contiguous(), k.contiguous(), v.contiguous(), scale));
    });
  }
  return x;
}

std::pair<at::Tensor, at::Tensor> DFlashDrafter::context_kv(int64_t l, const at::Tensor& context,
                                                            const at::Tensor& cos_c, const at::Tensor& sin_c,
                                                            const Batch& batch, bool shared) const {
  const layers::SelfAttention& A = layers_[static_cast<size_t>(l)].attn;
  if (!shared) return {A.keys(context, cos_c, sin_c), A.values(context)};
  const size_t i = static_cast<size_t>(l);
  SharedContext& s = shared_;
  if (batch.part == 0) {
    if (l == 0) s = SharedContext{batch.tokens.data_ptr(), {}, {}, {}, {}};
    s.real_k.push_back(A.keys(context, cos_c, sin_c));
    s.real_v.push_back(A.values(context));
    s.leaf_k.push_back(s.real_k.back().detach().requires_grad_());
    s.leaf_v.push_back(s.real_v.back().detach().requires_grad_());
  } else if (s.tokens != batch.tokens.data_ptr() || s.real_k.size() <= i) {
    throw std::logic_error("dflash: part " + std::to_string(batch.part) +
                           " of a step in parts came without part 0 of "
                           "its batch (the parts of a step run in order on one batch)");
  }
  if (batch.part + 1 == anchor_parts_) return {s.real_k[i], s.real_v[i]};
  return {s.leaf_k[i], s.leaf_v[i]};
}

// The last part's: the real keys and values with the gradients the earlier parts gathered in
// their copies; the shared state is released (the result holds what the backward needs).
std::vector<std::pair<at::Tensor, at::Tensor>> DFlashDrafter::take_shared_roots() const {
  std::vector<std::pair<at::Tensor, at::Tensor>> roots;
  SharedContext& s = shared_;
  for (size_t i = 0; i < s.real_k.size(); ++i) {
    if (s.leaf_k[i].grad().defined()) roots.emplace_back(s.real_k[i], s.leaf_k[i].grad());
    if (s.leaf_v[i].grad().defined()) roots.emplace_back(s.real_v[i], s.leaf_v[i].grad());
  }
  shared_ = SharedContext{};
  return roots;
}

// The loss through the engine's LM-head op over the rows that carry one (position 0
// and unlabelled rows never reach the LM head), and the metrics: per position j,
// argmax == label over the counted rows (0 when a position has none).
// Labels from the target (labels = "target_argmax" / "target_kl"): row r's label comes from
// the target's logits at position anchor + j - 1 (its prediction of the token at anchor + j,
// as speculators aligns them), computed inside the loss op from the target's final-normed
// last-layer states at those positions, never as a [rows, vocab] tensor here.
StepResult DFlashDrafter::loss_and_metrics(const Batch& batch, const at::Tensor& x, const StepPlan& plan,
                                           LossContext& loss, bool training) const {
  const int64_t B = x.size(0), L = x.size(1), N = part_anchors(), BS = block_size_;
  const at::Tensor final_states = rms_norm(x, final_norm_).view({B * L, hidden_});
  StepResult result;
  // Always through the op, also with no labelled row (a zero loss): every step runs the
  // same ops, so data-parallel ranks agree on what ran.
  LmHeadLossInput in;
  in.hidden = final_states.index_select(0, plan.rows);
  in.weight = target_head_;
  in.labels = plan.row_labels;
  in.row_weights = plan.row_weights;
  in.weight_sum = by_positions_ ? double(plan.counted) : plan.weight_sum;
  in.top_k = loss_top_k();
  in.logit_scale = output_multiplier_;
  in.logit_softcap = softcap_;
  in.target_logit_scale = target_logit_scale_;
  in.target_logit_softcap = target_logit_softcap_;
  if (labels_ != "data") {
    const int64_t S = batch.hidden.size(1);
    const at::Tensor last = batch.hidden.select(2, label_index_).reshape({B * S, hidden_});
    in.target_hidden = last.index_select(0, plan.target_positions.to(last.device())).to(device_, dtype_);
    in.target_index = plan.row_target;
    in.target_soft = labels_ == "target_kl";
    in.target_temperature = label_temperature_;
  }
  const LmHeadLossOutput out = loss.lm_head_loss(in);
  // Accuracy against what the drafter is trained towards (the target's argmax when the
  // labels come from the target).
  const at::Tensor wanted = out.target_argmax.defined() ? out.target_argmax : plan.row_labels;
  const LossExtra extra = extra_loss(LossRows{in, out, wanted, plan.row_previous}, training);
  result.loss = extra.loss.defined() ? out.loss + extra.loss : out.loss;
  result.loss_weight = in.weight_sum;
  const at::Tensor chosen = extra.chosen.defined() ? extra.chosen : out.argmax;
  const at::Tensor hits =
      at::zeros({BS}, plan.rows.options()).index_add_(0, plan.row_position, chosen.eq(wanted).to(at::kLong));
  if (!training) {
    // Validation: the valid blocks as drafts, so the engine can measure the exact greedy
    // acceptance length (rows without a label keep -1: they end a draft anyway).
    const at::Tensor predictions =
        at::full({B * L}, -1, plan.rows.options()).index_copy_(0, plan.rows, chosen).view({B, N, BS});
    result.drafts = block_drafts(predictions, plan.labels.view({B, N, BS}), plan.input.blocks);
  }
  const std::vector<int64_t> count = plan.position_count;
  const std::vector<std::pair<std::string, at::Tensor>> scalars = extra.scalars;
  auto fill = [hits, count, BS, scalars](StepResult& r) {
    const at::Tensor h = hits.to(at::kCPU);
    r.position_accuracy.clear();
    r.tokens = 0;
    for (int64_t j = 1; j < BS; ++j) {
      const int64_t c = count[static_cast<size_t>(j)];
      r.position_accuracy.push_back(c > 0 ? double(h[j].item<int64_t>()) / double(c) : 0.0);
      r.tokens += c;
    }
    r.scalars = {{"tau_sim", simulated_tau(r.position_accuracy)}};
    for (const auto& [name, value] : scalars) r.scalars.emplace_back(name, value.item<double>());
  };
  // On CUDA the metrics are read after the backward has been queued (see StepResult).
  if (training && device_.is_cuda())
    result.deferred = fill;
  else
    fill(result);
  return result;
}

// An online target: the reference's rule (one id per drafter layer from 1 to L - 3, kept
// inside the target); offline data: every layer it exports.
std::vector<int64_t> DFlashDrafter::default_layer_ids(const TargetModel& target) const {
  if (!target.online) return target.exported_layers;
  std::vector<int64_t> ids = dflash::reference_layer_ids(target.layers, layers_n_);
  for (int64_t& id : ids) id = std::max<int64_t>(0, std::min(id, target.layers - 1));
  return ids;
}

void DFlashDrafter::read_layer_types(const Config& config) {
  const std::vector<std::string> types = config.strings("layer_types");
  const int64_t window = config.integer("sliding_window");
  windows_.assign(static_cast<size_t>(layers_n_), 0);
  if (types.empty()) {
    if (window > 0)
      config.fail("sliding_window", "sliding_window = " + std::to_string(window) +
                                        " but no layer is \"sliding_attention\" (give layer_types, or 0)");
    return;
  }
  if (static_cast<int64_t>(types.size()) != layers_n_)
    config.fail("layer_types", std::to_string(types.size()) + " layer types for layers = " + std::to_string(layers_n_) +
                                   " (give one per drafter layer)");
  for (size_t l = 0; l < types.size(); ++l) {
    if (types[l] != "full_attention" && types[l] != "sliding_attention")
      config.fail("layer_types", "entry " + std::to_string(l) + " is \"" + types[l] +
                                     "\"; accepted: \"full_attention\", \"sliding_attention\"");
    if (types[l] == "sliding_attention") {
      if (window < 1)
        config.fail("sliding_window", "layer " + std::to_string(l) +
                                          " is \"sliding_attention\" but sliding_window = 0 (give its window, >= 1)");
      windows_[l] = window;
    }
  }
}

void DFlashDrafter::mask_for_layer(AttentionContext& attention, MaskInput& mask, int64_t window, int64_t& current) {
  if (window == current) return;
  mask.window = window;
  attention.set_mask(mask);
  current = window;
}

void DFlashDrafter::check_hidden(int64_t hidden) const {
  if (hidden % heads_ != 0)
    config_.fail(config_.given("hidden") ? "hidden" : "heads",
                 "hidden size " + std::to_string(hidden) + " is not divisible by heads = " + std::to_string(heads_) +
                     " (accepted: a number of heads that divides the hidden size)");
}

at::Tensor DFlashDrafter::mlp(int64_t l, const at::Tensor& h) const { return layers_[static_cast<size_t>(l)].mlp(h); }

at::Tensor DFlashDrafter::layer(int64_t l, const at::Tensor& x, const Attend& attend) const {
  const Layer& P = layers_[static_cast<size_t>(l)];
  const at::Tensor y = x + attend(rms_norm(x, P.input_norm));
  return y + mlp(l, rms_norm(y, P.post_norm));
}

at::Tensor DFlashDrafter::embed(const at::Tensor& tokens) const {
  std::vector<int64_t> shape(tokens.sizes().begin(), tokens.sizes().end());
  shape.push_back(embedding_.size(1));
  const at::Tensor x = embedding_.index_select(0, tokens.reshape({-1})).view(shape);
  return input_scale_ == 1.0 ? x : x * input_scale_;
}

DraftProposal DFlashDrafter::choose(const at::Tensor& states, const at::Tensor& last, const Sampling& sampling) const {
  (void)last;
  const at::Tensor logits = served_logits(at::linear(states, target_head_), output_multiplier_, softcap_);
  DraftProposal out;
  if (sampling.greedy()) {
    out.tokens = logits.argmax(-1);
  } else {
    out.probs = sampling_probs(logits, sampling.temperature, sampling.top_p);
    out.tokens = sample_tokens(out.probs, sampling.generator);
  }
  return out;
}

at::Tensor DFlashDrafter::rms_norm(const at::Tensor& x, const at::Tensor& w) const {
  return layers::rms_norm(x, w, eps_);
}

// cos/sin of the RoPE angles of `pos` [B, T] as [B, 1, T, D] (broadcast over heads),
// made where `pos` lives (the run's device: no table crosses the bus).
std::pair<at::Tensor, at::Tensor> DFlashDrafter::rope_tables(const at::Tensor& pos) const {
  auto [cos, sin] = rope_.type == "default" ? flashdraft::rope_tables(pos, rope_theta_, head_dim_, dtype_)
                                            : flashdraft::rope_tables(pos, inv_freq_, rope_attention_factor(), dtype_);
  return {cos.unsqueeze(1), sin.unsqueeze(1)};
}

// The context's tables (positions 0..S-1 in every sequence): the same every step, made
// once per shape.
const std::pair<at::Tensor, at::Tensor>& DFlashDrafter::context_rope(int64_t B, int64_t S) const {
  if (!context_rope_.first.defined() || context_rope_.first.size(0) != B || context_rope_.first.size(2) != S) {
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
    context_rope_ = rope_tables(at::arange(S, long_opts).unsqueeze(0).expand({B, S}));
  }
  return context_rope_;
}

}  // namespace flashdraft::dflash

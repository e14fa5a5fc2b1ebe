// A DFlash drafter as a Hugging Face folder (the dflash plugin's serving format): config.json + model.safetensors in
// the layout the public DFlash reference (z-lab/dflash, dflash/model.py: DFlashDraftModel) and the serving engines that
// load DFlash drafters read. Export writes it; import reads one back into the experiment's drafter after checking that
// it is the same drafter.
//
// config.json (what each key means to a reader of the layout):
//   architectures ["DFlashDraftModel"], model_type "qwen3" (the drafter's layers are Qwen3
//   decoder layers: q/k RMSNorm per head, SwiGLU; the reference builds its config as a
//   Qwen3Config), hidden_size, intermediate_size, num_hidden_layers (drafter layers),
//   num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta (and
//   rope_parameters, the transformers 5 spelling), vocab_size (the target's),
//   num_target_layers, block_size, torch_dtype (and dtype), attention_bias false,
//   tie_word_embeddings false, dflash_config {mask_token_id, target_layer_ids, block_size},
//   is_causal (true when the drafter was trained with [mask] in_block = "causal": the
//   reference then attends causally inside a block; false otherwise, written explicitly).
//   layer_types, sliding_window and use_sliding_window true when a layer is
//   "sliding_attention" ([drafter] layer_types / sliding_window; the reference then masks
//   those layers to keys within the window of each query, as the drafter was trained).
//   dflash_config.input_embedding_scale, output_multiplier and final_logit_softcapping where
//   the drafter's [drafter] keys of those names differ from the reference's defaults (1, 1,
//   none): the block's embeddings times the first, the logits times the second, then capped;
//   read back from dflash_config or the top level, as the reference reads them.
//   rope_parameters: rope_type and rope_theta, and where [drafter] rope_type is "linear",
//   "llama3" or "yarn" its factor, original_max_position_embeddings and the type's own keys
//   (low_freq_factor / high_freq_factor; beta_fast, beta_slow, truncate, attention_factor):
//   the reference's Qwen3RotaryEmbedding computes the same frequencies and scales cos and sin
//   by attention_factor. Read back from rope_parameters or rope_scaling (transformers 4's),
//   its pretraining length from there, the top level's original_max_position_embeddings, or
//   max_position_embeddings, as transformers takes it; other types ("dynamic", "longrope")
//   are refused with a sentence.
//   A training choice the layout cannot say (a [mask] other than "dflash") is refused at export
//   with a sentence.
//   Target layer id L is the output of the target's decoder layer L = transformers'
//   hidden_states[L + 1], as the reference reads it.
// model.safetensors: fc.weight [H, n*H], hidden_norm.weight [H], norm.weight [H], and per
//   layer i: layers.i.{input_layernorm,post_attention_layernorm}.weight [H],
//   layers.i.self_attn.{q,k,v,o}_proj.weight, layers.i.self_attn.{q,k}_norm.weight [D],
//   layers.i.mlp.{gate,up,down}_proj.weight; no embedding and no LM head (the target's).
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/drafter_format.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/rope_scaling.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft::hf_drafter {

// A folder that cannot be written or imported; what() is a sentence.
using Error = FormatError;

struct Layout {
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  int64_t vocab = 0, block_size = 0, mask_token = 0, target_layers = 0;
  std::vector<int64_t> target_layer_ids;
  double rope_theta = 10000.0, rms_eps = 1e-6;
  // rope_parameters' scaling (rope_type default: none).
  RopeScaling rope;
  // dflash_config's input_embedding_scale, output_multiplier, final_logit_softcapping (0: none).
  double input_scale = 1.0, output_multiplier = 1.0, softcap = 0.0;
  bool is_causal = false;  // attention inside a block: causal ([mask] in_block = "causal") or not
  // Per layer "full_attention" or "sliding_attention" (empty: every layer full) and the
  // sliding layers' window (config.json: layer_types, sliding_window, use_sliding_window).
  std::vector<std::string> layer_types;
  int64_t sliding_window = 0;
  std::string dtype = "float32";  // torch_dtype: float32 | bfloat16 | float16
  std::string target;             // what the target was (informational)
  // A drafter of the family (Variant): its architecture and the values of its own keys.
  std::string architecture = "DFlashDraftModel";
  std::vector<std::pair<std::string, int64_t>> extra;
  // The value of an extra key; Error when the layout has none.
  int64_t value(const std::string& key) const;
};

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A drafter of the DFlash family that the reference stores in this layout with more (z-lab's
// DFlash2DraftModel): its architecture name, integer keys of its own (config.json's
// dflash_config.<key>, the [drafter] key of the same name), and tensors beyond DFlash's.
// The default is DFlash itself.
struct Variant {
  std::string architecture = "DFlashDraftModel";
  std::string display = "DFlash";  // in sentences and the format's name
  std::string plugin = "dflash";   // the drafter plugin that has the layout
  std::vector<std::string> keys;
  std::function<TensorShapes(const Layout&)> tensors;  // null: none
};

using Named = NamedTensors;

// Every tensor of a drafter of this layout with its shape, in file order.
TensorShapes tensor_shapes(const Layout& layout, const Variant& variant = Variant());

// The layout of a bound "dflash" drafter: sizes from its tensors, the rest from its
// resolved [drafter] table and the target it was bound to.
// `mask` / `mask_table`: the experiment's [mask] generator and its table; a generator the
// layout cannot express is an Error naming it.
Layout describe(const Config& drafter_table, Drafter& drafter, const TargetModel& target, c10::ScalarType dtype,
                const std::string& mask, const Config& mask_table, const Variant& variant = Variant());

std::string config_json(const Layout& layout);
// Reads <folder>/config.json; throws Error naming the file, the key and what is accepted.
Layout read_config(const std::string& folder, const Variant& variant = Variant());
Layout read_config_file(const std::string& file, const Variant& variant = Variant());
// The same from config.json's text; `file` names it in errors.
Layout read_config_text(const std::string& text, const std::string& file, const Variant& variant = Variant());

// Writes <folder>/config.json and <folder>/model.safetensors (our writer; tensors cast to
// layout.dtype, every name and shape checked against the layout first). The folder is
// written under a temporary name and renamed into place.
void write(const std::string& folder, const Layout& layout, const Named& weights, const Variant& variant = Variant());

// Copies the folder's tensors into `params` (in place) after checking the folder against
// `expected` (the experiment's drafter): architecture, every size, ids and token, every
// tensor's presence, shape and dtype. Throws Error before changing anything.
void import(const std::string& folder, const Layout& expected, const Named& params, const Variant& variant = Variant());

// The format the dflash plugin gives the engine (Drafter::format()).
class Format final : public DrafterFormat {
 public:
  explicit Format(Variant variant = Variant()) : variant_(std::move(variant)) {}
  std::string name() const override { return "Hugging Face " + variant_.display + " layout"; }
  std::string layout(Drafter& drafter, const FormatInput& run) const override;
  void write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const override;
  void import(const std::string& folder, Drafter& drafter, const FormatInput& run,
              const NamedTensors& tensors) const override;

 private:
  Variant variant_;
};

}  // namespace flashdraft::hf_drafter

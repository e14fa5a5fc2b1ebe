// An EAGLE-3 drafter as a Hugging Face folder (the eagle3 plugin's serving format): config.json + model.safetensors in
// the layout vLLM and SGLang load as `LlamaForCausalLMEagle3` (one Llama decoder layer, "midlayer", whose attention
// input is [input_layernorm(embedding) | hidden_norm(hidden)], a fused projection `fc` of three target hidden states, a
// final norm and an LM head over a reduced draft vocabulary with its maps). Export writes it; import reads one back
// into the experiment's drafter after checking that it is the same drafter.
//
// config.json: architectures ["LlamaForCausalLMEagle3"], model_type "llama", hidden_size,
//   num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps,
//   rope_theta, rope_scaling where [drafter] rope_type is not "default" (its type and numbers, as the published Llama
//   3.1 EAGLE-3 drafters write it; read back from rope_scaling or rope_parameters), max_position_embeddings,
//   vocab_size (the target's), draft_vocab_size,
//   num_hidden_layers 1, tie_word_embeddings false, hidden_act "silu", torch_dtype and
//   eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}.
//   Layer ids: flashdraft's id l is the output of target decoder layer l (transformers'
//   hidden_states[l + 1]). vLLM captures the *input* of the decoder layers named in
//   eagle_aux_hidden_state_layer_ids (its default (2, L/2, L-3)), so the file holds l + 1;
//   SGLang adds 1 to the ids it reads (it names layer outputs), so an SGLang user passes
//   the flashdraft ids, kept under "flashdraft" {target_layer_ids}.
// model.safetensors: fc.weight [H, 3H], midlayer.input_layernorm.weight [H],
//   midlayer.hidden_norm.weight [H], midlayer.self_attn.{q,k,v,o}_proj.weight,
//   midlayer.post_attention_layernorm.weight [H], midlayer.mlp.{gate,up,down}_proj.weight,
//   norm.weight [H], lm_head.weight [draft_vocab, H], d2t [draft_vocab] int64 (target id of
//   draft id d = d + d2t[d]), t2d [vocab] bool (target id is in the draft vocabulary). No
//   embedding (the target's).
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/drafter_format.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/rope_scaling.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft::hf_eagle3 {

using Error = FormatError;
using Named = NamedTensors;
inline constexpr const char* kArchitecture = "LlamaForCausalLMEagle3";

struct Layout {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  int64_t vocab = 0, draft_vocab = 0, target_layers = 0, max_position = 2048, ttt_steps = 0;
  std::vector<int64_t> aux_layer_ids;  // flashdraft's convention (output of decoder layer l)
  double rope_theta = 500000.0, rms_eps = 1e-6;
  RopeScaling rope;  // rope_scaling ("default": none)
  std::string dtype = "float32";
  std::string target;
};

std::vector<std::pair<std::string, std::vector<int64_t>>> tensor_shapes(const Layout& layout);
// The layout of a bound "eagle3" drafter (sizes from its tensors and its resolved table).
Layout describe(const Config& drafter_table, Drafter& drafter, const TargetModel& target, c10::ScalarType dtype,
                int64_t seq_len);
std::string config_json(const Layout& layout);
Layout read_config_file(const std::string& file);
// The same from config.json's text; `file` names it in errors.
Layout read_config_text(const std::string& text, const std::string& file);
// config.json + model.safetensors (floats in layout.dtype, d2t int64, t2d bool), written
// under a temporary name and renamed into place.
void write(const std::string& folder, const Layout& layout, const Named& tensors);
// Checks the folder against `expected` (every size, ids, tensor names, shapes, dtypes) and
// copies its tensors into `tensors` (parameters and the d2t/t2d buffers) in place.
void import(const std::string& folder, const Layout& expected, const Named& tensors);

// The format the eagle3 plugin gives the engine (Drafter::format()); export is refused for a
// [mask] other than "eagle3_ttt".
class Format final : public DrafterFormat {
 public:
  std::string name() const override { return "Hugging Face EAGLE-3 layout"; }
  std::string layout(Drafter& drafter, const FormatInput& run) const override;
  void write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const override;
  void import(const std::string& folder, Drafter& drafter, const FormatInput& run,
              const NamedTensors& tensors) const override;
};

}  // namespace flashdraft::hf_eagle3

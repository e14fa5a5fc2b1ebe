// Reading config.json (nlohmann::json).
#include "hf_config.hpp"

#include <flashdraft/text.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <utility>

namespace flashdraft::hf {

const std::vector<std::string> kSupportedArchitectures = {"LlamaForCausalLM",
                                                          "MistralForCausalLM",
                                                          "Qwen2ForCausalLM",
                                                          "Qwen3ForCausalLM",
                                                          "Qwen3MoeForCausalLM",
                                                          "Qwen2MoeForCausalLM",
                                                          "MixtralForCausalLM",
                                                          "Glm4MoeForCausalLM",
                                                          "MiniMaxM2ForCausalLM",
                                                          "Phi3ForCausalLM",
                                                          "GptOssForCausalLM",
                                                          "Qwen3_5ForCausalLM",
                                                          "Qwen3_5ForConditionalGeneration",
                                                          "Qwen3VLForConditionalGeneration",
                                                          "Qwen2VLForConditionalGeneration",
                                                          "Qwen2_5_VLForConditionalGeneration",
                                                          "Gemma3ForCausalLM",
                                                          "SmolLM3ForCausalLM",
                                                          "Olmo2ForCausalLM",
                                                          "Glm4ForCausalLM",
                                                          "Glm4vForConditionalGeneration",
                                                          "Glm4vMoeForConditionalGeneration",
                                                          "Exaone4ForCausalLM",
                                                          "Ernie4_5ForCausalLM",
                                                          "Ernie4_5_MoeForCausalLM",
                                                          "SeedOssForCausalLM",
                                                          "HunYuanDenseV1ForCausalLM",
                                                          "Olmo3ForCausalLM",
                                                          "Gemma3ForConditionalGeneration",
                                                          "Qwen3VLMoeForConditionalGeneration",
                                                          "Qwen3_5MoeForCausalLM",
                                                          "Qwen3_5MoeForConditionalGeneration",
                                                          "Qwen3NextForCausalLM",
                                                          "DeepseekV3ForCausalLM",
                                                          "Glm4MoeLiteForCausalLM",
                                                          "Ministral3ForCausalLM",
                                                          "Mistral3ForConditionalGeneration",
                                                          "GraniteForCausalLM",
                                                          "GraniteMoeForCausalLM",
                                                          "GraniteMoeSharedForCausalLM",
                                                          "Dots1ForCausalLM",
                                                          "HunYuanMoEV1ForCausalLM",
                                                          "DeepseekV2ForCausalLM",
                                                          "CohereForCausalLM",
                                                          "Cohere2ForCausalLM",
                                                          "OlmoeForCausalLM",
                                                          "FlexOlmoForCausalLM",
                                                          "ArceeForCausalLM",
                                                          "Llama4ForCausalLM",
                                                          "Llama4ForConditionalGeneration",
                                                          "GraniteMoeHybridForCausalLM",
                                                          "ApertusForCausalLM",
                                                          "NemotronHForCausalLM",
                                                          "BambaForCausalLM",
                                                          "Gemma4ForCausalLM",
                                                          "Gemma4ForConditionalGeneration",
                                                          "Mistral4ForCausalLM",
                                                          "AfmoeForCausalLM",
                                                          "SolarOpenForCausalLM",
                                                          "GraniteSWAForCausalLM",
                                                          "GraniteMoeSWAForCausalLM",
                                                          "Exaone4_5_ForConditionalGeneration",
                                                          "Glm46VForConditionalGeneration",
                                                          "MinistralForCausalLM",
                                                          "CwmForCausalLM",
                                                          "GlmForCausalLM",
                                                          "ExaoneMoeForCausalLM",
                                                          "HeliumForCausalLM",
                                                          "YoutuForCausalLM"};

bool ModelConfig::sparse(int64_t layer) const {
  if (!moe_blocks.empty()) return moe_blocks[static_cast<size_t>(layer)] != 0;  // (Nemotron-H: its "E" blocks)
  return experts > 0 && layer >= first_dense && (layer + 1) % sparse_step == 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

namespace {

using json = nlohmann::json;

struct Reader {
  const json& j;
  std::string file;
  [[noreturn]] void fail(const std::string& key, const std::string& message) const {
    throw std::runtime_error(file + ": " + key + ": " + message);
  }
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }
  int64_t integer(const std::string& key, int64_t min_value) const {
    if (!has(key)) fail(key, "missing (an integer >= " + std::to_string(min_value) + " is needed)");
    const json& v = j.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < min_value)
      fail(key, "value " + v.dump() + " is not an integer >= " + std::to_string(min_value));
    return v.get<int64_t>();
  }
  int64_t integer(const std::string& key, int64_t min_value, int64_t fallback) const {
    return has(key) ? integer(key, min_value) : fallback;
  }
  double real(const json& from, const std::string& key, double fallback) const {
    if (!from.contains(key) || from.at(key).is_null()) return fallback;
    if (!from.at(key).is_number()) fail(key, "value " + from.at(key).dump() + " is not a number");
    return from.at(key).get<double>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j.at(key).is_boolean()) fail(key, "value " + j.at(key).dump() + " is not true or false");
    return j.at(key).get<bool>();
  }
};

// LongRoPE (transformers' _compute_longrope_parameters): short_factor and long_factor, one number a
// rotated pair each; cos and sin scaled by attention_factor, else by sqrt(1 + ln(factor) / ln(the
// pretraining length)) where factor > 1.
void read_longrope(const Reader& r, const json& scaling, int64_t rotary_dim, RopeScaling& l) {
  for (auto [key, out] : {std::pair<const char*, std::vector<double>*>{"short_factor", &l.short_factor},
                          std::pair<const char*, std::vector<double>*>{"long_factor", &l.long_factor}}) {
    const bool list = scaling.contains(key) && scaling.at(key).is_array();
    if (list)
      for (const json& v : scaling.at(key))
        if (v.is_number() && v.get<double>() > 0) out->push_back(v.get<double>());
    if (!list || out->size() != scaling.at(key).size() || static_cast<int64_t>(out->size()) != rotary_dim / 2)
      r.fail("rope_scaling", std::string(key) + ": " + (scaling.contains(key) ? scaling.at(key).dump() : "missing") +
                                 " (accepted: a list of " + std::to_string(rotary_dim / 2) +
                                 " positive numbers, one a rotated pair of the head's " + std::to_string(rotary_dim) +
                                 " rotated dimensions)");
  }
  if (scaling.contains("attention_factor") && !scaling.at("attention_factor").is_null())
    l.attention_factor = r.real(scaling, "attention_factor", 1.0);
  else
    l.attention_factor =
        l.factor <= 1 ? 1.0 : std::sqrt(1 + std::log(l.factor) / std::log(double(l.original_max_position)));
  if (!(l.attention_factor > 0)) r.fail("rope_scaling", "attention_factor must be positive");
}

// YaRN (transformers' _compute_yarn_parameters): the ramp's bounds and the factor cos and sin
// are scaled by (attention_factor, else from mscale / mscale_all_dim, else 0.1 ln(factor) + 1).
void read_yarn(const Reader& r, const json& scaling, RopeScaling& y) {
  // Python's `x or default`: a 0 or null bound takes the default too.
  const double fast = r.real(scaling, "beta_fast", 0.0), slow = r.real(scaling, "beta_slow", 0.0);
  y.beta_fast = fast != 0.0 ? fast : 32.0;
  y.beta_slow = slow != 0.0 ? slow : 1.0;
  if (scaling.contains("truncate") && !scaling.at("truncate").is_null()) {
    if (!scaling.at("truncate").is_boolean())
      r.fail("rope_scaling", "truncate: value " + scaling.at("truncate").dump() + " is not true or false");
    y.truncate = scaling.at("truncate").get<bool>();
  }
  const double mscale = r.real(scaling, "mscale", 0.0), mscale_all_dim = r.real(scaling, "mscale_all_dim", 0.0);
  if (scaling.contains("attention_factor") && !scaling.at("attention_factor").is_null())
    y.attention_factor = r.real(scaling, "attention_factor", 1.0);
  else
    y.attention_factor = yarn_attention_factor(y.factor, mscale, mscale_all_dim);
  if (!(y.attention_factor > 0)) r.fail("rope_scaling", "attention_factor must be positive");
}

// rope_theta and the scaling: transformers 4 writes rope_theta and rope_scaling at the
// top level, transformers 5 a rope_parameters object holding both.
// Gemma 3's two RoPEs: rope_parameters per layer type (as transformers 5 writes it: {"full_attention": {...},
// "sliding_attention": {...}}) or, as published, rope_theta (the full layers') with rope_scaling, and
// rope_local_base_freq (the sliding layers'; default 10000). Returns the full layers' parameters (null: none).
// OLMo 3's: the same per layer type, or as published rope_theta and rope_scaling for the full layers, the sliding ones
// unscaled at Olmo3Config's default_theta 500000 (transformers' conversion has used rope_theta for the full layers by
// then). Its defaults: 500000 for both.
const json* read_gemma3_rope(const Reader& r, ModelConfig& c) {
  const json* per_type = r.has("rope_parameters") && r.j.at("rope_parameters").is_object() &&
                                 r.j.at("rope_parameters").contains("full_attention")
                             ? &r.j.at("rope_parameters")
                             : nullptr;
  const bool olmo3 = c.architecture == "Olmo3ForCausalLM";
  const double full_default = olmo3 ? 500000.0 : 1e6;
  if (!per_type) {
    c.rope_theta = r.real(r.j, "rope_theta", full_default);
    c.rope_local_theta = olmo3 ? 500000.0 : r.real(r.j, "rope_local_base_freq", 10000.0);
    if (!(c.rope_local_theta > 0)) r.fail("rope_local_base_freq", "must be positive");
    return r.has("rope_scaling") ? &r.j.at("rope_scaling") : nullptr;
  }
  const json& full = per_type->at("full_attention");
  if (!full.is_object())
    r.fail("rope_parameters", "full_attention holds " + full.dump() + "; expected an object of RoPE parameters");
  c.rope_theta = r.real(full, "rope_theta", olmo3 ? r.real(r.j, "rope_theta", full_default) : full_default);
  c.rope_local_theta = olmo3 ? r.real(r.j, "rope_theta", 500000.0) : 10000.0;
  if (per_type->contains("sliding_attention") && !per_type->at("sliding_attention").is_null()) {
    const json& local = per_type->at("sliding_attention");
    const std::string type = local.is_object() && local.contains("rope_type") && local.at("rope_type").is_string()
                                 ? local.at("rope_type").get<std::string>()
                                 : "default";
    if (!local.is_object() || type != "default")
      r.fail("rope_parameters", "sliding_attention holds " + local.dump() +
                                    "; accepted: an object of rope_type \"default\" and its rope_theta (" +
                                    c.architecture + "'s sliding layers rotate unscaled)");
    c.rope_local_theta = r.real(local, "rope_theta", 10000.0);
    if (!(c.rope_local_theta > 0)) r.fail("rope_parameters", "sliding_attention's rope_theta must be positive");
  }
  return &full;
}

// Gemma 4's two RoPEs (rope_parameters per layer type; Gemma4TextConfig's defaults where absent): the sliding layers'
// "default" over head_dim, the full layers' "proportional" (partial_rotary_factor of the frequencies turning, factor
// dividing them; "default": all of them, undivided) over their own width.
void read_gemma4_rope(const Reader& r, ModelConfig& c) {
  c.rope_theta = 1e6, c.rope_local_theta = 1e4, c.rope_proportion = 0.25, c.rotary_dim = c.head_dim;
  if (!r.has("rope_parameters")) return;
  const json& p = r.j.at("rope_parameters");
  const auto type_of = [](const json& o) {
    return o.contains("rope_type") && o.at("rope_type").is_string() ? o.at("rope_type").get<std::string>() : "default";
  };
  for (const char* kind : {"full_attention", "sliding_attention"})
    if (!p.is_object() || !p.contains(kind) || !p.at(kind).is_object())
      r.fail("rope_parameters",
             "holds " + p.dump().substr(0, 160) +
                 "; accepted: an object with \"full_attention\" "
                 "and \"sliding_attention\" objects of RoPE parameters (Gemma 4's two kinds of layer)");
  const json& local = p.at("sliding_attention");
  if (type_of(local) != "default")
    r.fail("rope_parameters", "sliding_attention's rope_type \"" + type_of(local) +
                                  "\" is not supported (accepted: \"default\", as Gemma 4 publishes)");
  c.rope_local_theta = r.real(local, "rope_theta", 1e4);
  const json& full = p.at("full_attention");
  const std::string type = type_of(full);
  if (type != "proportional" && type != "default")
    r.fail("rope_parameters",
           "full_attention's rope_type \"" + type +
               "\" is not supported (accepted: \"proportional\", as Gemma 4 publishes, or \"default\")");
  c.rope_theta = r.real(full, "rope_theta", 1e6);
  c.rope_proportion = type == "default" ? 1.0 : r.real(full, "partial_rotary_factor", 1.0);
  c.rope_factor = type == "default" ? 1.0 : r.real(full, "factor", 1.0);
  if (!(c.rope_proportion > 0 && c.rope_proportion <= 1))
    r.fail("rope_parameters",
           "full_attention's partial_rotary_factor " + std::to_string(c.rope_proportion) + " is not in (0, 1]");
  if (!(c.rope_factor > 0)) r.fail("rope_parameters", "full_attention's factor must be positive");
  if (!(c.rope_theta > 0 && c.rope_local_theta > 0)) r.fail("rope_parameters", "every rope_theta must be positive");
}

void read_rope(const Reader& r, ModelConfig& c) {
  if (c.gemma4()) return read_gemma4_rope(r, c);
  const json* scaling = nullptr;
  const double default_theta = c.solar_open() ? 1e6 : 10000.0;  // (SolarOpenConfig's default_theta)
  if (c.gemma3() || c.architecture == "Olmo3ForCausalLM") {
    scaling = read_gemma3_rope(r, c);
  } else if (r.has("rope_parameters") && r.j.at("rope_parameters").is_object()) {
    const json& p = r.j.at("rope_parameters");
    c.rope_theta = r.real(p, "rope_theta", r.real(r.j, "rope_theta", default_theta));
    scaling = &p;
  } else if (c.cwm() && !r.has("rope_scaling")) {
    // (CwmConfig's default: Llama 3.1's scaling, factor 16 over 8192, base 1e6)
    static const json cwm_default = {{"rope_type", "llama3"},
                                     {"factor", 16.0},
                                     {"low_freq_factor", 1.0},
                                     {"high_freq_factor", 4.0},
                                     {"original_max_position_embeddings", 8192}};
    c.rope_theta = r.real(r.j, "rope_theta", 1e6);
    scaling = &cwm_default;
  } else {
    c.rope_theta = r.real(r.j, "rope_theta", default_theta);
    if (r.has("rope_scaling")) scaling = &r.j.at("rope_scaling");
  }
  if (!(c.rope_theta > 0)) r.fail("rope_theta", "must be positive");
  // partial_rotary_factor: GLM-4.5 rotates the first half of each head (its config's default, 0.5),
  // Phi-3 / Phi-4 the part its config says (Phi-4-mini: 0.75); the other families here rotate all of
  // it (transformers' Llama / Qwen / Mistral code has no part).
  const bool glm = (c.glm4_moe() && !c.solar_open()) || c.glm_attention(), phi3 = c.architecture == "Phi3ForCausalLM";
  const bool qwen3_5 = c.hybrid();  // (Qwen3_5TextConfig's and Qwen3NextConfig's default: 0.25)
  // (MiniMax-M2 as published: rotary_dim, which transformers reads as partial_rotary_factor rotary_dim / head_dim
  // where rope_parameters does not say it)
  const double minimax = c.minimax_m2() ? double(r.integer("rotary_dim", 2, c.head_dim)) / double(c.head_dim) : 0;
  // (GLM-4.1V's text config has no default of its own: transformers' rotary takes 1)
  const double top_partial = r.real(r.j, "partial_rotary_factor",
                                    glm && c.architecture != "Glm4vForConditionalGeneration" ? 0.5
                                    : qwen3_5                                                ? 0.25
                                    : minimax > 0                                            ? minimax
                                                                                             : 1.0);
  // (Bamba: transformers' BambaConfig rotates half of each head whatever the config says)
  // (Mistral 4's latent attention: head_dim is the rotated part here, all of which rotates)
  const double partial = c.bamba()                         ? 0.5
                         : c.mistral4()                    ? 1.0
                         : scaling && scaling->is_object() ? r.real(*scaling, "partial_rotary_factor", top_partial)
                                                           : top_partial;
  if (partial != 1.0 && !glm && !phi3 && !qwen3_5 && minimax == 0 && !c.bamba())
    r.fail("partial_rotary_factor", "value " + std::to_string(partial) + " rotates part of each head, which " +
                                        c.architecture + " does not (accepted: 1 or absent)");
  c.rotary_dim = static_cast<int64_t>(double(c.head_dim) * partial);
  if (!(partial > 0 && partial <= 1) || c.rotary_dim < 2 || c.rotary_dim % 2 != 0)
    r.fail("partial_rotary_factor", "value " + std::to_string(partial) + " rotates " + std::to_string(c.rotary_dim) +
                                        " of head_dim " + std::to_string(c.head_dim) +
                                        " dimensions (accepted: a factor in (0, 1] giving an even count >= 2)");
  if (!scaling) return;
  if (!scaling->is_object()) r.fail("rope_scaling", "expected an object or null, found " + scaling->dump());
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (scaling->contains(key) && scaling->at(key).is_string()) type = scaling->at(key).get<std::string>();
  if (type == "dynamic" && c.hunyuan() && r.real(*scaling, "alpha", 0.0) > 0) {
    // (Hunyuan's fixed alpha: a stretched base at every length, transformers' ntk_alpha)
    const double D = double(c.head_dim);
    c.rope_theta *= std::pow(r.real(*scaling, "alpha", 0.0), D / (D - 2));
    type = "default";
  }
  // (Qwen2-VL / Qwen2.5-VL as published: "mrope" with its sections, which a text's positions make plain RoPE)
  if (type == "mrope" && c.qwen2_vl()) type = "default";
  if (type != "default" && type != "linear" && type != "llama3" && type != "yarn" && type != "longrope")
    r.fail("rope_scaling",
           "rope type \"" + type + "\" is not supported (supported: default, linear, llama3, yarn, longrope)");
  c.rope.type = type;
  c.rope.low_freq_factor = r.real(*scaling, "low_freq_factor", 1.0);
  c.rope.mscale_all_dim = r.real(*scaling, "mscale_all_dim", 0.0);
  if (c.architecture == "Ministral3ForCausalLM" || c.architecture == "Mistral3ForConditionalGeneration" ||
      c.mistral4()) {
    c.query_scale_beta = r.real(*scaling, "llama_4_scaling_beta", 0.0);
    c.query_scale_length = static_cast<int64_t>(r.real(*scaling, "original_max_position_embeddings", 0.0));
    if (c.query_scale_beta != 0 && c.query_scale_length < 1)
      r.fail("rope_parameters", "llama_4_scaling_beta " + std::to_string(c.query_scale_beta) +
                                    " needs original_max_position_embeddings (a positive length)");
  }
  c.rope.high_freq_factor = r.real(*scaling, "high_freq_factor", 4.0);
  // The pretraining length, as transformers takes it: a top-level original_max_position_embeddings
  // first, then the scaling's, then max_position_embeddings.
  const double max_position = r.real(r.j, "max_position_embeddings", 8192.0);
  c.rope.original_max_position = static_cast<int64_t>(
      r.has("original_max_position_embeddings") ? r.real(r.j, "original_max_position_embeddings", max_position)
                                                : r.real(*scaling, "original_max_position_embeddings", max_position));
  // yarn and longrope without a factor: the ratio of the lengths after and before (DeepSeek-V3's and
  // Phi-3's configs).
  const bool ratio = type == "yarn" || type == "longrope";
  c.rope.factor = r.real(*scaling, "factor", ratio ? max_position / double(c.rope.original_max_position) : 1.0);
  if (type != "default" && !(c.rope.factor > 0)) r.fail("rope_scaling", "factor must be positive");
  if (type == "yarn") read_yarn(r, *scaling, c.rope);
  if (type == "longrope") read_longrope(r, *scaling, c.rotary_dim, c.rope);
}

// DeepSeek-V3's multi-head latent attention (ModelConfig::mla): its ranks and head dimensions; head_dim is set to
// qk_rope_head_dim first (the rotated part, as transformers' DeepseekV3Config does), to qk_nope + qk_rope after the
// RoPE is read (read_mla_scale).
void read_mla(const Reader& r, ModelConfig& c) {
  c.q_lora = r.has("q_lora_rank") ? r.integer("q_lora_rank", 1) : 0;  // (null: q_proj)
  c.kv_lora = r.integer("kv_lora_rank", 1);
  c.qk_nope = r.integer("qk_nope_head_dim", 0);
  c.qk_rope = r.integer("qk_rope_head_dim", 2);
  c.v_dim = r.integer("v_head_dim", 1);
  c.rope_interleave = r.boolean("rope_interleave", true);
  if (c.qk_rope % 2 != 0) r.fail("qk_rope_head_dim", std::to_string(c.qk_rope) + " is odd (RoPE rotates pairs)");
  if (c.v_dim > c.qk_nope + c.qk_rope)
    r.fail("v_head_dim", std::to_string(c.v_dim) + " is wider than qk_nope_head_dim + qk_rope_head_dim = " +
                             std::to_string(c.qk_nope + c.qk_rope) +
                             " (the engine pads the values to the keys' width)");
  if (r.boolean("attention_bias", false))
    r.fail("attention_bias", "true: biases on the latent attention's projections are not read (accepted: false)");
  c.head_dim = c.qk_rope;
}

// After read_rope: the attention's width and softmax scale (transformers' yarn_apply_mscale).
void read_mla_scale(ModelConfig& c) {
  c.head_dim = c.qk_nope + c.qk_rope;
  c.softmax_scale = 1.0 / std::sqrt(double(c.head_dim));
  if (c.rope.type != "default" && c.rope.mscale_all_dim != 0 && c.rope.factor > 1) {
    const double m = 0.1 * c.rope.mscale_all_dim * std::log(c.rope.factor) + 1.0;
    c.softmax_scale *= m * m;
  }
}

// A per-layer list of config.json (`key`: layer_types, mlp_layer_types): `layers` entries, each of the two names
// `kinds`; out[l] = 1 where the second.
void read_layer_types(const Reader& r, int64_t layers, const std::string& key,
                      const std::pair<std::string, std::string>& kinds, std::vector<uint8_t>& out) {
  const json& v = r.j.at(key);
  if (!v.is_array() || static_cast<int64_t>(v.size()) != layers)
    r.fail(key, "value " + v.dump().substr(0, 120) + " is not a list of " + std::to_string(layers) +
                    " layer types (num_hidden_layers)");
  out.assign(static_cast<size_t>(layers), 0);
  for (size_t l = 0; l < v.size(); ++l) {
    if (v[l] != kinds.first && v[l] != kinds.second)
      r.fail(key, "holds " + v[l].dump() + " (accepted: \"" + kinds.first + "\", \"" + kinds.second + "\")");
    out[l] = v[l] == kinds.second;
  }
}

// EXAONE 4.0's sliding_window_pattern where layer_types does not list the layers: an integer n (every n-th layer full,
// the others sliding; Exaone4Config's default 4) or a string of L (sliding) and G (full) repeated from layer 0.
void read_exaone4_pattern(const Reader& r, ModelConfig& c) {
  const json pattern = r.has("sliding_window_pattern") ? r.j.at("sliding_window_pattern") : json(4);
  const std::string accepted = "; accepted: an integer >= 1 (every n-th layer full) or a string of L and G";
  if (pattern.is_number_integer() && pattern.get<int64_t>() >= 1) {
    for (int64_t l = 0; l < c.layers; ++l) c.sliding[static_cast<size_t>(l)] = (l + 1) % pattern.get<int64_t>() != 0;
    return;
  }
  const std::string s = pattern.is_string() ? pattern.get<std::string>() : "";
  if (s.empty() || s.find_first_not_of("LG") != std::string::npos)
    r.fail("sliding_window_pattern", "value " + pattern.dump() + accepted);
  for (int64_t l = 0; l < c.layers; ++l)
    c.sliding[static_cast<size_t>(l)] = s[static_cast<size_t>(l) % s.size()] == 'L';
}

// Which layers attend through a sliding window (ModelConfig::sliding): Mistral's and Phi-3's every
// layer when sliding_window is set (`all`); a family with use_sliding_window (Qwen2) the layers from
// max_window_layers on; layer_types, where config.json lists them, says it per layer.
void read_sliding_layers(const Reader& r, bool all, ModelConfig& c) {
  c.sliding.assign(static_cast<size_t>(c.layers), 0);
  const bool gpt_oss = c.architecture == "GptOssForCausalLM";
  const bool qwen2_rule = !all && (c.dots1() || r.boolean("use_sliding_window", false));
  if (!(all || qwen2_rule) || !(r.has("sliding_window") || c.gemma4() || c.afmoe() || c.granite_swa() || c.cwm()))
    return;
  // (the configs' defaults: Gemma4TextConfig's 512, AfmoeConfig's 1024, GraniteSWAConfig's 128, CwmConfig's 8192)
  c.sliding_window = r.integer("sliding_window", 1, c.afmoe() ? 1024 : c.granite_swa() ? 128 : c.cwm() ? 8192 : 512);
  if (r.has("layer_types")) {
    read_layer_types(r, c.layers, "layer_types", {"full_attention", "sliding_attention"}, c.sliding);
    if (c.gemma4()) c.sliding.back() = 0;  // (Gemma4TextConfig makes its last layer full, whatever the list says)
    return;
  }
  if (c.exaone4() || c.exaone_moe()) return read_exaone4_pattern(r, c);
  // (transformers' Qwen2Config defaults max_window_layers to 28; GptOssConfig's layer_types to sliding
  // layers 0, 2, 4, ..., full ones between)
  const int64_t first = qwen2_rule ? r.integer("max_window_layers", 0, c.dots1() ? 62 : 28) : 0;
  // (Gemma3TextConfig's sliding_window_pattern, default 6: every sixth layer full; Olmo3Config's layer_types: every
  // fourth)
  // (Cohere2Config's sliding_window_pattern, default 4)
  const int64_t pattern = c.gemma3()                             ? r.integer("sliding_window_pattern", 1, 6)
                          : c.gemma4()                           ? 6
                          : c.afmoe()                            ? r.integer("global_attn_every_n_layers", 1, 4)
                          : c.cohere2()                          ? r.integer("sliding_window_pattern", 1, 4)
                          : c.architecture == "Olmo3ForCausalLM" ? 4
                                                                 : 0;
  for (int64_t l = first; l < c.layers; ++l)
    c.sliding[static_cast<size_t>(l)] =
        c.granite_swa() || c.cwm() ? l % 4 != 0  // (GraniteSWAConfig's and CwmConfig's: layer 0 full, then 4, ...)
        : pattern > 0              ? (l + 1) % pattern != 0
                                   : !gpt_oss || l % 2 == 0;
  if (c.gemma4()) c.sliding.back() = 0;
}

// The sizes GLM-4.5's and the DeepSeek routers share: moe_intermediate_size, n_shared_experts (default `shared`) of
// that width every token runs, the first first_k_dense_replace (default `dense`) layers dense, routed_scaling_factor;
// their weights kept in float32.
void read_deepseek_kind_experts(const Reader& r, ModelConfig& c, int64_t shared, int64_t dense) {
  c.moe_intermediate = r.integer("moe_intermediate_size", 1);
  c.float_router_weights = true;
  c.shared_experts = r.integer("n_shared_experts", 0, shared);
  c.shared_intermediate = c.shared_experts * c.moe_intermediate;
  c.first_dense = r.integer("first_k_dense_replace", 0, dense);
  c.routed_scale = r.real(r.j, "routed_scaling_factor", 1.0);
  if (!(c.routed_scale > 0)) r.fail("routed_scaling_factor", "must be positive");
}

// n_group groups of the experts and topk_group, how many of them a token's experts are chosen from (GLM-4.5's and the
// DeepSeek routers'), each group holding at least `least` experts; fallback: both keys' value where absent (0: needed).
void read_groups(const Reader& r, ModelConfig& c, int64_t least, int64_t fallback) {
  c.groups = fallback > 0 ? r.integer("n_group", 1, fallback) : r.integer("n_group", 1);
  c.topk_groups = fallback > 0 ? r.integer("topk_group", 1, fallback) : r.integer("topk_group", 1);
  if (c.experts % c.groups != 0 || c.experts / c.groups < least)
    r.fail("n_group", std::to_string(c.groups) + " groups of " + std::to_string(c.experts) +
                          " experts (accepted: a divisor of the experts leaving at least " + std::to_string(least) +
                          " in each group)");
  if (c.topk_groups > c.groups)
    r.fail("topk_group", std::to_string(c.topk_groups) + " is more than n_group " + std::to_string(c.groups));
  if (c.experts_per_token > c.topk_groups * (c.experts / c.groups))
    r.fail("num_experts_per_tok", std::to_string(c.experts_per_token) + " is more than the " +
                                      std::to_string(c.topk_groups * (c.experts / c.groups)) +
                                      " experts of the topk_group groups chosen");
}

// GLM-4.5's experts (transformers' Glm4MoeConfig; DeepSeek-V3's routing): a sigmoid router in
// float32 with a per-expert correction bias that only chooses; the top k of the best topk_group of
// n_group groups (a group scored by its best two), renormalised when norm_topk_prob, times
// routed_scaling_factor; n_shared_experts experts' worth of width every token runs; the first
// first_k_dense_replace layers dense.
void read_glm_routing(const Reader& r, ModelConfig& c) {
  read_deepseek_kind_experts(r, c, /*shared=*/1, /*dense=*/1);
  c.norm_topk = r.boolean("norm_topk_prob", true);
  c.sigmoid_router = true;
  read_groups(r, c, /*least=*/2, /*fallback=*/1);
}

// DeepSeek-V2's experts (transformers' DeepseekV2TopkRouter; DeepseekV2Config's defaults): topk_method "greedy" (the
// default) or "group_limited_greedy" over n_group groups; anything else (V3's "noaux_tc") is refused.
void read_deepseek_v2_routing(const Reader& r, ModelConfig& c) {
  read_deepseek_kind_experts(r, c, /*shared=*/2, /*dense=*/0);
  const json method = r.has("topk_method") ? r.j.at("topk_method") : json("greedy");
  if (method == "greedy") return;
  if (method != "group_limited_greedy")
    r.fail("topk_method", "value " + method.dump() +
                              " is not DeepSeek-V2's (accepted: \"greedy\", \"group_limited_greedy\", or absent)");
  read_groups(r, c, /*least=*/1, /*fallback=*/0);
}

// MiniMax-M2's experts (transformers' MiniMaxM2SparseMoeBlock): every layer sparse, num_local_experts of
// intermediate_size stored as Mixtral's; the router's logits in the model's dtype, their sigmoid in float32, the top k
// of sigmoid + a per-expert correction bias (block_sparse_moe.e_score_correction_bias) chosen among all the experts (no
// groups), weighted by their sigmoids renormalised over the k, kept in float32. The published config.json's keys that
// say so are checked where present: another value would be run as the wrong model.
void read_minimax_m2_routing(const Reader& r, ModelConfig& c) {
  c.moe_intermediate = c.intermediate;
  c.norm_topk = c.float_router_weights = c.sigmoid_router = c.router_logits_in_dtype = true;
  if (r.has("scoring_func") && r.j.at("scoring_func") != "sigmoid")
    r.fail("scoring_func", "value " + r.j.at("scoring_func").dump() +
                               " is not supported (MiniMax-M2's router: \"sigmoid\", as transformers runs it)");
  if (!r.boolean("use_routing_bias", true))
    r.fail("use_routing_bias",
           "false is not supported (MiniMax-M2's router chooses by e_score_correction_bias, as "
           "transformers runs it: accepted true or absent)");
  if (r.integer("shared_intermediate_size", 0, 0) != 0)
    r.fail("shared_intermediate_size", "value " + r.j.at("shared_intermediate_size").dump() +
                                           " asks for a shared expert, which MiniMax-M2 does not have (accepted: 0)");
}

// ERNIE 4.5's experts (ModelConfig::ernie4_5_moe): its own keys for the sizes and the sparse layers.
void read_ernie4_5_routing(const Reader& r, ModelConfig& c) {
  c.moe_intermediate = r.integer("moe_intermediate_size", 1);
  c.softmax_choice_bias = true;
  c.norm_min = r.real(r.j, "moe_norm_min", 1e-12);
  if (!(c.norm_min > 0)) r.fail("moe_norm_min", "must be positive");
  c.shared_experts = r.integer("moe_num_shared_experts", 0, 0);
  c.shared_intermediate = c.shared_experts * c.moe_intermediate;
  c.first_dense = r.integer("moe_layer_start_index", 0, 1);
  c.sparse_step = r.integer("moe_layer_interval", 1, 1);
  const int64_t end = r.has("moe_layer_end_index") && r.j.at("moe_layer_end_index") == -1
                          ? c.layers - 1
                          : r.integer("moe_layer_end_index", 0, c.layers - 1);
  for (int64_t l = end + 1; l < c.layers; ++l) c.mlp_only_layers.push_back(l);
}

// The experts of Qwen3MoeForCausalLM (transformers' Qwen3MoeConfig; its version 5 writes the
// count as num_local_experts, the published checkpoints as num_experts), of Qwen2MoeForCausalLM
// (the same routing, norm_topk_prob false by default, plus a gated shared expert of
// shared_expert_intermediate_size), of MixtralForCausalLM
// (MixtralConfig: num_local_experts experts of intermediate_size, every layer sparse, the top k
// always renormalised and kept in float32), of Glm4MoeForCausalLM (read_glm_routing) and of Qwen3.5-MoE
// (Qwen2-MoE's, its top k always renormalised).
// Llama 4's experts (transformers' Llama4TextMoe): num_local_experts of intermediate_size, the MoE layers moe_layers
// (else every interleave_moe_layer_step-th), a shared expert of the same width.
void read_llama4_experts(const Reader& r, ModelConfig& c) {
  c.experts = r.integer("num_local_experts", 1);
  c.experts_key = "num_local_experts";
  c.experts_per_token = r.integer("num_experts_per_tok", 1, 1);
  if (c.experts_per_token > c.experts)
    r.fail("num_experts_per_tok", std::to_string(c.experts_per_token) + " is more than the " +
                                      std::to_string(c.experts) + " experts of num_local_experts");
  c.moe_intermediate = c.shared_intermediate = r.integer("intermediate_size", 1);
  c.router_scales_input = true;
  if (!r.has("moe_layers")) {
    c.sparse_step = r.integer("interleave_moe_layer_step", 1, 1);
    return;
  }
  const json& v = r.j.at("moe_layers");
  std::vector<uint8_t> moe(static_cast<size_t>(c.layers), 0);
  if (!v.is_array()) r.fail("moe_layers", "value " + v.dump() + " is not a list of layer indices");
  for (const json& l : v) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.layers)
      r.fail("moe_layers", "holds " + l.dump() + "; accepted: layer indices 0.." + std::to_string(c.layers - 1));
    moe[static_cast<size_t>(l.get<int64_t>())] = 1;
  }
  for (int64_t l = 0; l < c.layers; ++l)
    if (!moe[static_cast<size_t>(l)]) c.mlp_only_layers.push_back(l);
}

// Hunyuan's experts (transformers' HunYuanMoEV1Moe): num_experts and moe_topk an integer or one a layer (the published
// configs list them per layer, all equal; a count that changes from layer to layer is refused).
void read_hunyuan_experts(const Reader& r, ModelConfig& c) {
  const auto uniform = [&](const char* key) -> int64_t {
    if (!r.has(key) || !r.j.at(key).is_array()) return r.integer(key, 1);
    const json& v = r.j.at(key);
    bool ok = static_cast<int64_t>(v.size()) == c.layers;
    for (const json& n : v) ok = ok && n.is_number_integer() && n.get<int64_t>() >= 1 && n == v[0];
    if (!ok)
      r.fail(key, "holds " + v.dump() + "; accepted: an integer >= 1, or a list of num_hidden_layers (" +
                      std::to_string(c.layers) +
                      ") equal integers (a count that changes between layers is not supported)");
    return v[0].get<int64_t>();
  };
  c.experts = uniform("num_experts");
  c.experts_key = "num_experts";
  c.experts_per_token = uniform("moe_topk");
  if (c.experts_per_token > c.experts)
    r.fail("moe_topk", std::to_string(c.experts_per_token) + " is more than the " + std::to_string(c.experts) +
                           " experts of num_experts (accepted: 1.." + std::to_string(c.experts) + ")");
  c.moe_intermediate = c.shared_intermediate = c.intermediate;
  c.norm_topk = c.float_router_weights = true;
}

// OLMoE's experts: intermediate_size wide, every layer sparse; norm_topk_prob false by default.
void read_olmoe_experts(const Reader& r, ModelConfig& c) {
  c.experts = r.integer("num_experts", 1);
  c.experts_key = "num_experts";
  c.experts_per_token = r.integer("num_experts_per_tok", 1);
  if (c.experts_per_token > c.experts)
    r.fail("num_experts_per_tok", std::to_string(c.experts_per_token) + " is more than the " +
                                      std::to_string(c.experts) + " experts of num_experts");
  c.moe_intermediate = c.intermediate;
  c.norm_topk = r.boolean("norm_topk_prob", false);
}

// GLM-4.7-Flash's and K-EXAONE's experts (GLM-4.5's routing): mlp_layer_types says which layers are dense; their
// defaults: layer 0, and the layers below first_k_dense_replace.
void read_mlp_layer_types(const Reader& r, ModelConfig& c) {
  read_glm_routing(r, c);
  if (c.exaone_moe()) {  // (ExaoneMoeConfig's key for the shared experts)
    c.shared_experts = r.integer("num_shared_experts", 0, 1);
    c.shared_intermediate = c.shared_experts * c.moe_intermediate;
  }
  const int64_t dense = c.exaone_moe() ? c.first_dense : 1;
  c.first_dense = 0;
  std::vector<uint8_t> sparse(static_cast<size_t>(c.layers), 1);
  for (int64_t l = 0; l < std::min(dense, c.layers); ++l) sparse[static_cast<size_t>(l)] = 0;
  if (r.has("mlp_layer_types")) read_layer_types(r, c.layers, "mlp_layer_types", {"dense", "sparse"}, sparse);
  c.mlp_only_layers.clear();
  for (int64_t l = 0; l < c.layers; ++l)
    if (!sparse[static_cast<size_t>(l)]) c.mlp_only_layers.push_back(l);
}

// Qwen3-MoE's mlp_only_layers: the layers that run a dense MLP.
void read_mlp_only_layers(const Reader& r, ModelConfig& c) {
  const json& v = r.j.at("mlp_only_layers");
  if (!v.is_array()) r.fail("mlp_only_layers", "value " + v.dump() + " is not a list of layer indices");
  for (const json& l : v) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.layers)
      r.fail("mlp_only_layers", "holds " + l.dump() + "; accepted: layer indices 0.." + std::to_string(c.layers - 1) +
                                    " (num_hidden_layers " + std::to_string(c.layers) + ")");
    c.mlp_only_layers.push_back(l.get<int64_t>());
  }
}

void read_experts(const Reader& r, ModelConfig& c) {
  if (c.granite_hybrid() && r.integer("num_local_experts", 0, 8) == 0) {  // (Granite-4.0-micro: its shared MLP alone)
    c.intermediate = r.integer("shared_intermediate_size", 1, 1024);
    return;
  }
  if (c.hunyuan_moe()) return read_hunyuan_experts(r, c);
  if (c.llama4()) return read_llama4_experts(r, c);
  if (c.olmoe()) return read_olmoe_experts(r, c);
  const bool mixtral = c.architecture == "MixtralForCausalLM" || c.minimax_m2() || c.granite_moe();
  const bool ernie = c.ernie4_5_moe();
  const char* count = ernie                                   ? "moe_num_experts"
                      : !mixtral && r.has("num_experts")      ? "num_experts"
                      : !mixtral && r.has("n_routed_experts") ? "n_routed_experts"
                                                              : "num_local_experts";
  c.experts = r.integer(count, 1);
  c.experts_key = count;
  const char* per_token = ernie ? "moe_k" : "num_experts_per_tok";
  c.experts_per_token = r.integer(per_token, 1);
  if (c.experts_per_token > c.experts)
    r.fail(per_token, std::to_string(c.experts_per_token) + " is more than the " + std::to_string(c.experts) +
                          " experts of " + count + " (accepted: 1.." + std::to_string(c.experts) + ")");
  if (c.minimax_m2()) return read_minimax_m2_routing(r, c);
  if (c.ernie4_5_moe()) return read_ernie4_5_routing(r, c);
  if (c.granite_moe()) {  // (the softmax of the top k logits: the top k of the softmax, renormalised; cast back)
    c.moe_intermediate = c.intermediate;
    c.norm_topk = true;
    // (GraniteMoeForCausalLM has no shared MLP, whatever its config.json says; Granite 4.0's default 1024)
    if (c.architecture == "GraniteMoeSharedForCausalLM" || c.architecture == "GraniteMoeSWAForCausalLM" ||
        c.granite_hybrid())
      c.shared_intermediate = r.integer("shared_intermediate_size", 0, c.granite_hybrid() ? 1024 : 0);
    return;
  }
  if (mixtral) {
    c.moe_intermediate = c.intermediate;
    c.norm_topk = c.float_router_weights = true;
    return;
  }
  if (c.architecture == "GptOssForCausalLM") {
    // (transformers' GptOssExperts: swiglu_alpha, fixed at 1.702 in the published checkpoints' code)
    c.moe_intermediate = c.intermediate;
    c.norm_topk = true;  // (its softmax over the top k logits: the top k of the softmax, renormalised)
    c.glu_alpha = r.real(r.j, "swiglu_alpha", 1.702);
    c.glu_limit = r.real(r.j, "swiglu_limit", 7.0);
    if (!(c.glu_alpha > 0) || !(c.glu_limit > 0))
      r.fail("swiglu_limit", "swiglu_alpha and swiglu_limit must be positive");
    return;
  }
  if (c.architecture == "Glm4MoeLiteForCausalLM" || c.exaone_moe()) return read_mlp_layer_types(r, c);
  if (c.glm4_moe() || c.architecture == "DeepseekV3ForCausalLM") read_glm_routing(r, c);
  if (c.solar_open()) c.first_dense = 0;  // (every layer sparse: SolarOpenConfig has no first_k_dense_replace)
  if (c.glm4_moe() || c.architecture == "DeepseekV3ForCausalLM") return;
  if (c.deepseek_v2()) return read_deepseek_v2_routing(r, c);
  if (c.afmoe()) {  // (AfmoeConfig's defaults: one dense layer, two shared experts' worth, route_scale 1)
    c.moe_intermediate = r.integer("moe_intermediate_size", 1);
    c.first_dense = r.integer("num_dense_layers", 0, 1);
    c.shared_intermediate = c.moe_intermediate * r.integer("num_shared_experts", 0, 2);
    c.routed_scale = r.real(r.j, "route_scale", 1.0);
    if (!(c.routed_scale > 0)) r.fail("route_scale", "must be positive");
    c.sigmoid_router = c.router_logits_in_dtype = c.norm_topk = c.float_router_weights = true;
    return;
  }
  if (c.mistral4()) {  // (Mistral4Config's defaults: one shared expert, no dense layer, renormalised, one group)
    read_deepseek_kind_experts(r, c, /*shared=*/1, /*dense=*/0);
    c.norm_topk = r.boolean("norm_topk_prob", true);
    return read_groups(r, c, /*least=*/2, /*fallback=*/1);
  }
  if (c.dots1()) {  // (GLM-4.5's routing, Dots1Config's defaults)
    read_glm_routing(r, c);
    if (!r.has("norm_topk_prob")) c.norm_topk = false;
    if (!r.has("first_k_dense_replace")) c.first_dense = 0;
    return;
  }
  c.moe_intermediate = r.integer("moe_intermediate_size", 1);
  c.sparse_step = r.integer("decoder_sparse_step", 1, 1);
  c.norm_topk = r.boolean("norm_topk_prob", c.hybrid());  // (Qwen3NextConfig's default: true)
  if (c.architecture == "Qwen2MoeForCausalLM" || c.hybrid()) {
    c.shared_intermediate = r.integer("shared_expert_intermediate_size", 1);
    c.shared_gate = true;
  }
  // (Qwen3_5MoeTopKRouter and Qwen3VLMoeTextTopKRouter renormalise their top k always)
  if (c.qwen3_5() || c.qwen3_vl()) c.norm_topk = true;
  if (r.has("mlp_only_layers")) read_mlp_only_layers(r, c);
}

// quantization_config: gpt-oss's MXFP4 experts are read (dequantized at load); any other quantized
// checkpoint is refused (its tensors are not the ones the config.json sizes).
void read_quantization(const Reader& r, ModelConfig& c) {
  if (!r.has("quantization_config")) return;
  const json& q = r.j.at("quantization_config");
  const std::string method = q.is_object() && q.contains("quant_method") && q.at("quant_method").is_string()
                                 ? q.at("quant_method").get<std::string>()
                                 : "";
  if (method == "mxfp4" && c.architecture == "GptOssForCausalLM") {
    c.quant_method = method;
    return;
  }
  if (method == "fp8") {  // (block-wise FP8: DeepSeek-V3's, Qwen3's -FP8 releases, MiniMax-M2's, ...)
    const std::string fmt = q.contains("fmt") && q.at("fmt").is_string() ? q.at("fmt").get<std::string>() : "e4m3";
    if (fmt != "e4m3")
      r.fail("quantization_config", "fmt \"" + fmt + "\" is not read (accepted: \"e4m3\", FP8 E4M3 weights)");
    c.quant_method = method;
    c.fp8_block = {128, 128};
    if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
      const json& b = q.at("weight_block_size");
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
          b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1)
        r.fail("quantization_config", "weight_block_size holds " + b.dump() +
                                          "; accepted: [rows, columns] of positive integers (e.g. [128, 128])");
      c.fp8_block = {b[0].get<int64_t>(), b[1].get<int64_t>()};
    }
    return;
  }
  r.fail("quantization_config", "quant_method " + (method.empty() ? q.dump().substr(0, 80) : "\"" + method + "\"") +
                                    ": a quantized " + c.architecture +
                                    " checkpoint is not read (accepted: an unquantized checkpoint, block-wise "
                                    "\"fp8\" weights, or gpt-oss's \"mxfp4\" experts)");
}

// Qwen3.5's Gated DeltaNet layers (transformers' Qwen3_5TextConfig): which layers (layer_types, else
// every full_attention_interval-th full and the others linear), their heads and the convolution's taps;
// its attention layers' output gate and its norms' 1 + w.
void read_linear_attention(const Reader& r, ModelConfig& c) {
  c.attn_gate = c.norm_plus_one = true;
  c.lin_k_heads = r.integer("linear_num_key_heads", 1, 16);
  c.lin_v_heads = r.integer("linear_num_value_heads", 1, 32);
  c.lin_k_dim = r.integer("linear_key_head_dim", 1, 128);
  c.lin_v_dim = r.integer("linear_value_head_dim", 1, 128);
  c.conv_kernel = r.integer("linear_conv_kernel_dim", 1, 4);
  if (c.lin_v_heads % c.lin_k_heads != 0)
    r.fail("linear_num_value_heads", std::to_string(c.lin_v_heads) + " is not a multiple of linear_num_key_heads " +
                                         std::to_string(c.lin_k_heads));
  c.linear.assign(static_cast<size_t>(c.layers), 0);
  if (r.has("layer_types"))
    return read_layer_types(r, c.layers, "layer_types", {"full_attention", "linear_attention"}, c.linear);
  const int64_t interval = r.integer("full_attention_interval", 1, 4);
  for (int64_t l = 0; l < c.layers; ++l) c.linear[static_cast<size_t>(l)] = (l + 1) % interval != 0;
}

// SmolLM3's NoPE layers (SmolLM3Config): no_rope_layers (1: the layer rotates, 0: it does not), else every
// no_rope_layer_interval-th layer (default 4) without RoPE.
// After the sliding layers: Granite SWA's layer_rope_theta, one base a layer (0: no RoPE), as one base for its full
// layers (rope_theta) and one for its sliding layers (rope_local_theta, where it differs); anything else is refused.
void read_layer_thetas(const Reader& r, ModelConfig& c) {
  if (!r.has("layer_rope_theta")) return;  // (every layer rope_theta's)
  const json& v = r.j.at("layer_rope_theta");
  if (!v.is_array() || static_cast<int64_t>(v.size()) != c.layers)
    r.fail("layer_rope_theta", "value " + v.dump().substr(0, 120) + " is not a list of " + std::to_string(c.layers) +
                                   " bases (num_hidden_layers; 0: no RoPE)");
  c.nope.assign(static_cast<size_t>(c.layers), 0);
  double full = 0, local = 0;
  for (int64_t l = 0; l < c.layers; ++l) {
    const json& t = v[static_cast<size_t>(l)];
    if (!t.is_number() || !(t.get<double>() >= 0))
      r.fail("layer_rope_theta", "holds " + t.dump() + " at layer " + std::to_string(l) +
                                     " (accepted: a base > 0, or 0 "
                                     "for no RoPE)");
    const double theta = t.get<double>();
    c.nope[static_cast<size_t>(l)] = theta == 0;
    double& kind = c.window(l) > 0 ? local : full;
    if (theta == 0) continue;
    if (kind != 0 && kind != theta)
      r.fail("layer_rope_theta", "layer " + std::to_string(l) + "'s base " + t.dump() + " differs from an earlier " +
                                     (c.window(l) > 0 ? "sliding" : "full") + " layer's " + json(kind).dump() +
                                     " (accepted: one base for the full layers and one for the sliding ones)");
    kind = theta;
  }
  c.rope_theta = full > 0 ? full : local > 0 ? local : c.rope_theta;
  if (local > 0 && local != c.rope_theta) {
    if (c.rope.type != "default")
      r.fail("layer_rope_theta", "two bases with rope type \"" + c.rope.type +
                                     "\", which scales both (accepted here: one base, or rope type \"default\")");
    c.rope_local_theta = local;
  }
}

void read_nope_layers(const Reader& r, ModelConfig& c) {
  c.nope.assign(static_cast<size_t>(c.layers), 0);
  if (!r.has("no_rope_layers")) {
    const int64_t interval = r.integer("no_rope_layer_interval", 1, 4);
    for (int64_t l = 0; l < c.layers; ++l) c.nope[static_cast<size_t>(l)] = (l + 1) % interval == 0;
    return;
  }
  const json& v = r.j.at("no_rope_layers");
  if (!v.is_array() || static_cast<int64_t>(v.size()) != c.layers)
    r.fail("no_rope_layers", "holds " + v.dump().substr(0, 80) + "; accepted: a list of " + std::to_string(c.layers) +
                                 " flags (num_hidden_layers), 1 for a layer that rotates, 0 for one that does not");
  for (int64_t l = 0; l < c.layers; ++l) {
    const json& x = v[static_cast<size_t>(l)];
    if (!x.is_number_integer() || (x.get<int64_t>() != 0 && x.get<int64_t>() != 1))
      r.fail("no_rope_layers", "entry " + std::to_string(l) + " is " + x.dump() + "; accepted: 0 or 1");
    c.nope[static_cast<size_t>(l)] = x.get<int64_t>() == 0;
  }
}

// Llama 4's own keys (Llama4TextConfig; its defaults where absent): NoPE layers and their query temperature, the L2
// q / k norms, chunked layers, the dense layers' width.
void read_llama4(const Reader& r, ModelConfig& c) {
  c.rope_interleave = true;  // (its rotary's complex products: pairs interleaved)
  read_nope_layers(r, c);
  c.qk_norm_after_rope = r.boolean("use_qk_norm", true);
  if (r.boolean("attn_temperature_tuning", true)) {
    c.query_scale_beta = r.real(r.j, "attn_scale", 0.1);
    c.query_scale_length = r.integer("floor_scale", 1, 8192);
    c.query_scale_offset = 1;
    c.query_scale_nope_only = true;
  }
  c.intermediate = r.integer("intermediate_size_mlp", 1, 16384);
  if (r.has("attention_chunk_size")) c.chunk = r.integer("attention_chunk_size", 1);
  if (c.chunk == 0) return;
  if (r.has("layer_types")) {
    read_layer_types(r, c.layers, "layer_types", {"full_attention", "chunked_attention"}, c.chunked);
  } else {  // (Llama4TextConfig's: the layers that rotate are chunked)
    c.chunked.assign(static_cast<size_t>(c.layers), 0);
    for (int64_t l = 0; l < c.layers; ++l) c.chunked[static_cast<size_t>(l)] = !c.no_rope(l);
  }
}

// Gemma 3's own keys (Gemma3TextConfig): its activation, its softmax scale, no soft-capping.
void read_gemma3(const Reader& r, ModelConfig& c) {
  const char* act = r.has("hidden_activation") ? "hidden_activation" : "hidden_act";
  if (r.has(act) && r.j.at(act) != "gelu_pytorch_tanh")
    r.fail(act, "value " + r.j.at(act).dump() + " is not supported for " + c.architecture +
                    " (accepted: \"gelu_pytorch_tanh\", Gemma 3's)");
  c.gelu_mlp = c.embed_scale = c.sandwich_norms = c.norm_plus_one = c.qk_norm = true;
  const double scalar = r.real(r.j, "query_pre_attn_scalar", 256.0);
  if (!(scalar > 0)) r.fail("query_pre_attn_scalar", "must be positive");
  c.softmax_scale = 1.0 / std::sqrt(scalar);
  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (r.has(cap))
      r.fail(cap, "value " + r.j.at(cap).dump() + " soft-caps logits (Gemma 2's kind), which is not supported " +
                      "(accepted: null, as Gemma 3 publishes)");
}

// Gemma 4's own keys (Gemma4TextConfig): its activation and layout, its per-layer embeddings
// (hidden_size_per_layer_input, 256 where absent; null or 0: none; vocab_size_per_layer_input rows); bidirectional
// attention is refused. Its
// mixture-of-experts block (enable_moe_block: 26B-A4B): num_experts of moe_intermediate_size, top_k_experts a token, in
// every layer beside its MLP.
void read_gemma4(const Reader& r, ModelConfig& c) {
  if (r.has("hidden_activation") && r.j.at("hidden_activation") != "gelu_pytorch_tanh")
    r.fail("hidden_activation", "value " + r.j.at("hidden_activation").dump() +
                                    " is not supported for Gemma 4 (accepted: \"gelu_pytorch_tanh\", its own)");
  c.embed_scale = c.sandwich_norms = c.gelu_mlp = c.qk_norm = c.norm_weight_fp32 = c.v_norm = true;
  c.softmax_scale = 1.0;
  c.qkv_bias = c.o_bias = r.boolean("attention_bias", false);
  c.keys_as_values = r.boolean("attention_k_eq_v", false);
  // (null: none, as transformers reads it; absent: Gemma4TextConfig's default 256)
  c.ple = r.j.contains("hidden_size_per_layer_input") ? r.integer("hidden_size_per_layer_input", 0, 0) : 256;
  c.ple_vocab = c.ple > 0 ? r.integer("vocab_size_per_layer_input", 1, 262144) : 0;
  if (r.boolean("enable_moe_block", false)) {  // (every layer's experts beside its MLP; 26B-A4B's)
    c.experts = r.integer("num_experts", 1);
    c.experts_per_token = r.integer("top_k_experts", 1);
    c.moe_intermediate = r.integer("moe_intermediate_size", 1);
    c.experts_key = "num_experts";
    c.norm_topk = c.float_router_weights = true;
    if (c.experts_per_token > c.experts)
      r.fail("top_k_experts", std::to_string(c.experts_per_token) + " is more than num_experts " +
                                  std::to_string(c.experts) + " (accepted: 1.." + std::to_string(c.experts) + ")");
  }
  if (r.has("use_bidirectional_attention") && r.j.at("use_bidirectional_attention") != "vision")
    r.fail("use_bidirectional_attention", "value " + r.j.at("use_bidirectional_attention").dump() +
                                              " is not supported (accepted: null or \"vision\": a text attends "
                                              "causally)");
  c.logit_softcap = r.real(r.j, "final_logit_softcapping", 0.0);
  if (r.has("final_logit_softcapping") && (!(c.logit_softcap > 0) || !std::isfinite(c.logit_softcap)))
    r.fail("final_logit_softcapping", "value " + r.j.at("final_logit_softcapping").dump() +
                                          " is not a positive number (accepted: > 0, or null for none)");
}

// After the sliding layers: Gemma 4's last num_kv_shared_layers layers' sources of keys and values (the last layer of
// their kind before them, as transformers' Gemma4TextConfig.kv_sharing_modes), and their MLPs' width.
void read_gemma4_sharing(const Reader& r, ModelConfig& c) {
  const int64_t shared = r.integer("num_kv_shared_layers", 0, 0);
  const bool wide = r.boolean("use_double_wide_mlp", false);
  if (shared == 0) return;
  if (shared >= c.layers)
    r.fail("num_kv_shared_layers", std::to_string(shared) + " shares every layer's keys and values (accepted: 0.." +
                                       std::to_string(c.layers - 1) + ", num_hidden_layers " +
                                       std::to_string(c.layers) + " minus at least one layer that makes its own)");
  const int64_t first = c.layers - shared;
  c.kv_source.resize(static_cast<size_t>(c.layers));
  c.layer_intermediate.assign(static_cast<size_t>(c.layers), c.intermediate);
  for (int64_t l = 0; l < c.layers; ++l) {
    int64_t source = l;
    if (l >= first) {
      source = first - 1;
      while (source >= 0 && (c.window(source) > 0) != (c.window(l) > 0)) --source;
      if (source < 0)
        r.fail("num_kv_shared_layers", std::to_string(shared) + ": layer " + std::to_string(l) + " (" +
                                           (c.window(l) > 0 ? "sliding" : "full") +
                                           ") shares keys and values with no earlier layer of its kind (accepted: a "
                                           "count leaving one of each kind before the shared layers)");
      if (wide) c.layer_intermediate[static_cast<size_t>(l)] = 2 * c.intermediate;
    }
    c.kv_source[static_cast<size_t>(l)] = source;
  }
}

// After the sliding layers: Gemma 4's full layers' head width and key / value heads, from per_layer_config (integer
// layer keys, each overriding head_dim and / or num_key_value_heads; one override for all the layers of a kind, as
// transformers' RoPE needs) or from global_head_dim (Gemma4TextConfig's default 512) and, with attention_k_eq_v,
// num_global_key_value_heads.
void read_gemma4_heads(const Reader& r, ModelConfig& c) {
  c.layer_head_dim.assign(static_cast<size_t>(c.layers), c.head_dim);
  c.layer_kv_heads.assign(static_cast<size_t>(c.layers), c.kv_heads);
  if (r.has("per_layer_config")) {
    const json& p = r.j.at("per_layer_config");
    if (!p.is_object()) r.fail("per_layer_config", "value " + p.dump().substr(0, 120) + " is not an object");
    for (const auto& [key, overrides] : p.items()) {
      const int64_t l = key.find_first_not_of("0123456789") == std::string::npos && !key.empty() && key.size() < 9
                            ? std::stoll(key)
                            : -1;
      if (l < 0 || l >= c.layers || !overrides.is_object())
        r.fail("per_layer_config", "key \"" + key + "\" holding " + overrides.dump().substr(0, 80) +
                                       " (accepted: layer indices 0.." + std::to_string(c.layers - 1) +
                                       " holding objects of head_dim / num_key_value_heads)");
      const Reader layer{overrides, r.file + ": per_layer_config." + key};
      for (const auto& [name, value] : overrides.items())
        if (name != "head_dim" && name != "num_key_value_heads")
          layer.fail(name, "is not read per layer (accepted here: head_dim, num_key_value_heads)");
      c.layer_head_dim[static_cast<size_t>(l)] = layer.integer("head_dim", 2, c.head_dim);
      c.layer_kv_heads[static_cast<size_t>(l)] = layer.integer("num_key_value_heads", 1, c.kv_heads);
    }
  } else {
    const int64_t width = r.integer("global_head_dim", 2, 512);
    const int64_t kv = c.keys_as_values ? r.integer("num_global_key_value_heads", 1, c.kv_heads) : c.kv_heads;
    for (int64_t l = 0; l < c.layers; ++l)
      if (c.window(l) == 0)
        c.layer_head_dim[static_cast<size_t>(l)] = width, c.layer_kv_heads[static_cast<size_t>(l)] = kv;
  }
  for (int64_t l = 0; l < c.layers; ++l) {
    int64_t first = 0;  // (the first layer of l's kind)
    while ((c.window(first) > 0) != (c.window(l) > 0)) ++first;
    const int64_t D = c.head_dim_of(l), kv = c.kv_heads_of(l);
    if (D % 2 != 0 || c.heads % kv != 0)
      r.fail("per_layer_config", "layer " + std::to_string(l) + ": head_dim " + std::to_string(D) + " and " +
                                     std::to_string(kv) +
                                     " key / value heads (accepted: an even width, a divisor of "
                                     "num_attention_heads " +
                                     std::to_string(c.heads) + ")");
    if (D != c.head_dim_of(first) || kv != c.kv_heads_of(first))
      r.fail("per_layer_config", "layer " + std::to_string(l) + "'s heads (" + std::to_string(kv) + " x " +
                                     std::to_string(D) + ") differ from layer " + std::to_string(first) +
                                     "'s, of the same kind (accepted: one width and count per kind of layer, as "
                                     "transformers' RoPE reads them)");
  }
}

// Cohere's and Cohere 2's own keys (CohereConfig, Cohere2Config): their LayerNorms' layer_norm_eps, logit_scale.
void read_cohere(const Reader& r, ModelConfig& c) {
  c.layer_norm = c.parallel = c.rope_interleave = c.norm_weight_fp32 = true;
  c.rms_eps = r.real(r.j, "layer_norm_eps", 1e-5);
  if (!(c.rms_eps > 0)) r.fail("layer_norm_eps", "must be positive");
  c.logit_scale = r.real(r.j, "logit_scale", 0.0625);
  if (!(c.logit_scale > 0) || !std::isfinite(c.logit_scale))
    r.fail("logit_scale", "value " + r.j.at("logit_scale").dump() + " is not a positive number (absent: 0.0625)");
  if (r.boolean("use_qk_norm", false))
    r.fail("use_qk_norm",
           "true is not supported (Cohere's LayerNorms of q and k per head are not read; accepted: "
           "false or absent)");
}

// A number of time_step_limit: a JSON number, or transformers' {"__float__": "Infinity"} (how it writes inf).
double limit_number(const Reader& r, const json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_object() && v.contains("__float__") && v.at("__float__").is_string()) {
    const std::string f = v.at("__float__").get<std::string>();
    if (f == "Infinity" || f == "inf") return std::numeric_limits<double>::infinity();
  }
  r.fail("time_step_limit", "holds " + v.dump() + " (accepted: numbers, or {\"__float__\": \"Infinity\"})");
}

// Granite 4.0-H's Mamba-2 layers (GraniteMoeHybridConfig's mamba_* keys and their defaults).
void read_mamba2(const Reader& r, ModelConfig& c) {
  const int64_t inner = r.integer("mamba_expand", 1, 2) * c.hidden;
  c.mamba_heads = r.integer("mamba_n_heads", 1, 128);
  c.mamba_groups = r.integer("mamba_n_groups", 1, 1);
  c.mamba_state = r.integer("mamba_d_state", 1, 256);
  c.conv_kernel = r.integer("mamba_d_conv", 2, 4);
  const bool automatic = !r.has("mamba_d_head") || r.j.at("mamba_d_head") == "auto";
  c.mamba_head_dim = automatic ? inner / c.mamba_heads : r.integer("mamba_d_head", 1);
  if (c.mamba_head_dim * c.mamba_heads != inner)
    r.fail(automatic ? "mamba_n_heads" : "mamba_d_head",
           std::to_string(c.mamba_heads) + " heads of " + std::to_string(c.mamba_head_dim) +
               " are not mamba_expand x " + "hidden_size = " + std::to_string(inner) +
               " (accepted: heads x head width = that)");
  if (c.mamba_heads % c.mamba_groups != 0)
    r.fail("mamba_n_groups", std::to_string(c.mamba_groups) + " does not divide mamba_n_heads " +
                                 std::to_string(c.mamba_heads) + " (accepted: a divisor of it)");
  c.mamba_chunk = r.integer("mamba_chunk_size", 1, 256);
  c.mamba_conv_bias = r.boolean("mamba_conv_bias", true);
  c.mamba_proj_bias = r.boolean("mamba_proj_bias", false);
  if (r.has("time_step_limit")) {
    const json& v = r.j.at("time_step_limit");
    if (!v.is_array() || v.size() != 2)
      r.fail("time_step_limit", "value " + v.dump() + " is not a list of two numbers (accepted: [least dt, most dt])");
    c.dt_min = limit_number(r, v[0]), c.dt_max = limit_number(r, v[1]);
    if (!(c.dt_min <= c.dt_max))
      r.fail("time_step_limit", "value " + v.dump() + ": its least dt is above its most (accepted: [least, most])");
  }
  if (r.has("hidden_act") && r.j.at("hidden_act") != "silu")
    r.fail("hidden_act", "value " + r.j.at("hidden_act").dump() +
                             " (the Mamba-2 layers take it as their convolution's activation: accepted: "
                             "\"silu\")");
}

// Granite 4.0's hybrid kind: its layer_types (GraniteMoeHybridConfig's default: every layer Mamba-2; "mamba" and
// "attention" as published, "linear_attention" and "full_attention" as transformers 5 writes them), its Mamba-2
// layers' sizes, and its position embedding (its MLP: read_experts).
void read_granite_hybrid(const Reader& r, ModelConfig& c) {
  c.linear.assign(static_cast<size_t>(c.layers), 1);
  if (r.has("layer_types")) {
    const json& v = r.j.at("layer_types");
    if (!v.is_array() || static_cast<int64_t>(v.size()) != c.layers)
      r.fail("layer_types", "value " + v.dump().substr(0, 120) + " is not a list of " + std::to_string(c.layers) +
                                " layer types (num_hidden_layers)");
    for (size_t l = 0; l < v.size(); ++l) {
      const bool attention = v[l] == "attention" || v[l] == "full_attention";
      if (!attention && v[l] != "mamba" && v[l] != "linear_attention")
        r.fail("layer_types", "holds " + v[l].dump() +
                                  " (accepted: \"attention\" or \"full_attention\", \"mamba\" or "
                                  "\"linear_attention\")");
      c.linear[l] = !attention;
    }
  }
  if (std::find(c.linear.begin(), c.linear.end(), 1) == c.linear.end())
    c.linear.clear();  // (every layer attends: Granite-4.0-micro)
  else
    read_mamba2(r, c);
  if (!r.has("position_embedding_type") || r.j.at("position_embedding_type") != "rope")
    c.nope.assign(static_cast<size_t>(c.layers), 1);  // (no RoPE in any layer)
}

// Bamba's layers: attention at attn_layer_indices (BambaConfig's default none: every layer Mamba-2), Mamba-2 elsewhere
// with Granite 4.0-H's keys.
void read_bamba(const Reader& r, ModelConfig& c) {
  c.linear.assign(static_cast<size_t>(c.layers), 1);
  if (r.has("attn_layer_indices")) {
    const json& v = r.j.at("attn_layer_indices");
    if (!v.is_array())
      r.fail("attn_layer_indices", "value " + v.dump() + " is not a list (accepted: a list of layer indices)");
    for (const json& l : v) {
      if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.layers)
        r.fail("attn_layer_indices", "holds " + l.dump() + "; accepted: layer indices 0.." +
                                         std::to_string(c.layers - 1) + " (num_hidden_layers " +
                                         std::to_string(c.layers) + ")");
      c.linear[static_cast<size_t>(l.get<int64_t>())] = 0;
    }
  }
  read_mamba2(r, c);
}

// Granite's multipliers (GraniteConfig: each 1 where absent, as transformers takes them), each a positive number.
void read_granite(const Reader& r, ModelConfig& c) {
  const auto positive = [&](const char* key) {
    const double v = r.real(r.j, key, 1.0);
    if (!(v > 0) || !std::isfinite(v))
      r.fail(key, "value " + r.j.at(key).dump() + " is not a positive number (accepted: > 0; absent: 1)");
    return v;
  };
  c.embed_multiplier = positive("embedding_multiplier");
  c.residual_multiplier = positive("residual_multiplier");
  c.softmax_scale = positive("attention_multiplier");  // (the softmax scale itself: absent, 1, as transformers')
  c.logit_scale = 1.0 / positive("logits_scaling");
  if (c.granite_hybrid()) read_granite_hybrid(r, c);
}

// eos_token_id: an id or a list of ids (absent or null: none).
std::vector<int64_t> eos_ids(const json& j, const std::string& file) {
  std::vector<int64_t> ids;
  if (!j.contains("eos_token_id") || j.at("eos_token_id").is_null()) return ids;
  const json& v = j.at("eos_token_id");
  auto add = [&](const json& x) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0)
      throw std::runtime_error(file + ": eos_token_id holds " + x.dump() +
                               "; accepted: a token id (a non-negative integer) or a list of them");
    ids.push_back(x.get<int64_t>());
  };
  if (v.is_array())
    for (const json& x : v) add(x);
  else
    add(v);
  return ids;
}

// A JSON file, parsed; throws with the file's name where it cannot be read or parsed.
json read_json(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error(file + ": cannot be read");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw std::runtime_error(file + ": not valid JSON (" + std::string(e.what()) + ")");
  }
}

// architectures[0], one of kSupportedArchitectures.
std::string read_architecture(const Reader& top) {
  const json& j = top.j;
  if (!top.has("architectures") || !j.at("architectures").is_array() || j.at("architectures").empty() ||
      !j.at("architectures")[0].is_string())
    top.fail("architectures", "missing; supported: " + join(kSupportedArchitectures));
  const std::string a = j.at("architectures")[0].get<std::string>();
  if (std::find(kSupportedArchitectures.begin(), kSupportedArchitectures.end(), a) == kSupportedArchitectures.end())
    top.fail("architectures", "\"" + a + "\" is not supported (supported: " + join(kSupportedArchitectures) + ")");
  return a;
}

// MiniMax-M2's q / k norms: over all of q's heads and all of k's at once (use_qk_norm, qk_norm_type "per_layer"; what
// transformers' MiniMaxM2Attention always runs).
void read_minimax_m2_norms(const Reader& r, ModelConfig& c) {
  if (!r.boolean("use_qk_norm", true))
    r.fail("use_qk_norm",
           "false is not supported (transformers' MiniMaxM2Attention norms q and k always: accepted "
           "true or absent)");
  if (r.has("qk_norm_type") && r.j.at("qk_norm_type") != "per_layer")
    r.fail("qk_norm_type", "value " + r.j.at("qk_norm_type").dump() +
                               " is not supported (accepted: \"per_layer\", one norm over all heads, as published)");
  c.qk_norm_full = true;
}

// Nemotron-H's blocks as listed: layers_block_type ("mamba" / "linear_attention", "attention" / "full_attention",
// "mlp", "moe"), else hybrid_override_pattern (M, *, -, E) as published: one letter or name a block.
std::vector<char> nemotron_h_blocks(const Reader& r) {
  std::vector<char> out;
  const std::string accepted =
      " (accepted: layers_block_type of \"mamba\" or \"linear_attention\", \"attention\" or \"full_attention\", "
      "\"mlp\", \"moe\"; or hybrid_override_pattern of M, *, -, E)";
  if (r.has("layers_block_type")) {
    const json& v = r.j.at("layers_block_type");
    if (!v.is_array() || v.empty()) r.fail("layers_block_type", "value " + v.dump().substr(0, 120) + " is not a list");
    for (const json& t : v) {
      const std::string s = t.is_string() ? t.get<std::string>() : "";
      const char k = s == "mamba" || s == "linear_attention"     ? 'M'
                     : s == "attention" || s == "full_attention" ? '*'
                     : s == "mlp"                                ? '-'
                     : s == "moe"                                ? 'E'
                                                                 : '?';
      if (k == '?') r.fail("layers_block_type", "holds " + t.dump() + accepted);
      out.push_back(k);
    }
  } else if (r.has("hybrid_override_pattern") && r.j.at("hybrid_override_pattern").is_string()) {
    const std::string s = r.j.at("hybrid_override_pattern").get<std::string>();
    if (s.empty() || s.find_first_not_of("M*-E") != std::string::npos)
      r.fail("hybrid_override_pattern", "value \"" + s + "\" is not a string of M, *, - and E" + accepted);
    out.assign(s.begin(), s.end());
  } else {
    r.fail("layers_block_type", "missing, and no hybrid_override_pattern (one of them lists the blocks)" + accepted);
  }
  return out;
}

int64_t nemotron_h_layers(const Reader& r) { return static_cast<int64_t>(nemotron_h_blocks(r).size()); }

// Nemotron 3's experts blocks (NemotronHConfig's keys and defaults): GLM-4.5's sigmoid router with groups, ungated
// ReLU² experts and a shared ReLU² MLP; Nemotron 3 Super's experts in a latent width (moe_latent_size).
void read_nemotron_h_experts(const Reader& r, ModelConfig& c) {
  c.experts_key = "n_routed_experts";
  c.experts = r.integer("n_routed_experts", 1, 8);
  c.experts_per_token = r.integer("num_experts_per_tok", 1, 2);
  if (c.experts_per_token > c.experts)
    r.fail("num_experts_per_tok", std::to_string(c.experts_per_token) + " is more than the " +
                                      std::to_string(c.experts) + " experts (accepted: at most n_routed_experts)");
  c.moe_intermediate = r.integer("moe_intermediate_size", 1, 7688);
  c.shared_intermediate = r.integer("moe_shared_expert_intermediate_size", 1, 7688);
  c.sigmoid_router = c.float_router_weights = true;
  c.groups = r.integer("n_group", 1, 1);
  c.topk_groups = r.integer("topk_group", 1, 1);
  if (c.experts % c.groups != 0 || c.topk_groups > c.groups)
    r.fail("n_group", std::to_string(c.groups) + " groups (topk_group " + std::to_string(c.topk_groups) + ") of " +
                          std::to_string(c.experts) +
                          " experts (accepted: a divisor of n_routed_experts, at least "
                          "topk_group)");
  c.norm_topk = r.boolean("norm_topk_prob", true);
  c.routed_scale = r.real(r.j, "routed_scaling_factor", 1.0);
  c.moe_latent = r.integer("moe_latent_size", 1, 0);  // (null or absent: none)
}

// Nemotron-H's blocks, its Mamba-2 sizes (NemotronHConfig's keys and defaults, with the published aliases
// mamba_n_groups / mamba_d_conv / mamba_dt_min), its ReLU² MLP and its float32 norm weights; every layer without RoPE.
void read_nemotron_h(const Reader& r, ModelConfig& c) {
  const std::vector<char> blocks = nemotron_h_blocks(r);
  c.linear.assign(blocks.size(), 0);
  c.mlp_blocks.assign(blocks.size(), 0);
  c.moe_blocks.assign(blocks.size(), 0);
  for (size_t l = 0; l < blocks.size(); ++l) {
    c.linear[l] = blocks[l] == 'M';
    c.mlp_blocks[l] = blocks[l] == '-' || blocks[l] == 'E';
    c.moe_blocks[l] = blocks[l] == 'E';
  }
  if (std::find(blocks.begin(), blocks.end(), 'E') != blocks.end()) read_nemotron_h_experts(r, c);
  c.nope.assign(blocks.size(), 1);
  c.relu2_mlp = c.norm_weight_fp32 = true;
  const auto alias = [&](const char* key, const char* old, int64_t min_value, int64_t fallback) {
    return r.has(key) ? r.integer(key, min_value) : r.integer(old, min_value, fallback);
  };
  c.mamba_heads = r.integer("mamba_num_heads", 1, 128);
  c.mamba_head_dim = r.integer("mamba_head_dim", 1, 64);
  c.mamba_state = r.integer("ssm_state_size", 1, 128);
  c.mamba_groups = alias("n_groups", "mamba_n_groups", 1, 8);
  c.conv_kernel = alias("conv_kernel", "mamba_d_conv", 2, 4);
  c.mamba_chunk = r.integer("chunk_size", 1, 128);
  c.mamba_conv_bias = r.boolean("use_conv_bias", true);
  c.mamba_proj_bias = r.boolean("use_bias", false);
  c.dt_min = r.real(r.j, "time_step_min", r.real(r.j, "mamba_dt_min", 0.001));
  if (c.mamba_heads % c.mamba_groups != 0)
    r.fail(r.has("n_groups") ? "n_groups" : "mamba_n_groups",
           std::to_string(c.mamba_groups) + " does not divide mamba_num_heads " + std::to_string(c.mamba_heads) +
               " (accepted: a divisor of it)");
  for (const char* key : {"mlp_hidden_act", "mamba_hidden_act"}) {
    const char* want = key[1] == 'l' ? "relu2" : "silu";
    if (r.has(key) && r.j.at(key) != want)
      r.fail(key, "value " + r.j.at(key).dump() + " is not supported (accepted: \"" + want + "\", as published)");
  }
}

// The decoder's sizes: vocabulary, hidden, layers, heads, head_dim, MLP width, the norms' epsilon.
void read_sizes(const Reader& r, ModelConfig& c) {
  c.vocab = r.integer("vocab_size", 1);
  c.hidden = r.integer("hidden_size", 1);
  c.layers = c.nemotron_h() ? nemotron_h_layers(r) : r.integer("num_hidden_layers", 1);
  c.heads = r.integer("num_attention_heads", 1);
  c.kv_heads = r.integer("num_key_value_heads", 1, c.nemotron_h() ? 8 : c.heads);  // (NemotronHConfig's default 8)
  c.intermediate = r.integer("intermediate_size", 1);
  if (c.heads % c.kv_heads != 0)
    r.fail("num_key_value_heads",
           std::to_string(c.kv_heads) + " does not divide num_attention_heads = " + std::to_string(c.heads));
  c.head_dim = r.integer("head_dim", 1, c.nemotron_h() ? 128 : c.hidden % c.heads == 0 ? c.hidden / c.heads : 0);
  if (c.head_dim == 0)
    r.fail("head_dim", "missing, and hidden_size " + std::to_string(c.hidden) + " is not a multiple of " +
                           "num_attention_heads " + std::to_string(c.heads));
  if (c.head_dim % 2 != 0) r.fail("head_dim", std::to_string(c.head_dim) + " is odd (RoPE rotates pairs)");
  c.rms_eps = c.nemotron_h() ? r.real(r.j, "layer_norm_epsilon", 1e-5) : r.real(r.j, "rms_norm_eps", 1e-6);
}

// A multimodal checkpoint's language model: its keys in text_config, its tensors under model.language_model.
bool composite(const ModelConfig& c) {
  return c.architecture == "Qwen3_5ForConditionalGeneration" ||
         c.architecture == "Qwen3_5MoeForConditionalGeneration" ||
         c.architecture == "Mistral3ForConditionalGeneration" || c.qwen3_vl() ||
         c.architecture == "Gemma3ForConditionalGeneration" || c.architecture == "Glm4vForConditionalGeneration" ||
         c.architecture == "Glm4vMoeForConditionalGeneration" || c.qwen2_vl() ||
         c.architecture == "Llama4ForConditionalGeneration" || c.architecture == "Gemma4ForConditionalGeneration" ||
         c.architecture == "Exaone4_5_ForConditionalGeneration" || c.architecture == "Glm46VForConditionalGeneration";
}

// The layouts of the families whose layers differ from Llama's in their norms, RoPE pairs, biases or multipliers
// (hf_config.hpp: Seed-OSS, ERNIE 4.5, OLMo, EXAONE 4.0, Hunyuan, GLM-4, OLMoE, Granite, Cohere, Llama 4), and the MLP
// biases no family here reads.
void read_family_layout(const Reader& r, ModelConfig& c) {
  if (c.seed_oss()) {
    c.qkv_bias = r.boolean("attention_bias", true);
    c.o_bias = r.boolean("attention_out_bias", false);
  }
  if (c.ernie4_5()) {
    c.rope_interleave = true;
    if (r.boolean("use_bias", false))
      r.fail("use_bias",
             "true is not supported (ERNIE 4.5's linear layers' biases would not be read; accepted: false "
             "or absent, as published)");
  }
  if (c.olmo()) c.qk_norm_full = c.post_norms = c.sandwich_norms = c.norm_weight_fp32 = true;
  if (c.helium()) c.norm_weight_fp32 = c.rope_interleave = true;
  if (c.olmoe()) {
    c.qk_norm_full = true;
    c.clip_qkv = r.real(r.j, "clip_qkv", 0.0);  // (null: none)
    if (c.clip_qkv < 0 || !std::isfinite(c.clip_qkv))
      r.fail("clip_qkv", "value " + r.j.at("clip_qkv").dump() + " is not a positive number (accepted: > 0 or null)");
  }
  if (c.exaone4()) c.qk_norm = c.post_norms = c.sandwich_norms = true;
  if (c.exaone_moe()) c.qk_norm = true;
  if (c.hunyuan()) c.qk_norm_after_rope = true;
  if (c.glm4()) c.sandwich_norms = true;
  if (c.glm_attention()) c.rope_interleave = true;
  if (c.afmoe()) {
    c.sandwich_norms = c.norm_weight_fp32 = true;
    if (r.boolean("mup_enabled", false)) c.embed_multiplier = std::sqrt(double(c.hidden));  // (as a Python float)
  }
  if (c.granite()) read_granite(r, c);
  if (c.cohere()) read_cohere(r, c);
  if (c.llama4()) read_llama4(r, c);
  if (c.bamba()) read_bamba(r, c);
  if (c.nemotron_h()) read_nemotron_h(r, c);
  // (a checkpoint with MLP biases would be run without them)
  if (r.boolean("mlp_bias", false))
    r.fail("mlp_bias", "true is not supported (the MLP's biases would not be read; accepted: false or absent)");
}

// The ids that end a response: generation_config.json's eos_token_id where the folder has one (what generate stops
// at), else config.json's (`config`, read from `file`).
std::vector<int64_t> stop_ids(const std::string& folder, const json& config, const std::string& file) {
  std::vector<int64_t> ids = eos_ids(config, file);
  const std::filesystem::path generation = std::filesystem::path(folder) / "generation_config.json";
  if (std::filesystem::is_regular_file(generation)) {
    const json gj = read_json(generation.string());
    if (gj.is_object() && gj.contains("eos_token_id") && !gj.at("eos_token_id").is_null())
      ids = eos_ids(gj, generation.string());
  }
  return ids;
}

}  // namespace

ModelConfig read_config(const std::string& folder) {
  namespace fs = std::filesystem;
  const std::string file = (fs::path(folder) / "config.json").string();
  if (!fs::is_directory(folder))
    throw std::runtime_error("[target] path \"" + folder +
                             "\" is not a folder (a Hugging Face checkpoint folder with "
                             "config.json and model.safetensors is expected)");
  if (!fs::exists(file))
    throw std::runtime_error(file + ": cannot be read (the checkpoint folder needs its config.json)");
  const json j = read_json(file);
  if (!j.is_object()) throw std::runtime_error(file + ": expected a JSON object");
  ModelConfig c;
  c.path = file;
  const Reader top{j, file};
  c.architecture = read_architecture(top);
  const bool multimodal = composite(c);
  // (Qwen2-VL and Qwen2.5-VL as published hold them at the top, beside vision_config; transformers 5 saves a
  // text_config)
  const bool flat = c.qwen2_vl() && !(j.contains("text_config") && j.at("text_config").is_object());
  if (multimodal && !flat && !(j.contains("text_config") && j.at("text_config").is_object()))
    top.fail("text_config", "missing (" + c.architecture + " holds its language model's keys there)");
  if (multimodal) c.prefix = "model.language_model.";
  const json& text = multimodal && !flat ? j.at("text_config") : j;
  const Reader r{text, multimodal && !flat ? file + ": text_config" : file};
  read_sizes(r, c);
  const bool deepseek = c.architecture == "DeepseekV3ForCausalLM" || c.architecture == "Glm4MoeLiteForCausalLM" ||
                        c.deepseek_v2() || c.mistral4() || c.youtu();
  if (deepseek) {
    read_mla(r, c);
    if (c.deepseek_v2()) c.rope_interleave = true;  // (its rotary's complex products: pairs interleaved, no key)
    c.kv_heads = c.heads;                           // (every head's keys and values from the latent)
  }
  read_rope(r, c);
  if (deepseek) read_mla_scale(c);
  if (r.has("max_position_embeddings"))
    c.max_position = static_cast<int64_t>(r.real(text, "max_position_embeddings", 0.0));
  if (c.rope.type != "default" && !c.gemma3())  // (Gemma 3's max_position_embeddings is the scaled length)
    c.max_position =
        std::max(c.max_position, static_cast<int64_t>(c.rope.factor * double(c.rope.original_max_position)));
  const bool qwen2 = c.architecture == "Qwen2ForCausalLM" || c.qwen2_vl();
  const bool moe = c.architecture == "Qwen3MoeForCausalLM" || c.architecture == "Qwen3VLMoeForConditionalGeneration";
  const bool qwen3 = c.architecture == "Qwen3ForCausalLM" || moe || c.qwen3_vl();
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  const bool mistral = c.mistral_kind();
  const bool glm = c.glm4_moe();                                   // biases on q, k, v only; optional q / k norms
  const bool qwen2_moe = c.architecture == "Qwen2MoeForCausalLM";  // q / k / v biases unless qkv_bias is false
  c.qk_norm = qwen3 || c.hybrid() || c.dots1() || c.apertus() || c.afmoe() || (glm && r.boolean("use_qk_norm", false));
  if (c.minimax_m2()) read_minimax_m2_norms(r, c);
  c.qkv_bias = qwen2 || (glm && r.boolean("attention_bias", false)) || (qwen2_moe && r.boolean("qkv_bias", true)) ||
               (c.glm_attention() && r.boolean("attention_bias", true));  // (GlmConfig's, Glm4Config's default)
  const bool phi3 = c.architecture == "Phi3ForCausalLM";                  // no biases
  const bool gpt_oss = c.architecture == "GptOssForCausalLM";  // biases on q, k, v, o unless attention_bias false
  c.qkv_bias = c.qkv_bias || (c.helium() && r.boolean("attention_bias", false));
  c.o_bias = !qwen2 && !qwen2_moe && !mistral && !glm && !phi3 && !c.minimax_m2() && !c.glm_attention() &&
             !c.exaone4() && !c.exaone_moe() && !c.ernie4_5() && !c.nemotron_h() && !c.helium() &&
             r.boolean("attention_bias", gpt_oss);
  if (c.o_bias) c.qkv_bias = true;  // (attention_bias: q, k, v and o)
  c.sinks = c.norm_weight_fp32 = gpt_oss;
  if (c.granite_swa()) c.sinks = true;
  read_family_layout(r, c);
  read_quantization(r, c);
  if (multimodal && !flat) read_quantization(top, c);  // (a composite checkpoint's quantization_config: the top)
  // every family here gates its MLP with SiLU (SwiGLU) but Gemma 3 (GELU's tanh approximation); another
  // activation would be run as the wrong one
  if (c.gemma3()) {
    read_gemma3(r, c);
  } else if (c.gemma4()) {
    read_gemma4(r, c);
  } else if (c.arcee() || c.apertus()) {  // (ArceeConfig's default: "relu2"; ApertusConfig's: "xielu")
    const char* act = c.arcee() ? "relu2" : "xielu";
    (c.arcee() ? c.relu2_mlp : c.xielu_mlp) = true;
    if (r.has("hidden_act") && r.j.at("hidden_act") != act)
      r.fail("hidden_act", "value " + r.j.at("hidden_act").dump() + " is not supported for " + c.architecture +
                               " (accepted: \"" + act + "\", its ungated MLP's)");
  } else if (r.has("hidden_act") && r.j.at("hidden_act") != "silu") {
    r.fail("hidden_act", "value " + r.j.at("hidden_act").dump() + " is not supported (accepted: \"silu\")");
  }
  const bool hybrid_moe = c.architecture.rfind("Qwen3_5Moe", 0) == 0 || c.architecture == "Qwen3NextForCausalLM";
  if (moe || qwen2_moe || mixtral || glm || gpt_oss || hybrid_moe || (deepseek && !c.youtu()) || c.minimax_m2() ||
      c.ernie4_5_moe() || c.granite_moe() || c.dots1() || c.hunyuan_moe() || c.olmoe() || c.llama4() || c.afmoe() ||
      c.exaone_moe())
    read_experts(r, c);
  if (multimodal && top.has("tie_word_embeddings"))  // (the composite model's own key decides)
    c.tie_embeddings = top.boolean("tie_word_embeddings", false) ? 1 : 0;
  else if (r.has("tie_word_embeddings"))
    c.tie_embeddings = r.boolean("tie_word_embeddings", false) ? 1 : 0;
  if (c.hybrid()) read_linear_attention(r, c);
  read_sliding_layers(r,
                      mistral || phi3 || gpt_oss || c.gemma3() || c.gemma4() || c.architecture == "Olmo3ForCausalLM" ||
                          c.exaone4() || c.exaone_moe() || c.cohere2() || c.afmoe() || c.granite_swa(),
                      c);
  if (c.gemma4()) read_gemma4_heads(r, c), read_gemma4_sharing(r, c);
  if (((c.exaone4() || c.exaone_moe()) && c.sliding_window > 0) || c.cohere2() || c.afmoe()) {  // (full: no RoPE)
    c.nope.assign(static_cast<size_t>(c.layers), 0);
    for (int64_t l = 0; l < c.layers; ++l) c.nope[static_cast<size_t>(l)] = !c.sliding[static_cast<size_t>(l)];
  }
  if (c.architecture == "SmolLM3ForCausalLM") read_nope_layers(r, c);
  if (c.granite_swa()) read_layer_thetas(r, c);
  c.eos = stop_ids(folder, text.contains("eos_token_id") ? text : j, file);
  return c;
}

}  // namespace flashdraft::hf

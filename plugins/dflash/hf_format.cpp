// A DFlash drafter as a Hugging Face folder (layout in hf_format.hpp).
#include "hf_format.hpp"

#include <flashdraft/rope_config.hpp>
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;

namespace flashdraft::hf_drafter {

namespace {

using Json = nlohmann::ordered_json;

const std::map<std::string, std::pair<std::string, c10::ScalarType>>& dtypes() {
  static const std::map<std::string, std::pair<std::string, c10::ScalarType>> table = {
      {"float32", {"F32", at::kFloat}}, {"bfloat16", {"BF16", at::kBFloat16}}, {"float16", {"F16", at::kHalf}}};
  return table;
}

std::string dtype_name(c10::ScalarType t) {
  for (const auto& [name, d] : dtypes())
    if (d.second == t) return name;
  throw Error(std::string("a drafter in ") + c10::toString(t) +
              " cannot be exported (accepted: float32, bfloat16, float16)");
}

std::string shape_str(const std::vector<int64_t>& s) { return list_str(s); }

std::vector<int64_t> shape_of(const Named& params, const std::string& name) {
  for (const auto& [n, t] : params)
    if (n == name) return std::vector<int64_t>(t.sizes().begin(), t.sizes().end());
  throw Error("the drafter has no tensor '" + name + "': only a DFlash drafter (plugin \"dflash\") has the layout " +
              "of a Hugging Face DFlash folder");
}

// Reads config.json keys with sentences naming the file and the key.
struct ConfigReader {
  const Json& j;
  std::string file;
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(file + ": " + key + ": " + why);
  }
  const Json* find(const std::string& key) const {
    if (j.contains("dflash_config") && j["dflash_config"].is_object() && j["dflash_config"].contains(key))
      return &j["dflash_config"][key];
    return j.contains(key) && !j[key].is_null() ? &j[key] : nullptr;
  }
  int64_t integer(const std::string& key) const {
    const Json* v = find(key);
    if (!v) fail(key, "missing (a DFlash drafter's config.json has it)");
    if (!v->is_number_integer()) fail(key, "value " + v->dump() + " is not an integer");
    return v->get<int64_t>();
  }
  double real(const std::string& key, double fallback) const {
    const Json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) fail(key, "value " + v->dump() + " is not a number");
    return v->get<double>();
  }
};

void read_architecture(const ConfigReader& r, const Variant& v) {
  const Json& a = r.j.contains("architectures") ? r.j["architectures"] : Json();
  if (!a.is_array() || a.empty() || !a[0].is_string())
    r.fail("architectures", "missing (accepted: [\"" + v.architecture + "\"])");
  const std::string name = a[0].get<std::string>();
  if (name != v.architecture)
    r.fail("architectures", "\"" + name + "\" is not a " + v.display + " drafter (accepted: \"" + v.architecture +
                                "\"; a target model or another drafter cannot initialise a " + v.display +
                                " drafter, [drafter] plugin = \"" + v.plugin + "\")");
}

std::string read_dtype(const ConfigReader& r) {
  const Json* v = r.find("torch_dtype");
  if (!v) v = r.find("dtype");
  if (!v) return "float32";
  if (!v->is_string() || !dtypes().count(v->get<std::string>()))
    r.fail("torch_dtype",
           "value " + v->dump() + " is not a dtype a drafter is stored in (accepted: float32, bfloat16, float16)");
  return v->get<std::string>();
}

// Keys of the reference's config that change the drafter's function in ways this drafter
// does not compute: accepted only at the reference's defaults.
// layer_types and the window of the sliding layers, as transformers' Qwen3Config reads them
// (sliding_window counts only with use_sliding_window true); every layer full: no types.
void read_layer_types(const ConfigReader& r, Layout& l) {
  const Json* types = r.find("layer_types");
  if (!types || types->is_null()) return;
  if (!types->is_array()) r.fail("layer_types", "value " + types->dump() + " is not a list");
  bool sliding = false;
  for (const auto& t : *types) {
    if (!t.is_string() || (t != "full_attention" && t != "sliding_attention"))
      r.fail("layer_types", "holds " + t.dump() + " (accepted: \"full_attention\", \"sliding_attention\")");
    l.layer_types.push_back(t.get<std::string>());
    sliding = sliding || t == "sliding_attention";
  }
  if (static_cast<int64_t>(l.layer_types.size()) != l.layers)
    r.fail("layer_types", std::to_string(l.layer_types.size()) +
                              " entries for num_hidden_layers = " + std::to_string(l.layers) + " (one per layer)");
  if (!sliding) {
    l.layer_types.clear();
    return;
  }
  const Json* use = r.find("use_sliding_window");
  const Json* window = r.find("sliding_window");
  if (!use || !use->is_boolean() || !use->get<bool>() || !window || !window->is_number_integer() ||
      window->get<int64_t>() < 1)
    r.fail("sliding_window",
           "layer_types has \"sliding_attention\" layers but no window (accepted: "
           "use_sliding_window true and sliding_window >= 1)");
  l.sliding_window = window->get<int64_t>();
}

// The reference's scales and cap (dflash_config first, then the top level, as its _draft_value reads them): a cap
// that is null or not positive is none.
void read_scales(const ConfigReader& r, Layout& l) {
  for (auto [key, value] : {std::pair<const char*, double*>{"input_embedding_scale", &l.input_scale},
                            {"output_multiplier", &l.output_multiplier}}) {
    *value = r.real(key, 1.0);
    if (!(*value > 0) || !std::isfinite(*value))
      r.fail(key, "value " + std::to_string(*value) + " is not a positive number (accepted: > 0, or absent for 1)");
  }
  const Json* cap = r.find("final_logit_softcapping");
  if (cap && !cap->is_null() && !cap->is_number())
    r.fail("final_logit_softcapping", "value " + cap->dump() +
                                          " is not a number (accepted: a cap > 0; 0, null or "
                                          "absent for none)");
  l.softcap = cap && cap->is_number() && cap->get<double>() > 0 ? cap->get<double>() : 0.0;
}

std::vector<int64_t> read_ids(const ConfigReader& r) {
  const Json* v = r.find("target_layer_ids");
  if (!v || !v->is_array() || v->empty())
    r.fail("dflash_config.target_layer_ids", "missing or empty (a list of target layer ids is needed)");
  std::vector<int64_t> ids;
  for (const auto& x : *v) {
    if (!x.is_number_integer()) r.fail("dflash_config.target_layer_ids", "entry " + x.dump() + " is not an integer");
    ids.push_back(x.get<int64_t>());
  }
  return ids;
}

void compare(const std::string& file, const Layout& got, const Layout& want) {
  drafter_format::check_sizes(
      file,
      {{"hidden_size", got.hidden, want.hidden, "the target's hidden size ([drafter] hidden)"},
       {"num_hidden_layers", got.layers, want.layers, "[drafter] layers"},
       {"num_attention_heads", got.heads, want.heads, "[drafter] heads"},
       {"num_key_value_heads", got.kv_heads, want.kv_heads, "[drafter] kv_heads"},
       {"head_dim", got.head_dim, want.head_dim, "[drafter] head_dim, or hidden / heads"},
       {"intermediate_size", got.intermediate, want.intermediate, "[drafter] ffn, or 3 x hidden"},
       {"vocab_size", got.vocab, want.vocab, "the target's vocabulary"},
       {"num_target_layers", got.target_layers, want.target_layers, "the target's decoder layers"},
       {"block_size", got.block_size, want.block_size, "[drafter] block_size"},
       {"dflash_config.mask_token_id", got.mask_token, want.mask_token, "[drafter] mask_token"}},
      "a DFlash drafter");
  if (got.target_layer_ids != want.target_layer_ids)
    throw Error(file + ": dflash_config.target_layer_ids = " + list_str(got.target_layer_ids) +
                ", but the experiment's drafter reads target layers " + list_str(want.target_layer_ids) +
                " (from [drafter] target_layer_ids); accepted: the same ids");
  const auto all_full = [](const Layout& l) {
    return std::vector<std::string>(static_cast<size_t>(l.layers), "full_attention");
  };
  const std::vector<std::string> got_types = got.layer_types.empty() ? all_full(got) : got.layer_types;
  const std::vector<std::string> want_types = want.layer_types.empty() ? all_full(want) : want.layer_types;
  if (got_types != want_types || got.sliding_window != want.sliding_window)
    throw Error(file + ": layer_types / sliding_window = " + join(got_types) + " / " +
                std::to_string(got.sliding_window) + ", but the experiment's drafter has " + join(want_types) + " / " +
                std::to_string(want.sliding_window) + " (from [drafter] layer_types and sliding_window)");
  if (got.is_causal != want.is_causal)
    throw Error(file + ": is_causal = " + (got.is_causal ? "true" : "false") +
                ", but the experiment's drafter attends " + (want.is_causal ? "causally" : "bidirectionally") +
                " inside a block (from [mask] in_block); " + "accepted: a folder trained with the same in_block");
  for (const auto& [key, wanted] : want.extra)
    if (got.value(key) != wanted)
      throw Error(file + ": dflash_config." + key + " = " + std::to_string(got.value(key)) +
                  ", but the experiment's drafter has " + std::to_string(wanted) + " (from [drafter] " + key +
                  "); accepted: a folder exported with " + key + " = " + std::to_string(wanted));
  if (got.input_scale != want.input_scale || got.output_multiplier != want.output_multiplier ||
      got.softcap != want.softcap)
    throw Error(file + ": input_embedding_scale, output_multiplier, final_logit_softcapping = " +
                c10::str(got.input_scale, ", ", got.output_multiplier, ", ", got.softcap) +
                ", but the experiment's drafter has " +
                c10::str(want.input_scale, ", ", want.output_multiplier, ", ", want.softcap) +
                " (from the [drafter] keys of the same names; a cap of 0 is none); accepted: the same values");
  if (rope_str(got.rope) != rope_str(want.rope))
    throw Error(file + ": the RoPE scaling is " + rope_str(got.rope) + ", but the experiment's drafter has " +
                rope_str(want.rope) + " (from [drafter] rope_type and its rope_* keys); accepted: the same");
  if (got.rope_theta != want.rope_theta || got.rms_eps != want.rms_eps)
    throw Error(file + ": rope_theta = " + std::to_string(got.rope_theta) + ", rms_norm_eps = " +
                std::to_string(got.rms_eps) + ", but the experiment's drafter has " + std::to_string(want.rope_theta) +
                " and " + std::to_string(want.rms_eps) + " (from [drafter] rope_theta and rms_eps)");
}

// Every tensor of the folder: present, of the layout's shape, stored in config.json's dtype,
// and nothing else.
void check_tensors(const safetensors::Checkpoint& ck, const Layout& layout, const Variant& variant) {
  const std::string folder = ck.folder();
  const std::string stored = dtypes().at(layout.dtype).first;
  const auto shapes = tensor_shapes(layout, variant);
  for (const auto& [name, shape] : shapes) {
    const safetensors::TensorInfo* info = ck.find(name);
    if (!info)
      throw Error(folder + ": tensor '" + name + "' " + shape_str(shape) + " is missing (a " + variant.display +
                  " drafter of this config.json has it)");
    if (info->shape != shape)
      throw Error(folder + ": tensor '" + name + "' has shape " + shape_str(info->shape) + ", config.json implies " +
                  shape_str(shape));
    if (info->dtype != stored)
      throw Error(folder + ": tensor '" + name + "' is stored as " + info->dtype +
                  ", but config.json says torch_dtype " + layout.dtype + " (accepted: every tensor in " + stored + ")");
  }
  for (const auto& name : ck.names()) {
    bool known = false;
    for (const auto& s : shapes) known = known || s.first == name;
    if (!known)
      throw Error(folder + ": holds tensor '" + name + "', which a " + variant.display +
                  " drafter of this config.json does not have " + "(accepted: exactly the " +
                  std::to_string(shapes.size()) + " tensors of the layout)");
  }
}

}  // namespace

int64_t Layout::value(const std::string& key) const {
  for (const auto& [k, v] : extra)
    if (k == key) return v;
  throw Error("the layout has no value for dflash_config." + key);
}

TensorShapes tensor_shapes(const Layout& l, const Variant& variant) {
  const int64_t H = l.hidden, q = l.heads * l.head_dim, kv = l.kv_heads * l.head_dim, F = l.intermediate;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {
      {"fc.weight", {H, static_cast<int64_t>(l.target_layer_ids.size()) * H}}, {"hidden_norm.weight", {H}}};
  for (int64_t i = 0; i < l.layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const std::vector<std::pair<std::string, std::vector<int64_t>>> layer = {
        {"input_layernorm.weight", {H}},           {"self_attn.q_proj.weight", {q, H}},
        {"self_attn.k_proj.weight", {kv, H}},      {"self_attn.v_proj.weight", {kv, H}},
        {"self_attn.o_proj.weight", {H, q}},       {"self_attn.q_norm.weight", {l.head_dim}},
        {"self_attn.k_norm.weight", {l.head_dim}}, {"post_attention_layernorm.weight", {H}},
        {"mlp.gate_proj.weight", {F, H}},          {"mlp.up_proj.weight", {F, H}},
        {"mlp.down_proj.weight", {H, F}}};
    for (const auto& [name, shape] : layer) out.emplace_back(p + name, shape);
  }
  out.push_back({"norm.weight", {H}});
  if (variant.tensors)
    for (auto& t : variant.tensors(l)) out.push_back(std::move(t));
  return out;
}

Layout describe(const Config& table, Drafter& drafter, const TargetModel& target, c10::ScalarType dtype,
                const std::string& mask, const Config& mask_table, const Variant& variant) {
  if (mask != "dflash")
    throw Error("[mask] plugin = \"" + mask + "\": a DFlash folder says only how the \"dflash\" mask attends inside " +
                "a block (its is_causal key); the reference and the serving engines would run the drafter with that " +
                "mask, not this one (accepted for export: [mask] plugin = \"dflash\", in_block \"bidirectional\" " +
                "or \"causal\")");
  const Named params = drafter.parameters();
  Layout l;
  l.is_causal = mask_table.string("in_block") == "causal";
  l.hidden = shape_of(params, "fc.weight")[0];
  while (true) {
    const std::string p = "layers." + std::to_string(l.layers) + ".input_layernorm.weight";
    bool found = false;
    for (const auto& n : params) found = found || n.first == p;
    if (!found) break;
    ++l.layers;
  }
  l.head_dim = shape_of(params, "layers.0.self_attn.q_norm.weight")[0];
  l.heads = shape_of(params, "layers.0.self_attn.q_proj.weight")[0] / l.head_dim;
  l.kv_heads = shape_of(params, "layers.0.self_attn.k_proj.weight")[0] / l.head_dim;
  l.intermediate = shape_of(params, "layers.0.mlp.gate_proj.weight")[0];
  l.vocab = target.vocab;
  l.target_layers = target.layers;
  l.block_size = table.integer("block_size");
  l.mask_token = table.integer("mask_token") < 0 ? target.vocab - 1 : table.integer("mask_token");
  // The layers the context reads: the first fc-input / hidden of the drafter's target layers
  // (labels from the target read its last layer too, after them).
  l.target_layer_ids = drafter.target_layers(target);
  const int64_t context_layers = shape_of(params, "fc.weight")[1] / l.hidden;
  if (context_layers > 0 && static_cast<int64_t>(l.target_layer_ids.size()) > context_layers)
    l.target_layer_ids.resize(static_cast<size_t>(context_layers));
  l.rope_theta = table.real("rope_theta");
  l.rms_eps = table.real("rms_eps");
  l.rope = rope_scaling(table);
  l.input_scale = table.real("input_embedding_scale");
  l.output_multiplier = table.real("output_multiplier");
  l.softcap = table.real("final_logit_softcapping");
  const std::vector<std::string> types = table.strings("layer_types");
  if (std::find(types.begin(), types.end(), "sliding_attention") != types.end()) {
    l.layer_types = types;
    l.sliding_window = table.integer("sliding_window");
  }
  l.dtype = dtype_name(dtype);
  l.target = target.source;
  l.architecture = variant.architecture;
  for (const std::string& key : variant.keys) l.extra.emplace_back(key, table.integer(key));
  return l;
}

std::string config_json(const Layout& l) {
  Json j;
  j["architectures"] = {l.architecture};
  j["model_type"] = "qwen3";
  j["hidden_size"] = l.hidden;
  j["intermediate_size"] = l.intermediate;
  j["num_hidden_layers"] = l.layers;
  j["num_attention_heads"] = l.heads;
  j["num_key_value_heads"] = l.kv_heads;
  j["head_dim"] = l.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = l.rms_eps;
  j["rope_theta"] = l.rope_theta;
  j["rope_parameters"] = {{"rope_type", l.rope.type}, {"rope_theta", l.rope_theta}};
  write_rope_json(l.rope, j["rope_parameters"]);
  // (YaRN's context: transformers warns where max_position_embeddings / the pretraining length is not its factor)
  if (l.rope.type == "yarn")
    j["max_position_embeddings"] = static_cast<int64_t>(double(l.rope.original_max_position) * l.rope.factor);
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = false;
  j["vocab_size"] = l.vocab;
  j["num_target_layers"] = l.target_layers;
  j["block_size"] = l.block_size;
  j["torch_dtype"] = l.dtype;
  j["dtype"] = l.dtype;
  j["is_causal"] = l.is_causal;
  if (!l.layer_types.empty()) {
    j["layer_types"] = l.layer_types;
    j["use_sliding_window"] = true;
    j["sliding_window"] = l.sliding_window;
  }
  j["dflash_config"] = {
      {"mask_token_id", l.mask_token}, {"target_layer_ids", l.target_layer_ids}, {"block_size", l.block_size}};
  for (const auto& [key, value] : l.extra) j["dflash_config"][key] = value;
  // (written where they differ from the reference's defaults, which is what a folder without them computes)
  if (l.input_scale != 1.0) j["dflash_config"]["input_embedding_scale"] = l.input_scale;
  if (l.output_multiplier != 1.0) j["dflash_config"]["output_multiplier"] = l.output_multiplier;
  if (l.softcap > 0) j["dflash_config"]["final_logit_softcapping"] = l.softcap;
  j["flashdraft"] = {{"target", l.target},
                     {"target_layer_ids_meaning",
                      "id L = the output of target decoder layer L = transformers' "
                      "hidden_states[L + 1]"}};
  return j.dump(2) + "\n";
}

Layout read_config(const std::string& folder, const Variant& variant) {
  if (!fs::is_directory(folder))
    throw Error("\"" + folder + "\" is not a folder (a Hugging Face DFlash drafter folder with config.json and " +
                "model.safetensors is expected)");
  return read_config_file((fs::path(folder) / "config.json").string(), variant);
}

Layout read_config_file(const std::string& file, const Variant& variant) {
  std::ifstream in(file);
  if (!in) throw Error(file + ": cannot be read (a DFlash drafter folder has a config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return read_config_text(text.str(), file, variant);
}

Layout read_config_text(const std::string& text, const std::string& file, const Variant& variant) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw Error(file + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object()) throw Error(file + ": expected a JSON object");
  const ConfigReader r{j, file};
  read_architecture(r, variant);
  Layout l;
  l.architecture = variant.architecture;
  for (const std::string& key : variant.keys) l.extra.emplace_back(key, r.integer(key));
  l.hidden = r.integer("hidden_size");
  l.layers = r.integer("num_hidden_layers");
  l.heads = r.integer("num_attention_heads");
  l.kv_heads = r.integer("num_key_value_heads");
  l.head_dim = r.find("head_dim") ? r.integer("head_dim") : (l.heads > 0 ? l.hidden / l.heads : 0);
  l.intermediate = r.integer("intermediate_size");
  l.vocab = r.integer("vocab_size");
  l.target_layers = r.integer("num_target_layers");
  l.block_size = r.integer("block_size");
  l.mask_token = r.integer("mask_token_id");
  l.target_layer_ids = read_ids(r);
  l.rms_eps = r.real("rms_norm_eps", 1e-6);
  const Json* rope = r.find("rope_parameters");
  l.rope_theta = rope && rope->is_object() && rope->contains("rope_theta") && (*rope)["rope_theta"].is_number()
                     ? (*rope)["rope_theta"].get<double>()
                     : r.real("rope_theta", 10000.0);
  l.dtype = read_dtype(r);
  const Json* causal = r.find("is_causal");
  if (causal && !causal->is_boolean()) r.fail("is_causal", "value " + causal->dump() + " is not true or false");
  l.is_causal = causal && causal->get<bool>();
  read_layer_types(r, l);
  read_scales(r, l);
  l.rope = read_rope_json(j, [&r](const std::string& key, const std::string& why) { r.fail(key, why); });
  if (j.contains("flashdraft") && j["flashdraft"].is_object() && j["flashdraft"].contains("target") &&
      j["flashdraft"]["target"].is_string())
    l.target = j["flashdraft"]["target"].get<std::string>();
  return l;
}

void write(const std::string& folder, const Layout& layout, const Named& weights, const Variant& variant) {
  const c10::ScalarType dtype = dtypes().at(layout.dtype).second;
  Named out;
  for (const auto& [name, shape] : tensor_shapes(layout, variant)) {
    const at::Tensor* found = nullptr;
    for (const auto& w : weights)
      if (w.first == name) found = &w.second;
    if (!found) throw Error("cannot export: the drafter has no tensor '" + name + "' " + shape_str(shape));
    const std::vector<int64_t> have(found->sizes().begin(), found->sizes().end());
    if (have != shape)
      throw Error("cannot export: tensor '" + name + "' has shape " + shape_str(have) + ", the layout says " +
                  shape_str(shape));
    out.emplace_back(name, found->detach().to(at::kCPU, dtype).contiguous());
  }
  if (out.size() != weights.size())
    throw Error("cannot export: the drafter has " + std::to_string(weights.size()) + " tensors, the " +
                variant.display + " layout " + std::to_string(out.size()) +
                " (a tensor the layout does not name would be lost)");
  drafter_format::write_folder(folder, out, config_json(layout));
}

void import(const std::string& folder, const Layout& expected, const Named& params, const Variant& variant) {
  const Layout got = read_config(folder, variant);
  compare((fs::path(folder) / "config.json").string(), got, expected);
  const std::unique_ptr<safetensors::Checkpoint> ck = drafter_format::open_checkpoint(folder);
  check_tensors(*ck, got, variant);
  drafter_format::copy_into(folder, *ck, params);
}

std::string Format::layout(Drafter& drafter, const FormatInput& run) const {
  return config_json(describe(run.drafter, drafter, run.target, run.dtype, run.mask, run.mask_table, variant_));
}

void Format::write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const {
  hf_drafter::write(folder, read_config_text(layout, "the run's layout", variant_), tensors, variant_);
}

void Format::import(const std::string& folder, Drafter& drafter, const FormatInput& run,
                    const NamedTensors& tensors) const {
  hf_drafter::import(folder, describe(run.drafter, drafter, run.target, run.dtype, run.mask, run.mask_table, variant_),
                     tensors, variant_);
}

}  // namespace flashdraft::hf_drafter

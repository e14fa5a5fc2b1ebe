// An EAGLE-3 drafter as a Hugging Face folder (layout in hf_eagle3.hpp).
#include "hf_format.hpp"

#include <flashdraft/rope_config.hpp>
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace fs = std::filesystem;

namespace flashdraft::hf_eagle3 {

namespace {

using Json = nlohmann::ordered_json;

c10::ScalarType float_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw Error("dtype \"" + name + "\" is not one a drafter is stored in (accepted: float32, bfloat16, float16)");
}

std::string dtype_name(c10::ScalarType t) {
  if (t == at::kFloat) return "float32";
  if (t == at::kBFloat16) return "bfloat16";
  if (t == at::kHalf) return "float16";
  throw Error(std::string("a drafter in ") + c10::toString(t) +
              " cannot be exported (accepted: float32, bfloat16, float16)");
}

std::string stored_dtype(const std::string& tensor, const std::string& dtype) {
  if (tensor == "d2t") return "I64";
  if (tensor == "t2d") return "BOOL";
  return dtype == "float32" ? "F32" : dtype == "bfloat16" ? "BF16" : "F16";
}

c10::ScalarType tensor_dtype(const std::string& tensor, const std::string& dtype) {
  if (tensor == "d2t") return at::kLong;
  if (tensor == "t2d") return at::kBool;
  return float_dtype(dtype);
}

const at::Tensor* find(const Named& named, const std::string& name) {
  for (const auto& [n, t] : named)
    if (n == name) return &t;
  return nullptr;
}

std::vector<int64_t> shape_of(const Named& named, const std::string& name) {
  const at::Tensor* t = find(named, name);
  if (!t)
    throw Error("the drafter has no tensor '" + name + "': only an EAGLE-3 drafter (plugin \"eagle3\") has the " +
                "layout of a Hugging Face EAGLE-3 folder");
  return std::vector<int64_t>(t->sizes().begin(), t->sizes().end());
}

struct Reader {
  const Json& j;
  std::string file;
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(file + ": " + key + ": " + why);
  }
  int64_t integer(const std::string& key) const {
    if (!j.contains(key) || !j[key].is_number_integer())
      fail(key, j.contains(key) ? "value " + j[key].dump() + " is not an integer"
                                : "missing (an EAGLE-3 drafter's config.json has it)");
    return j[key].get<int64_t>();
  }
  double real(const std::string& key, double fallback) const {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) fail(key, "value " + j[key].dump() + " is not a number");
    return j[key].get<double>();
  }
};

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> tensor_shapes(const Layout& l) {
  const int64_t H = l.hidden, q = l.heads * l.head_dim, kv = l.kv_heads * l.head_dim, F = l.intermediate;
  return {{"fc.weight", {H, static_cast<int64_t>(l.aux_layer_ids.size()) * H}},
          {"midlayer.input_layernorm.weight", {H}},
          {"midlayer.hidden_norm.weight", {H}},
          {"midlayer.self_attn.q_proj.weight", {q, 2 * H}},
          {"midlayer.self_attn.k_proj.weight", {kv, 2 * H}},
          {"midlayer.self_attn.v_proj.weight", {kv, 2 * H}},
          {"midlayer.self_attn.o_proj.weight", {H, q}},
          {"midlayer.post_attention_layernorm.weight", {H}},
          {"midlayer.mlp.gate_proj.weight", {F, H}},
          {"midlayer.mlp.up_proj.weight", {F, H}},
          {"midlayer.mlp.down_proj.weight", {H, F}},
          {"norm.weight", {H}},
          {"lm_head.weight", {l.draft_vocab, H}},
          {"d2t", {l.draft_vocab}},
          {"t2d", {l.vocab}}};
}

Layout describe(const Config& table, Drafter& drafter, const TargetModel& target, c10::ScalarType dtype,
                int64_t seq_len) {
  Named all = drafter.parameters();
  for (auto& b : drafter.buffers()) all.push_back(b);
  Layout l;
  l.hidden = shape_of(all, "fc.weight")[0];
  l.heads = table.integer("heads");
  l.kv_heads = table.integer("kv_heads");
  l.head_dim = shape_of(all, "midlayer.self_attn.q_proj.weight")[0] / l.heads;
  l.intermediate = shape_of(all, "midlayer.mlp.gate_proj.weight")[0];
  l.vocab = target.vocab;
  l.draft_vocab = shape_of(all, "lm_head.weight")[0];
  l.target_layers = target.layers;
  const std::vector<int64_t> ids = drafter.target_layers(target);
  l.aux_layer_ids.assign(ids.begin(), ids.begin() + std::min<size_t>(3, ids.size()));
  l.rope_theta = table.real("rope_theta");
  l.rope = rope_scaling(table);
  l.rms_eps = table.real("rms_eps");
  l.max_position = table.integer("max_position") > 0 ? table.integer("max_position") : std::max<int64_t>(seq_len, 2048);
  l.ttt_steps = table.integer("ttt_steps");
  l.dtype = dtype_name(dtype);
  l.target = target.source;
  return l;
}

std::string config_json(const Layout& l) {
  Json j;
  j["architectures"] = {kArchitecture};
  j["model_type"] = "llama";
  j["hidden_size"] = l.hidden;
  j["num_attention_heads"] = l.heads;
  j["num_key_value_heads"] = l.kv_heads;
  j["head_dim"] = l.head_dim;
  j["intermediate_size"] = l.intermediate;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = l.rms_eps;
  j["rope_theta"] = l.rope_theta;
  if (l.rope.type != "default") write_rope_json(l.rope, j["rope_scaling"]);
  j["max_position_embeddings"] = l.max_position;
  j["vocab_size"] = l.vocab;
  j["draft_vocab_size"] = l.draft_vocab;
  j["num_hidden_layers"] = 1;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["tie_word_embeddings"] = false;
  j["torch_dtype"] = l.dtype;
  std::vector<int64_t> serving;
  for (int64_t id : l.aux_layer_ids) serving.push_back(id + 1);
  j["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", serving}, {"use_aux_hidden_state", true}};
  j["flashdraft"] = {
      {"target", l.target},
      {"target_layer_ids", l.aux_layer_ids},
      {"num_target_layers", l.target_layers},
      {"ttt_steps", l.ttt_steps},
      {"target_layer_ids_meaning",
       "flashdraft id l = the output of target decoder layer l = transformers' hidden_states[l + 1]; "
       "eagle_config.eagle_aux_hidden_state_layer_ids holds l + 1, the decoder layers whose input vLLM captures "
       "(SGLang adds 1 to the ids it reads: give it target_layer_ids)"}};
  return j.dump(2) + "\n";
}

Layout read_config_file(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw Error(file + ": cannot be read (an EAGLE-3 drafter folder has a config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return read_config_text(text.str(), file);
}

Layout read_config_text(const std::string& text, const std::string& file) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw Error(file + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!(j.is_object() && j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
        j["architectures"][0] == kArchitecture))
    throw Error(file + ": architectures: not an EAGLE-3 drafter (accepted: [\"" + std::string(kArchitecture) + "\"])");
  const Reader r{j, file};
  Layout l;
  l.hidden = r.integer("hidden_size");
  l.heads = r.integer("num_attention_heads");
  l.kv_heads = r.integer("num_key_value_heads");
  l.head_dim = j.contains("head_dim") ? r.integer("head_dim") : l.hidden / std::max<int64_t>(1, l.heads);
  l.intermediate = r.integer("intermediate_size");
  l.vocab = r.integer("vocab_size");
  l.draft_vocab = r.integer("draft_vocab_size");
  l.max_position = r.integer("max_position_embeddings");
  if (r.integer("num_hidden_layers") != 1)
    r.fail("num_hidden_layers", "= " + j["num_hidden_layers"].dump() + " (accepted: 1, EAGLE-3's one decoder layer)");
  l.rms_eps = r.real("rms_norm_eps", 1e-6);
  l.rope_theta = r.real("rope_theta", 500000.0);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object() && j["rope_parameters"].contains("rope_theta"))
    l.rope_theta = Reader{j["rope_parameters"], file + ": rope_parameters"}.real("rope_theta", l.rope_theta);
  l.rope = read_rope_json(j, [&r](const std::string& key, const std::string& why) { r.fail(key, why); });
  l.dtype = j.contains("torch_dtype") && j["torch_dtype"].is_string() ? j["torch_dtype"].get<std::string>() : "float32";
  float_dtype(l.dtype);
  const Json* ids = nullptr;
  if (j.contains("eagle_config") && j["eagle_config"].is_object() &&
      j["eagle_config"].contains("eagle_aux_hidden_state_layer_ids"))
    ids = &j["eagle_config"]["eagle_aux_hidden_state_layer_ids"];
  if (!ids || !ids->is_array() || ids->size() != 3)
    r.fail("eagle_config.eagle_aux_hidden_state_layer_ids", "missing or not a list of 3 layer ids");
  for (const auto& x : *ids) {
    if (!x.is_number_integer())
      r.fail("eagle_config.eagle_aux_hidden_state_layer_ids", "entry " + x.dump() + " is not an integer");
    l.aux_layer_ids.push_back(x.get<int64_t>() - 1);  // vLLM's "input of layer l + 1" -> flashdraft's l
  }
  if (j.contains("flashdraft") && j["flashdraft"].is_object()) {
    const Json& f = j["flashdraft"];
    if (f.contains("target") && f["target"].is_string()) l.target = f["target"].get<std::string>();
    if (f.contains("num_target_layers") && f["num_target_layers"].is_number_integer())
      l.target_layers = f["num_target_layers"].get<int64_t>();
    if (f.contains("ttt_steps") && f["ttt_steps"].is_number_integer()) l.ttt_steps = f["ttt_steps"].get<int64_t>();
  }
  return l;
}

void write(const std::string& folder, const Layout& layout, const Named& tensors) {
  Named out;
  for (const auto& [name, shape] : tensor_shapes(layout)) {
    const at::Tensor* found = find(tensors, name);
    if (!found) throw Error("cannot export: the drafter has no tensor '" + name + "' " + list_str(shape));
    const std::vector<int64_t> have(found->sizes().begin(), found->sizes().end());
    if (have != shape)
      throw Error("cannot export: tensor '" + name + "' has shape " + list_str(have) + ", the layout says " +
                  list_str(shape));
    at::Tensor t = found->detach().to(at::kCPU);
    // A weights file stores every tensor as float32: the maps come back exact (ids < 2^24).
    if (name == "t2d" && t.scalar_type() != at::kBool) t = t.ne(0);
    out.emplace_back(name, t.to(tensor_dtype(name, layout.dtype)).contiguous());
  }
  if (out.size() != tensors.size())
    throw Error("cannot export: the drafter has " + std::to_string(tensors.size()) + " tensors, the EAGLE-3 layout " +
                std::to_string(out.size()) + " (a tensor the layout does not name would be lost)");
  drafter_format::write_folder(folder, out, config_json(layout));
}

void import(const std::string& folder, const Layout& want, const Named& tensors) {
  if (!fs::is_directory(folder))
    throw Error("\"" + folder + "\" is not a folder (an EAGLE-3 drafter folder with config.json and " +
                "model.safetensors is expected)");
  const std::string file = (fs::path(folder) / "config.json").string();
  const Layout got = read_config_file(file);
  drafter_format::check_sizes(
      file,
      {{"hidden_size", got.hidden, want.hidden, "the target's hidden size ([drafter] hidden)"},
       {"num_attention_heads", got.heads, want.heads, "[drafter] heads"},
       {"num_key_value_heads", got.kv_heads, want.kv_heads, "[drafter] kv_heads"},
       {"head_dim", got.head_dim, want.head_dim, "[drafter] head_dim, or hidden / heads"},
       {"intermediate_size", got.intermediate, want.intermediate, "[drafter] intermediate_size"},
       {"vocab_size", got.vocab, want.vocab, "the target's vocabulary"},
       {"draft_vocab_size", got.draft_vocab, want.draft_vocab, "[drafter] draft_vocab"}},
      "an EAGLE-3 drafter");
  if (got.aux_layer_ids != want.aux_layer_ids)
    throw Error(file + ": eagle_config.eagle_aux_hidden_state_layer_ids names target layers " +
                list_str(got.aux_layer_ids) +
                " (flashdraft ids, the file's minus 1), but the experiment's drafter reads " +
                list_str(want.aux_layer_ids) + " (from [drafter] target_layers); accepted: the same ids");
  if (got.rope_theta != want.rope_theta || rope_str(got.rope) != rope_str(want.rope))
    throw Error(file + ": rope_theta " + c10::str(got.rope_theta) + " with RoPE scaling " + rope_str(got.rope) +
                ", but the experiment's drafter has " + c10::str(want.rope_theta) + " with " + rope_str(want.rope) +
                " (from [drafter] rope_theta, rope_type and its rope_* keys); accepted: the same");
  const std::unique_ptr<safetensors::Checkpoint> ck = drafter_format::open_checkpoint(folder);
  const auto shapes = tensor_shapes(got);
  for (const auto& [name, shape] : shapes) {
    const safetensors::TensorInfo* info = ck->find(name);
    if (!info)
      throw Error(folder + ": tensor '" + name + "' " + list_str(shape) +
                  " is missing (an EAGLE-3 drafter of this config.json has it)");
    if (info->shape != shape)
      throw Error(folder + ": tensor '" + name + "' has shape " + list_str(info->shape) + ", config.json implies " +
                  list_str(shape));
    if (info->dtype != stored_dtype(name, got.dtype))
      throw Error(folder + ": tensor '" + name + "' is stored as " + info->dtype + " (accepted: " +
                  stored_dtype(name, got.dtype) + ", from config.json's torch_dtype " + got.dtype + ")");
  }
  for (const auto& name : ck->names()) {
    bool known = false;
    for (const auto& s : shapes) known = known || s.first == name;
    if (!known)
      throw Error(folder + ": holds tensor '" + name +
                  "', which an EAGLE-3 drafter does not have (accepted: exactly the " + std::to_string(shapes.size()) +
                  " tensors of the layout)");
  }
  drafter_format::copy_into(folder, *ck, tensors);
}

std::string Format::layout(Drafter& drafter, const FormatInput& run) const {
  if (run.mask != "eagle3_ttt")
    throw Error("[mask] plugin = \"" + run.mask + "\": an EAGLE-3 folder is served with causal attention over the " +
                "context, the mask \"eagle3_ttt\" trains (accepted for export: \"eagle3_ttt\")");
  return config_json(describe(run.drafter, drafter, run.target, run.dtype, run.seq_len));
}

void Format::write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const {
  hf_eagle3::write(folder, read_config_text(layout, "the run's layout"), tensors);
}

void Format::import(const std::string& folder, Drafter& drafter, const FormatInput& run,
                    const NamedTensors& tensors) const {
  hf_eagle3::import(folder, describe(run.drafter, drafter, run.target, run.dtype, run.seq_len), tensors);
}

}  // namespace flashdraft::hf_eagle3

// A drafter's RoPE scaling in its table and its folder (rope_config.hpp).
#include <flashdraft/config.hpp>
#include <flashdraft/rope_config.hpp>

#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <string>

namespace flashdraft {

using Json = nlohmann::ordered_json;

void declare_rope_keys(Schema& s) {
  s.string("rope_type",
           "the RoPE's frequency scaling, as transformers' rope_parameters name it: \"default\" = none; \"linear\" = "
           "positions / rope_factor; \"llama3\" = Llama 3.1's (long wavelengths / rope_factor, short ones kept, "
           "blended between); \"yarn\" = YaRN's (long-context targets); exported with the folder")
      .def(std::string("default"))
      .one_of({"default", "linear", "llama3", "yarn"});
  s.real("rope_factor", "rope_type other than \"default\": the scaling factor").def(1.0).range(1e-6, 1e6);
  s.integer("rope_original_max_position",
            "rope_type \"llama3\" / \"yarn\": the pretraining length (original_max_position_embeddings)")
      .def(int64_t{0})
      .at_least(0);
  s.real("rope_low_freq_factor", "rope_type \"llama3\": low_freq_factor").def(1.0).range(1e-6, 1e6);
  s.real("rope_high_freq_factor", "rope_type \"llama3\": high_freq_factor").def(4.0).range(1e-6, 1e6);
  s.real("rope_beta_fast", "rope_type \"yarn\": the ramp's fast bound, in rotations (beta_fast)")
      .def(32.0)
      .range(1e-6, 1e6);
  s.real("rope_beta_slow", "rope_type \"yarn\": the ramp's slow bound, in rotations (beta_slow)")
      .def(1.0)
      .range(1e-6, 1e6);
  s.boolean("rope_truncate", "rope_type \"yarn\": the ramp's bounds rounded outwards (truncate)").def(true);
  s.real("rope_attention_factor",
         "rope_type \"yarn\": cos and sin times this (attention_factor); 0 = YaRN's 0.1 ln(rope_factor) + 1")
      .def(0.0)
      .range(0.0, 1e6);
}

RopeScaling rope_scaling(const Config& t) {
  RopeScaling s;
  s.type = t.string("rope_type");
  if (s.type == "default") return s;
  s.factor = t.real("rope_factor");
  s.original_max_position = t.integer("rope_original_max_position");
  s.low_freq_factor = t.real("rope_low_freq_factor");
  s.high_freq_factor = t.real("rope_high_freq_factor");
  s.beta_fast = t.real("rope_beta_fast");
  s.beta_slow = t.real("rope_beta_slow");
  s.truncate = t.boolean("rope_truncate");
  const double af = t.real("rope_attention_factor");
  s.attention_factor = af > 0 ? af : yarn_attention_factor(s.factor, 0.0, 0.0);
  if (s.type != "linear" && s.original_max_position < 1)
    t.fail("rope_original_max_position", "rope_type = \"" + s.type + "\" needs the pretraining length " +
                                             "(original_max_position_embeddings; accepted: a positive length)");
  if (s.type == "llama3" && s.low_freq_factor == s.high_freq_factor)
    t.fail("rope_high_freq_factor", "equals rope_low_freq_factor (" + c10::str(s.low_freq_factor) +
                                        "): Llama 3.1's blend between them would divide by zero");
  return s;
}

RopeScaling read_rope_json(const Json& j, const RopeFail& fail) {
  RopeScaling s;
  const char* key = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? "rope_parameters"
                    : j.contains("rope_scaling") && j["rope_scaling"].is_object()     ? "rope_scaling"
                                                                                      : nullptr;
  if (!key) return s;
  const Json& p = j[key];
  for (const char* k : {"rope_type", "type"})
    if (p.contains(k) && p[k].is_string()) s.type = p[k].get<std::string>();
  if (s.type == "default") return s;
  if (s.type != "linear" && s.type != "llama3" && s.type != "yarn")
    fail(std::string(key) + ".rope_type", "\"" + s.type + "\" is not a RoPE this drafter computes (accepted: " +
                                              "\"default\", \"linear\", \"llama3\", \"yarn\")");
  const auto number = [&](const Json& o, const std::string& where, const char* k, double fallback) {
    if (!o.contains(k) || o[k].is_null()) return fallback;
    if (!o[k].is_number()) fail(where + k, "value " + o[k].dump() + " is not a number");
    return o[k].get<double>();
  };
  const std::string in = std::string(key) + ".";
  const double max_position = number(j, "", "max_position_embeddings", 40960.0);  // (Qwen3Config's default)
  const double original = number(p, in, "original_max_position_embeddings",
                                 number(j, "", "original_max_position_embeddings", max_position));
  s.original_max_position = static_cast<int64_t>(original);
  s.factor = number(p, in, "factor", s.type == "yarn" ? max_position / original : 1.0);
  if (!(s.factor > 0)) fail(in + "factor", "value " + c10::str(s.factor) + " is not positive");
  s.low_freq_factor = number(p, in, "low_freq_factor", 1.0);
  s.high_freq_factor = number(p, in, "high_freq_factor", 4.0);
  // (Python's `x or default`, as transformers reads YaRN's bounds)
  const double fast = number(p, in, "beta_fast", 0.0), slow = number(p, in, "beta_slow", 0.0);
  s.beta_fast = fast != 0.0 ? fast : 32.0;
  s.beta_slow = slow != 0.0 ? slow : 1.0;
  if (p.contains("truncate") && p["truncate"].is_boolean()) s.truncate = p["truncate"].get<bool>();
  const double given = number(p, in, "attention_factor", 0.0);
  s.attention_factor =
      given > 0 ? given
                : yarn_attention_factor(s.factor, number(p, in, "mscale", 0.0), number(p, in, "mscale_all_dim", 0.0));
  return s;
}

void write_rope_json(const RopeScaling& s, Json& p) {
  p["rope_type"] = s.type;
  if (s.type == "default") return;
  p["factor"] = s.factor;
  if (s.type == "linear") return;
  p["original_max_position_embeddings"] = s.original_max_position;
  if (s.type == "llama3") {
    p["low_freq_factor"] = s.low_freq_factor;
    p["high_freq_factor"] = s.high_freq_factor;
  } else {
    p["beta_fast"] = s.beta_fast;
    p["beta_slow"] = s.beta_slow;
    p["truncate"] = s.truncate;
    p["attention_factor"] = s.attention_factor;
  }
}

std::string rope_str(const RopeScaling& s) {
  if (s.type == "default") return "\"default\"";
  std::string out = "\"" + s.type + "\" (factor " + c10::str(s.factor);
  if (s.type != "linear") out += ", original_max_position_embeddings " + std::to_string(s.original_max_position);
  if (s.type == "llama3") out += ", low / high_freq_factor " + c10::str(s.low_freq_factor, " / ", s.high_freq_factor);
  if (s.type == "yarn")
    out += ", beta_fast / beta_slow " + c10::str(s.beta_fast, " / ", s.beta_slow) + ", truncate " +
           (s.truncate ? "true" : "false") + ", attention_factor " + c10::str(s.attention_factor);
  return out + ")";
}

}  // namespace flashdraft

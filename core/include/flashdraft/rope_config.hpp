// A drafter's RoPE scaling as its [drafter] table and its Hugging Face folder say it: the rope_type / rope_* keys
// (declare_rope_keys, rope_scaling) and transformers' rope_parameters in config.json (read_rope_json,
// write_rope_json). Types: "default", "linear", "llama3", "yarn"; the frequencies: rope_inv_freq (flashdraft/ops.hpp),
// the hf target's own code.
#pragma once

#include <flashdraft/export.hpp>
#include <flashdraft/rope_scaling.hpp>

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <string>

namespace flashdraft {

class Schema;
class Config;

// rope_type ("default": none) and the rope_* keys of the other types, in a drafter's schema.
FLASHDRAFT_API void declare_rope_keys(Schema& s);
// The scaling of a table with those keys. A type that needs the pretraining length without rope_original_max_position,
// or llama3's two factors equal, fail the key with a sentence.
FLASHDRAFT_API RopeScaling rope_scaling(const Config& table);

// Reads config.json's rope_parameters (transformers 5), else rope_scaling (transformers 4): the type and the numbers
// transformers reads for it (the pretraining length from there, else the top level's original_max_position_embeddings,
// else max_position_embeddings; YaRN's attention factor from attention_factor, else mscale / mscale_all_dim).
// `fail(key, why)` (which must throw) for a type other than the four or a bad number.
using RopeFail = std::function<void(const std::string& key, const std::string& why)>;
FLASHDRAFT_API RopeScaling read_rope_json(const nlohmann::ordered_json& config, const RopeFail& fail);
// Adds the scaling's keys to a rope_parameters object (rope_type, and the numbers its type reads).
FLASHDRAFT_API void write_rope_json(const RopeScaling& s, nlohmann::ordered_json& rope_parameters);
// The scaling in words ("default", or the type and the numbers it reads), for sentences: two scalings with the same
// words give the same frequencies and tables.
FLASHDRAFT_API std::string rope_str(const RopeScaling& s);

}  // namespace flashdraft

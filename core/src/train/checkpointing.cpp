// Checkpoints of a run.
#include "train/checkpointing.hpp"

#include "train/optimizer.hpp"
#include "train/rng_state.hpp"

#include <sstream>

namespace flashdraft {

std::string table_toml(const std::string& table, const std::string& plugin, const Schema& schema, const Config& c) {
  std::ostringstream os;
  os << "[" << table << "]\nplugin = \"" << plugin << "\"\n";
  for (const auto& k : schema.keys()) {
    Value v;
    switch (k.type) {
      case ValueType::integer: v = c.integer(k.name); break;
      case ValueType::real: v = c.real(k.name); break;
      case ValueType::boolean: v = c.boolean(k.name); break;
      case ValueType::string: v = c.string(k.name); break;
      case ValueType::integer_list: v = c.integers(k.name); break;
      case ValueType::real_list: v = c.reals(k.name); break;
      case ValueType::string_list: v = c.strings(k.name); break;
    }
    os << k.name << " = " << to_string(v) << "\n";
  }
  return os.str();
}

std::filesystem::path save_checkpoint(const RunCheckpoint& what, int64_t done, const RunLog& log,
                                      const std::vector<std::pair<std::string, at::Tensor>>& weights,
                                      TrainOptimizer& optimizer, const at::Generator& anchors, c10::Device device) {
  checkpoint::Manifest m;
  m.step = done;
  m.data_position = done;  // train_batch(i) is a function of (seed, i): the position is the step
  m.log_file = std::filesystem::path(what.log_path).filename().string();
  m.drafter_plugin = what.drafter_plugin;
  m.drafter_toml = what.drafter_toml;
  for (const auto& name : log.names())
    if (name.rfind("events/", 0) != 0) m.log_rows[name] = log.rows(name);
  checkpoint::State state{weights, &optimizer, {}, {}, {}};
  capture_generators(state, anchors, device);
  return checkpoint::write(what.root, m, state, what.keep);
}

}  // namespace flashdraft

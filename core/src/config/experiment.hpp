// The experiment file: TOML parsed with TOML++, every table checked against its
// schema (the engine's own tables here; plugin tables once the plugin is known).
#pragma once

#include <flashdraft/config.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

// One of the tables that name a plugin (a kind of selection "one" in plugin_kinds.def:
// [drafter], [dataset], [mask]).
struct PluginChoice {
  std::string section;   // "drafter"
  std::string plugin;    // value of `plugin`
  SourcePosition where;  // of the `plugin` key
};

class FLASHDRAFT_API Experiment {
 public:
  // Parses and checks the engine's tables; throws ConfigError with file:line:col.
  static Experiment load(const std::string& path);
  static Experiment parse(const std::string& text, const std::string& path);

  const std::string& path() const { return path_; }
  const std::string& text() const { return text_; }
  const Config& run() const { return run_; }
  const Config& attention() const { return attention_; }
  const Config& optimizer() const { return optimizer_; }
  const Config& plugins() const { return plugins_; }
  const Config& checkpoint() const { return checkpoint_; }
  const Config& eval() const { return eval_; }
  const Config& distributed() const { return distributed_; }
  const Config& loss() const { return loss_; }
  // The plugin a table names: choice("drafter"). Every kind whose selection is "one" has
  // its table checked at load (missing table or `plugin` key: ConfigError).
  const PluginChoice& choice(const std::string& table) const;
  // Whether the experiment has the table of an optional kind (e.g. [target]).
  bool has_choice(const std::string& table) const { return choices_.count(table) > 0; }

  // Checks a plugin's table against the plugin's schema. For [drafter], [dataset]
  // and [mask] the table is the section itself (less `plugin`); for a kernel it is
  // [kernels.<name>] (absent = all defaults).
  Config plugin_config(const std::string& section, const Schema& schema) const;
  Config kernel_config(const std::string& kernel, const Schema& schema) const;

  // Overrides (command line): run.steps, run.out.
  void override_integer(const std::string& table, const std::string& key, int64_t v);
  void override_string(const std::string& table, const std::string& key, const std::string& v);

  // The engine's schemas (for `flashdraft schema`).
  static std::vector<Schema> engine_schemas();

 private:
  struct Parsed;
  std::shared_ptr<const Parsed> parsed_;
  std::string path_, text_;
  Config run_, attention_, optimizer_, plugins_, checkpoint_, eval_, distributed_, loss_;
  std::map<std::string, PluginChoice> choices_;
};

}  // namespace flashdraft

// Loading an experiment: the file, the registry, the plugins and their tables.
#include "config/setup.hpp"

#include <flashdraft/text.hpp>

#include <stdexcept>

namespace flashdraft {

const PluginUse& Setup::use(PluginKind kind) const {
  const auto it = named.find(kind);
  if (it == named.end()) throw std::logic_error(std::string("no ") + to_string(kind) + " plugin in this setup");
  return it->second;
}

const PluginUse* Setup::find(PluginKind kind) const {
  const auto it = named.find(kind);
  return it == named.end() ? nullptr : &it->second;
}

std::string kernel_not_found(const Registry& registry, const std::string& name) {
  std::vector<std::string> names;
  for (const auto* k : registry.of_kind(PluginKind::kernel)) names.push_back(k->name);
  return "no kernel plugin named '" + name + "' was found (kernels found: [" + join(names) + "])";
}

Setup load_setup(const RunOptions& options) {
  Setup s{Experiment::load(options.experiment), nullptr, {}, {}};
  if (!options.out.empty()) s.experiment.override_string("run", "out", options.out);
  if (options.steps > 0) s.experiment.override_integer("run", "steps", options.steps);
  s.registry = std::make_unique<Registry>(
      Registry::search_path(options.plugin_paths, s.experiment.plugins().strings("paths"), options.experiment));
  for (const PluginKindInfo& kind : plugin_kinds()) {
    if (kind.listed || (kind.optional && !s.experiment.has_choice(kind.table))) continue;
    const PluginChoice& choice = s.experiment.choice(kind.table);
    PluginUse use{choice.plugin, nullptr, {}};
    try {
      use.plugin = &s.registry->get(kind.kind, choice.plugin);
    } catch (const std::runtime_error& e) {
      throw ConfigError(choice.where.str() + ": [" + choice.section + "] plugin: " + e.what());
    }
    use.config = s.experiment.plugin_config(kind.table, s.registry->schema(*use.plugin));
    s.named[kind.kind] = std::move(use);
  }
  for (const auto& name : s.experiment.attention().strings("kernels")) {
    PluginUse use{name, nullptr, {}};
    for (const auto* k : s.registry->of_kind(PluginKind::kernel))
      if (k->name == name) use.plugin = k;
    if (use.plugin) use.config = s.experiment.kernel_config(name, s.registry->schema(*use.plugin));
    s.kernels.push_back(std::move(use));
  }
  return s;
}

}  // namespace flashdraft

// The build's plugins as the tests and benchmarks load them: one Registry over
// FLASHDRAFT_PLUGIN_DIR, and plugins configured like an experiment would configure them
// (every key of the plugin's schema at its default unless overridden).
#pragma once

#include "built_plugins.hpp"
#include "registry/registry.hpp"

#include <flashdraft/config.hpp>
#include <flashdraft/plugin.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>

namespace test {

inline const flashdraft::Registry& plugins() {
  static const flashdraft::Registry reg({built_plugin_dir()});
  return reg;
}

// table: where the config's values would sit in an experiment file ("kernels.<name>",
// "mask"), for the messages of a plugin that refuses them.
template <class T>
std::shared_ptr<T> load(flashdraft::PluginKind kind, const std::string& name, const std::string& table,
                        const std::map<std::string, flashdraft::Value>& overrides = {}) {
  const flashdraft::FoundPlugin& plugin = plugins().get(kind, name);
  const flashdraft::Schema schema = plugins().schema(plugin);
  flashdraft::Config config(table, flashdraft::SourcePosition{});
  for (const flashdraft::KeySpec& key : schema.keys()) {
    const auto o = overrides.find(key.name);
    if (o != overrides.end())
      config.set(key.name, o->second, std::nullopt);
    else if (key.fallback)
      config.set(key.name, *key.fallback, std::nullopt);
  }
  return flashdraft::create_as<T>(plugins(), plugin, config);
}

}  // namespace test

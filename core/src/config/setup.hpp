// Stage 1 of a run: the experiment file read and checked, the plugins it names found
// on the search path, and every plugin table checked against its plugin's schema.
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/plugin.hpp>

#include "config/experiment.hpp"
#include "config/run_options.hpp"
#include "registry/registry.hpp"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

// A plugin named by the experiment and its checked table. `plugin` is null for a listed
// kind (kernels) whose name was not found: the kernel choice reports it as a refusal.
struct PluginUse {
  std::string name;
  const FoundPlugin* plugin = nullptr;
  Config config;
};

struct FLASHDRAFT_API Setup {
  Experiment experiment;
  std::unique_ptr<Registry> registry;
  std::map<PluginKind, PluginUse> named;  // kinds whose table names one plugin (drafter, dataset, mask)
  std::vector<PluginUse> kernels;         // [attention].kernels, in preference order

  const PluginUse& use(PluginKind kind) const;
  // Null when the experiment has no table of that (optional) kind.
  const PluginUse* find(PluginKind kind) const;
};

// Throws ConfigError (file:line:col) for a bad experiment or a plugin that is not found.
FLASHDRAFT_API Setup load_setup(const RunOptions& options);

// "no kernel plugin named 'x' was found (kernels found: [...])".
std::string kernel_not_found(const Registry& registry, const std::string& name);

}  // namespace flashdraft

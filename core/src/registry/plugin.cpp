// Out-of-line pieces of the plugin API, so their type information lives here, and the
// table of plugin kinds (plugin_kinds.def).
#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/plugin.hpp>

#include <stdexcept>
#include <string>

namespace flashdraft {

PluginObject::~PluginObject() = default;

const std::vector<PluginKindInfo>& plugin_kinds() {
  static const std::vector<PluginKindInfo> kinds = {
#define FLASHDRAFT_PLUGIN_KIND(ID, KIND, INTERFACE, TABLE, SELECTION) \
  PluginKindInfo{PluginKind::KIND,                                    \
                 #KIND,                                               \
                 "flashdraft::" #INTERFACE,                           \
                 TABLE,                                               \
                 std::string(#SELECTION) == "listed",                 \
                 std::string(#SELECTION) == "optional",               \
                 [](const PluginObject* o) { return dynamic_cast<const INTERFACE*>(o) != nullptr; }},
#include <flashdraft/plugin_kinds.def>
#undef FLASHDRAFT_PLUGIN_KIND
  };
  return kinds;
}

const PluginKindInfo* find_plugin_kind(int id) {
  for (const auto& k : plugin_kinds())
    if (static_cast<int>(k.kind) == id) return &k;
  return nullptr;
}

const PluginKindInfo& plugin_kind(PluginKind kind) {
  if (const PluginKindInfo* k = find_plugin_kind(static_cast<int>(kind))) return *k;
  throw std::logic_error("plugin kind " + std::to_string(static_cast<int>(kind)) + " has no row in plugin_kinds.def");
}

const char* to_string(PluginKind kind) {
  const PluginKindInfo* k = find_plugin_kind(static_cast<int>(kind));
  return k ? k->name : "unknown";
}

}  // namespace flashdraft

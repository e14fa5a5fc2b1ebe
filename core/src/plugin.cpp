// Out-of-line pieces of the plugin API, so their type information lives here.
#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/plugin.hpp>

namespace flashdraft {

PluginObject::~PluginObject() = default;

const char* to_string(PluginKind kind) {
  switch (kind) {
    case PluginKind::drafter: return "drafter";
    case PluginKind::mask: return "mask";
    case PluginKind::kernel: return "kernel";
    case PluginKind::dataset: return "dataset";
  }
  return "unknown";
}

}  // namespace flashdraft

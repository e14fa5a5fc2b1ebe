// The plugin registry: finds plugin libraries on the search path, checks their
// descriptor (API version, build fingerprint), and creates plugin objects. Loaded
// libraries stay loaded until the process exits.
#pragma once

#include <flashdraft/plugin.hpp>

#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

struct FoundPlugin {
  const PluginDescriptor* descriptor = nullptr;
  std::string path;
  PluginKind kind = PluginKind::kernel;
  std::string name, version, summary;
};

struct RejectedFile {
  std::string path;
  std::string reason;
};

class FLASHDRAFT_API Registry {
 public:
  // Folders in search order: command line, FLASHDRAFT_PLUGIN_PATH, the experiment's
  // [plugins].paths (relative to the experiment file), then the build's and the
  // installation's plugin folders (found next to libflashdraft.so).
  static std::vector<std::string> search_path(const std::vector<std::string>& command_line,
                                              const std::vector<std::string>& experiment_paths,
                                              const std::string& experiment_file);
  explicit Registry(std::vector<std::string> folders);

  const std::vector<std::string>& folders() const { return folders_; }
  const std::vector<FoundPlugin>& found() const { return found_; }
  const std::vector<RejectedFile>& rejected() const { return rejected_; }

  // Throws std::runtime_error naming the plugins of that kind that exist and the
  // folders searched (and any rejected file of that name, with its reason).
  const FoundPlugin& get(PluginKind kind, const std::string& name) const;
  std::vector<const FoundPlugin*> of_kind(PluginKind kind) const;

  Schema schema(const FoundPlugin& plugin) const;
  // Creates the object and checks it implements the interface of its kind.
  std::unique_ptr<PluginObject> create(const FoundPlugin& plugin, const Config& config) const;

  // The engine's own fingerprint, as a plugin would carry it.
  static BuildFingerprint engine_fingerprint();

 private:
  void load_file(const std::string& path);
  std::vector<std::string> folders_;
  std::vector<FoundPlugin> found_;
  std::vector<RejectedFile> rejected_;
};

// Convenience: create and cast in one step.
template <class T>
std::unique_ptr<T> create_as(const Registry& registry, const FoundPlugin& plugin, const Config& config) {
  std::unique_ptr<PluginObject> obj = registry.create(plugin, config);
  return std::unique_ptr<T>(static_cast<T*>(obj.release()));
}

}  // namespace flashdraft

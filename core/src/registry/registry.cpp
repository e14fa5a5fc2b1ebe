// Plugin discovery and loading through Boost.DLL.
#include "registry/registry.hpp"

#include <ATen/ATen.h>

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace fs = std::filesystem;

namespace flashdraft {

namespace {

// Libraries are never unloaded: objects, exceptions and deleters made by plugin code
// may live until exit. The list itself is leaked on purpose for the same reason.
std::vector<boost::dll::shared_library>& loaded_libraries() {
  static auto* libs = new std::vector<boost::dll::shared_library>();
  return *libs;
}

// LibTorch computes exp, log, sqrt, tanh, sin, erf ... of contiguous fp32/fp64 CPU
// tensors with MKL's vector math (VML). VML picks its kernel table from a CPU type that
// it detects on its first call, without synchronisation: it stores the raw CPU code (9
// on AVX-512) before the table index that code maps to (5). A thread that makes its
// first VML call in that window runs the wrong table, whose exp is off by up to 1.5e-4
// relative instead of 1e-7. The first VML call of a process is typically an op split
// across the OpenMP threads, so two threads do race: dense_ref's exp(S - m) then came
// out with that error on the half of the rows one thread computed, now and then (more
// often on a loaded machine), up to 3x the 1e-5 fp32 bound of the kernel tests. One
// VML call on a single thread, before any plugin runs, completes the detection for the
// whole process. 16 elements: below LibTorch's parallel grain, so it runs on this
// thread only.
void settle_vector_math_dispatch() {
  static std::once_flag once;
  std::call_once(once, [] { (void)at::exp(at::zeros({16}, at::kFloat)); });
}

std::vector<std::string> split_paths(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ':'))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

BuildFingerprint Registry::engine_fingerprint() { return FLASHDRAFT_BUILD_FINGERPRINT; }

std::vector<std::string> Registry::search_path(const std::vector<std::string>& command_line,
                                               const std::vector<std::string>& experiment_paths,
                                               const std::string& experiment_file) {
  std::vector<std::string> dirs;
  for (const auto& p : command_line)
    for (const auto& d : split_paths(p)) dirs.push_back(d);
  if (const char* env = std::getenv("FLASHDRAFT_PLUGIN_PATH"))
    for (const auto& d : split_paths(env)) dirs.push_back(d);
  const fs::path base = experiment_file.empty() ? fs::path() : fs::path(experiment_file).parent_path();
  for (const auto& p : experiment_paths) {
    fs::path d(p);
    dirs.push_back((d.is_relative() && !base.empty() ? base / d : d).lexically_normal().string());
  }
  // Next to the engine library: <build>/lib/libflashdraft.so -> <build>/plugins,
  // <prefix>/lib/libflashdraft.so -> <prefix>/lib/flashdraft/plugins.
  const fs::path lib_dir = fs::path(boost::dll::this_line_location().string()).parent_path();
  for (const fs::path& d : {lib_dir.parent_path() / "plugins", lib_dir / "flashdraft" / "plugins"})
    if (fs::is_directory(d)) dirs.push_back(d.lexically_normal().string());
  // Keep the first occurrence of each folder.
  std::vector<std::string> unique;
  for (const auto& d : dirs)
    if (std::find(unique.begin(), unique.end(), d) == unique.end()) unique.push_back(d);
  return unique;
}

Registry::Registry(std::vector<std::string> folders) : folders_(std::move(folders)) {
  settle_vector_math_dispatch();
  for (const auto& dir : folders_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.is_regular_file() && entry.path().extension() == ".so") files.push_back(entry.path().string());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) load_file(f);
  }
}

void Registry::load_file(const std::string& path) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  boost::dll::shared_library lib;
  try {
    lib.load(path, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    rejected_.push_back({path, std::string("cannot be loaded: ") + e.what()});
    return;
  }
  if (!lib.has("flashdraft_plugin")) {
    rejected_.push_back({path,
                         "not a flashdraft plugin (no 'flashdraft_plugin' entry point; "
                         "plugins define one with FLASHDRAFT_PLUGIN(...))"});
    return;
  }
  const PluginDescriptor* d = lib.get_alias<const PluginDescriptor*()>("flashdraft_plugin")();
  auto reject = [&](const std::string& why) { rejected_.push_back({path, why}); };
  if (!d) return reject("its entry point returned no descriptor");
  if (d->api_version != kPluginApiVersion)
    return reject("plugin API version " + std::to_string(d->api_version) + ", engine expects " +
                  std::to_string(kPluginApiVersion) + " (rebuild the plugin against this flashdraft)");
  const BuildFingerprint e = engine_fingerprint(), p = d->fingerprint;
  if (std::strcmp(e.torch_version, p.torch_version) != 0)
    return reject(std::string("built against LibTorch ") + p.torch_version + ", engine uses LibTorch " +
                  e.torch_version + " (plugins exchange tensors with the engine: the versions must match)");
  if (e.cxx11_abi != p.cxx11_abi)
    return reject("built with _GLIBCXX_USE_CXX11_ABI=" + std::to_string(p.cxx11_abi) + ", engine uses " +
                  std::to_string(e.cxx11_abi));
  if (e.with_cuda != p.with_cuda)
    return reject(std::string("built against a LibTorch ") + (p.with_cuda ? "with" : "without") +
                  " CUDA, engine's LibTorch is " + (e.with_cuda ? "with" : "without") + " CUDA");
  if (e.compiler_major != p.compiler_major)
    return reject("built with compiler major version " + std::to_string(p.compiler_major) + ", engine with " +
                  std::to_string(e.compiler_major));
  const int kind = static_cast<int>(d->kind);
  if (!find_plugin_kind(kind)) {
    std::string known;
    for (const auto& k : plugin_kinds()) known += (known.empty() ? "" : ", ") + std::string(k.name);
    return reject("unknown plugin kind " + std::to_string(kind) + " (this engine knows: " + known + ")");
  }
  if (!d->name || !*d->name) return reject("descriptor has an empty name");
  if (!d->create || !d->declare) return reject("descriptor lacks its create or declare function");
  for (const auto& f : found_)
    if (f.kind == d->kind && f.name == d->name)
      return reject(std::string(to_string(d->kind)) + " '" + d->name + "' is already provided by " + f.path +
                    " (earlier in the search path)");
  found_.push_back(FoundPlugin{d, path, d->kind, d->name, d->version ? d->version : "", d->summary ? d->summary : ""});
  loaded_libraries().push_back(std::move(lib));
}

std::vector<const FoundPlugin*> Registry::of_kind(PluginKind kind) const {
  std::vector<const FoundPlugin*> out;
  for (const auto& f : found_)
    if (f.kind == kind) out.push_back(&f);
  return out;
}

const FoundPlugin& Registry::get(PluginKind kind, const std::string& name) const {
  for (const auto& f : found_)
    if (f.kind == kind && f.name == name) return f;
  std::ostringstream os;
  os << "no " << to_string(kind) << " plugin named '" << name << "'. ";
  const auto avail = of_kind(kind);
  if (avail.empty()) {
    os << "No " << to_string(kind) << " plugins were found.";
  } else {
    os << to_string(kind) << " plugins found: [";
    for (size_t i = 0; i < avail.size(); ++i) os << (i ? ", " : "") << avail[i]->name;
    os << "].";
    Schema names;
    for (const auto* a : avail) names.boolean(a->name, "");
    const std::string near = names.closest(name);
    if (!near.empty()) os << " Did you mean '" << near << "'?";
  }
  os << " Folders searched: ";
  if (folders_.empty()) os << "(none)";
  for (size_t i = 0; i < folders_.size(); ++i) os << (i ? ", " : "") << folders_[i];
  for (const auto& r : rejected_)
    if (r.path.find(name) != std::string::npos) os << ". Rejected " << r.path << ": " << r.reason;
  os << " (`flashdraft plugins` lists everything found and rejected)";
  throw std::runtime_error(os.str());
}

Schema Registry::schema(const FoundPlugin& plugin) const {
  Schema s(plugin.name);
  plugin.descriptor->declare(s);
  return s;
}

std::unique_ptr<PluginObject> Registry::create(const FoundPlugin& plugin, const Config& config) const {
  std::unique_ptr<PluginObject> obj(plugin.descriptor->create(config));
  const PluginKindInfo& kind = plugin_kind(plugin.kind);
  if (!kind.implements(obj.get()))
    throw std::runtime_error(plugin.path + ": " + kind.name + " plugin '" + plugin.name +
                             "' created an object that does not implement " + kind.interface);
  return obj;
}

}  // namespace flashdraft

// The plugin ABI: every plugin shared library exports one entry point,
// `flashdraft_plugin`, through Boost.DLL, returning a PluginDescriptor. The registry
// reads api_version first (it is the first field and never moves), then the build
// fingerprint, and refuses any mismatch with a sentence naming the file, the field
// and both values. Plugins exchange at::Tensor with the engine, like PyTorch
// extensions, so the fingerprint (LibTorch version, C++ ABI, CUDA) must match.
//
// A plugin defines its class and then writes, at namespace scope in one .cpp:
//   FLASHDRAFT_PLUGIN(kernel, "my_kernel", "0.1.0", "one-line summary", MyKernel)
// where MyKernel derives from the interface of that kind (plugin_kinds.def: Drafter,
// MaskGenerator, AttentionKernel, Dataset, Target), has a constructor taking `const Config&`,
// and a static `void declare(Schema&)` that declares the keys of its experiment table.
#pragma once

#include <flashdraft/config.hpp>

#include <boost/dll/alias.hpp>

#include <vector>

#ifndef FLASHDRAFT_TORCH_VERSION
#error "FLASHDRAFT_TORCH_VERSION must be defined by the build (flashdraft's CMake package does it)"
#endif
#ifndef FLASHDRAFT_WITH_CUDA
#error "FLASHDRAFT_WITH_CUDA must be defined by the build (flashdraft's CMake package does it)"
#endif

namespace flashdraft {

// Bump on any change of the descriptor or of an interface class layout (one number:
// the engine's version, and the one plugins compile unless a test overrides it).
#define FLASHDRAFT_ENGINE_API_VERSION 11
#ifndef FLASHDRAFT_PLUGIN_API_VERSION
#define FLASHDRAFT_PLUGIN_API_VERSION FLASHDRAFT_ENGINE_API_VERSION
#endif
constexpr int kPluginApiVersion = FLASHDRAFT_ENGINE_API_VERSION;

// The kinds come from one table, plugin_kinds.def.
enum class PluginKind : int {
#define FLASHDRAFT_PLUGIN_KIND(ID, KIND, INTERFACE, TABLE, SELECTION) KIND = ID,
#include <flashdraft/plugin_kinds.def>
#undef FLASHDRAFT_PLUGIN_KIND
};
FLASHDRAFT_API const char* to_string(PluginKind kind);

class PluginObject;

// One row of plugin_kinds.def, as the engine uses it.
struct PluginKindInfo {
  PluginKind kind;
  const char* name;                                // "drafter"
  const char* interface;                           // "flashdraft::Drafter"
  const char* table;                               // experiment table: "drafter", or "kernels" for [kernels.<name>]
  bool listed;                                     // true: [attention].kernels lists several; false: `plugin = "..."`
  bool optional;                                   // the table may be absent
  bool (*implements)(const PluginObject* object);  // the object implements the interface
};
// Every kind, in the order of plugin_kinds.def.
FLASHDRAFT_API const std::vector<PluginKindInfo>& plugin_kinds();
// The row of a kind id; null for an id no row has (a plugin from a newer engine).
FLASHDRAFT_API const PluginKindInfo* find_plugin_kind(int id);
FLASHDRAFT_API const PluginKindInfo& plugin_kind(PluginKind kind);

// What the plugin was compiled against; compared field by field with the engine's.
struct BuildFingerprint {
  const char* torch_version;  // LibTorch version string, e.g. "2.11.0"
  int cxx11_abi;              // _GLIBCXX_USE_CXX11_ABI
  int with_cuda;              // LibTorch built with CUDA (1) or not (0)
  int compiler_major;         // __GNUC__ (or __clang_major__)
};

#if defined(__clang__)
#define FLASHDRAFT_COMPILER_MAJOR __clang_major__
#else
#define FLASHDRAFT_COMPILER_MAJOR __GNUC__
#endif
#define FLASHDRAFT_BUILD_FINGERPRINT                                                                  \
  ::flashdraft::BuildFingerprint {                                                                    \
    FLASHDRAFT_TORCH_VERSION, _GLIBCXX_USE_CXX11_ABI, FLASHDRAFT_WITH_CUDA, FLASHDRAFT_COMPILER_MAJOR \
  }

// Base of every object a plugin creates. Its virtual destructor is defined in the
// engine library, so type information is shared across libraries; objects are
// destroyed while their plugin is still loaded (plugins stay loaded until exit).
class FLASHDRAFT_API PluginObject {
 public:
  virtual ~PluginObject();
};

struct PluginDescriptor {
  int api_version;  // must stay the first field
  PluginKind kind;
  const char* name;
  const char* version;
  const char* summary;
  BuildFingerprint fingerprint;
  void (*declare)(Schema& schema);                // keys of the plugin's table
  PluginObject* (*create)(const Config& config);  // new object of the kind's interface
};

namespace detail {
template <class T>
PluginObject* create_plugin(const Config& config) {
  return new T(config);
}
}  // namespace detail

}  // namespace flashdraft

#define FLASHDRAFT_PLUGIN(KIND, NAME, VERSION, SUMMARY, CLASS)                                           \
  namespace {                                                                                            \
  const ::flashdraft::PluginDescriptor* flashdraft_plugin_entry() {                                      \
    static const ::flashdraft::PluginDescriptor descriptor{FLASHDRAFT_PLUGIN_API_VERSION,                \
                                                           ::flashdraft::PluginKind::KIND,               \
                                                           NAME,                                         \
                                                           VERSION,                                      \
                                                           SUMMARY,                                      \
                                                           FLASHDRAFT_BUILD_FINGERPRINT,                 \
                                                           &CLASS::declare,                              \
                                                           &::flashdraft::detail::create_plugin<CLASS>}; \
    return &descriptor;                                                                                  \
  }                                                                                                      \
  }                                                                                                      \
  BOOST_DLL_ALIAS(flashdraft_plugin_entry, flashdraft_plugin)

// The build's plugin folder for the tests: FLASHDRAFT_PLUGIN_DIR (this build's, compiled in),
// unless the environment variable of that name gives another (the programs of a build carried
// to another machine, bench/device_build.sh).
#pragma once

#include <cstdlib>
#include <string>

inline std::string built_plugin_dir() {
  const char* env = std::getenv("FLASHDRAFT_PLUGIN_DIR");
  return env && *env ? env : FLASHDRAFT_PLUGIN_DIR;
}

// Small text and hashing helpers shared by the engine and plugins (header-only): lists
// in messages, and the FNV-1a 64 hash of checkpoints' checksums and data cache names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace flashdraft {

// "[1, 3, 5]": how messages show a list of values.
template <class T>
std::string list_str(const std::vector<T>& values) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
  os << "]";
  return os.str();
}

// "a, b, c": names joined for a sentence.
inline std::string join(const std::vector<std::string>& names, const std::string& separator = ", ") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? separator : "") + names[i];
  return out;
}

// FNV-1a 64 over a byte range; pass the previous result as `h` to continue a hash.
inline uint64_t fnv1a64(const void* data, size_t size, uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}
inline uint64_t fnv1a64(const std::string& s) { return fnv1a64(s.data(), s.size()); }

}  // namespace flashdraft

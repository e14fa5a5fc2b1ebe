// HDF5 attributes as the engine writes them (run logs, weights exports) and as plugins
// use them (data caches): one implementation, every call checked. `object` is an open
// HDF5 file, group or dataset id (hid_t; an int64_t in HDF5 >= 1.10).
#pragma once

#include <flashdraft/export.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flashdraft::hdf5 {

// A variable-length UTF-8 string attribute; an existing attribute of that name is replaced.
FLASHDRAFT_API void write_string_attribute(int64_t object, const std::string& key, const std::string& value);
// A 1-D int64 attribute; an existing attribute of that name is replaced.
FLASHDRAFT_API void write_int_attribute(int64_t object, const std::string& key, const std::vector<int64_t>& values);
// Reads an int64 attribute (any integer type on file); throws std::runtime_error naming the key.
FLASHDRAFT_API std::vector<int64_t> read_int_attribute(int64_t object, const std::string& key);

}  // namespace flashdraft::hdf5

// The safetensors format (Hugging Face checkpoints), read and written by our own code.
//
// A file is: 8 bytes little-endian N, then N bytes of UTF-8 JSON
//   {"__metadata__": {"k": "v", ...}, "<name>": {"dtype": "BF16", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to its start. The reader memory-maps the
// file and checks every header before any tensor is used: the JSON parses, every dtype
// is known, offsets lie inside the file and do not overlap, shape x element size equals
// the byte length. A bad file is refused with a sentence naming the file, the tensor and
// the problem (safetensors::Error). Tensors are copied from the map straight to the
// requested device in the requested dtype.
//
// A checkpoint folder holds model.safetensors, or shards listed by
// model.safetensors.index.json ({"weight_map": {"<name>": "<shard file>"}}); every name
// of the index must be in its shard.
#pragma once

#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft::safetensors {

class FLASHDRAFT_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TensorInfo {
  std::string name;
  std::string dtype;            // as in the file: "F32", "BF16", "F16", "I64", ...
  c10::ScalarType scalar_type;  // the same as a LibTorch dtype
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
  std::string file;             // the file it lives in
};

// One file, memory-mapped for the object's lifetime.
class FLASHDRAFT_API File {
 public:
  explicit File(const std::string& path);  // throws Error
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const;
  const std::vector<TensorInfo>& tensors() const;         // in file order
  const TensorInfo* find(const std::string& name) const;  // null: not in the file
  const std::map<std::string, std::string>& metadata() const;
  // The tensor on `device` in `dtype` (a copy; the map is not referenced afterwards).
  at::Tensor load(const std::string& name, c10::Device device, c10::ScalarType dtype) const;
  // Rows [begin, begin + count) of the tensor's first dimension, the same way (a tensor of many rows read in parts,
  // e.g. a hidden-state cache's [T, E, H]).
  at::Tensor load_rows(const std::string& name, int64_t begin, int64_t count, c10::Device device,
                       c10::ScalarType dtype) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A checkpoint folder: model.safetensors or the shards of model.safetensors.index.json.
class FLASHDRAFT_API Checkpoint {
 public:
  explicit Checkpoint(const std::string& folder);  // throws Error
  ~Checkpoint();
  const std::string& folder() const;
  std::vector<std::string> names() const;  // sorted
  const TensorInfo* find(const std::string& name) const;
  // Throws Error naming the folder and the tensor when it is missing.
  at::Tensor load(const std::string& name, c10::Device device, c10::ScalarType dtype) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes `tensors` (CPU or not; any supported dtype, stored as it is) to `path`
// atomically (a temporary file renamed), with `metadata` under "__metadata__".
FLASHDRAFT_API void write(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

}  // namespace flashdraft::safetensors

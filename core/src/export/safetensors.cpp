// The safetensors reader and writer declared in flashdraft/safetensors.hpp.
//
// Reader: File maps the whole file read-only (POSIX mmap) for its lifetime and checks the
// header before any tensor is handed out (parse_header, check_entry, check_disjoint):
//   - 8 + N <= file size, where N is the 8-byte little-endian header length;
//   - the N bytes are JSON, an object, with no name given twice;
//   - "__metadata__", when present, is an object of strings;
//   - every other entry has a known dtype, a shape of non-negative integers, and
//     data_offsets [begin, end] with begin <= end <= the data section's size;
//   - product(shape) x element size == end - begin, computed without overflow;
//   - no two tensors share a byte (zero-byte tensors share none).
// After these checks every load() reads only bytes inside the map. load() always copies:
// the tensor it returns owns its memory and never refers to the map.
//
// Writer: the reader's twin. Header entries and data in the caller's order, data packed
// back to back from offset 0 (no holes: the Python package refuses holes), the header
// padded with spaces to a multiple of 8 bytes (as the Python package pads it, so the data
// section starts 8-aligned), written to path.tmp.<pid>, fsynced, then renamed over path.
//
// Byte order: safetensors stores the header length and all tensor data little-endian.
// This code reads and writes them in host order, which is correct on little-endian hosts
// (x86-64, aarch64 Linux) only; the static_assert below stops a big-endian build.
#include <flashdraft/safetensors.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>

namespace flashdraft::safetensors {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian and this code copies it in host order: a big-endian host would need "
              "byte swaps in File::load and write()");

namespace {

// ordered_json keeps the header's key order: tensors() lists tensors in file order.
using Json = nlohmann::ordered_json;

constexpr const char* kMetadataKey = "__metadata__";

// The dtypes read and written, with their LibTorch types; element sizes come from
// c10::elementSize. BOOL is one byte per element holding 0 or 1.
struct Dtype {
  const char* name;
  c10::ScalarType type;
};
constexpr Dtype kDtypes[] = {{"F64", c10::ScalarType::Double},
                             {"F32", c10::ScalarType::Float},
                             {"F16", c10::ScalarType::Half},
                             {"BF16", c10::ScalarType::BFloat16},
                             {"I64", c10::ScalarType::Long},
                             {"I32", c10::ScalarType::Int},
                             {"I16", c10::ScalarType::Short},
                             {"I8", c10::ScalarType::Char},
                             {"U8", c10::ScalarType::Byte},
                             {"BOOL", c10::ScalarType::Bool},
                             {"F8_E4M3", c10::ScalarType::Float8_e4m3fn}};
// Dtypes of the format that this code does not read (yet): named apart from unknown ones.
constexpr const char* kUnsupportedDtypes[] = {"F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4",
                                              "U64",     "U32",     "U16",     "C64"};

// "F64, F32, ..." or, with_torch, "F64 (Double), F32 (Float), ...".
std::string supported_dtypes(bool with_torch = false) {
  std::vector<std::string> names;
  for (const Dtype& d : kDtypes)
    names.push_back(with_torch ? std::string(d.name) + " (" + c10::toString(d.type) + ")" : d.name);
  return join(names);
}

const Dtype* dtype_named(const std::string& name) {
  for (const Dtype& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

const Dtype* dtype_of(c10::ScalarType type) {
  for (const Dtype& d : kDtypes)
    if (type == d.type) return &d;
  return nullptr;
}

// "a, b, c": at most `most` names, then how many there are in all.
std::string some_names(const std::vector<std::string>& names, size_t most = 8) {
  if (names.size() <= most) return join(names);
  return join(std::vector<std::string>(names.begin(), names.begin() + most)) + ", ... (" +
         std::to_string(names.size()) + " in all)";
}

std::string offsets_str(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

[[noreturn]] void fail(const std::string& file, const std::string& problem) { throw Error(file + ": " + problem); }
[[noreturn]] void fail(const std::string& file, const std::string& tensor, const std::string& problem) {
  throw Error(file + ": tensor '" + tensor + "': " + problem);
}

// Parses the header bytes. A name given twice is refused here: JSON parsers keep one of
// the two silently, which would leave the other's bytes unaccounted for.
Json parse_header(const std::string& file, const char* first, const char* last) {
  std::string duplicate;
  std::set<std::string> seen;
  const Json::parser_callback_t note_keys = [&](int depth, Json::parse_event_t event, Json& parsed) {
    // depth 1: the keys of the top-level object (the tensor names and __metadata__).
    if (depth == 1 && event == Json::parse_event_t::key && parsed.is_string()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(first, last, note_keys);
  } catch (const Json::parse_error& e) {
    fail(file, "the header is not valid JSON (" + std::string(e.what()) + "; a safetensors header is a JSON object)");
  }
  if (!header.is_object())
    fail(file, "the header is a JSON " + std::string(header.type_name()) +
                   ", not an object of tensor entries (the file is not safetensors or is corrupt)");
  if (!duplicate.empty()) fail(file, duplicate, "named twice in the header (each name may appear once)");
  return header;
}

std::map<std::string, std::string> read_metadata(const std::string& file, const Json& value) {
  if (!value.is_object())
    fail(file, std::string(kMetadataKey) + " is a JSON " + value.type_name() + ", expected an object of strings");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string())
      fail(file, std::string(kMetadataKey) + " key '" + key + "' holds " + v.dump() +
                     ", expected a string (metadata values are strings)");
    metadata[key] = v.get<std::string>();
  }
  return metadata;
}

// One header entry, checked against the data section's size (see the list at the top).
TensorInfo check_entry(const std::string& file, const std::string& name, const Json& entry, uint64_t data_size) {
  if (!entry.is_object())
    fail(file, name,
         "the entry is a JSON " + std::string(entry.type_name()) +
             ", expected an object with dtype, shape and data_offsets");
  TensorInfo info;
  info.name = name;
  info.file = file;

  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string())
    fail(file, name, "dtype is missing or not a string (expected one of " + supported_dtypes() + ")");
  info.dtype = dtype->get<std::string>();
  const Dtype* known = dtype_named(info.dtype);
  if (!known) {
    for (const char* other : kUnsupportedDtypes)
      if (info.dtype == other)
        fail(file, name,
             "dtype " + info.dtype + " is not supported by this reader (supported: " + supported_dtypes() + ")");
    fail(file, name, "unknown dtype '" + info.dtype + "' (known: " + supported_dtypes() + ")");
  }
  info.scalar_type = known->type;

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array())
    fail(file, name, "shape is missing or not an array (expected a list of non-negative integers, [] for a scalar)");
  const uint64_t element_size = c10::elementSize(info.scalar_type);
  uint64_t bytes = element_size;  // product(shape) x element size, checked for overflow
  for (const Json& dim : *shape) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(file, name, "shape " + shape->dump() + " holds " + dim.dump() + " (dimensions are non-negative integers)");
    const uint64_t d = dim.get<uint64_t>();
    info.shape.push_back(int64_t(d));
    if (__builtin_mul_overflow(bytes, d, &bytes))
      fail(file, name,
           "shape " + shape->dump() + " of " + info.dtype +
               " overflows 64 bits in bytes (no file holds such a tensor; the header is wrong)");
  }

  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    fail(file, name,
         "data_offsets is " + (offsets == entry.end() ? std::string("missing") : offsets->dump()) +
             " (expected [begin, end]: two non-negative integers)");
  info.begin = (*offsets)[0].get<uint64_t>();
  info.end = (*offsets)[1].get<uint64_t>();
  const std::string where = "data_offsets " + offsets_str(info.begin, info.end);
  if (info.begin > info.end) fail(file, name, where + " begin after end (begin <= end is required)");
  if (info.end > data_size)
    fail(file, name,
         where + " end past the data section (" + std::to_string(data_size) +
             " bytes; the file is truncated or the header is wrong)");
  if (info.end - info.begin != bytes)
    fail(file, name,
         "shape " + list_str(info.shape) + " of " + info.dtype + " is " + std::to_string(bytes) + " bytes but " +
             where + " hold " + std::to_string(info.end - info.begin) +
             " (shape x element size must equal end - begin)");
  return info;
}

// No byte of the data section belongs to two tensors. Sorted by begin, the non-empty
// ranges are disjoint exactly when each begins at or after the previous one's end.
void check_disjoint(const std::string& file, const std::vector<TensorInfo>& tensors) {
  std::vector<const TensorInfo*> ranges;
  for (const TensorInfo& t : tensors)
    if (t.begin < t.end) ranges.push_back(&t);
  std::sort(ranges.begin(), ranges.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const TensorInfo& before = *ranges[i - 1];
    const TensorInfo& t = *ranges[i];
    if (t.begin < before.end)
      fail(file, t.name,
           "data_offsets " + offsets_str(t.begin, t.end) + " overlap those of tensor '" + before.name + "' " +
               offsets_str(before.begin, before.end) + " (every tensor needs its own bytes; the header is wrong)");
  }
}

// std::filesystem is left out on purpose: the LibTorch of the PyPI wheel exports its own
// copies of several of its functions (status, remove_all, ...), which can crash when
// called from here (see checkpoint.hpp); POSIX stat does the little needed.
bool is_regular_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// folder + "/" + name, without doubling a trailing slash.
std::string in_folder(const std::string& folder, const std::string& name) {
  return folder.empty() || folder.back() == '/' ? folder + name : folder + "/" + name;
}

// Writes all of [data, data + size) to fd; false with errno set on failure.
bool write_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= size_t(n);
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// File

struct File::Impl {
  std::string path;
  const uint8_t* map = nullptr;  // the whole file, PROT_READ, until ~Impl
  size_t map_size = 0;
  const uint8_t* data = nullptr;  // the data section: map + 8 + header length
  uint64_t data_size = 0;
  std::vector<TensorInfo> tensors;
  std::unordered_map<std::string, size_t> by_name;
  std::map<std::string, std::string> metadata;

  ~Impl() {
    if (map) ::munmap(const_cast<uint8_t*>(map), map_size);
  }

  void map_file() {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(path, std::string("cannot open the file (") + std::strerror(errno) + ")");
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path, "not a regular file (expected a .safetensors file)");
    }
    map_size = size_t(st.st_size);
    if (map_size < 8) {
      ::close(fd);
      fail(path, "the file is " + std::to_string(map_size) +
                     " bytes, shorter than the 8-byte header length that starts a safetensors file");
    }
    void* m = ::mmap(nullptr, map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);  // the mapping keeps the file's pages reachable
    if (m == MAP_FAILED) fail(path, std::string("cannot memory-map the file (") + std::strerror(map_errno) + ")");
    map = static_cast<const uint8_t*>(m);
  }

  void read_header() {
    uint64_t header_size = 0;
    std::memcpy(&header_size, map, 8);  // little-endian on disk and in this host
    if (header_size > map_size - 8)
      fail(path, "header length " + std::to_string(header_size) + " runs past the end of the file (the file is " +
                     std::to_string(map_size) + " bytes, so a header of at most " + std::to_string(map_size - 8) +
                     "; the file is truncated or not safetensors)");
    const char* header_text = reinterpret_cast<const char*>(map + 8);
    const Json header = parse_header(path, header_text, header_text + header_size);
    data = map + 8 + header_size;
    data_size = map_size - 8 - header_size;
    for (const auto& [name, entry] : header.items()) {
      if (name == kMetadataKey) {
        metadata = read_metadata(path, entry);
        continue;
      }
      by_name[name] = tensors.size();
      tensors.push_back(check_entry(path, name, entry, data_size));
    }
    check_disjoint(path, tensors);
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const TensorInfo& t : tensors) out.push_back(t.name);
    return out;
  }

  // A copy of one checked tensor's bytes on `device` in `dtype`.
  at::Tensor copy_out(const TensorInfo& t, c10::Device device, c10::ScalarType dtype) const {
    const uint8_t* bytes = data + t.begin;
    const uint64_t size = t.end - t.begin;
    // Zero elements (a 0 in the shape) are zero bytes: nothing to read, and begin may be
    // the data section's end.
    if (size == 0) return at::empty(t.shape, at::TensorOptions().device(device).dtype(dtype));
    // FP8 values are a quantized checkpoint's: meaningful only with their scales, which the caller applies
    // (e.g. the hf target's block-wise weight_scale_inv); never cast alone.
    if (t.scalar_type == c10::ScalarType::Float8_e4m3fn && dtype != t.scalar_type)
      fail(path, t.name,
           "dtype F8_E4M3 holds quantized values, read only as they are (Float8_e4m3fn) by a reader that applies "
           "their scales; asked for " +
               std::string(c10::toString(dtype)));
    if (t.scalar_type == c10::ScalarType::Bool) {
      // LibTorch assumes bool bytes are 0 or 1; other values would make undefined results.
      const auto* bad = std::find_if(bytes, bytes + size, [](uint8_t b) { return b > 1; });
      if (bad != bytes + size)
        fail(path, t.name,
             "BOOL element " + std::to_string(bad - bytes) + " is the byte " + std::to_string(*bad) +
                 " (BOOL elements are 0 or 1; the data is corrupt)");
    }
    const auto stored = at::TensorOptions().dtype(t.scalar_type);
    if (reinterpret_cast<uintptr_t>(bytes) % c10::elementSize(t.scalar_type) == 0) {
      // A view of the map (read-only pages: never written), copied by .to(copy = true)
      // even when device and dtype already match.
      const at::Tensor view = at::from_blob(const_cast<uint8_t*>(bytes), t.shape, stored);
      return view.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
    }
    // Offsets need not be multiples of the element size (an F32 after 3 bytes of U8):
    // such bytes are copied into an aligned tensor first, then converted or moved.
    at::Tensor aligned = at::empty(t.shape, stored);
    std::memcpy(aligned.data_ptr(), bytes, size);
    return aligned.to(device, dtype);
  }
};

File::File(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->map_file();
  impl_->read_header();
}

File::~File() = default;

const std::string& File::path() const { return impl_->path; }
const std::vector<TensorInfo>& File::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& File::metadata() const { return impl_->metadata; }

const TensorInfo* File::find(const std::string& name) const {
  const auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->tensors[it->second];
}

at::Tensor File::load(const std::string& name, c10::Device device, c10::ScalarType dtype) const {
  const TensorInfo* info = find(name);
  if (!info) fail(impl_->path, "no tensor '" + name + "' in the file (it holds " + some_names(impl_->names()) + ")");
  return impl_->copy_out(*info, device, dtype);
}

at::Tensor File::load_rows(const std::string& name, int64_t begin, int64_t count, c10::Device device,
                           c10::ScalarType dtype) const {
  const TensorInfo* info = find(name);
  if (!info) fail(impl_->path, "no tensor '" + name + "' in the file (it holds " + some_names(impl_->names()) + ")");
  const int64_t rows = info->shape.empty() ? 0 : info->shape[0];
  if (begin < 0 || count < 0 || begin + count > rows)
    fail(impl_->path, name,
         "rows " + std::to_string(begin) + ".." + std::to_string(begin + count) + " asked for, the tensor has " +
             std::to_string(rows));
  TensorInfo part = *info;
  const uint64_t row_bytes = rows == 0 ? 0 : (info->end - info->begin) / static_cast<uint64_t>(rows);
  part.shape[0] = count;
  part.begin = info->begin + static_cast<uint64_t>(begin) * row_bytes;
  part.end = part.begin + static_cast<uint64_t>(count) * row_bytes;
  return impl_->copy_out(part, device, dtype);
}

// ---------------------------------------------------------------------------------------
// Checkpoint

struct Checkpoint::Impl {
  std::string folder;
  std::vector<std::unique_ptr<File>> files;  // each file opened once
  std::map<std::string, const File*> owner;  // every tensor name -> the file holding it

  // Adds the tensors of `file` (all, or only `listed`: with an index, the index says what
  // the checkpoint holds, as for transformers); a name already held by another file is
  // refused.
  void add(std::unique_ptr<File> file, const std::vector<std::string>* listed = nullptr) {
    for (const TensorInfo& t : file->tensors()) {
      if (listed && std::find(listed->begin(), listed->end(), t.name) == listed->end()) continue;
      const auto [it, added] = owner.emplace(t.name, file.get());
      if (!added)
        fail(folder, t.name,
             "in two shards, " + it->second->path() + " and " + file->path() + " (a name must be in one shard only)");
    }
    files.push_back(std::move(file));
  }

  void open_index(const std::string& index) {
    std::ifstream in(index, std::ios::binary);
    if (!in) fail(index, "cannot open the file");
    std::stringstream text;
    text << in.rdbuf();
    nlohmann::json parsed;
    try {
      parsed = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::parse_error& e) {
      fail(index, "not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!parsed.is_object() || !parsed.contains("weight_map") || !parsed["weight_map"].is_object())
      fail(index, "no \"weight_map\" object (expected {\"weight_map\": {\"<tensor>\": \"<shard file>\", ...}})");
    // Shard file -> the names the index puts in it.
    std::map<std::string, std::vector<std::string>> shards;
    for (const auto& [name, shard] : parsed["weight_map"].items()) {
      if (!shard.is_string())
        fail(index, name, "weight_map gives " + shard.dump() + " as its shard (expected a file name)");
      shards[shard.get<std::string>()].push_back(name);
    }
    if (shards.empty()) fail(index, "weight_map is empty (a checkpoint holds at least one tensor)");
    for (const auto& [shard, names] : shards) {
      std::unique_ptr<File> file;
      try {
        file = std::make_unique<File>(in_folder(folder, shard));
      } catch (const Error& e) {
        fail(index, "shard '" + shard + "' (listed for " + some_names(names, 3) + ") cannot be read: " + e.what());
      }
      for (const std::string& name : names)
        if (!file->find(name))
          fail(index, name,
               "listed in shard '" + shard + "', which does not hold it (the shard holds " +
                   std::to_string(file->tensors().size()) + " tensors; the index and the shards disagree)");
      add(std::move(file), &names);
    }
  }
};

Checkpoint::Checkpoint(const std::string& folder) : impl_(std::make_unique<Impl>()) {
  impl_->folder = folder;
  const std::string single = in_folder(folder, "model.safetensors");
  const std::string index = in_folder(folder, "model.safetensors.index.json");
  // A single file wins over an index, as in transformers.
  if (is_regular_file(single)) {
    impl_->add(std::make_unique<File>(single));
  } else if (is_regular_file(index)) {
    impl_->open_index(index);
  } else {
    fail(folder, std::string("no safetensors checkpoint: looked for model.safetensors and "
                             "model.safetensors.index.json") +
                     (is_directory(folder) ? "" : " (and the folder does not exist)"));
  }
}

Checkpoint::~Checkpoint() = default;

const std::string& Checkpoint::folder() const { return impl_->folder; }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& entry : impl_->owner) out.push_back(entry.first);
  return out;  // sorted: owner is a std::map
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  const auto it = impl_->owner.find(name);
  return it == impl_->owner.end() ? nullptr : it->second->find(name);
}

at::Tensor Checkpoint::load(const std::string& name, c10::Device device, c10::ScalarType dtype) const {
  const auto it = impl_->owner.find(name);
  if (it == impl_->owner.end())
    fail(impl_->folder, "no tensor '" + name + "' in the checkpoint (it holds " + some_names(names()) + ")");
  return it->second->load(name, device, dtype);
}

// ---------------------------------------------------------------------------------------
// write

void write(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  const std::string problem = "cannot write " + path + ": ";
  // The header first: its entries need only names, dtypes and shapes.
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::string what = problem + "tensor '" + name + "': ";
    if (name == kMetadataKey) throw Error(what + "the name is reserved for the metadata");
    if (header.contains(name)) throw Error(what + "the name is given twice (names must be unique)");
    if (!tensor.defined()) throw Error(what + "the tensor is undefined");
    const Dtype* dtype = dtype_of(tensor.scalar_type());
    if (!dtype)
      throw Error(what + "dtype " + std::string(c10::toString(tensor.scalar_type())) +
                  " is not one this writer supports (supported: " + supported_dtypes(true) + ")");
    const uint64_t size = tensor.numel() * tensor.element_size();
    header[name] = {{"dtype", dtype->name},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", Json::array({offset, offset + size})}};
    offset += size;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error& e) {
    throw Error(problem + "a tensor name or metadata string is not valid UTF-8 (" + e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-aligned
  const uint64_t header_size = text.size();

  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(problem + "cannot create " + temporary + " (" + std::strerror(errno) + ")");
  const auto give_up = [&](const std::string& why) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw Error(problem + why);
  };
  if (!write_all(fd, &header_size, 8) || !write_all(fd, text.data(), text.size()))
    give_up(std::string("writing the header failed (") + std::strerror(errno) + ")");
  for (const auto& [name, tensor] : tensors) {
    // One tensor at a time on the CPU, contiguous: the bytes the header described.
    const at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    if (!write_all(fd, cpu.data_ptr(), cpu.nbytes()))
      give_up("writing tensor '" + name + "' failed (" + std::strerror(errno) + ")");
  }
  if (::fsync(fd) != 0) give_up(std::string("fsync failed (") + std::strerror(errno) + ")");
  if (::close(fd) != 0) {
    ::unlink(temporary.c_str());
    throw Error(problem + "closing " + temporary + " failed (" + std::strerror(errno) + ")");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temporary.c_str());
    throw Error(problem + "renaming " + temporary + " to it failed (" + why + ")");
  }
}

}  // namespace flashdraft::safetensors

#include <flashdraft/hidden_cache.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace flashdraft {

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw std::runtime_error("hidden_cache " + where + ": " + what);
}

// FNV-1a over the token ids (as 32-bit values: the cache stores them so).
template <class T>
uint64_t hash_tokens(const T* tokens, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t v = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b, v >>= 8) h = (h ^ (v & 0xffu)) * 1099511628211ull;
  }
  return h;
}

std::vector<int64_t> parse_layers(const std::string& file, const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      fail(file, "metadata layers = \"" + text + "\" is not a comma-separated list of layer ids (e.g. \"1,17,33\")");
    }
  }
  if (out.empty()) fail(file, "metadata layers is empty (the layers whose states the file holds, e.g. \"1,17,33\")");
  return out;
}

std::string meta(const std::string& file, const std::map<std::string, std::string>& m, const std::string& key) {
  const auto it = m.find(key);
  if (it == m.end()) fail(file, "no metadata '" + key + "' (scripts/dump-hidden-states writes it)");
  return it->second;
}

}  // namespace

HiddenCache::HiddenCache(const std::string& folder, int64_t hidden_size, int64_t model_layers) : folder_(folder) {
  std::vector<std::string> files;
  if (!fs::is_directory(folder)) fail(folder, "not a folder (the folder scripts/dump-hidden-states wrote)");
  for (const auto& e : fs::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("hidden-", 0) == 0 && e.path().extension() == ".safetensors") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) fail(folder, "holds no hidden-*.safetensors file (write them with scripts/dump-hidden-states)");
  for (const std::string& path : files) {
    Shard shard;
    shard.file = std::make_unique<safetensors::File>(path);
    const safetensors::File& f = *shard.file;
    const auto& m = f.metadata();
    if (meta(path, m, "format") != "flashdraft-hidden-v1")
      fail(path, "metadata format = \"" + m.at("format") + "\", expected \"flashdraft-hidden-v1\"");
    const std::vector<int64_t> layers = parse_layers(path, meta(path, m, "layers"));
    if (shards_.empty()) {
      layers_ = layers;
      model_ = meta(path, m, "model");
    } else if (layers != layers_) {
      fail(path, "holds layers " + meta(path, m, "layers") + ", the folder's first file others (every file of a " +
                     "cache holds the same layers)");
    }
    for (int64_t l : layers)
      if (l < 0 || l >= model_layers)
        fail(path,
             "holds layer " + std::to_string(l) + ", the target has layers 0.." + std::to_string(model_layers - 1));
    if (meta(path, m, "hidden_size") != std::to_string(hidden_size))
      fail(path, "was written for hidden_size " + m.at("hidden_size") + ", the target's is " +
                     std::to_string(hidden_size) + " (a cache of another model?)");
    const safetensors::TensorInfo *tok = f.find("tokens"), *off = f.find("offsets"), *hid = f.find("hidden");
    if (!tok || !off || !hid) fail(path, "needs the tensors tokens, offsets and hidden");
    if (tok->shape.size() != 1 || tok->dtype != "I32") fail(path, "tokens must be I32 [T]");
    if (off->shape.size() != 1 || off->dtype != "I64" || off->shape[0] < 2)
      fail(path, "offsets must be I64 [n + 1] with n >= 1");
    const int64_t T = tok->shape[0], E = static_cast<int64_t>(layers.size());
    if (hid->shape != std::vector<int64_t>{T, E, hidden_size} ||
        (hid->dtype != "BF16" && hid->dtype != "F16" && hid->dtype != "F32"))
      fail(path, "hidden must be BF16, F16 or F32 [" + std::to_string(T) + ", " + std::to_string(E) + ", " +
                     std::to_string(hidden_size) + "] (tokens x layers x hidden_size)");
    dtype_ = hid->dtype;
    const at::Tensor t = f.load("tokens", c10::kCPU, at::kInt).contiguous();
    shard.tokens.assign(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + T);
    const at::Tensor o = f.load("offsets", c10::kCPU, at::kLong).contiguous();
    const int64_t* offs = o.data_ptr<int64_t>();
    const int64_t n = o.size(0) - 1;
    if (offs[0] != 0 || offs[n] != T)
      fail(path, "offsets run from " + std::to_string(offs[0]) + " to " + std::to_string(offs[n]) + ", not 0 to " +
                     std::to_string(T));
    for (int64_t i = 0; i < n; ++i) {
      if (offs[i + 1] <= offs[i]) fail(path, "offsets are not increasing at conversation " + std::to_string(i));
      const size_t id = entries_.size();
      entries_.push_back({static_cast<int32_t>(shards_.size()), offs[i], offs[i + 1] - offs[i]});
      whole_.emplace(hash_tokens(shard.tokens.data() + offs[i], offs[i + 1] - offs[i]), id);
    }
    tokens_ += T;
    shards_.push_back(std::move(shard));
  }
}

std::string HiddenCache::describe() const {
  std::string ls;
  for (int64_t l : layers_) ls += (ls.empty() ? "" : ",") + std::to_string(l);
  return folder_ + " (" + std::to_string(entries_.size()) + " conversations, " + std::to_string(tokens_) +
         " tokens, layers " + ls + ", " + dtype_ + ", from " + model_ + ")";
}

bool HiddenCache::begins_with(const Entry& e, const int64_t* tokens, int64_t length) const {
  if (e.length < length) return false;
  const int32_t* own = shards_[static_cast<size_t>(e.shard)].tokens.data() + e.begin;
  for (int64_t i = 0; i < length; ++i)
    if (own[i] != tokens[i]) return false;
  return true;
}

const HiddenCache::Entry* HiddenCache::find(const int64_t* tokens, int64_t length) {
  const uint64_t h = hash_tokens(tokens, length);
  for (auto [it, end] = whole_.equal_range(h); it != end; ++it)
    if (entries_[it->second].length == length && begins_with(entries_[it->second], tokens, length))
      return &entries_[it->second];
  // A conversation the dataset cut at seq_len: the cached one that begins with it (the prefixes of this length
  // hashed once, the first time a document of this length is asked for).
  auto [slot, fresh] = prefix_.try_emplace(length);
  if (fresh)
    for (size_t id = 0; id < entries_.size(); ++id) {
      const Entry& e = entries_[id];
      if (e.length > length)
        slot->second.emplace(hash_tokens(shards_[static_cast<size_t>(e.shard)].tokens.data() + e.begin, length), id);
    }
  for (auto [it, end] = slot->second.equal_range(h); it != end; ++it)
    if (begins_with(entries_[it->second], tokens, length)) return &entries_[it->second];
  return nullptr;
}

std::string HiddenCache::not_held(const int64_t* tokens, int64_t length) const {
  std::string head;
  for (int64_t i = 0; i < std::min<int64_t>(length, 8); ++i) head += (i ? ", " : "") + std::to_string(tokens[i]);
  return "hidden_cache " + folder_ + ": no cached conversation begins with this document's " + std::to_string(length) +
         " tokens [" + head + (length > 8 ? ", ..." : "") + "] (the cache holds " + std::to_string(entries_.size()) +
         " conversations; dump it from the same data shards the [dataset] reads, with --max-length at least its "
         "seq_len)";
}

std::string HiddenCache::missing(const Batch& batch) {
  const std::vector<std::vector<int64_t>> rows = row_documents(batch);
  const at::Tensor ids = batch.tokens.to(at::kCPU, at::kLong).contiguous();
  for (size_t b = 0; b < rows.size(); ++b) {
    int64_t from = 0;
    for (int64_t length : rows[b]) {
      const int64_t* tokens = ids[static_cast<int64_t>(b)].data_ptr<int64_t>() + from;
      if (length > 0 && !find(tokens, length))
        return "row " + std::to_string(b) + ", tokens " + std::to_string(from) + ".." + std::to_string(from + length) +
               ": " + not_held(tokens, length);
      from += length;
    }
  }
  return {};
}

at::Tensor HiddenCache::document(const int64_t* tokens, int64_t length, const std::vector<int64_t>& columns,
                                 c10::Device device, c10::ScalarType dtype) {
  const Entry* e = find(tokens, length);
  if (!e) throw std::runtime_error(not_held(tokens, length));
  const safetensors::File& f = *shards_[static_cast<size_t>(e->shard)].file;
  const at::Tensor rows = f.load_rows("hidden", e->begin, length, device, dtype);  // [length, E, H]
  bool all = static_cast<int64_t>(columns.size()) == rows.size(1);
  for (size_t i = 0; i < columns.size() && all; ++i) all = columns[i] == static_cast<int64_t>(i);
  return all ? rows : rows.index_select(1, at::tensor(columns, at::kLong).to(device));
}

at::Tensor HiddenCache::batch(const Batch& batch, const std::vector<int64_t>& columns, c10::Device device,
                              c10::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> rows = row_documents(batch);
  const int64_t B = batch.tokens.size(0), S = batch.tokens.size(1);
  const int64_t H = shards_.front().file->find("hidden")->shape[2];
  at::Tensor out =
      at::zeros({B, S, static_cast<int64_t>(columns.size()), H}, at::TensorOptions().dtype(dtype).device(device));
  const at::Tensor ids = batch.tokens.to(at::kCPU, at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    int64_t from = 0;
    for (int64_t length : rows[static_cast<size_t>(b)]) {
      if (length > 0)
        out[b]
            .narrow(0, from, length)
            .copy_(document(ids[b].data_ptr<int64_t>() + from, length, columns, device, dtype));
      from += length;
    }
  }
  return out;
}

int64_t HiddenCache::column(int64_t layer) const {
  const auto at = std::find(layers_.begin(), layers_.end(), layer);
  return at == layers_.end() ? -1 : at - layers_.begin();
}

}  // namespace flashdraft

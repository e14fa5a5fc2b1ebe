// The tokens dataset: tokenized conversations from HDF5 shards (written by
// scripts/prepare-data), cut into rows of seq_len tokens. It carries no hidden states
// and no target: a Target plugin computes the hidden states online from the tokens.
//
// Shards (datasets/tokens/README.md is the reference): every *.h5 file of the folder
// `path` (or the one file `path`), in name order, each with
//   /tokens    int32 [T]     token ids of all its conversations, concatenated
//   /loss_mask uint8 [T]     1 = assistant token that carries loss
//   /offsets   int64 [n+1]   conversation i spans offsets[i]..offsets[i+1]
//   attributes format = "flashdraft-tokens-v1", vocab_size, tokenizer, source
// Everything is checked on open and read into memory (5 bytes per token).
//
// Conversations, numbered across shards in file order, are split once into a held-out
// set (the first eval count of a permutation drawn from split_seed) and a training set.
// Conversations are truncated to seq_len; those left with fewer than min_loss_tokens
// assistant tokens are left out. A row holds one conversation (pack = false) or as many
// whole conversations as fit, one after another in a fixed seeded order (pack = true):
// a conversation never straddles two rows, so every document starts at its true
// beginning. Rows are padded with token 0 (loss_mask false) after `lengths`.
//
// Order: training batch `index` is a pure function of (configuration, seed, index):
// epoch e = index / batches_per_epoch walks a permutation of the training rows drawn
// from (seed, e), and batch k of the epoch takes rows k*B .. k*B+B-1 of it (the last
// rows % B of each epoch's permutation are not used in that epoch). Resuming at step s
// therefore continues exactly where the run stopped. Held-out batches take the held-out
// rows in file order.
#include <flashdraft/hdf5_attributes.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/text.hpp>

#include <ATen/ATen.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace flashdraft {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFormat = "flashdraft-tokens-v1";

// --- Batch::documents -------------------------------------------------------------------
// Per sequence, the lengths of its packed documents (sum = its length; empty = one
// document per sequence). make_batch computes them for every batch; set_documents hands
// them to the field where the Batch this plugin is compiled against has it, and drops
// them where it does not (a plugin API without packed documents).
template <class B, class = void>
struct HasDocuments : std::false_type {};
template <class B>
struct HasDocuments<B, std::void_t<decltype(std::declval<B&>().documents)>> : std::true_type {};

template <class B>
void set_documents(B& batch, std::vector<std::vector<int64_t>> documents) {
  if constexpr (HasDocuments<B>::value) {
    batch.documents = std::move(documents);
  } else {
    (void)batch;
    (void)documents;
  }
}

// --- seeded permutations ----------------------------------------------------------------
// splitmix64: decorrelates the seeds of the separate streams (split, packing, epochs).
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
enum class Stream : uint64_t { split = 1, pack = 2, epoch = 3 };

// A permutation of `items` by Fisher-Yates over std::mt19937_64, whose output the C++
// standard fixes: the same (seed, stream, n) gives the same order on every platform.
void permute(std::vector<int64_t>& items, uint64_t seed, Stream stream, uint64_t n) {
  std::mt19937_64 gen(mix(mix(seed) ^ mix(static_cast<uint64_t>(stream)) ^ mix(n + 0x5851F42D4C957F2DULL)));
  for (size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[gen() % i]);
}

// --- HDF5 reading (C API, every call checked) -------------------------------------------
// An HDF5 id closed when it goes out of scope.
class H5Id {
 public:
  H5Id(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() {
    if (id_ >= 0) close_(id_);
  }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// While it lives, HDF5 prints no error stack: every failure is reported as a sentence.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietHdf5(const QuietHdf5&) = delete;
  QuietHdf5& operator=(const QuietHdf5&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

[[noreturn]] void refuse(const std::string& file, const std::string& problem) {
  throw std::runtime_error("tokens dataset: shard " + file + ": " + problem +
                           " (the layout is described in datasets/tokens/README.md; scripts/prepare-data writes it)");
}

std::string read_string_attribute(hid_t file, const std::string& path, const std::string& key) {
  if (H5Aexists(file, key.c_str()) <= 0) refuse(path, "the root attribute '" + key + "' is missing");
  H5Id attr(H5Aopen(file, key.c_str(), H5P_DEFAULT), H5Aclose);
  H5Id type(attr.ok() ? H5Aget_type(attr.get()) : -1, H5Tclose);
  if (!type.ok() || H5Tget_class(type.get()) != H5T_STRING)
    refuse(path, "the root attribute '" + key + "' is not a string");
  if (H5Tis_variable_str(type.get()) > 0) {
    H5Id mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), H5Tget_cset(type.get()));
    char* value = nullptr;
    if (H5Aread(attr.get(), mem.get(), &value) < 0 || value == nullptr)
      refuse(path, "the root attribute '" + key + "' could not be read");
    std::string out(value);
    H5free_memory(value);
    return out;
  }
  std::string out(H5Tget_size(type.get()), '\0');
  if (H5Aread(attr.get(), type.get(), out.data()) < 0)
    refuse(path, "the root attribute '" + key + "' could not be read");
  return out.substr(0, out.find('\0'));
}

int64_t read_integer_attribute(hid_t file, const std::string& path, const std::string& key) {
  if (H5Aexists(file, key.c_str()) <= 0) refuse(path, "the root attribute '" + key + "' is missing");
  {
    H5Id attr(H5Aopen(file, key.c_str(), H5P_DEFAULT), H5Aclose);
    H5Id type(attr.ok() ? H5Aget_type(attr.get()) : -1, H5Tclose);
    H5Id space(attr.ok() ? H5Aget_space(attr.get()) : -1, H5Sclose);
    if (!type.ok() || H5Tget_class(type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.get()) != 1)
      refuse(path, "the root attribute '" + key + "' is not one integer");
  }
  return hdf5::read_int_attribute(file, key).at(0);
}

// A 1-D integer dataset of `bytes`-byte elements, read as `T`.
template <class T>
std::vector<T> read_integers(hid_t file, const std::string& path, const std::string& name, size_t bytes,
                             const char* layout_type) {
  if (H5Lexists(file, name.c_str(), H5P_DEFAULT) <= 0) refuse(path, "the dataset " + name + " is missing");
  H5Id set(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  H5Id type(set.ok() ? H5Dget_type(set.get()) : -1, H5Tclose);
  H5Id space(set.ok() ? H5Dget_space(set.get()) : -1, H5Sclose);
  if (!type.ok() || !space.ok()) refuse(path, "the dataset " + name + " could not be opened");
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != bytes)
    refuse(path,
           "the dataset " + name + " holds " +
               (H5Tget_class(type.get()) == H5T_INTEGER ? std::to_string(8 * H5Tget_size(type.get())) + "-bit integers"
                                                        : std::string("values that are not integers")) +
               "; the layout asks for " + layout_type);
  if (H5Sget_simple_extent_ndims(space.get()) != 1)
    refuse(path, "the dataset " + name + " has " + std::to_string(H5Sget_simple_extent_ndims(space.get())) +
                     " dimensions; the layout asks for 1");
  std::vector<T> values(static_cast<size_t>(H5Sget_simple_extent_npoints(space.get())));
  const hid_t mem = std::is_same<T, int32_t>::value   ? H5T_NATIVE_INT32
                    : std::is_same<T, uint8_t>::value ? H5T_NATIVE_UINT8
                                                      : H5T_NATIVE_INT64;
  if (!values.empty() && H5Dread(set.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0)
    refuse(path, "the dataset " + name + " could not be read");
  return values;
}

// One shard, checked: every problem is a sentence naming the file and the dataset.
struct Shard {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> loss_mask;
  std::vector<int64_t> offsets;
  int64_t vocab_size = 0;
  std::string tokenizer;
};

Shard read_shard(const std::string& path) {
  QuietHdf5 quiet;
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) refuse(path, "the file is not a readable HDF5 file");
  const hid_t f = file.get();
  if (H5Aexists(f, "format") <= 0) refuse(path, "the root attribute 'format' is missing; this is not a token shard");
  const std::string format = read_string_attribute(f, path, "format");
  if (format != kFormat)
    refuse(path, "the root attribute 'format' is \"" + format + "\"; this plugin reads \"" + kFormat + "\"");
  Shard s;
  s.vocab_size = read_integer_attribute(f, path, "vocab_size");
  if (s.vocab_size < 1 || s.vocab_size > std::numeric_limits<int32_t>::max())
    refuse(path, "the root attribute 'vocab_size' is " + std::to_string(s.vocab_size) +
                     " (accepted: 1 .. 2147483647, token ids are int32)");
  s.tokenizer = read_string_attribute(f, path, "tokenizer");
  read_string_attribute(f, path, "source");  // required by the layout; for the record only
  s.tokens = read_integers<int32_t>(f, path, "/tokens", 4, "int32");
  s.loss_mask = read_integers<uint8_t>(f, path, "/loss_mask", 1, "uint8");
  s.offsets = read_integers<int64_t>(f, path, "/offsets", 8, "int64");

  const int64_t T = static_cast<int64_t>(s.tokens.size()), n = static_cast<int64_t>(s.offsets.size()) - 1;
  if (n < 1 || T == 0)
    refuse(path, "the shard is empty (/offsets has " + std::to_string(s.offsets.size()) + " values, /tokens " +
                     std::to_string(T) + "); a shard holds at least one conversation");
  if (static_cast<int64_t>(s.loss_mask.size()) != T)
    refuse(path, "the lengths disagree: /loss_mask has " + std::to_string(s.loss_mask.size()) + " values, /tokens " +
                     std::to_string(T));
  if (s.offsets.front() != 0)
    refuse(path, "/offsets starts at " + std::to_string(s.offsets.front()) + "; it must start at 0");
  for (int64_t i = 0; i < n; ++i)
    if (s.offsets[i + 1] <= s.offsets[i])
      refuse(path, "/offsets is not increasing: conversation " + std::to_string(i) + " spans offsets[" +
                       std::to_string(i) + "] = " + std::to_string(s.offsets[i]) + " .. offsets[" +
                       std::to_string(i + 1) + "] = " + std::to_string(s.offsets[i + 1]) +
                       " (every conversation holds at least one token)");
  if (s.offsets.back() != T)
    refuse(path, "the lengths disagree: /offsets ends at " + std::to_string(s.offsets.back()) + ", /tokens has " +
                     std::to_string(T) + " values");
  for (int64_t t = 0; t < T; ++t) {
    if (s.tokens[t] < 0 || s.tokens[t] >= s.vocab_size) {
      const int64_t c = std::upper_bound(s.offsets.begin(), s.offsets.end(), t) - s.offsets.begin() - 1;
      refuse(path, "/tokens[" + std::to_string(t) + "] = " + std::to_string(s.tokens[t]) + " (conversation " +
                       std::to_string(c) + ") is outside the vocabulary: vocab_size is " +
                       std::to_string(s.vocab_size) + " (accepted: 0 .. " + std::to_string(s.vocab_size - 1) + ")");
    }
    if (s.loss_mask[t] > 1)
      refuse(path, "/loss_mask[" + std::to_string(t) + "] = " + std::to_string(s.loss_mask[t]) + " (accepted: 0 or 1)");
  }
  return s;
}

// Rows of conversations: row r holds conversations[begin[r] .. begin[r+1]).
struct Rows {
  std::vector<int64_t> conversations;
  std::vector<int64_t> begin{0};
  int64_t size() const { return static_cast<int64_t>(begin.size()) - 1; }
  void close_row() { begin.push_back(static_cast<int64_t>(conversations.size())); }
};

class TokensDataset final : public Dataset {
 public:
  static void declare(Schema& s) {
    s.string("path",
             "folder of token shards (*.h5, read in name order) or one shard; relative to the current directory");
    s.integer("seq_len", "tokens per row; longer conversations are truncated").def(int64_t{2048}).range(2, 1 << 24);
    s.integer("batch_size", "rows per batch").def(int64_t{4}).at_least(1);
    s.boolean("pack", "false: one conversation per row, padded; true: whole conversations packed into each row")
        .def(false);
    s.real("eval_fraction", "share of the conversations held out for validation").def(0.02).range(0.0, 0.9);
    s.integer("eval_sequences", "held-out conversations (-1: eval_fraction of them)").def(int64_t{-1}).at_least(-1);
    s.boolean("shuffle", "shuffle the training rows every epoch (false: file order)").def(true);
    s.integer("seed", "seed of the packing and of the epochs' order (0: the run's seed)").def(int64_t{0}).at_least(0);
    s.integer("split_seed", "seed of the held-out split (kept apart so that every run seed validates alike)")
        .def(int64_t{1})
        .at_least(0);
    s.integer("min_loss_tokens", "conversations with fewer assistant tokens within seq_len are left out")
        .def(int64_t{1})
        .at_least(0);
  }

  explicit TokensDataset(const Config& c) : config_(c) {
    seq_len_ = c.integer("seq_len");
    batch_ = c.integer("batch_size");
    pack_ = c.boolean("pack");
    shuffle_ = c.boolean("shuffle");
    min_loss_tokens_ = c.integer("min_loss_tokens");
    if (c.given("eval_fraction") && c.given("eval_sequences"))
      c.fail("eval_sequences", "eval_sequences and eval_fraction are both given; give one of them");
  }

  void open(const RunContext& ctx) override {
    say_ = ctx.say ? ctx.say : [](const std::string& s) { std::printf("%s\n", s.c_str()); };
    seed_ = config_.integer("seed") > 0 ? static_cast<uint64_t>(config_.integer("seed")) : ctx.seed;
    files_.clear();
    tokens_.clear();
    loss_mask_.clear();
    order_epoch_ = -1;
    find_files();
    read_files();
    split_and_pack();
  }

  TargetModel target() const override { return TargetModel{}; }  // no target: a [target] plugin provides it
  int64_t batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_len_; }
  int64_t eval_batches() const override { return eval_rows_.size() / batch_; }
  std::string source() const override {
    std::vector<std::string> names;
    for (const std::string& f : files_) names.push_back(fs::path(f).filename().string());
    return folder_ + ": " + join(names);
  }

  Batch train_batch(int64_t index) override {
    if (index < 0) throw std::invalid_argument("training batch " + std::to_string(index) + " does not exist");
    const int64_t per_epoch = train_rows_.size() / batch_;
    const int64_t epoch = index / per_epoch, k = index % per_epoch;
    if (epoch != order_epoch_) {
      order_.resize(static_cast<size_t>(train_rows_.size()));
      std::iota(order_.begin(), order_.end(), int64_t{0});
      if (shuffle_) permute(order_, seed_, Stream::epoch, static_cast<uint64_t>(epoch));
      order_epoch_ = epoch;
    }
    return make_batch(train_rows_, std::vector<int64_t>(order_.begin() + k * batch_, order_.begin() + (k + 1) * batch_),
                      index);
  }

  Batch eval_batch(int64_t index) override {
    if (index < 0 || index >= eval_batches())
      throw std::invalid_argument("eval batch " + std::to_string(index) + " does not exist (there are " +
                                  std::to_string(eval_batches()) + ")");
    std::vector<int64_t> rows(static_cast<size_t>(batch_));
    std::iota(rows.begin(), rows.end(), index * batch_);
    return make_batch(eval_rows_, rows, index);
  }

 private:
  // `path` as a folder of *.h5 (name order) or one file; relative to the current directory.
  void find_files() {
    const std::string given = config_.string("path");
    if (given.empty())
      config_.fail("path", "path is empty; give a folder of token shards written by scripts/prepare-data");
    std::error_code ec;
    const fs::path p = fs::absolute(given, ec);
    if (ec || !fs::exists(p))
      config_.fail("path", "path \"" + given + "\" does not exist (resolved against the current directory " +
                               fs::current_path().string() + " to " + p.string() +
                               "); give a folder of token shards written by scripts/prepare-data");
    if (fs::is_directory(p)) {
      folder_ = p.string();
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file() && e.path().extension() == ".h5") files_.push_back(e.path().string());
      std::sort(files_.begin(), files_.end());
      if (files_.empty())
        config_.fail("path", "the folder " + folder_ + " holds no token shard (*.h5); scripts/prepare-data --out " +
                                 given + " writes them");
    } else {
      folder_ = p.parent_path().string();
      files_.push_back(p.string());
    }
  }

  // Reads and checks every shard; conversations are numbered across shards in file order.
  void read_files() {
    starts_ = {0};
    for (const std::string& f : files_) {
      Shard s = read_shard(f);
      if (tokens_.empty()) {
        vocab_size_ = s.vocab_size;
        tokenizer_ = s.tokenizer;
      } else if (s.vocab_size != vocab_size_ || s.tokenizer != tokenizer_) {
        throw std::runtime_error("tokens dataset: the shards disagree: " + files_.front() + " has vocab_size " +
                                 std::to_string(vocab_size_) + " and tokenizer \"" + tokenizer_ + "\", " + f +
                                 " has vocab_size " + std::to_string(s.vocab_size) + " and tokenizer \"" + s.tokenizer +
                                 "\"; one dataset comes from one tokenizer");
      }
      const int64_t base = static_cast<int64_t>(tokens_.size());
      tokens_.insert(tokens_.end(), s.tokens.begin(), s.tokens.end());
      loss_mask_.insert(loss_mask_.end(), s.loss_mask.begin(), s.loss_mask.end());
      for (size_t i = 1; i < s.offsets.size(); ++i) starts_.push_back(base + s.offsets[i]);
    }
  }

  int64_t conversations() const { return static_cast<int64_t>(starts_.size()) - 1; }
  // Tokens of conversation c that a row holds (truncated to seq_len).
  int64_t row_length(int64_t c) const { return std::min(starts_[c + 1] - starts_[c], seq_len_); }
  int64_t loss_tokens(int64_t c) const {
    const auto first = loss_mask_.begin() + starts_[c];
    return std::count(first, first + row_length(c), uint8_t{1});
  }

  int64_t eval_count() const {
    const int64_t n = conversations();
    const int64_t wanted = config_.integer("eval_sequences") >= 0
                               ? config_.integer("eval_sequences")
                               : std::llround(config_.real("eval_fraction") * static_cast<double>(n));
    if (wanted >= n)
      config_.fail(config_.given("eval_sequences") ? "eval_sequences" : "eval_fraction",
                   "the held-out set of " + std::to_string(wanted) + " conversations leaves none of the " +
                       std::to_string(n) + " in " + folder_ + " for training");
    return wanted;
  }

  // Rows from conversations in the given order: one each, or packed greedily (a row
  // is closed when the next conversation does not fit in what is left of it).
  Rows make_rows(const std::vector<int64_t>& order) const {
    Rows rows;
    int64_t used = 0;
    for (int64_t c : order) {
      const int64_t len = row_length(c);
      if (rows.conversations.size() > static_cast<size_t>(rows.begin.back()) && (!pack_ || used + len > seq_len_)) {
        rows.close_row();
        used = 0;
      }
      rows.conversations.push_back(c);
      used += len;
    }
    if (rows.conversations.size() > static_cast<size_t>(rows.begin.back())) rows.close_row();
    return rows;
  }

  // How much of the training rows the tokens fill, and what seq_len cuts off: the numbers
  // that tell padded steps from packed ones, and a seq_len that drops the ends of answers.
  std::string fill_line(const std::vector<int64_t>& train) const {
    int64_t kept = 0, cut = 0, dropped = 0;
    for (int64_t c : train) {
      kept += row_length(c);
      const int64_t len = starts_[c + 1] - starts_[c];
      if (len > seq_len_) ++cut, dropped += len - seq_len_;
    }
    const double fill = 100.0 * double(kept) / double(train_rows_.size() * seq_len_);
    char pct[64];
    std::snprintf(pct, sizeof pct, "%.1f%% tokens, %.1f%% padding", fill, 100.0 - fill);
    std::string line = "data: the training rows hold " + std::string(pct);
    if (!pack_ && fill < 75.0) line += " (pack = true puts several conversations in a row)";
    const std::string S = std::to_string(seq_len_);
    if (cut == 0) return line + "; no conversation is longer than seq_len = " + S;
    return line + "; " + std::to_string(cut) + (cut == 1 ? " conversation" : " conversations") +
           " longer than seq_len = " + S + (cut == 1 ? " loses its last " : " lose their last ") +
           std::to_string(dropped) + " tokens";
  }

  void split_and_pack() {
    const int64_t n = conversations();
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t{0});
    permute(all, static_cast<uint64_t>(config_.integer("split_seed")), Stream::split, 0);
    const int64_t n_eval = eval_count();
    std::vector<uint8_t> held_out(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n_eval; ++i) held_out[all[i]] = 1;

    std::vector<int64_t> train, eval;
    int64_t left_out = 0;
    for (int64_t c = 0; c < n; ++c) {
      if (loss_tokens(c) < min_loss_tokens_) {
        ++left_out;
        continue;
      }
      (held_out[c] ? eval : train).push_back(c);
    }
    // Which conversations share a packed row is drawn once (the rows' order changes
    // every epoch); without shuffle, rows follow the files.
    if (shuffle_ && pack_) permute(train, seed_, Stream::pack, 0);
    train_rows_ = make_rows(train);
    eval_rows_ = make_rows(eval);

    int64_t tokens = 0, assistant = 0;
    for (int64_t c = 0; c < n; ++c) tokens += starts_[c + 1] - starts_[c];
    assistant = std::count(loss_mask_.begin(), loss_mask_.end(), uint8_t{1});
    say_("data: tokens from " + folder_ + ": " + std::to_string(files_.size()) + " shards, " + std::to_string(n) +
         " conversations, " + std::to_string(tokens) + " tokens (" + std::to_string(assistant) +
         " assistant), vocab_size " + std::to_string(vocab_size_) + ", tokenizer " + tokenizer_);
    say_("data: " + std::to_string(train.size()) + " training conversations in " + std::to_string(train_rows_.size()) +
         (pack_ ? " packed" : "") + " rows of " + std::to_string(seq_len_) + " (" +
         std::to_string(train_rows_.size() / batch_) + " batches per epoch); " + std::to_string(eval.size()) +
         " held out in " + std::to_string(eval_batches()) + " batches; " + std::to_string(left_out) +
         " left out (fewer than min_loss_tokens = " + std::to_string(min_loss_tokens_) +
         " assistant tokens within seq_len)");
    if (train_rows_.size() > 0) say_(fill_line(train));
    if (train_rows_.size() < batch_)
      config_.fail("batch_size", "batch_size = " + std::to_string(batch_) + " exceeds the " +
                                     std::to_string(train_rows_.size()) + " training rows of " + folder_);
  }

  // Rows `which` of `rows` as a batch: tokens and mask copied, zero-padded after each
  // row's length; in packed rows, the lengths of the conversations (documents) in order.
  Batch make_batch(const Rows& rows, const std::vector<int64_t>& which, int64_t index) const {
    const int64_t B = static_cast<int64_t>(which.size());
    at::Tensor tokens = at::zeros({B, seq_len_}, at::kLong);
    at::Tensor mask = at::zeros({B, seq_len_}, at::kBool);
    at::Tensor lengths = at::zeros({B}, at::kLong);
    int64_t* len_of = lengths.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> documents(static_cast<size_t>(B));
    int64_t* tok = tokens.data_ptr<int64_t>();
    bool* msk = mask.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r = which[b];
      int64_t pos = 0;
      for (int64_t i = rows.begin[r]; i < rows.begin[r + 1]; ++i) {
        const int64_t c = rows.conversations[i], len = row_length(c);
        for (int64_t t = 0; t < len; ++t) {
          tok[b * seq_len_ + pos + t] = tokens_[starts_[c] + t];
          msk[b * seq_len_ + pos + t] = loss_mask_[starts_[c] + t] != 0;
        }
        documents[b].push_back(len);
        pos += len;
      }
      len_of[b] = pos;
    }
    Batch batch;
    batch.tokens = tokens;
    batch.loss_mask = mask;
    batch.lengths = lengths;
    batch.index = index;
    if (pack_) set_documents(batch, std::move(documents));
    return batch;
  }

  Config config_;
  int64_t seq_len_ = 0, batch_ = 0, min_loss_tokens_ = 0;
  bool pack_ = false, shuffle_ = true;
  uint64_t seed_ = 0;
  std::function<void(const std::string&)> say_;
  std::string folder_, tokenizer_;
  std::vector<std::string> files_;
  int64_t vocab_size_ = 0;
  std::vector<int32_t> tokens_;     // every shard's tokens, concatenated
  std::vector<uint8_t> loss_mask_;  // same length
  std::vector<int64_t> starts_;     // conversation c spans starts_[c] .. starts_[c+1]
  Rows train_rows_, eval_rows_;
  std::vector<int64_t> order_;  // the training rows in the order of epoch order_epoch_
  int64_t order_epoch_ = -1;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(dataset, "tokens", "0.1.0",
                  "tokenized conversations from HDF5 shards (scripts/prepare-data), padded or packed rows; "
                  "no target: hidden states come from a [target] plugin",
                  flashdraft::TokensDataset)

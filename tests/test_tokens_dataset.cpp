// The tokens dataset (datasets/tokens): shards written here with the HDF5 C API from
// synthetic conversations whose first token is their own number, so every row can be
// decomposed back into the conversations it holds and compared with what was written:
// padded and packed rows, the held-out split, the order per seed and epoch, resuming,
// and the sentences that refuse bad shards. ReadsShardsOfPrepareData reads the shards of
// scripts/prepare-data (run by tests/python/test_tokens_dataset.py) against h5py's view.
#include "built_plugins.hpp"
#include "dflash_oracle.hpp"
#include "train/checkpoint.hpp"

#include <flashdraft/hdf5_attributes.hpp>

#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>

using namespace flashdraft;
namespace fs = std::filesystem;

namespace {

using flashdraft::checkpoint::remove_tree;  // not fs::remove_all (see checkpoint.hpp)

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("flashdraft_tokens_" + name + "_" + std::to_string(::getpid()));
  remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

// --- shards -------------------------------------------------------------------------------
struct Conversation {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

// The raw content of one shard file; the defaults follow the layout, the tests break it.
struct ShardFile {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets{0};
  std::string format = "flashdraft-tokens-v1";
  int64_t vocab_size = 1000;
  std::string tokenizer = "test-tokenizer";
  hid_t tokens_type = H5T_STD_I32LE;
  bool with_offsets = true;

  void add(const Conversation& c) {
    tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
    mask.insert(mask.end(), c.mask.begin(), c.mask.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
};

template <class T>
void write_1d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const std::vector<T>& values) {
  const hsize_t n = values.size();
  const hid_t space = H5Screate_simple(1, &n, nullptr);
  const hid_t set = H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(set, 0) << name;
  if (n > 0) {
    ASSERT_GE(H5Dwrite(set, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0) << name;
  }
  H5Dclose(set);
  H5Sclose(space);
}

void write_shard(const fs::path& path, const ShardFile& s) {
  const hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  if (s.tokens_type == H5T_STD_I32LE) {
    write_1d(f, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, s.tokens);
  } else {
    write_1d(f, "tokens", s.tokens_type, H5T_NATIVE_INT64, std::vector<int64_t>(s.tokens.begin(), s.tokens.end()));
  }
  write_1d(f, "loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, s.mask);
  if (s.with_offsets) write_1d(f, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, s.offsets);
  if (!s.format.empty()) hdf5::write_string_attribute(f, "format", s.format);
  hdf5::write_int_attribute(f, "vocab_size", {s.vocab_size});
  hdf5::write_string_attribute(f, "tokenizer", s.tokenizer);
  hdf5::write_string_attribute(f, "source", "test_tokens_dataset.cpp");
  H5Fclose(f);
}

// Conversation c: first token c (its name), then a pseudo-random walk; 3..31 tokens,
// every 13th one 50 long (longer than the rows of most tests); the assistant part is
// the last two thirds, except for every 11th conversation, which has none.
Conversation conversation(int64_t c, int64_t vocab) {
  const int64_t len = c % 13 == 12 ? 50 : 3 + (c * 37) % 29;
  Conversation conv;
  for (int64_t j = 0; j < len; ++j) {
    conv.tokens.push_back(static_cast<int32_t>(j == 0 ? c : (c * 131 + j * 17 + j * j) % vocab));
    conv.mask.push_back(c % 11 != 5 && j >= len / 3);
  }
  return conv;
}

// n conversations in shards of `per_shard` (shard-000.h5, ...).
std::vector<Conversation> write_conversations(const fs::path& dir, int64_t n, int64_t per_shard) {
  std::vector<Conversation> all;
  ShardFile shard;
  int files = 0;
  for (int64_t c = 0; c < n; ++c) {
    all.push_back(conversation(c, 1000));
    shard.add(all.back());
    if ((c + 1) % per_shard == 0 || c + 1 == n) {
      char name[32];
      std::snprintf(name, sizeof name, "shard-%03d.h5", files++);
      write_shard(dir / name, shard);
      shard = ShardFile{};
    }
  }
  return all;
}

// --- the plugin ----------------------------------------------------------------------------
std::unique_ptr<Dataset> open_dataset(const std::map<std::string, Value>& over, uint64_t run_seed = 3,
                                      std::vector<std::string>* said = nullptr) {
  static Registry registry({built_plugin_dir()});
  const FoundPlugin& p = registry.get(PluginKind::dataset, "tokens");
  auto d = create_as<Dataset>(registry, p, dflash_test::make_config(registry.schema(p), over));
  RunContext ctx;
  ctx.seed = run_seed;
  ctx.say = [said](const std::string& s) {
    if (said) said->push_back(s);
  };
  d->open(ctx);
  return d;
}

// Batch::documents where the plugin API has it (the plugin fills it in packed rows).
template <class B, class = void>
struct HasDocuments : std::false_type {};
template <class B>
struct HasDocuments<B, std::void_t<decltype(std::declval<B&>().documents)>> : std::true_type {};
template <class B>
const std::vector<std::vector<int64_t>>* documents_of(const B& batch) {
  if constexpr (HasDocuments<B>::value) return &batch.documents;
  return nullptr;
}

// Row b of a batch, decomposed into the conversations it holds (each recognised by its
// first token and checked token by token, mask included, truncated to seq_len); padding
// after the row's length must be token 0 without loss. Returns the conversations.
std::vector<int64_t> decompose(const Batch& batch, int64_t b, const std::vector<Conversation>& convs) {
  const int64_t S = batch.tokens.size(1), length = batch.lengths[b].item<int64_t>();
  const at::Tensor tok = batch.tokens[b].contiguous(), msk = batch.loss_mask[b].contiguous();
  const int64_t* t = tok.data_ptr<int64_t>();
  const bool* m = msk.data_ptr<bool>();
  std::vector<int64_t> found, lengths;
  EXPECT_GE(length, 1);
  EXPECT_LE(length, S);
  for (int64_t pos = 0; pos < length;) {
    const int64_t c = t[pos];
    if (c < 0 || c >= static_cast<int64_t>(convs.size())) {
      ADD_FAILURE() << "row " << b << " position " << pos << ": token " << c << " starts no conversation";
      return found;
    }
    const Conversation& conv = convs[static_cast<size_t>(c)];
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(conv.tokens.size()), S);
    EXPECT_LE(pos + len, length) << "conversation " << c << " runs past the row's length";
    for (int64_t j = 0; j < len && pos + j < S; ++j) {
      EXPECT_EQ(t[pos + j], conv.tokens[j]) << "row " << b << " conversation " << c << " token " << j;
      EXPECT_EQ(m[pos + j], conv.mask[j] != 0) << "row " << b << " conversation " << c << " mask " << j;
    }
    found.push_back(c);
    lengths.push_back(len);
    pos += len;
  }
  for (int64_t p = length; p < S; ++p) {
    EXPECT_EQ(t[p], 0) << "padding of row " << b << " at " << p;
    EXPECT_FALSE(m[p]) << "padding of row " << b << " at " << p << " carries loss";
  }
  if (const auto* docs = documents_of(batch)) {
    if (found.size() > 1 || !docs->empty()) {
      EXPECT_EQ(docs->size(), static_cast<size_t>(batch.tokens.size(0)));
      if (docs->size() > static_cast<size_t>(b)) {
        EXPECT_EQ((*docs)[b], lengths) << "documents of row " << b;
        int64_t sum = 0;
        for (int64_t d : (*docs)[b]) sum += d;
        EXPECT_EQ(sum, length) << "documents of row " << b << " do not sum to its length";
      }
    }
  }
  return found;
}

// The conversations of every row of batches [first, first + count), in order.
std::vector<int64_t> walk(Dataset& d, int64_t first, int64_t count, const std::vector<Conversation>& convs,
                          bool eval = false) {
  std::vector<int64_t> out;
  for (int64_t i = first; i < first + count; ++i) {
    const Batch batch = eval ? d.eval_batch(i) : d.train_batch(i);
    EXPECT_EQ(batch.tokens.sizes().vec(), (std::vector<int64_t>{d.batch_size(), d.seq_len()}));
    EXPECT_EQ(batch.tokens.scalar_type(), at::kLong);
    EXPECT_EQ(batch.loss_mask.scalar_type(), at::kBool);
    EXPECT_EQ(batch.lengths.scalar_type(), at::kLong);
    EXPECT_FALSE(batch.hidden.defined());
    EXPECT_EQ(batch.index, i);
    for (int64_t b = 0; b < batch.tokens.size(0); ++b)
      for (int64_t c : decompose(batch, b, convs)) out.push_back(c);
  }
  return out;
}

bool same_batch(const Batch& a, const Batch& b) {
  return at::equal(a.tokens, b.tokens) && at::equal(a.loss_mask, b.loss_mask) && at::equal(a.lengths, b.lengths);
}

int64_t loss_tokens(const Conversation& c, int64_t seq_len) {
  int64_t n = 0;
  for (size_t j = 0; j < c.mask.size() && static_cast<int64_t>(j) < seq_len; ++j) n += c.mask[j];
  return n;
}

// 40 conversations in two shards (25 + 15), rows of 24 tokens, batches of 3.
struct Fixture {
  fs::path dir = fresh_dir("data");
  std::vector<Conversation> convs = write_conversations(dir, 40, 25);
  std::map<std::string, Value> config(std::map<std::string, Value> over) const {
    std::map<std::string, Value> c{{"path", dir.string()},
                                   {"seq_len", int64_t{24}},
                                   {"batch_size", int64_t{3}},
                                   {"eval_sequences", int64_t{6}},
                                   {"min_loss_tokens", int64_t{0}}};
    for (auto& [k, v] : over) c[k] = v;
    return c;
  }
  ~Fixture() { remove_tree(dir); }
};

TEST(TokensDataset, PaddedRowsSplitAndCoverage) {
  Fixture f;
  std::vector<std::string> said;
  auto d = open_dataset(f.config({}), 3, &said);
  ASSERT_EQ(said.size(), 3u);  // the files, the split, how full the rows are
  EXPECT_NE(said[0].find("2 shards, 40 conversations"), std::string::npos) << said[0];
  EXPECT_EQ(said[2].rfind("data: the training rows hold ", 0), 0u) << said[2];
  EXPECT_FALSE(d->target().embedding.defined());
  EXPECT_EQ(d->target().vocab, 0);
  EXPECT_EQ(d->source(), f.dir.string() + ": shard-000.h5, shard-001.h5");

  // Held out: 6 conversations in 2 batches, the same on every run seed.
  ASSERT_EQ(d->eval_batches(), 2);
  const std::vector<int64_t> eval = walk(*d, 0, 2, f.convs, true);
  EXPECT_EQ(eval, walk(*open_dataset(f.config({}), 99), 0, 2, f.convs, true));
  const std::set<int64_t> eval_set(eval.begin(), eval.end());
  EXPECT_EQ(eval_set.size(), 6u);
  EXPECT_THROW(d->eval_batch(2), std::invalid_argument);

  // 34 training rows: 11 batches per epoch, one row left over each epoch. Within an
  // epoch no conversation comes twice; over epochs training and held-out sets are
  // disjoint and together make up all 40.
  std::set<int64_t> train_set;
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    const std::vector<int64_t> rows = walk(*d, epoch * 11, 11, f.convs);
    const std::set<int64_t> once(rows.begin(), rows.end());
    EXPECT_EQ(rows.size(), 33u);
    EXPECT_EQ(once.size(), 33u) << "epoch " << epoch << " repeats a conversation";
    for (int64_t c : rows) EXPECT_EQ(eval_set.count(c), 0u) << "held-out conversation " << c << " in training";
    train_set.insert(rows.begin(), rows.end());
  }
  EXPECT_EQ(train_set.size(), 34u);
}

TEST(TokensDataset, OrderIsAFunctionOfSeedAndEpoch) {
  Fixture f;
  auto a = open_dataset(f.config({}), 3), b = open_dataset(f.config({}), 3);
  for (int64_t i : {0, 1, 10, 11, 25}) EXPECT_TRUE(same_batch(a->train_batch(i), b->train_batch(i))) << i;
  // Resuming: batch 25 asked first (a fresh run resumed at step 25) equals batch 25 of a
  // run that walked there.
  auto resumed = open_dataset(f.config({}), 3);
  const Batch late = resumed->train_batch(25);
  for (int64_t i = 0; i < 25; ++i) a->train_batch(i);
  EXPECT_TRUE(same_batch(late, a->train_batch(25)));

  const std::vector<int64_t> epoch0 = walk(*a, 0, 11, f.convs), epoch1 = walk(*a, 11, 11, f.convs);
  EXPECT_NE(epoch0, epoch1);
  EXPECT_NE(epoch0, walk(*open_dataset(f.config({}), 4), 0, 11, f.convs)) << "another run seed, same order";
  // A seed of its own overrides the run's.
  auto s1 = open_dataset(f.config({{"seed", int64_t{7}}}), 1), s2 = open_dataset(f.config({{"seed", int64_t{7}}}), 2);
  EXPECT_EQ(walk(*s1, 0, 11, f.convs), walk(*s2, 0, 11, f.convs));
  EXPECT_NE(walk(*s1, 0, 11, f.convs), epoch0);

  // shuffle = false: the training conversations in file order, every epoch.
  auto plain = open_dataset(f.config({{"shuffle", false}}), 3);
  const std::vector<int64_t> first = walk(*plain, 0, 11, f.convs);
  EXPECT_TRUE(std::is_sorted(first.begin(), first.end()));
  EXPECT_EQ(first, walk(*plain, 11, 11, f.convs));
}

TEST(TokensDataset, PaddedRowsTruncateLongConversationsAndSkipRowsWithoutLoss) {
  Fixture f;
  // seq_len 20: conversations of 50 (and 23..31) tokens are cut; a row with fewer than 6
  // assistant tokens within the row is left out.
  auto d = open_dataset(f.config({{"seq_len", int64_t{20}}, {"min_loss_tokens", int64_t{6}}}));
  std::set<int64_t> expected;
  for (int64_t c = 0; c < 40; ++c)
    if (loss_tokens(f.convs[static_cast<size_t>(c)], 20) >= 6) expected.insert(c);
  std::set<int64_t> seen;
  bool truncated = false;
  for (int64_t epoch = 0; epoch < 8; ++epoch)
    for (int64_t i = 0; i < 3; ++i) {  // decompose() checks each row against its conversation
      const Batch batch = d->train_batch(epoch * 3 + i);
      for (int64_t b = 0; b < 3; ++b) {
        const std::vector<int64_t> cs = decompose(batch, b, f.convs);
        ASSERT_EQ(cs.size(), 1u);
        const int64_t len = static_cast<int64_t>(f.convs[static_cast<size_t>(cs[0])].tokens.size());
        EXPECT_EQ(batch.lengths[b].item<int64_t>(), std::min<int64_t>(len, 20));
        truncated |= len > 20;
        seen.insert(cs[0]);
      }
      if (const auto* docs = documents_of(batch)) {
        EXPECT_TRUE(docs->empty()) << "padded rows are one document each";
      }
    }
  EXPECT_TRUE(truncated);
  for (int64_t c : seen) EXPECT_EQ(expected.count(c), 1u) << "conversation " << c << " has too little loss";
  for (int64_t c : walk(*d, 0, d->eval_batches(), f.convs, true)) EXPECT_EQ(expected.count(c), 1u) << c;
}

TEST(TokensDataset, PackedRowsHoldWholeConversations) {
  Fixture f;
  auto d = open_dataset(f.config({{"pack", true}, {"seq_len", int64_t{40}}, {"batch_size", int64_t{2}}}));
  // Batches per epoch: every training conversation sits in exactly one row, so the
  // first batch that repeats a conversation starts epoch 1 (fewer than batch_size rows
  // are left over per epoch, so that batch holds at least one row already seen).
  int64_t per_epoch = 0;
  for (std::set<int64_t> seen;; ++per_epoch) {
    bool repeat = false;
    for (int64_t c : walk(*d, per_epoch, 1, f.convs)) repeat |= !seen.insert(c).second;
    if (repeat) break;
  }
  ASSERT_GT(per_epoch, 0);
  const std::vector<int64_t> epoch0 = walk(*d, 0, per_epoch, f.convs);
  const std::vector<int64_t> epoch1 = walk(*d, per_epoch, per_epoch, f.convs);
  EXPECT_NE(epoch0, epoch1);
  // Packing happened: rows hold more than one conversation on average.
  EXPECT_GT(static_cast<double>(epoch0.size()) / double(2 * per_epoch), 1.5);
  const std::set<int64_t> train(epoch0.begin(), epoch0.end());
  EXPECT_EQ(train.size(), epoch0.size());
  const std::vector<int64_t> eval = walk(*d, 0, d->eval_batches(), f.convs, true);
  for (int64_t c : eval) EXPECT_EQ(train.count(c), 0u) << "held-out conversation " << c << " in training";
  if (documents_of(d->train_batch(0)) == nullptr)
    std::cout << "note: this plugin API has no Batch::documents; rows were checked by decomposition only\n";
}

// The data line that says how full the rows are and what seq_len cuts off, against the
// numbers counted here from the conversations written (every one trains: no held-out set,
// min_loss_tokens 0).
TEST(TokensDataset, SaysHowFullTheRowsAreAndWhatSeqLenCuts) {
  Fixture f;
  auto fill_line = [&](const std::map<std::string, Value>& over) {
    std::vector<std::string> said;
    open_dataset(f.config(over), 3, &said);
    for (const std::string& s : said)
      if (s.rfind("data: the training rows hold ", 0) == 0) return s;
    ADD_FAILURE() << "no fill line among " << said.size() << " lines";
    return std::string();
  };
  int64_t kept = 0, cut = 0, dropped = 0;
  for (const Conversation& c : f.convs) {
    const auto len = static_cast<int64_t>(c.tokens.size());
    kept += std::min<int64_t>(len, 20);
    if (len > 20) ++cut, dropped += len - 20;
  }
  ASSERT_GT(cut, 0);
  char pct[64];
  const double fill = 100.0 * double(kept) / double(40 * 20);  // padded: a row per conversation
  std::snprintf(pct, sizeof pct, "%.1f%% tokens, %.1f%% padding", fill, 100.0 - fill);
  const std::string padded = fill_line({{"seq_len", int64_t{20}}, {"eval_sequences", int64_t{0}}});
  EXPECT_NE(padded.find(pct), std::string::npos) << padded;
  EXPECT_NE(padded.find(std::to_string(cut) + " conversations longer than seq_len = 20 lose their last " +
                        std::to_string(dropped) + " tokens"),
            std::string::npos)
      << padded;
  EXPECT_EQ(padded.find("pack = true") != std::string::npos, fill < 75.0) << padded;
  // Rows of 60 hold every conversation (the longest is 50); packed, they are fuller than padded.
  const std::string packed = fill_line({{"seq_len", int64_t{60}}, {"eval_sequences", int64_t{0}}, {"pack", true}});
  EXPECT_NE(packed.find("no conversation is longer than seq_len = 60"), std::string::npos) << packed;
  EXPECT_EQ(packed.find("pack = true"), std::string::npos) << packed;
  const std::string loose = fill_line({{"seq_len", int64_t{60}}, {"eval_sequences", int64_t{0}}});
  EXPECT_NE(loose.find("(pack = true puts several conversations in a row)"), std::string::npos) << loose;
  auto percent = [](const std::string& s) { return std::stod(s.substr(s.find("hold ") + 5)); };
  EXPECT_GT(percent(packed), 2 * percent(loose)) << packed << "\n" << loose;
}

// --- refusals ---------------------------------------------------------------------------------
std::string open_error(const std::map<std::string, Value>& config) {
  try {
    open_dataset(config);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void expect_refused(const std::string& what, const ShardFile& shard, std::vector<std::string> needles) {
  const fs::path dir = fresh_dir("bad");
  write_shard(dir / "bad.h5", shard);
  const std::string error =
      open_error({{"path", dir.string()}, {"eval_sequences", int64_t{0}}, {"batch_size", int64_t{1}}});
  needles.push_back((dir / "bad.h5").string());
  for (const std::string& n : needles)
    EXPECT_NE(error.find(n), std::string::npos) << what << ": \"" << n << "\" not in: " << error;
  remove_tree(dir);
}

ShardFile good_shard() {
  ShardFile s;
  for (int64_t c = 0; c < 3; ++c) s.add(conversation(c, 1000));
  return s;
}

TEST(TokensDataset, BadShardsAreRefusedWithSentences) {
  ShardFile s = good_shard();
  s.format = "flashdraft-embedded-v1";
  expect_refused("wrong format", s, {"'format' is \"flashdraft-embedded-v1\"", "flashdraft-tokens-v1"});
  s = good_shard();
  s.format = "";
  expect_refused("no format", s, {"'format' is missing"});
  s = good_shard();
  s.mask.pop_back();
  expect_refused("lengths", s, {"/loss_mask has " + std::to_string(s.mask.size()) + " values", "/tokens"});
  s = good_shard();
  s.offsets[2] = s.offsets[1];
  expect_refused("offsets", s, {"/offsets is not increasing", "conversation 1"});
  s = good_shard();
  s.offsets.back() -= 1;
  expect_refused("offsets end", s, {"/offsets ends at " + std::to_string(s.offsets.back())});
  s = good_shard();
  s.tokens[4] = 1000;
  expect_refused("token id", s, {"/tokens[4] = 1000", "vocab_size is 1000"});
  s = good_shard();
  s.tokens[2] = -1;
  expect_refused("negative id", s, {"/tokens[2] = -1", "conversation 0"});
  s = good_shard();
  s.mask[1] = 2;
  expect_refused("mask value", s, {"/loss_mask[1] = 2", "0 or 1"});
  expect_refused("empty", ShardFile{}, {"the shard is empty"});
  s = good_shard();
  s.with_offsets = false;
  expect_refused("no offsets", s, {"the dataset /offsets is missing"});
  s = good_shard();
  s.tokens_type = H5T_STD_I64LE;
  expect_refused("int64 tokens", s, {"/tokens holds 64-bit integers", "int32"});
}

TEST(TokensDataset, BadPathsAndSizesAreRefused) {
  const fs::path dir = fresh_dir("paths");
  EXPECT_NE(open_error({{"path", (dir / "missing").string()}}).find("does not exist"), std::string::npos);
  EXPECT_NE(open_error({{"path", dir.string()}}).find("holds no token shard"), std::string::npos);
  std::ofstream(dir / "text.h5") << "not HDF5\n";
  std::string e = open_error({{"path", dir.string()}});
  EXPECT_NE(e.find((dir / "text.h5").string() + ": the file is not a readable HDF5 file"), std::string::npos) << e;
  remove_tree(dir);

  // Two shards of different vocabularies.
  const fs::path two = fresh_dir("two");
  ShardFile a = good_shard(), b = good_shard();
  b.vocab_size = 2000;
  write_shard(two / "a.h5", a);
  write_shard(two / "b.h5", b);
  e = open_error({{"path", two.string()}, {"eval_sequences", int64_t{0}}, {"batch_size", int64_t{1}}});
  EXPECT_NE(e.find("the shards disagree"), std::string::npos) << e;
  EXPECT_NE(e.find("vocab_size 2000"), std::string::npos) << e;
  remove_tree(two);

  Fixture f;
  e = open_error(f.config({{"batch_size", int64_t{35}}}));
  EXPECT_NE(e.find("batch_size = 35 exceeds the 34 training rows"), std::string::npos) << e;
  e = open_error(f.config({{"eval_sequences", int64_t{40}}}));
  EXPECT_NE(e.find("leaves none of the 40"), std::string::npos) << e;
  e = open_error(f.config({{"eval_fraction", 0.1}}));
  EXPECT_NE(e.find("eval_sequences and eval_fraction are both given"), std::string::npos) << e;
}

// Shards of scripts/prepare-data: tests/python/test_tokens_dataset.py sets
// FLASHDRAFT_TOKENS_SHARDS (the folder) and FLASHDRAFT_TOKENS_EXPECTED (a text file, per
// conversation in file order a line of its token ids and a line of its mask, as h5py
// reads them). Rows in file order, one conversation each, must reproduce them.
TEST(TokensDataset, ReadsShardsOfPrepareData) {
  const char* shards = std::getenv("FLASHDRAFT_TOKENS_SHARDS");
  const char* expected = std::getenv("FLASHDRAFT_TOKENS_EXPECTED");
  if (!shards || !expected) {
    GTEST_SKIP() << "run by tests/python/test_tokens_dataset.py";
  }
  std::vector<Conversation> convs;
  std::ifstream in(expected);
  for (std::string ids, mask; std::getline(in, ids) && std::getline(in, mask);) {
    Conversation c;
    std::istringstream a(ids), b(mask);
    for (int64_t v; a >> v;) c.tokens.push_back(static_cast<int32_t>(v));
    for (int v; b >> v;) c.mask.push_back(static_cast<uint8_t>(v));
    convs.push_back(c);
  }
  ASSERT_FALSE(convs.empty()) << expected;
  auto d = open_dataset({{"path", std::string(shards)},
                         {"seq_len", int64_t{4096}},
                         {"batch_size", int64_t{1}},
                         {"eval_sequences", int64_t{0}},
                         {"shuffle", false},
                         {"min_loss_tokens", int64_t{0}}});
  for (size_t i = 0; i < convs.size(); ++i) {
    const Batch batch = d->train_batch(static_cast<int64_t>(i));
    const int64_t len = static_cast<int64_t>(convs[i].tokens.size());
    ASSERT_EQ(batch.lengths[0].item<int64_t>(), len) << "conversation " << i;
    for (int64_t t = 0; t < len; ++t) {
      EXPECT_EQ(batch.tokens[0][t].item<int64_t>(), convs[i].tokens[t]) << "conversation " << i << " token " << t;
      EXPECT_EQ(batch.loss_mask[0][t].item<bool>(), convs[i].mask[t] != 0) << "conversation " << i << " mask " << t;
    }
  }
  // The next batch starts the second epoch: conversation 0 again.
  EXPECT_TRUE(at::equal(d->train_batch(static_cast<int64_t>(convs.size())).tokens, d->train_batch(0).tokens));
}

}  // namespace

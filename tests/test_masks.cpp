// Mask generators (masks/*) against plain oracles written here, element by element.
//
// For every generator, over >= 200 random parameter draws (lengths that are not
// multiples of the block size, BQ != BKV, ragged edge tiles, BKV not a multiple of 32):
//   - dense(mask) == the generator's own predicate == an oracle written in this file
//     (a different formulation of the same rule, e.g. "distance from the end");
//   - the full and partial lists are exactly the tiles the oracle classifies as full
//     (all in-range elements visible) and partial (some, not all); empty never listed;
//     bitmap bits outside the sequence are zero;
//   - the transposed lists are the exact transpose (recomputed here by a double loop);
//   - BlockMask::validate() accepts the mask.
// Then: validate() rejects hand-corrupted masks; the DFlash rules of issue 3; bad input
// is refused with a message naming the value.
#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>

#include "built_plugins.hpp"
#include "registry/registry.hpp"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

constexpr int kDraws = 200;

const fd::Registry& registry() {
  static const fd::Registry reg({built_plugin_dir()});
  return reg;
}

// The generator `name` with its declared defaults, overridden by `keys`.
std::unique_ptr<fd::MaskGenerator> make(const std::string& name, const std::map<std::string, fd::Value>& keys = {}) {
  const fd::FoundPlugin& p = registry().get(fd::PluginKind::mask, name);
  const fd::Schema schema = registry().schema(p);
  fd::Config cfg("mask", fd::SourcePosition{"test_masks.cpp", 1, 1});
  for (const auto& [k, v] : keys) {
    EXPECT_NE(schema.find(k), nullptr) << name << " does not declare key " << k;
    cfg.set(k, v, std::nullopt);
  }
  for (const fd::KeySpec& spec : schema.keys())
    if (!keys.count(spec.name)) {
      EXPECT_TRUE(spec.fallback.has_value()) << name << ": required key " << spec.name << " not set by the test";
      if (spec.fallback) cfg.set(spec.name, *spec.fallback, std::nullopt);
    }
  return fd::create_as<fd::MaskGenerator>(registry(), p, cfg);
}

using Oracle = std::function<bool(int64_t b, int64_t q, int64_t kv)>;

struct BlockShape {
  int64_t q, kv;
};
// BQ != BKV, BKV not a multiple of 32 (padding bits in each bitmap row), tiny tiles.
const std::vector<BlockShape> kShapes = {{16, 32}, {64, 64}, {128, 64}, {32, 128}, {24, 40},
                                         {1, 7},   {33, 65}, {8, 8},    {128, 128}};

bool bit(const fd::BlockMask& m, int64_t e, int64_t r, int64_t c) {
  return (m.bits[static_cast<size_t>(e * m.words_per_tile() + r * m.words_per_row() + c / 32)] >> (c % 32)) & 1u;
}

// All checks of one built mask against the oracle. Returns "" or the first problem.
std::string check_mask(const fd::MaskGenerator& gen, const fd::MaskInput& in, int64_t bq, int64_t bkv,
                       const Oracle& oracle, int64_t want_batch) {
  std::ostringstream err;
  const fd::BlockMask m = gen.build(in, bq, bkv);
  try {
    m.validate();
  } catch (const std::exception& e) {
    return std::string("validate() refused a generated mask: ") + e.what();
  }
  if (m.batch != want_batch || m.heads != 1 || m.q_len != in.q_len || m.kv_len != in.kv_len || m.block_q != bq ||
      m.block_kv != bkv) {
    err << "extents: batch " << m.batch << " (want " << want_batch << "), heads " << m.heads << ", q_len " << m.q_len
        << ", kv_len " << m.kv_len << ", blocks " << m.block_q << "x" << m.block_kv;
    return err.str();
  }
  // 1. Element by element: dense(mask) == predicate == oracle, for every batch element.
  const at::Tensor d = fd::dense(m);
  if (d.sizes() != at::IntArrayRef({m.batch, 1, m.q_len, m.kv_len})) return "dense() has the wrong shape";
  auto acc = d.accessor<bool, 4>();
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t mb = m.batch == 1 ? 0 : b;
    for (int64_t q = 0; q < in.q_len; ++q)
      for (int64_t kv = 0; kv < in.kv_len; ++kv) {
        const bool o = oracle(b, q, kv), p = gen.visible(in, b, 0, q, kv), x = acc[mb][0][q][kv];
        if (o != p || o != x) {
          err << "element (b " << b << ", q " << q << ", kv " << kv << "): oracle " << o << ", predicate " << p
              << ", dense " << x;
          return err.str();
        }
      }
  }
  // 2. Lists: exactly the oracle's full and partial tiles, bitmaps zero off the sequence.
  const int64_t nq = m.q_blocks(), nk = m.kv_blocks();
  for (int64_t mb = 0; mb < m.batch; ++mb)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t row = mb * nq + i, q0 = i * bq, q1 = std::min(q0 + bq, in.q_len);
      std::vector<int32_t> want_full, want_part;
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t k0 = j * bkv, k1 = std::min(k0 + bkv, in.kv_len);
        int64_t seen = 0;
        for (int64_t q = q0; q < q1; ++q)
          for (int64_t kv = k0; kv < k1; ++kv) seen += oracle(mb, q, kv);
        if (seen == (q1 - q0) * (k1 - k0))
          want_full.push_back(static_cast<int32_t>(j));
        else if (seen > 0)
          want_part.push_back(static_cast<int32_t>(j));
      }
      const std::vector<int32_t> full(m.full_index.begin() + m.full_offset[row],
                                      m.full_index.begin() + m.full_offset[row + 1]);
      const std::vector<int32_t> part(m.part_index.begin() + m.part_offset[row],
                                      m.part_index.begin() + m.part_offset[row + 1]);
      if (full != want_full || part != want_part) {
        err << "batch " << mb << " q block " << i << ": listed " << full.size() << " full / " << part.size()
            << " partial tiles, the oracle has " << want_full.size() << " / " << want_part.size();
        return err.str();
      }
      for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e) {
        const int64_t k0 = int64_t(m.part_index[e]) * bkv;
        for (int64_t r = 0; r < bq; ++r)
          for (int64_t c = 0; c < m.words_per_row() * 32; ++c) {
            const bool inside = q0 + r < in.q_len && c < bkv && k0 + c < in.kv_len;
            if (!inside && bit(m, e, r, c)) {
              err << "partial entry " << e << " has bit (" << r << ", " << c << ") set off the sequence";
              return err.str();
            }
          }
      }
    }
  // 3. Transpose, recomputed by a plain double loop over (kv block, q block).
  std::vector<int32_t> tfo{0}, tfi, tpo{0}, tpi, tpe;
  for (int64_t mb = 0; mb < m.batch; ++mb)
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t row = mb * nq + i;
        for (int32_t e = m.full_offset[row]; e < m.full_offset[row + 1]; ++e)
          if (m.full_index[e] == j) tfi.push_back(static_cast<int32_t>(i));
        for (int32_t e = m.part_offset[row]; e < m.part_offset[row + 1]; ++e)
          if (m.part_index[e] == j) {
            tpi.push_back(static_cast<int32_t>(i));
            tpe.push_back(e);
          }
      }
      tfo.push_back(static_cast<int32_t>(tfi.size()));
      tpo.push_back(static_cast<int32_t>(tpi.size()));
    }
  if (tfo != m.t_full_offset || tfi != m.t_full_index) return "transposed full lists are not the transpose";
  if (tpo != m.t_part_offset || tpi != m.t_part_index || tpe != m.t_part_entry)
    return "transposed partial lists are not the transpose";
  return "";
}

std::string describe(const fd::MaskInput& in, int64_t bq, int64_t bkv) {
  std::ostringstream os;
  os << "B=" << in.batch << " Lq=" << in.q_len << " Lkv=" << in.kv_len << " blocks " << bq << "x" << bkv;
  return os.str();
}

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // inclusive
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// ---------------------------------------------------------------- property tests

TEST(MaskCausal, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(101);
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.q_len = uniform(rng, 1, 260);
    in.kv_len = uniform(rng, 1, 260);
    const int64_t offset = uniform(rng, -in.q_len, in.kv_len);
    const bool bottom_right = uniform(rng, 0, 1);
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    auto gen = make("causal", {{"offset", offset}, {"bottom_right", bottom_right}});
    const int64_t Lq = in.q_len, Lkv = in.kv_len;
    // Bottom-right: key kv is visible when it lies no nearer the end than the query,
    // counted from the ends, shifted by offset. Top-left: kv - q <= offset.
    const Oracle oracle = [=](int64_t, int64_t q, int64_t kv) {
      if (bottom_right) return (Lkv - 1 - kv) >= (Lq - 1 - q) - offset;
      return kv - q <= offset;
    };
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, oracle, 1);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " offset " << offset
                           << " bottom_right " << bottom_right;
  }
}

// Cached decoding: row b's queries are positions q_offsets[b] + q of its keys (served
// validation's target decoder); the mask differs per batch element.
TEST(MaskCausal, QueryOffsetsPerBatchElementMatchOracle) {
  std::mt19937_64 rng(103);
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.batch = uniform(rng, 1, 4);
    in.q_len = uniform(rng, 1, 40);
    in.kv_len = uniform(rng, in.q_len, 300);
    for (int64_t b = 0; b < in.batch; ++b) in.q_offsets.push_back(uniform(rng, 0, in.kv_len - in.q_len));
    const int64_t offset = uniform(rng, -2, 2);
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    auto gen = make("causal", {{"offset", offset}, {"bottom_right", uniform(rng, 0, 1) == 1}});
    // A query at position p = q_offsets[b] + q reads every key at a position up to p (+ offset).
    const Oracle oracle = [&in, offset](int64_t b, int64_t q, int64_t kv) {
      const int64_t position = in.q_offsets[static_cast<size_t>(b)] + q;
      return kv - position <= offset;
    };
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, oracle, in.batch);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " offset " << offset;
  }
  fd::MaskInput bad;
  bad.batch = 2;
  bad.q_len = 4;
  bad.kv_len = 10;
  bad.q_offsets = {1};
  try {
    make("causal")->build(bad, 16, 16);
    FAIL() << "one offset for a batch of two was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("q_offsets has 1 entries for a batch of 2"), std::string::npos) << e.what();
  }
}

TEST(MaskSlidingWindow, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(202);
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.q_len = uniform(rng, 1, 260);
    in.kv_len = uniform(rng, 1, 260);
    const int64_t window = uniform(rng, 1, in.kv_len);
    const bool two_sided = uniform(rng, 0, 1);
    const int64_t offset = uniform(rng, -20, 20);
    const bool bottom_right = uniform(rng, 0, 1);
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    auto gen = make("sliding_window",
                    {{"window", window}, {"two_sided", two_sided}, {"offset", offset}, {"bottom_right", bottom_right}});
    const int64_t Lq = in.q_len, Lkv = in.kv_len;
    // Position of the diagonal key for query q, then a band on one or both sides.
    const Oracle oracle = [=](int64_t, int64_t q, int64_t kv) {
      const int64_t diag = bottom_right ? (Lkv - 1) - ((Lq - 1 - q) - offset) : q + offset;
      const int64_t behind = diag - kv;
      if (two_sided) return behind > -window && behind < window;
      return behind >= 0 && behind <= window - 1;
    };
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, oracle, 1);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " window " << window
                           << " two_sided " << two_sided << " offset " << offset << " bottom_right " << bottom_right;
  }
}

// Random split of n into documents (some long, some of length 1, zero-length allowed).
std::vector<int64_t> random_docs(std::mt19937_64& rng, int64_t n) {
  std::vector<int64_t> lens;
  int64_t left = n;
  while (left > 0) {
    const int64_t len = uniform(rng, 0, 9) == 0 ? 0 : std::min(left, uniform(rng, 1, std::max<int64_t>(1, n / 3)));
    lens.push_back(len);
    left -= len;
  }
  return lens;
}

TEST(MaskDocument, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(303);
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.q_len = in.kv_len = uniform(rng, 1, 260);
    in.batch = uniform(rng, 1, 3);
    const int source = draw % 3;  // 0: per-element lists, 1: one shared list, 2: TOML lengths
    std::vector<int64_t> toml;
    if (source == 0)
      for (int64_t b = 0; b < in.batch; ++b) in.doc_lengths.push_back(random_docs(rng, in.q_len));
    else if (source == 1)
      in.doc_lengths.push_back(random_docs(rng, in.q_len));
    else
      toml = random_docs(rng, in.q_len);
    // a target's sliding layers (MaskInput::window): every other draw, a row starts no earlier than q - W + 1
    in.window = draw % 2 ? uniform(rng, 1, 40) : 0;
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    auto gen = make("document", {{"lengths", toml}});
    // Document id of every position, per batch element; same id and kv <= q.
    std::vector<std::vector<int64_t>> id(static_cast<size_t>(in.batch));
    for (int64_t b = 0; b < in.batch; ++b) {
      const std::vector<int64_t>& lens =
          source == 0 ? in.doc_lengths[static_cast<size_t>(b)] : (source == 1 ? in.doc_lengths[0] : toml);
      for (size_t doc = 0; doc < lens.size(); ++doc)
        for (int64_t t = 0; t < lens[doc]; ++t) id[static_cast<size_t>(b)].push_back(static_cast<int64_t>(doc));
    }
    const int64_t W = in.window;
    const Oracle oracle = [&id, W](int64_t b, int64_t q, int64_t kv) {
      return kv <= q && (W == 0 || q - kv < W) &&
             id[static_cast<size_t>(b)][static_cast<size_t>(q)] == id[static_cast<size_t>(b)][static_cast<size_t>(kv)];
    };
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, oracle, source == 0 ? in.batch : 1);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " source " << source << " window "
                           << W;
  }
}

TEST(MaskPrefixLm, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(404);
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.q_len = uniform(rng, 1, 260);
    in.kv_len = draw % 2 ? in.q_len : uniform(rng, in.q_len, 300);
    const int64_t prefix = uniform(rng, 0, in.kv_len);
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    auto gen = make("prefix_lm", {{"prefix", prefix}});
    const int64_t Lq = in.q_len, Lkv = in.kv_len;
    const Oracle oracle = [=](int64_t, int64_t q, int64_t kv) { return kv < prefix || (Lkv - 1 - kv) >= (Lq - 1 - q); };
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, oracle, 1);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " prefix " << prefix;
  }
}

// A DFlash batch: sorted distinct anchors in [0, S - BS], some padding blocks whose
// anchor is garbage (padding anchors must be ignored).
fd::MaskInput random_dflash(std::mt19937_64& rng, int64_t batch, int64_t S, int64_t BS, int64_t N, bool padding) {
  fd::MaskInput in;
  in.batch = batch;
  in.blocks.context_len = S;
  in.blocks.block_size = BS;
  in.q_len = N * BS;
  in.kv_len = S + N * BS;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int64_t> pool(static_cast<size_t>(S - BS + 1));
    for (size_t t = 0; t < pool.size(); ++t) pool[t] = static_cast<int64_t>(t);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int64_t> a(pool.begin(), pool.begin() + N);
    std::sort(a.begin(), a.end());
    std::vector<uint8_t> valid(static_cast<size_t>(N), 1);
    if (padding)
      for (int64_t n = 0; n < N; ++n)
        if (uniform(rng, 0, 4) == 0) {
          valid[static_cast<size_t>(n)] = 0;
          a[static_cast<size_t>(n)] = uniform(rng, -5, S + 5);  // anything: ignored
        }
    in.blocks.anchors.push_back(a);
    in.blocks.valid.push_back(valid);
  }
  return in;
}

// Issue 3's rule: a valid block b sees context kv < anchor_b, or kv in block b (in
// "causal" mode only its own row and those before it); padding blocks see nothing.
Oracle dflash_oracle(const fd::MaskInput& in, bool causal) {
  return [&in, causal](int64_t b, int64_t q, int64_t kv) {
    const int64_t S = in.blocks.context_len, BS = in.blocks.block_size;
    const int64_t block = q / BS, row = q % BS;
    if (!in.blocks.valid[static_cast<size_t>(b)][static_cast<size_t>(block)]) return false;
    if (kv < S) return kv < in.blocks.anchors[static_cast<size_t>(b)][static_cast<size_t>(block)];
    const int64_t first = S + block * BS, last = first + BS - 1;
    if (kv < first || kv > last) return false;
    return !causal || kv - first <= row;
  };
}

TEST(MaskDFlash, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(505);
  auto bidirectional = make("dflash");
  auto causal = make("dflash", {{"in_block", std::string("causal")}});
  for (int draw = 0; draw < 2 * kDraws; ++draw) {
    const bool in_block_causal = draw % 2;
    const int64_t BS = uniform(rng, 1, 20);
    const int64_t S = uniform(rng, BS, 160);
    const int64_t N = uniform(rng, 1, std::min<int64_t>(12, S - BS + 1));
    const fd::MaskInput in = random_dflash(rng, uniform(rng, 1, 3), S, BS, N, draw % 3 != 0);
    const BlockShape bs = kShapes[static_cast<size_t>(draw / 2) % kShapes.size()];
    const fd::MaskGenerator& gen = in_block_causal ? *causal : *bidirectional;
    const std::string problem = check_mask(gen, in, bs.q, bs.kv, dflash_oracle(in, in_block_causal), in.batch);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " S " << S << " BS " << BS
                           << " N " << N << " in_block " << (in_block_causal ? "causal" : "bidirectional");
  }
}

// Sliding-window draft layers: row j of block n (position anchor + j) sees only keys within
// `window` positions: context kv > anchor + j - window, own-block rows |j - j'| < window.
TEST(MaskDFlash, SlidingWindowMatchesOracle) {
  std::mt19937_64 rng(509);
  auto bidirectional = make("dflash");
  auto causal = make("dflash", {{"in_block", std::string("causal")}});
  int64_t cut = 0;  // values the window hides that the full mask shows
  for (int draw = 0; draw < 2 * kDraws; ++draw) {
    const bool in_block_causal = draw % 2;
    const int64_t BS = uniform(rng, 1, 20);
    const int64_t S = uniform(rng, BS, 160);
    const int64_t N = uniform(rng, 1, std::min<int64_t>(12, S - BS + 1));
    fd::MaskInput in = random_dflash(rng, uniform(rng, 1, 3), S, BS, N, draw % 3 != 0);
    in.window = uniform(rng, 1, 40);
    const Oracle full = dflash_oracle(in, in_block_causal);
    const Oracle oracle = [&in, full](int64_t b, int64_t q, int64_t kv) {
      const int64_t BS = in.blocks.block_size, j = q % BS;
      const int64_t a = in.blocks.anchors[size_t(b)][size_t(q / BS)];
      const int64_t key_pos = kv < in.blocks.context_len ? kv : a + (kv - in.blocks.context_len) % BS;
      return full(b, q, kv) && std::abs(a + j - key_pos) < in.window;
    };
    for (int64_t b = 0; b < in.batch; ++b)
      for (int64_t q = 0; q < in.q_len; ++q)
        for (int64_t kv = 0; kv < in.kv_len; ++kv) cut += full(b, q, kv) && !oracle(b, q, kv);
    const BlockShape bs = kShapes[static_cast<size_t>(draw / 2) % kShapes.size()];
    const fd::MaskGenerator& gen = in_block_causal ? *causal : *bidirectional;
    const std::string problem = check_mask(gen, in, bs.q, bs.kv, oracle, in.batch);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " S " << S << " BS " << BS
                           << " N " << N << " window " << in.window;
  }
  EXPECT_GT(cut, 0);  // not vacuous
}

// A server's shorter last block (served validation): block n keeps its first len tokens; its
// later queries see nothing and nobody sees its later keys.
TEST(MaskDFlash, BlockLengthsMatchOracle) {
  std::mt19937_64 rng(507);
  auto bidirectional = make("dflash");
  auto causal = make("dflash", {{"in_block", std::string("causal")}});
  for (int draw = 0; draw < 2 * kDraws; ++draw) {
    const bool in_block_causal = draw % 2;
    const int64_t BS = uniform(rng, 1, 20);
    const int64_t S = uniform(rng, BS, 160);
    const int64_t N = uniform(rng, 1, std::min<int64_t>(6, S - BS + 1));
    fd::MaskInput in = random_dflash(rng, uniform(rng, 1, 3), S, BS, N, draw % 3 != 0);
    for (int64_t b = 0; b < in.batch; ++b) {
      std::vector<int64_t> len;
      for (int64_t n = 0; n < N; ++n) len.push_back(uniform(rng, 1, BS));
      in.blocks.lengths.push_back(len);
    }
    const Oracle full = dflash_oracle(in, in_block_causal);
    const Oracle oracle = [&in, full](int64_t b, int64_t q, int64_t kv) {
      const int64_t BS = in.blocks.block_size, len = in.blocks.lengths[size_t(b)][size_t(q / BS)];
      if (q % BS >= len) return false;  // a query past the block's tokens
      if (kv >= in.blocks.context_len && (kv - in.blocks.context_len) % BS >= len) return false;  // a key past them
      return full(b, q, kv);
    };
    const BlockShape bs = kShapes[static_cast<size_t>(draw / 2) % kShapes.size()];
    const fd::MaskGenerator& gen = in_block_causal ? *causal : *bidirectional;
    const std::string problem = check_mask(gen, in, bs.q, bs.kv, oracle, in.batch);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " S " << S << " BS " << BS
                           << " N " << N;
  }
  fd::MaskInput bad = random_dflash(rng, 1, 40, 8, 2, false);
  bad.blocks.lengths = {{8, 9}};
  try {
    make("dflash")->build(bad, 16, 16);
    FAIL() << "a block length above the block size was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("has length 9; a block holds 1..8 tokens"), std::string::npos) << e.what();
  }
}

// Packed rows: a block sees only the context of its anchor's document, and stays inside it.
TEST(MaskDFlash, DocumentsMatchOracle) {
  std::mt19937_64 rng(509);
  auto bidirectional = make("dflash");
  auto causal = make("dflash", {{"in_block", std::string("causal")}});
  int draws = 0;
  while (draws < 2 * kDraws) {
    const bool in_block_causal = draws % 2;
    const int64_t BS = uniform(rng, 1, 12);
    const int64_t S = uniform(rng, 2 * BS, 180);
    fd::MaskInput in;
    in.batch = uniform(rng, 1, 3);
    in.blocks.context_len = S;
    in.blocks.block_size = BS;
    std::vector<std::vector<int64_t>> starts_of;  // per row, the anchors a block may start at
    int64_t N = 0;
    for (int64_t b = 0; b < in.batch; ++b) {
      std::vector<int64_t> docs;
      for (int64_t used = 0; used < S;) {
        const int64_t len = std::min<int64_t>(S - used, uniform(rng, 1, 3 * BS));
        docs.push_back(len);
        used += len;
      }
      std::vector<int64_t> ok;
      int64_t begin = 0;
      for (int64_t len : docs) {
        for (int64_t a = begin; a + BS <= begin + len; ++a) ok.push_back(a);
        begin += len;
      }
      in.doc_lengths.push_back(docs);
      starts_of.push_back(ok);
    }
    N = uniform(rng, 1, 6);
    bool enough = true;
    for (const auto& ok : starts_of) enough = enough && static_cast<int64_t>(ok.size()) >= N;
    if (!enough) continue;
    for (int64_t b = 0; b < in.batch; ++b) {
      std::vector<int64_t> pool = starts_of[static_cast<size_t>(b)];
      std::shuffle(pool.begin(), pool.end(), rng);
      std::vector<int64_t> a(pool.begin(), pool.begin() + N);
      std::sort(a.begin(), a.end());
      in.blocks.anchors.push_back(a);
      in.blocks.valid.push_back(std::vector<uint8_t>(static_cast<size_t>(N), 1));
    }
    in.q_len = N * BS;
    in.kv_len = S + N * BS;
    // The start of the document of context position p, by walking the lengths.
    const auto doc_start = [&in](int64_t b, int64_t p) {
      int64_t start = 0;
      for (int64_t len : in.doc_lengths[static_cast<size_t>(b)]) {
        if (p < start + len) return start;
        start += len;
      }
      return start;
    };
    const Oracle full = dflash_oracle(in, in_block_causal);
    const Oracle oracle = [&in, full, doc_start](int64_t b, int64_t q, int64_t kv) {
      const int64_t a = in.blocks.anchors[size_t(b)][size_t(q / in.blocks.block_size)];
      if (kv < in.blocks.context_len && doc_start(b, kv) != doc_start(b, a)) return false;  // another document
      return full(b, q, kv);
    };
    const BlockShape bs = kShapes[static_cast<size_t>(draws / 2) % kShapes.size()];
    const fd::MaskGenerator& gen = in_block_causal ? *causal : *bidirectional;
    const std::string problem = check_mask(gen, in, bs.q, bs.kv, oracle, in.batch);
    ASSERT_EQ(problem, "") << "draw " << draws << ": " << describe(in, bs.q, bs.kv) << " S " << S << " BS " << BS;
    ++draws;
  }
  // A block that would run past its document's end is refused with a sentence.
  fd::MaskInput bad;
  bad.batch = 1;
  bad.blocks.context_len = 20;
  bad.blocks.block_size = 4;
  bad.q_len = 4;
  bad.kv_len = 24;
  bad.blocks.anchors = {{7}};
  bad.doc_lengths = {{9, 11}};
  try {
    make("dflash")->build(bad, 16, 16);
    FAIL() << "a block crossing a document end was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("runs past the end 9 of its document [0, 9)"), std::string::npos) << e.what();
  }
  bad.doc_lengths = {{9, 10}};
  EXPECT_THROW(make("dflash")->build(bad, 16, 16), std::invalid_argument);  // documents must cover the context
}

// ---------------------------------------------------------------- DFlash rules (issue 3)

TEST(MaskDFlash, BlocksNeverSeeOtherBlocksAndPaddingSeesNothing) {
  std::mt19937_64 rng(606);
  auto gen = make("dflash");
  for (int draw = 0; draw < 50; ++draw) {
    const int64_t BS = uniform(rng, 2, 16), S = uniform(rng, BS + 4, 200);
    const int64_t N = uniform(rng, 2, std::min<int64_t>(10, S - BS + 1));
    const fd::MaskInput in = random_dflash(rng, 2, S, BS, N, true);
    const fd::BlockMask m = gen->build(in, 32, 48);
    const at::Tensor d = fd::dense(m);
    auto acc = d.accessor<bool, 4>();
    for (int64_t b = 0; b < in.batch; ++b)
      for (int64_t q = 0; q < in.q_len; ++q) {
        const int64_t n = q / BS;
        const bool valid = in.blocks.valid[static_cast<size_t>(b)][static_cast<size_t>(n)];
        int64_t seen_ctx = 0, seen_own = 0;
        for (int64_t kv = 0; kv < in.kv_len; ++kv) {
          const bool on = acc[b][0][q][kv];
          if (!valid) {
            ASSERT_FALSE(on) << "padding block " << n << " of batch " << b << " sees kv " << kv;
            continue;
          }
          if (kv >= S && (kv - S) / BS != n) {
            ASSERT_FALSE(on) << "block " << n << " sees block " << (kv - S) / BS;
          }
          if (kv < S)
            seen_ctx += on;
          else
            seen_own += on;
        }
        if (valid) {
          // exactly the anchor's prefix of the context and the whole own block
          EXPECT_EQ(seen_ctx, in.blocks.anchors[static_cast<size_t>(b)][static_cast<size_t>(n)]);
          EXPECT_EQ(seen_own, BS);
        }
      }
  }
}

TEST(MaskDFlash, AnchorsAtTheFirstAndLastValidPosition) {
  // anchor 0: the block sees no context at all, only itself; anchor S - BS: the block
  // sees the context up to S - BS - 1 (the BS - 1 labels after the anchor stay hidden).
  auto gen = make("dflash");
  for (const BlockShape& bs : kShapes) {
    fd::MaskInput in;
    in.batch = 1;
    in.blocks.context_len = 70;
    in.blocks.block_size = 16;
    in.blocks.anchors = {{0, 20, 54}};
    in.blocks.valid = {{1, 1, 1}};
    in.q_len = 48;
    in.kv_len = 70 + 48;
    const fd::BlockMask m = gen->build(in, bs.q, bs.kv);
    m.validate();
    for (int64_t q = 0; q < 16; ++q) {
      for (int64_t kv = 0; kv < 70; ++kv) EXPECT_FALSE(m.visible(0, 0, q, kv)) << "anchor 0 sees context " << kv;
      for (int64_t kv = 70; kv < 86; ++kv) EXPECT_TRUE(m.visible(0, 0, q, kv));
    }
    for (int64_t q = 32; q < 48; ++q)
      for (int64_t kv = 0; kv < 70; ++kv) EXPECT_EQ(m.visible(0, 0, q, kv), kv < 54) << "q " << q << " kv " << kv;
    EXPECT_EQ(m.visible_pairs(), 16 * (0 + 20 + 54) + 3 * 16 * 16);
  }
}

TEST(MaskDFlash, NoValidFlagsMeansEveryBlockIsValid) {
  std::mt19937_64 rng(707);
  auto gen = make("dflash");
  fd::MaskInput in = random_dflash(rng, 2, 90, 7, 9, false);
  const fd::BlockMask flagged = gen->build(in, 16, 32);
  in.blocks.valid.clear();
  const fd::BlockMask unflagged = gen->build(in, 16, 32);
  EXPECT_TRUE(fd::dense(flagged).equal(fd::dense(unflagged)));
  EXPECT_EQ(flagged.full_index, unflagged.full_index);
  EXPECT_EQ(flagged.bits, unflagged.bits);
  EXPECT_GT(flagged.visible_pairs(), 0);
}

// ---------------------------------------------------------------- validate() on corrupted masks

// A mask with rows of several full tiles, partial tiles, ragged edges and padding bits.
fd::BlockMask sample_mask() {
  auto gen = make("causal");
  fd::MaskInput in;
  in.q_len = 150;  // 150 = 4 x 32 + 22: ragged last q block
  in.kv_len = 150;
  fd::BlockMask m = gen->build(in, 32, 40);  // 40 = 32 + 8: padding bits in every row's 2nd word
  m.validate();
  return m;
}

void expect_refused(const fd::BlockMask& m, const std::string& fragment) {
  try {
    m.validate();
    ADD_FAILURE() << "validate() accepted a corrupted mask (expected: " << fragment << ")";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(BlockMaskValidate, RejectsHandCorruptedMasks) {
  const fd::BlockMask good = sample_mask();
  ASSERT_GE(good.full_count(), 3);
  ASSERT_GE(good.partial_count(), 2);
  const int64_t nq = good.q_blocks();

  {  // unsorted full index within a row
    fd::BlockMask m = good;
    int64_t row = 0;
    while (m.full_offset[row + 1] - m.full_offset[row] < 2) ++row;
    std::swap(m.full_index[m.full_offset[row]], m.full_index[m.full_offset[row] + 1]);
    expect_refused(m, "not strictly increasing");
  }
  {  // a partial tile whose bits were all set: it is full
    fd::BlockMask m = good;
    const int64_t e = 0, i = 0;  // first partial entry is in row 0 (the diagonal tile)
    ASSERT_EQ(m.part_offset[1], 1);
    const int64_t k0 = int64_t(m.part_index[e]) * m.block_kv;
    for (int64_t r = 0; r < std::min(m.block_q, m.q_len - i * m.block_q); ++r)
      for (int64_t c = 0; c < std::min(m.block_kv, m.kv_len - k0); ++c)
        m.bits[static_cast<size_t>(e * m.words_per_tile() + r * m.words_per_row() + c / 32)] |= 1u << (c % 32);
    expect_refused(m, "all its elements are visible");
  }
  {  // a partial tile with no bit: empty tiles are never listed
    fd::BlockMask m = good;
    std::fill(m.bits.begin(), m.bits.begin() + m.words_per_tile(), 0u);
    expect_refused(m, "no visible element");
  }
  {  // a bit in the padding of a row (column >= BKV)
    fd::BlockMask m = good;
    m.bits[1] |= 1u << 9;  // row 0, column 32 + 9 = 41 >= 40
    expect_refused(m, "padding bits");
  }
  {  // a bit off the sequence: row 22.. of the ragged last q block
    fd::BlockMask m = good;
    const int64_t last_row = nq - 1;
    const int32_t e = m.part_offset[last_row];
    ASSERT_LT(e, m.part_offset[last_row + 1]);
    m.bits[static_cast<size_t>(e * m.words_per_tile() + 25 * m.words_per_row())] |= 1u;  // row 25 >= 22
    expect_refused(m, "outside the sequence");
  }
  {  // transposed full entry naming a q block that does not list that kv block
    fd::BlockMask m = good;
    // kv block 0 is full for q blocks 1.. (q block 0 holds it as partial); point one at 0
    ASSERT_GT(m.t_full_offset[1], 0);
    m.t_full_index[0] = 0;
    expect_refused(m, "transposed full list");
  }
  {  // transposed partial entry pointing at the wrong bitmap
    fd::BlockMask m = good;
    m.t_part_entry[0] = m.t_part_entry[0] + 1;
    expect_refused(m, "transposed partial entry");
  }
  {  // a tile dropped from the transpose only
    fd::BlockMask m = good;
    m.t_full_index.pop_back();
    m.t_full_offset.back() -= 1;
    expect_refused(m, "transposed full");
  }
  {  // index out of range
    fd::BlockMask m = good;
    m.full_index[0] = static_cast<int32_t>(m.kv_blocks());
    expect_refused(m, "out of range");
  }
}

// ---------------------------------------------------------------- bad input

template <class F>
void expect_invalid(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "no error (expected one naming " << fragments[0] << ")";
  } catch (const std::invalid_argument& e) {
    for (const std::string& s : fragments)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "message lacks '" << s << "': " << e.what();
  }
}

fd::MaskInput dflash_input(std::vector<int64_t> anchors, int64_t S, int64_t BS) {
  fd::MaskInput in;
  in.batch = 1;
  in.blocks.context_len = S;
  in.blocks.block_size = BS;
  const int64_t N = static_cast<int64_t>(anchors.size());
  in.blocks.anchors = {std::move(anchors)};
  in.blocks.valid = {std::vector<uint8_t>(static_cast<size_t>(N), 1)};
  in.q_len = N * BS;
  in.kv_len = S + N * BS;
  return in;
}

TEST(MaskBadInput, DFlashAnchorsAndBlockSize) {
  auto gen = make("dflash");
  expect_invalid(
      [&] {
        gen->build(dflash_input({3, 100, 40}, 200, 8), 64, 64);
      },
      {"anchor 40", "anchor 100", "strictly increasing"});
  expect_invalid([&] { gen->build(dflash_input({3, 7, 7}, 200, 8), 64, 64); }, {"anchor 7", "strictly increasing"});
  expect_invalid([&] { gen->build(dflash_input({3, 250}, 200, 8), 64, 64); }, {"anchor 250", "outside the context"});
  expect_invalid([&] { gen->build(dflash_input({-2, 10}, 200, 8), 64, 64); }, {"anchor -2"});
  expect_invalid(
      [&] {
        gen->build(dflash_input({3, 193}, 200, 8), 64, 64);
      },
      {"anchor 193", "no room for the 7 tokens", "<= 192"});
  fd::MaskInput zero = dflash_input({3, 9}, 200, 8);
  zero.blocks.block_size = 0;
  zero.q_len = 0;
  zero.kv_len = 200;
  expect_invalid([&] { gen->build(zero, 64, 64); }, {"block size 0"});
  // the last valid anchor S - BS itself is accepted; a padding block's anchor is not checked
  EXPECT_NO_THROW(gen->build(dflash_input({3, 192}, 200, 8), 64, 64));
  fd::MaskInput padded = dflash_input({3, 5000}, 200, 8);
  padded.blocks.valid[0][1] = 0;
  EXPECT_NO_THROW(gen->build(padded, 64, 64));
  // tile size 0 (the kernel's block size) is refused by the builder, naming it
  expect_invalid([&] { gen->build(dflash_input({3, 9}, 200, 8), 0, 64); }, {"block size 0x64"});
  // lengths that do not match anchors x block size
  fd::MaskInput wrong = dflash_input({3, 9}, 200, 8);
  wrong.q_len = 17;
  expect_invalid([&] { gen->build(wrong, 64, 64); }, {"query length 17", "2 x 8 = 16"});
}

TEST(MaskBadInput, WindowPrefixAndDocuments) {
  fd::MaskInput in;
  in.q_len = in.kv_len = 300;
  expect_invalid([&] { make("sliding_window", {{"window", int64_t{301}}})->build(in, 64, 64); }, {"window 301", "300"});
  EXPECT_NO_THROW(make("sliding_window", {{"window", int64_t{300}}})->build(in, 64, 64));
  expect_invalid([&] { make("prefix_lm", {{"prefix", int64_t{512}}})->build(in, 64, 64); }, {"prefix 512", "300"});

  auto doc = make("document");
  fd::MaskInput d = in;
  d.doc_lengths = {{100, 150, 49}};
  expect_invalid([&] { doc->build(d, 64, 64); }, {"sum to 299", "300"});
  d.doc_lengths = {{100, 250, -50}};
  expect_invalid([&] { doc->build(d, 64, 64); }, {"length -50"});
  d.batch = 3;
  d.doc_lengths = {{300}, {300}};
  expect_invalid([&] { doc->build(d, 64, 64); }, {"2 lists", "batch of 3"});
  d = in;
  d.doc_lengths.clear();
  expect_invalid([&] { doc->build(d, 64, 64); }, {"no document lengths"});
  expect_invalid(
      [&] {
        make("document", {{"lengths", std::vector<int64_t>{200, 50}}})->build(in, 64, 64);
      },
      {"sum to 250", "[mask] key lengths"});
}

}  // namespace

// ---------------------------------------------------------------- EAGLE-3 training-time test

namespace {

// Random document lengths summing to S (some of length 1, some long).
std::vector<int64_t> random_documents(std::mt19937_64& rng, int64_t S) {
  std::vector<int64_t> lens;
  for (int64_t left = S; left > 0;) {
    const int64_t len = std::min(left, uniform(rng, 1, std::max<int64_t>(1, S / 2)));
    lens.push_back(len);
    left -= len;
  }
  return lens;
}

// Written from the definition (plugins/eagle3): query t sees key (j, s) = j * S + s iff
// j == 0, s <= t and s is in t's document, or j >= 1 and s == t.
Oracle eagle3_oracle(const fd::MaskInput& in) {
  return [&in](int64_t b, int64_t q, int64_t kv) {
    const int64_t S = in.q_len, j = kv / S, s = kv % S;
    if (j >= 1) return s == q;
    if (s > q) return false;
    if (in.doc_lengths.empty()) return true;
    const auto& lens = in.doc_lengths[in.doc_lengths.size() == 1 ? 0 : static_cast<size_t>(b)];
    std::vector<int64_t> doc_of;
    for (size_t d = 0; d < lens.size(); ++d) doc_of.insert(doc_of.end(), static_cast<size_t>(lens[d]), int64_t(d));
    return doc_of[static_cast<size_t>(s)] == doc_of[static_cast<size_t>(q)];
  };
}

}  // namespace

TEST(MaskEagle3Ttt, MatchesOracleOverRandomDraws) {
  std::mt19937_64 rng(3303);
  auto gen = make("eagle3_ttt");
  for (int draw = 0; draw < kDraws; ++draw) {
    fd::MaskInput in;
    in.batch = uniform(rng, 1, 3);
    in.q_len = uniform(rng, 1, 90);
    in.kv_len = in.q_len * uniform(rng, 1, 5);
    const int kind = draw % 3;  // no documents, one shared list, one list per element
    if (kind == 1) in.doc_lengths = {random_documents(rng, in.q_len)};
    if (kind == 2)
      for (int64_t b = 0; b < in.batch; ++b) in.doc_lengths.push_back(random_documents(rng, in.q_len));
    const BlockShape bs = kShapes[static_cast<size_t>(draw) % kShapes.size()];
    const int64_t want_batch = kind == 2 && in.batch > 1 ? in.batch : 1;
    const std::string problem = check_mask(*gen, in, bs.q, bs.kv, eagle3_oracle(in), want_batch);
    ASSERT_EQ(problem, "") << "draw " << draw << ": " << describe(in, bs.q, bs.kv) << " steps " << in.kv_len / in.q_len
                           << " documents kind " << kind;
  }
}

TEST(MaskEagle3Ttt, LaterStepsSeeOnlyTheirOwnColumn) {
  auto gen = make("eagle3_ttt");
  fd::MaskInput in;
  in.q_len = 10;
  in.kv_len = 40;  // 4 unroll blocks
  in.doc_lengths = {{4, 6}};
  for (int64_t t = 0; t < 10; ++t) {
    int64_t seen = 0;
    for (int64_t kv = 0; kv < 40; ++kv) seen += gen->visible(in, 0, 0, t, kv);
    const int64_t doc_start = t < 4 ? 0 : 4;
    EXPECT_EQ(seen, (t - doc_start + 1) + 3) << "row " << t;  // causal in its document + 3 own states
    for (int64_t j = 1; j < 4; ++j) EXPECT_TRUE(gen->visible(in, 0, 0, t, j * 10 + t));
  }
}

TEST(MaskEagle3Ttt, RefusesBadShapesWithASentence) {
  auto gen = make("eagle3_ttt");
  fd::MaskInput in;
  in.q_len = 16;
  in.kv_len = 40;
  expect_invalid([&] { gen->build(in, 64, 64); }, {"key length 40", "not a positive multiple", "16"});
  in.kv_len = 0;
  expect_invalid([&] { gen->build(in, 64, 64); }, {"key length 0"});
  in.kv_len = 32;
  in.doc_lengths = {{10, 5}};
  expect_invalid([&] { gen->build(in, 64, 64); }, {"sum to 15", "16"});
  in.doc_lengths = {{16}, {16}, {16}};
  in.batch = 2;
  expect_invalid([&] { gen->build(in, 64, 64); }, {"3 lists", "batch of 2"});
  in.q_len = 0;
  expect_invalid([&] { gen->build(in, 64, 64); }, {"query length 0"});
}

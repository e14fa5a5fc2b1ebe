// bench_mask_build: how long each mask generator takes to build its BlockMask.
//
// DFlash anchors are re-drawn every training step, so the mask is rebuilt every step;
// the build must cost far less than the attention it describes. Cases (B = 1, one
// head, single thread):
//   dflash          S = 4096 context, 512 anchors x 16 -> Lq = 8192, Lkv = 4096 + 8192 = 12288
//   causal          Lq = 8192, Lkv = 12288 (bottom-right aligned: 4096 cached keys in front)
//   sliding_window  Lq = 8192, Lkv = 12288, window 1024 (causal band)
//   prefix_lm       Lq = Lkv = 8192, prefix 2048 (with Lkv > Lq and bottom-right alignment
//                   the prefix would be covered by the causal part, so equal lengths)
//   document        Lq = Lkv = 8192 (packed documents need Lq = Lkv), lengths drawn in
//                   [64, 1024] with a fixed seed
// at 128x128 and 64x64 tiles. Each case: 5 warm-up builds, then the median (and min)
// of at least 50 builds and 0.3 s; DFlash rotates over 8 anchor draws.
// Napkin math: a build writes each listed index once (4 B), each partial bitmap once
// (BQ*BKV/8 B) and the transpose once more; "ns/tile" = median / listed tiles.
//
// Usage: bench_mask_build [--no-append] [--results PATH]
// Prints a markdown table and appends it, with date and machine, to the "## mask_build"
// section of bench/RESULTS.md (created if missing; other sections are left alone).
#include <flashdraft/mask_generator.hpp>

#include "registry/registry.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

std::unique_ptr<fd::MaskGenerator> make(const fd::Registry& reg, const std::string& name,
                                        const std::map<std::string, fd::Value>& keys) {
  const fd::FoundPlugin& p = reg.get(fd::PluginKind::mask, name);
  const fd::Schema schema = reg.schema(p);
  fd::Config cfg("mask", fd::SourcePosition{"bench_mask_build", 0, 0});
  for (const fd::KeySpec& spec : schema.keys()) {
    auto it = keys.find(spec.name);
    if (it != keys.end())
      cfg.set(spec.name, it->second, std::nullopt);
    else if (spec.fallback)
      cfg.set(spec.name, *spec.fallback, std::nullopt);
  }
  return fd::create_as<fd::MaskGenerator>(reg, p, cfg);
}

fd::MaskInput dflash_input(std::mt19937_64& rng) {
  const int64_t S = 4096, N = 512, BS = 16;
  fd::MaskInput in;
  in.batch = 1;
  in.blocks.context_len = S;
  in.blocks.block_size = BS;
  in.q_len = N * BS;
  in.kv_len = S + N * BS;
  // N distinct anchors from the S - BS + 1 positions with BS - 1 tokens after them
  std::vector<int64_t> pool(static_cast<size_t>(S - BS + 1));
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<int64_t>(i);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int64_t> a(pool.begin(), pool.begin() + N);
  std::sort(a.begin(), a.end());
  in.blocks.anchors = {a};
  in.blocks.valid = {std::vector<uint8_t>(static_cast<size_t>(N), 1)};
  return in;
}

struct Case {
  std::string name, shape;
  std::unique_ptr<fd::MaskGenerator> gen;
  std::vector<fd::MaskInput> inputs;  // rotated over
};

struct Row {
  std::string name, shape, tile;
  int64_t full = 0, partial = 0, bytes = 0;
  double median_ms = 0, min_ms = 0;
  int runs = 0;
};

Row measure(const Case& c, int64_t bq, int64_t bkv) {
  using clock = std::chrono::steady_clock;
  Row row{c.name, c.shape, std::to_string(bq) + "x" + std::to_string(bkv)};
  const fd::BlockMask first = c.gen->build(c.inputs[0], bq, bkv);
  first.validate();
  row.full = first.full_count();
  row.partial = first.partial_count();
  row.bytes = first.bytes();
  for (int w = 0; w < 5; ++w) c.gen->build(c.inputs[static_cast<size_t>(w) % c.inputs.size()], bq, bkv);
  std::vector<double> ms;
  const auto start = clock::now();
  for (int i = 0; i < 50 || std::chrono::duration<double>(clock::now() - start).count() < 0.3; ++i) {
    const fd::MaskInput& in = c.inputs[static_cast<size_t>(i) % c.inputs.size()];
    const auto t0 = clock::now();
    const fd::BlockMask m = c.gen->build(in, bq, bkv);
    const auto t1 = clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    if (m.q_len != in.q_len) std::abort();  // keep the build observable
  }
  std::sort(ms.begin(), ms.end());
  row.median_ms = ms[ms.size() / 2];
  row.min_ms = ms.front();
  row.runs = static_cast<int>(ms.size());
  return row;
}

std::string machine() {
  std::string cpu = "unknown CPU";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + ", " + cpu + ", " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " cores online";
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

// Appends `block` at the end of the "## mask_build" section (before the next "## "
// heading), creating the section (or the file) when missing.
void append_results(const std::filesystem::path& path, const std::string& block) {
  std::string text;
  if (std::ifstream f(path); f) {
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  const std::string heading = "## mask_build\n";
  const size_t found = text.rfind(heading, 0) == 0 ? 0 : text.find("\n" + heading);
  if (found == std::string::npos) {
    if (!text.empty()) text += text.back() == '\n' ? "\n" : "\n\n";
    text += heading + "\n" + block;
  } else {
    const size_t start = text.rfind(heading, 0) == 0 ? 0 : found + 1;
    const size_t next = text.find("\n## ", start + heading.size());  // "### " runs do not match
    const size_t end = next == std::string::npos ? text.size() : next + 1;
    std::string insert = block;
    if (!(end >= 2 && text.compare(end - 2, 2, "\n\n") == 0)) insert = (text[end - 1] == '\n' ? "\n" : "\n\n") + insert;
    if (next != std::string::npos) insert += "\n";
    text.insert(end, insert);
  }
  std::ofstream(path) << text;
}

}  // namespace

int main(int argc, char** argv) {
  bool append = true;
  std::filesystem::path results = std::filesystem::path(__FILE__).parent_path() / "RESULTS.md";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-append")
      append = false;
    else if (a == "--results" && i + 1 < argc)
      results = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--no-append] [--results PATH]\n", argv[0]);
      return 2;
    }
  }
  // One core: the build is single-threaded code; pin it so the numbers are one core's.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  sched_setaffinity(0, sizeof(one), &one);

  const fd::Registry reg({FLASHDRAFT_PLUGIN_DIR});
  std::mt19937_64 rng(2026);
  std::vector<Case> cases;
  {
    Case c{"dflash", "S=4096, 512x16: 8192 x 12288", make(reg, "dflash", {}), {}};
    for (int i = 0; i < 8; ++i) c.inputs.push_back(dflash_input(rng));
    cases.push_back(std::move(c));
    Case cc{"dflash (in_block causal)", "S=4096, 512x16: 8192 x 12288",
            make(reg, "dflash", {{"in_block", std::string("causal")}}), cases.back().inputs};
    cases.push_back(std::move(cc));
    // A short sequence: the last 128 of the 512 blocks are padding (they see nothing);
    // the sampler puts padding blocks at the end.
    Case cp{"dflash (last 128 blocks padding)", "S=4096, 512x16: 8192 x 12288", make(reg, "dflash", {}),
            cases.front().inputs};
    for (fd::MaskInput& in : cp.inputs)
      for (int64_t n = 384; n < 512; ++n) in.blocks.valid[0][static_cast<size_t>(n)] = 0;
    cases.push_back(std::move(cp));
    // Worst case for the format: one valid block in 7 among the last 128, so each of
    // those q blocks mixes padding rows with a row group that sees ~30 context tiles:
    // none of them can be full, every one needs a 2 KiB bitmap (mask bytes x 3.6).
    Case cw{"dflash (last 128: 1 valid in 7, worst case)", "S=4096, 512x16: 8192 x 12288", make(reg, "dflash", {}),
            cases.front().inputs};
    for (fd::MaskInput& in : cw.inputs)
      for (int64_t n = 384; n < 512; ++n) in.blocks.valid[0][static_cast<size_t>(n)] = (n % 7 == 0);
    cases.push_back(std::move(cw));
  }
  fd::MaskInput wide;
  wide.q_len = 8192;
  wide.kv_len = 12288;
  fd::MaskInput square;
  square.q_len = square.kv_len = 8192;
  cases.push_back(Case{"causal", "8192 x 12288 (bottom-right)", make(reg, "causal", {}), {wide}});
  cases.push_back(
      Case{"sliding_window", "8192 x 12288, w=1024", make(reg, "sliding_window", {{"window", int64_t{1024}}}), {wide}});
  cases.push_back(
      Case{"prefix_lm", "8192 x 8192, p=2048", make(reg, "prefix_lm", {{"prefix", int64_t{2048}}}), {square}});
  {
    fd::MaskInput docs = square;
    std::vector<int64_t> lens;
    int64_t left = 8192;
    while (left > 0) {
      const int64_t len = std::min(left, std::uniform_int_distribution<int64_t>(64, 1024)(rng));
      lens.push_back(len);
      left -= len;
    }
    docs.doc_lengths = {lens};
    cases.push_back(
        Case{"document", "8192 x 8192, " + std::to_string(lens.size()) + " docs", make(reg, "document", {}), {docs}});
  }

  // One build of everything first, so the first measured case does not pay for the
  // allocator's first growth of the heap.
  for (const Case& c : cases) c.gen->build(c.inputs[0], 64, 64), c.gen->build(c.inputs[0], 128, 128);

  std::ostringstream table;
  table << "| mask | Lq x Lkv | tile | full | partial | mask bytes | median ms | min ms | ns/tile | GB/s written | "
           "builds |\n"
        << "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& [bq, bkv] : std::vector<std::pair<int64_t, int64_t>>{{128, 128}, {64, 64}})
    for (const Case& c : cases) {
      const Row r = measure(c, bq, bkv);
      char line[512];
      std::snprintf(line, sizeof(line), "| %s | %s | %s | %lld | %lld | %lld | %.3f | %.3f | %.1f | %.2f | %d |\n",
                    r.name.c_str(), r.shape.c_str(), r.tile.c_str(), static_cast<long long>(r.full),
                    static_cast<long long>(r.partial), static_cast<long long>(r.bytes), r.median_ms, r.min_ms,
                    1e6 * r.median_ms / std::max<int64_t>(1, r.full + r.partial),
                    static_cast<double>(r.bytes) / (r.median_ms * 1e6), r.runs);
      table << line;
      std::fputs(line, stdout);
      std::fflush(stdout);
    }
  // Reference point: the same DFlash mask classified element by element (the
  // predicate over all Lq x Lkv pairs through BlockMaskBuilder::add_tile), one build.
  {
    const Case& c = cases[0];
    const fd::MaskInput& in = c.inputs[0];
    const auto t0 = std::chrono::steady_clock::now();
    fd::BlockMaskBuilder builder(1, 1, in.q_len, in.kv_len, 128, 128);
    const int64_t nq = (in.q_len + 127) / 128, nk = (in.kv_len + 127) / 128;
    for (int64_t i = 0; i < nq; ++i) {
      builder.begin_row();
      for (int64_t j = 0; j < nk; ++j)
        builder.add_tile(static_cast<int32_t>(j),
                         [&](int64_t q, int64_t kv) { return c.gen->visible(in, 0, 0, q, kv); });
    }
    const fd::BlockMask scan = builder.finish();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const fd::BlockMask fast = c.gen->build(in, 128, 128);
    const bool same =
        scan.full_index == fast.full_index && scan.part_index == fast.part_index && scan.bits == fast.bits;
    table << "\nFor scale: the DFlash 128x128 mask classified element by element (predicate on all "
          << in.q_len * in.kv_len << " pairs, BlockMaskBuilder::add_tile) took " << static_cast<int64_t>(ms)
          << " ms for one build; " << (same ? "identical" : "DIFFERENT (bug!)") << " lists.\n";
  }
  const std::string header =
      "### " + utc_now() + " — `bench_mask_build` (Release), " + machine() + " (single thread, B = 1)\n\n";
  std::printf("\n%s%s", header.c_str(), table.str().c_str());
  std::printf("\nDFlash 128x128 target: <= 2 ms on one core.\n");
  if (append) {
    append_results(results, header + table.str());
    std::printf("appended to %s\n", results.string().c_str());
  }
  return 0;
}

// The safetensors reader and writer (core/src/export/safetensors.cpp):
//   - round trips of fresh random bit patterns in every supported dtype (with a 0-d, two
//     zero-element, a non-contiguous and an unaligned tensor) through write() and back
//     through File and Checkpoint are bitwise, and the tensors outlive the File's map;
//   - loading in another dtype equals LibTorch's plain conversion, bit for bit;
//   - files of the Python `safetensors` package (the reference implementation) are read,
//     and the package reads ours, compared with bytes taken from tensor memory, not files;
//   - a sharded checkpoint through model.safetensors.index.json;
//   - corrupt files, bad indexes and bad writes are refused with the expected sentence.
// Every test draws a fresh seed (printed; rerun one with the seed in its failure trace).
#include <flashdraft/safetensors.hpp>

#include "train/checkpoint.hpp"  // remove_tree

#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <torch/types.h>

#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <sstream>

namespace st = flashdraft::safetensors;

namespace {

const std::vector<c10::ScalarType> kAllTypes = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                                at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};

// The file's name of each type, written out here apart from the reader's own table.
std::string file_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: return "?";
  }
}

// The tensor's bytes, in memory order of its contiguous CPU copy.
std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) out += {digits[b >> 4], digits[b & 15]};
  return out.empty() ? "-" : out;
}

void expect_bitwise(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(got.sizes().vec(), want.sizes().vec()) << name;
  EXPECT_TRUE(bytes_of(got) == bytes_of(want)) << name << ": the bytes differ";
}

// The message of the Error that `f` throws; "" (and a test failure) when it throws none.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const st::Error& e) {
    std::printf("refused: %s\n", e.what());
    return e.what();
  }
  ADD_FAILURE() << "no safetensors::Error was thrown";
  return "";
}

#define EXPECT_REFUSED(statement, fragment)                                             \
  do {                                                                                  \
    const std::string message_ = refusal([&] { statement; });                           \
    EXPECT_NE(message_.find(fragment), std::string::npos)                               \
        << "expected the fragment: " << (fragment) << "\nin the message: " << message_; \
  } while (0)

// Plain POSIX for files and folders: several std::filesystem functions resolve to a broken
// copy inside the PyPI wheel's libtorch.so (see checkpoint.hpp).
bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

uint64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? uint64_t(st.st_size) : 0;
}

std::vector<std::string> entries(const std::string& folder) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// A file of the given header text and data bytes; `declared` overrides the 8-byte length.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> declared = std::nullopt) {
  const uint64_t n = declared.value_or(header.size());
  write_text(path, std::string(reinterpret_cast<const char*>(&n), 8) + header + data);
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    at::manual_seed(seed_);
    rng_.seed(seed_);
    trace_.emplace(__FILE__, __LINE__, "seed " + std::to_string(seed_));
    std::printf("seed %u\n", seed_);
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = ::testing::TempDir() + "flashdraft-safetensors-" + std::to_string(::getpid()) + "-" + info->name();
    flashdraft::checkpoint::remove_tree(dir_);
    ASSERT_EQ(::mkdir(dir_.c_str(), 0755), 0) << dir_ << ": " << std::strerror(errno);
  }
  void TearDown() override {
    trace_.reset();
    if (!HasFailure()) flashdraft::checkpoint::remove_tree(dir_);  // kept for a look when something failed
  }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::vector<int64_t> random_shape() {
    std::vector<int64_t> shape(std::uniform_int_distribution<int>(1, 3)(rng_));
    for (auto& d : shape) d = std::uniform_int_distribution<int>(1, 6)(rng_);
    return shape;
  }

  // Random bit patterns (NaNs, infinities and subnormals included for floats); BOOL: 0 or 1.
  static at::Tensor random_bits(c10::ScalarType type, const std::vector<int64_t>& shape) {
    const int64_t numel = c10::multiply_integers(shape);
    if (numel == 0) return at::empty(shape, at::TensorOptions().dtype(type));
    if (type == at::kBool) return at::randint(0, 2, shape, at::kByte).to(at::kBool);
    const int64_t bytes = numel * int64_t(c10::elementSize(type));
    return at::randint(0, 256, {bytes}, at::kByte).view(type).reshape(shape);
  }

  // Runs FLASHDRAFT_PYTHON on a script written into the test folder; returns (exit code, output).
  std::pair<int, std::string> python(const std::string& script, const std::string& args) {
    const std::string file = path("script.py");
    write_text(file, script);
    const std::string command = std::string(FLASHDRAFT_PYTHON) + " " + file + " " + args + " 2>&1";
    FILE* p = ::popen(command.c_str(), "r");
    if (!p) return {-1, "popen failed: " + command};
    std::string output;
    char buffer[4096];
    while (size_t n = std::fread(buffer, 1, sizeof buffer, p)) output.append(buffer, n);
    const int status = ::pclose(p);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
  }

  // Why the Python checks cannot run here ("" when they can). The project's .venv has
  // torch except on machines that build against another LibTorch (scripts/install-deps).
  std::string python_missing() {
    if (!exists(FLASHDRAFT_PYTHON)) return std::string(FLASHDRAFT_PYTHON) + " not found";
    const auto [code, output] = python("import torch\n", "");
    return code == 0 ? "" : std::string(FLASHDRAFT_PYTHON) + " has no torch: " + output;
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::optional<::testing::ScopedTrace> trace_;
  std::string dir_;
};

// ---------------------------------------------------------------------------------------
// Round trips

TEST_F(Safetensors, RoundTripOfEveryDtypeIsBitwise) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  // 3 bytes first: every later tensor starts at an odd offset, which the reader copies
  // through an aligned buffer.
  tensors.emplace_back("odd.u8", random_bits(at::kByte, {3}));
  for (c10::ScalarType type : kAllTypes)
    tensors.emplace_back("random." + file_dtype(type), random_bits(type, random_shape()));
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  tensors.emplace_back("special.f32", torch::tensor({0.0f, -0.0f, inf, -inf, nan, -nan, 1e-45f, 3.4e38f}));
  tensors.emplace_back("scalar.f64", random_bits(at::kDouble, {}));
  tensors.emplace_back("empty.bf16", random_bits(at::kBFloat16, {0, 3}));
  tensors.emplace_back("empty.i32", random_bits(at::kInt, {4, 0, 2}));
  tensors.emplace_back("transposed.f32", at::randn({5, 3}).t());  // stored as its contiguous copy
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "written by test_safetensors ü"}};
  const std::string file = path("model.safetensors");
  st::write(file, tensors, metadata);

  // The header length is a multiple of 8 and the data section holds exactly the tensors.
  uint64_t header_size = 0;
  std::ifstream(file, std::ios::binary).read(reinterpret_cast<char*>(&header_size), 8);
  EXPECT_EQ(header_size % 8, 0u);
  uint64_t data_size = 0;
  for (const auto& [name, t] : tensors) data_size += t.nbytes();
  EXPECT_EQ(file_size(file), 8 + header_size + data_size);
  EXPECT_FALSE(exists(file + ".tmp." + std::to_string(::getpid())));

  std::vector<at::Tensor> loaded;
  {
    const st::File f(file);
    EXPECT_EQ(f.path(), file);
    EXPECT_EQ(f.metadata(), metadata);
    ASSERT_EQ(f.tensors().size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& [name, t] = tensors[i];
      const st::TensorInfo& info = f.tensors()[i];  // file order: the order given to write()
      EXPECT_EQ(info.name, name);
      EXPECT_EQ(info.dtype, file_dtype(t.scalar_type())) << name;
      EXPECT_EQ(info.scalar_type, t.scalar_type()) << name;
      EXPECT_EQ(info.shape, t.sizes().vec()) << name;
      EXPECT_EQ(info.file, file);
      EXPECT_EQ(f.find(name), &info);
      loaded.push_back(f.load(name, at::kCPU, t.scalar_type()));
    }
    EXPECT_EQ(f.find("random.F64")->begin % 8, 3u) << "the unaligned path was not exercised";
    EXPECT_EQ(f.find("nope"), nullptr);
  }
  // The File and its map are gone: the loaded tensors own their bytes.
  for (size_t i = 0; i < tensors.size(); ++i) expect_bitwise(loaded[i], tensors[i].second, tensors[i].first);

  const st::Checkpoint checkpoint(dir_);
  EXPECT_EQ(checkpoint.folder(), dir_);
  std::vector<std::string> sorted;
  for (const auto& entry : tensors) sorted.push_back(entry.first);
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(checkpoint.names(), sorted);
  for (const auto& [name, t] : tensors) {
    ASSERT_NE(checkpoint.find(name), nullptr) << name;
    expect_bitwise(checkpoint.load(name, at::kCPU, t.scalar_type()), t, name);
  }
}

TEST_F(Safetensors, LoadInAnotherDtypeEqualsAPlainConversion) {
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"w.f32", at::randn({17, 9}) * 100},  // values that round differently in each target type
      {"w.bf16", at::randn({6, 4}).to(at::kBFloat16)},
      {"ids.i64", at::randint(-1000, 1000, {11}, at::kLong)},
      {"scalar.f32", at::randn({})},
      {"empty.f32", at::empty({0, 5})}};
  st::write(path("model.safetensors"), tensors);
  const st::File f(path("model.safetensors"));
  for (const auto& [name, t] : tensors)
    for (c10::ScalarType to : {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble})
      expect_bitwise(f.load(name, at::kCPU, to), t.to(to), name + " as " + c10::toString(to));
}

// Rows of a tensor's first dimension read alone are the tensor's rows, converted as a whole load converts them; rows
// past its end are refused with a sentence.
TEST_F(Safetensors, LoadRowsEqualsTheRowsOfTheWholeTensor) {
  const at::Tensor states = at::randn({13, 3, 7}).to(at::kBFloat16), ids = at::randint(0, 500, {13}, at::kInt);
  st::write(path("rows.safetensors"), {{"ids", ids}, {"states", states}});
  const st::File f(path("rows.safetensors"));
  for (const auto& [begin, count] : std::vector<std::pair<int64_t, int64_t>>{{0, 13}, {4, 5}, {12, 1}, {7, 0}}) {
    const std::string what = "rows " + std::to_string(begin) + " + " + std::to_string(count);
    expect_bitwise(f.load_rows("states", begin, count, at::kCPU, at::kFloat),
                   states.narrow(0, begin, count).to(at::kFloat), what);
    expect_bitwise(f.load_rows("ids", begin, count, at::kCPU, at::kLong), ids.narrow(0, begin, count).to(at::kLong),
                   what);
  }
  try {
    f.load_rows("states", 10, 4, at::kCPU, at::kFloat);
    ADD_FAILURE() << "rows past the end were read";
  } catch (const st::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows 10..14 asked for, the tensor has 13"), std::string::npos) << e.what();
  }
}

TEST_F(Safetensors, LoadsToCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here";
  const at::Tensor w = at::randn({33, 65});
  st::write(path("model.safetensors"), {{"w", w}});
  const st::File f(path("model.safetensors"));
  const at::Tensor on_gpu = f.load("w", at::Device(at::kCUDA, 0), at::kBFloat16);
  EXPECT_TRUE(on_gpu.is_cuda());
  expect_bitwise(on_gpu, w.to(at::kBFloat16), "w on cuda:0 as BFloat16");
}

// ---------------------------------------------------------------------------------------
// The Python package, both ways

TEST_F(Safetensors, ReadsFilesOfThePythonPackage) {
  if (const std::string why = python_missing(); !why.empty()) GTEST_SKIP() << why;
  // Fresh random tensors (no seed) saved by safetensors.torch.save_file; the manifest
  // holds each tensor's dtype, shape and bytes taken from torch's memory.
  const std::string script = R"PY(
import sys, torch
from safetensors.torch import save_file
out, manifest = sys.argv[1], sys.argv[2]
names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL"}
t = {
    "model.embed_tokens.weight": torch.randn(11, 8, dtype=torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(8, 5, dtype=torch.float16),
    "model.norm.weight": torch.randn(8),
    "f64": torch.randn(3, 2, dtype=torch.float64),
    "i64": torch.randint(-2**62, 2**62, (7,), dtype=torch.int64),
    "i32": torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32),
    "i16": torch.randint(-2**15, 2**15 - 1, (5,), dtype=torch.int16),
    "i8": torch.randint(-128, 127, (3,), dtype=torch.int8),
    "u8": torch.randint(0, 255, (4, 1), dtype=torch.uint8),
    "mask": torch.rand(6) > 0.5,
    "scalar": torch.randn(()),
    "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
}
save_file(t, out, metadata={"format": "pt", "origin": "python"})
with open(manifest, "w") as f:
    for name, x in t.items():
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        shape = ",".join(map(str, x.shape)) or "-"
        f.write(f"{name} {names[x.dtype]} {shape} {raw.hex() or '-'}\n")
)PY";
  const std::string file = path("python.safetensors"), manifest = path("manifest.txt");
  const auto [code, output] = python(script, file + " " + manifest);
  ASSERT_EQ(code, 0) << output;

  const st::File f(file);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"origin", "python"}}));
  std::ifstream in(manifest);
  std::string name, dtype, shape_text, bytes_text;
  size_t count = 0;
  while (in >> name >> dtype >> shape_text >> bytes_text) {
    ++count;
    const st::TensorInfo* info = f.find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, dtype) << name;
    std::vector<int64_t> shape;
    std::stringstream dims(shape_text == "-" ? "" : shape_text);
    for (std::string d; std::getline(dims, d, ',');) shape.push_back(std::stoll(d));
    EXPECT_EQ(info->shape, shape) << name;
    const at::Tensor t = f.load(name, at::kCPU, info->scalar_type);
    EXPECT_EQ(t.sizes().vec(), shape) << name;
    EXPECT_EQ(hex(bytes_of(t)), bytes_text) << name;
  }
  EXPECT_EQ(count, 12u);
  EXPECT_EQ(f.tensors().size(), count);
}

TEST_F(Safetensors, ThePythonPackageReadsOurFiles) {
  if (const std::string why = python_missing(); !why.empty()) GTEST_SKIP() << why;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  tensors.emplace_back("odd.i8", random_bits(at::kChar, {5}));
  for (c10::ScalarType type : kAllTypes)
    tensors.emplace_back("random." + file_dtype(type), random_bits(type, random_shape()));
  tensors.emplace_back("weights.bf16", at::randn({7, 3}).to(at::kBFloat16));
  tensors.emplace_back("scalar.f32", at::randn({}));
  tensors.emplace_back("empty.f16", at::empty({2, 0}, at::kHalf));
  const std::string file = path("ours.safetensors"), manifest = path("manifest.txt");
  st::write(file, tensors, {{"format", "pt"}, {"origin", "flashdraft"}});
  std::ostringstream lines;  // bytes from tensor memory, not from the file
  for (const auto& [name, t] : tensors) {
    std::string shape;
    for (int64_t d : t.sizes()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    lines << name << " " << file_dtype(t.scalar_type()) << " " << (shape.empty() ? "-" : shape) << " "
          << hex(bytes_of(t)) << "\n";
  }
  write_text(manifest, lines.str());

  const std::string script = R"PY(
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
path, manifest = sys.argv[1], sys.argv[2]
dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
loaded = load_file(path)
expected = [line.split() for line in open(manifest)]
problems = []
if sorted(loaded) != sorted(e[0] for e in expected):
    problems.append(f"names {sorted(loaded)} != {sorted(e[0] for e in expected)}")
for name, dtype, shape, raw in expected:
    x = loaded.get(name)
    if x is None:
        continue
    shape = [] if shape == "-" else [int(d) for d in shape.split(",")]
    got = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() or "-"
    if x.dtype != dtypes[dtype] or list(x.shape) != shape or got != raw:
        problems.append(f"{name}: {x.dtype} {list(x.shape)} differs from {dtype} {shape} or its bytes")
with safe_open(path, "pt") as f:
    if f.metadata() != {"format": "pt", "origin": "flashdraft"}:
        problems.append(f"metadata {f.metadata()}")
print("\n".join(problems) or f"ok: {len(expected)} tensors")
sys.exit(1 if problems else 0)
)PY";
  const auto [code, output] = python(script, file + " " + manifest);
  EXPECT_EQ(code, 0) << output;
  EXPECT_NE(output.find("ok: " + std::to_string(tensors.size()) + " tensors"), std::string::npos) << output;
}

// ---------------------------------------------------------------------------------------
// Sharded checkpoints

TEST_F(Safetensors, ShardedCheckpointThroughItsIndex) {
  const std::vector<std::pair<std::string, at::Tensor>> first = {
      {"model.embed.weight", at::randn({4, 3})}, {"model.norm.weight", at::randn({5}).to(at::kBFloat16)}};
  const std::vector<std::pair<std::string, at::Tensor>> second = {{"lm_head.weight", at::randn({3, 4}).to(at::kHalf)},
                                                                  {"positions", at::randint(0, 99, {2}, at::kLong)},
                                                                  {"empty", at::empty({0})}};
  st::write(path("model-00001-of-00002.safetensors"), first);
  st::write(path("model-00002-of-00002.safetensors"), second);
  std::string map;
  for (const auto& [name, t] : first)
    map += (map.empty() ? "" : ", ") + ("\"" + name + "\": \"model-00001-of-00002.safetensors\"");
  for (const auto& [name, t] : second) map += ", \"" + name + "\": \"model-00002-of-00002.safetensors\"";
  write_text(path("model.safetensors.index.json"),
             "{\"metadata\": {\"total_size\": 100}, \"weight_map\": {" + map + "}}");

  const st::Checkpoint checkpoint(dir_);
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"empty", "lm_head.weight", "model.embed.weight",
                                                          "model.norm.weight", "positions"}));
  for (const auto& [shard, tensors] : {std::make_pair(std::string("model-00001-of-00002.safetensors"), first),
                                       std::make_pair(std::string("model-00002-of-00002.safetensors"), second)})
    for (const auto& [name, t] : tensors) {
      const st::TensorInfo* info = checkpoint.find(name);
      ASSERT_NE(info, nullptr) << name;
      EXPECT_EQ(info->file, path(shard)) << name;
      expect_bitwise(checkpoint.load(name, at::kCPU, t.scalar_type()), t, name);
    }
  EXPECT_EQ(checkpoint.find("nope"), nullptr);
  EXPECT_REFUSED(checkpoint.load("nope", at::kCPU, at::kFloat),
                 dir_ + ": no tensor 'nope' in the checkpoint (it holds empty, lm_head.weight");
}

// ---------------------------------------------------------------------------------------
// Refusals

// The header {"a": {"dtype": D, "shape": S, "data_offsets": O}} (JSON text pasted as given).
std::string header_of_a(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{\"a\": {\"dtype\": \"" + dtype + "\", \"shape\": " + shape + ", \"data_offsets\": " + offsets + "}}";
}

TEST_F(Safetensors, RefusesCorruptHeaders) {
  const std::string a16 = R"("a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})";
  struct Case {
    const char* what;
    std::string header;
    size_t data_bytes;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"overlapping offsets", "{" + a16 + R"(, "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})", 24,
       "tensor 'b': data_offsets [8, 24] overlap those of tensor 'a' [0, 16]"},
      {"unknown dtype", header_of_a("F31", "[4]", "[0, 16]"), 16,
       "tensor 'a': unknown dtype 'F31' (known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3)"},
      {"F8_E5M2", header_of_a("F8_E5M2", "[4]", "[0, 4]"), 4,
       "tensor 'a': dtype F8_E5M2 is not supported by this reader"},
      {"shape x element size != byte length", header_of_a("F32", "[3]", "[0, 16]"), 16,
       "tensor 'a': shape [3] of F32 is 12 bytes but data_offsets [0, 16] hold 16"},
      {"bad JSON", R"({"a": {"dtype": "F32", "shape": [4],)", 16, "the header is not valid JSON"},
      {"not an object", "[1, 2]", 0, "the header is a JSON array, not an object"},
      {"negative dimension", header_of_a("F32", "[2, -2]", "[0, 16]"), 16,
       "tensor 'a': shape [2,-2] holds -2 (dimensions are non-negative integers)"},
      {"fractional dimension", header_of_a("F32", "[4.0]", "[0, 16]"), 16,
       "tensor 'a': shape [4.0] holds 4.0 (dimensions are non-negative integers)"},
      {"begin after end", header_of_a("F32", "[0]", "[16, 0]"), 16, "tensor 'a': data_offsets [16, 0] begin after end"},
      {"shape overflows", header_of_a("F32", "[4294967296, 4294967296]", "[0, 16]"), 16,
       "tensor 'a': shape [4294967296,4294967296] of F32 overflows 64 bits"},
      {"three offsets", header_of_a("F32", "[4]", "[0, 8, 16]"), 16,
       "tensor 'a': data_offsets is [0,8,16] (expected [begin, end]"},
      {"missing dtype", R"({"a": {"shape": [4], "data_offsets": [0, 16]}})", 16, "tensor 'a': dtype is missing"},
      {"metadata not strings", "{\"__metadata__\": {\"k\": 3}, " + a16 + "}", 16,
       "__metadata__ key 'k' holds 3, expected a string"},
      {"name given twice", "{" + a16 + ", " + a16 + "}", 16, "tensor 'a': named twice in the header"},
      {"offsets past the data section", "{" + a16 + "}", 12,
       "tensor 'a': data_offsets [0, 16] end past the data section (12 bytes; the file is truncated or the header is "
       "wrong)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string file = path("bad.safetensors");
    write_raw(file, c.header, std::string(c.data_bytes, '\0'));
    EXPECT_REFUSED(st::File{file}, file + ": " + c.fragment);
  }
}

TEST_F(Safetensors, RefusesTruncatedAndShortFiles) {
  const std::string file = path("model.safetensors");
  st::write(file, {{"a", at::randn({16})}, {"b", at::randn({8})}});
  ASSERT_EQ(::truncate(file.c_str(), off_t(file_size(file)) - 10), 0);  // the data section: 96 bytes -> 86
  EXPECT_REFUSED(st::File{file}, file +
                                     ": tensor 'b': data_offsets [64, 96] end past the data section (86 bytes; "
                                     "the file is truncated or the header is wrong)");

  write_raw(file, "{}", "", 1000);
  EXPECT_REFUSED(
      st::File{file},
      file + ": header length 1000 runs past the end of the file (the file is 10 bytes, so a header of at most 2");
  write_text(file, "abcde");
  EXPECT_REFUSED(st::File{file}, file + ": the file is 5 bytes, shorter than the 8-byte header length");
  EXPECT_REFUSED(st::File{path("absent.safetensors")}, "absent.safetensors: cannot open the file (No such file");
  EXPECT_REFUSED(st::File{dir_}, dir_ + ": not a regular file");
}

TEST_F(Safetensors, RefusesBoolBytesOtherThanZeroAndOne) {
  const std::string file = path("mask.safetensors");
  write_raw(file, R"({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})", std::string("\1\2\0", 3));
  const st::File f(file);  // the header is fine; the data is checked when loaded
  EXPECT_REFUSED(f.load("m", at::kCPU, at::kBool), file + ": tensor 'm': BOOL element 1 is the byte 2");
  EXPECT_REFUSED(f.load("n", at::kCPU, at::kBool), file + ": no tensor 'n' in the file (it holds m)");
}

// F8_E4M3 (a quantized checkpoint's weights, e.g. block-wise FP8 with their weight_scale_inv): read as the
// values they are, never cast without their scales.
TEST_F(Safetensors, ReadsFp8AsItIsAndNeverCastsIt) {
  const std::string file = path("fp8.safetensors");
  const at::Tensor values = (at::randn({6, 5}) * 30).to(at::kFloat8_e4m3fn);
  st::write(file, {{"w", values}, {"w_scale_inv", at::rand({1, 1})}});
  const st::File f(file);
  ASSERT_EQ(f.find("w")->dtype, "F8_E4M3");
  const at::Tensor read = f.load("w", c10::kCPU, at::kFloat8_e4m3fn);
  EXPECT_TRUE(at::equal(read.view(at::kByte), values.view(at::kByte)));
  EXPECT_GT(std::get<0>(at::_unique(read.to(at::kFloat))).numel(), 10);  // (not vacuous: many values)
  EXPECT_REFUSED(f.load("w", c10::kCPU, at::kBFloat16),
                 file +
                     ": tensor 'w': dtype F8_E4M3 holds quantized values, read only as they are (Float8_e4m3fn) by "
                     "a reader that applies their scales; asked for BFloat16");
}

TEST_F(Safetensors, RefusesBadCheckpointFolders) {
  EXPECT_REFUSED(st::Checkpoint{dir_}, dir_ +
                                           ": no safetensors checkpoint: looked for model.safetensors and "
                                           "model.safetensors.index.json");
  EXPECT_REFUSED(st::Checkpoint{path("absent")}, "(and the folder does not exist)");

  const std::string index = path("model.safetensors.index.json");
  st::write(path("model-00001-of-00002.safetensors"), {{"a", at::randn({2})}, {"b", at::randn({3})}});
  write_text(index,
             R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}})");
  EXPECT_REFUSED(st::Checkpoint{dir_},
                 index + ": tensor 'c': listed in shard 'model-00001-of-00002.safetensors', which does not hold it");

  write_text(index,
             R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_REFUSED(st::Checkpoint{dir_}, index +
                                           ": shard 'model-00002-of-00002.safetensors' (listed for c) "
                                           "cannot be read: ");

  st::write(path("model-00002-of-00002.safetensors"), {{"b", at::randn({3})}, {"c", at::randn({1})}});
  write_text(index,
             R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  {
    // The index says what the checkpoint holds: 'b' in shard 2 but listed for no shard is
    // not part of it (as for transformers); 'a' and 'c' are, each from its listed shard.
    const st::Checkpoint checkpoint(dir_);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"a", "c"}));
    EXPECT_EQ(checkpoint.find("b"), nullptr);
    EXPECT_EQ(checkpoint.find("a")->file, path("model-00001-of-00002.safetensors"));
  }

  write_text(index, R"({"metadata": {}})");
  EXPECT_REFUSED(st::Checkpoint{dir_}, index + ": no \"weight_map\" object");
  write_text(index, R"({"weight_map": )");
  EXPECT_REFUSED(st::Checkpoint{dir_}, index + ": not valid JSON");
}

TEST_F(Safetensors, WriteRefusesDuplicatesAndUnsupportedDtypes) {
  const std::string file = path("model.safetensors");
  EXPECT_REFUSED(st::write(file, {{"a", at::randn({2})}, {"a", at::randn({2})}}),
                 "cannot write " + file + ": tensor 'a': the name is given twice");
  EXPECT_REFUSED(st::write(file, {{"z", at::randn({2}, at::kComplexFloat)}}),
                 "cannot write " + file +
                     ": tensor 'z': dtype ComplexFloat is not one this writer supports "
                     "(supported: F64 (Double), F32 (Float)");
  EXPECT_REFUSED(st::write(file, {{"__metadata__", at::randn({2})}}), "the name is reserved for the metadata");
  EXPECT_REFUSED(st::write(file, {{"u", at::Tensor()}}), "tensor 'u': the tensor is undefined");
  EXPECT_FALSE(exists(file));  // refused before anything was written
  EXPECT_EQ(entries(dir_), std::vector<std::string>{});
  EXPECT_REFUSED(st::write(path("absent/model.safetensors"), {{"a", at::randn({2})}}), "cannot create ");
}

}  // namespace

// Training checkpoints (LibTorch archives + a checksummed text manifest) and the HDF5
// weights export. The layout and the atomic write are described in checkpoint.hpp.
#include "train/checkpoint.hpp"

#include "train/optimizer.hpp"

#include <flashdraft/hdf5_attributes.hpp>
#include <flashdraft/text.hpp>

#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <hdf5.h>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace flashdraft::checkpoint {

namespace {

constexpr const char* kFormat = "flashdraft-checkpoint 2";
constexpr const char* kFormat1 = "flashdraft-checkpoint 1";  // whole-file FNV-1a 64 checksums
constexpr const char* kWeights = "weights.pt";
constexpr const char* kOptimizer = "optimizer.pt";
constexpr const char* kRng = "rng.pt";
constexpr const char* kManifest = "manifest";

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << std::hex << std::setw(16) << std::setfill('0') << v;
  return os.str();
}

// Writes bytes to path and fsyncs them: after this returns, the file's contents are on
// disk (the folder entry is made durable by fsync_dir on the folder).
void write_durable(const fs::path& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw Error("cannot create " + path.string() + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw Error("cannot write " + path.string() + ": " + why);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error("cannot fsync " + path.string() + ": " + why);
  }
  ::close(fd);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some file systems do not open folders
  ::fsync(fd);
  ::close(fd);
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("checkpoint file " + path.string() + " is missing or unreadable");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream os(std::ios::binary);
  archive.save_to(os);
  return os.str();
}

std::string first_line(const std::string& s) {
  const auto eol = s.find('\n');
  return eol == std::string::npos ? s : s.substr(0, eol);
}

// Opens one of the checkpoint's archives after checking its size and checksum.
void open_archive(const fs::path& dir, const Manifest& m, const std::string& name,
                  torch::serialize::InputArchive& archive) {
  const fs::path path = dir / name;
  const FileEntry* entry = nullptr;
  for (const auto& f : m.files)
    if (f.name == name) entry = &f;
  if (!entry) throw Error("checkpoint " + dir.string() + ": the manifest does not list " + name);
  const std::string bytes = read_bytes(path);
  if (static_cast<int64_t>(bytes.size()) != entry->bytes)
    throw Error("checkpoint file " + path.string() + " has " + std::to_string(bytes.size()) +
                " bytes, the manifest says " + std::to_string(entry->bytes) + " (truncated or overwritten)");
  const uint64_t sum =
      m.format == 1 ? fnv1a64(bytes.data(), bytes.size()) : chunked_checksum(bytes.data(), bytes.size());
  if (sum != entry->checksum)
    throw Error("checkpoint file " + path.string() + " has checksum " + hex(sum) + ", the manifest says " +
                hex(entry->checksum) + " (the file was changed or corrupted after it was written)");
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const std::exception& e) {
    throw Error("checkpoint file " + path.string() + " is not a readable LibTorch archive (" + first_line(e.what()) +
                ")");
  }
}

// Compares the checkpoint's tensors with the ones the experiment's drafter has.
void check_tensors(const fs::path& dir, const Manifest& m,
                   const std::vector<std::pair<std::string, at::Tensor>>& expected) {
  const std::string file = (dir / kWeights).string();
  for (size_t i = 0; i < expected.size(); ++i) {
    const std::string& name = expected[i].first;
    const std::vector<int64_t> want(expected[i].second.sizes().begin(), expected[i].second.sizes().end());
    const TensorEntry* have = nullptr;
    for (const auto& t : m.tensors)
      if (t.name == name) have = &t;
    if (!have)
      throw Error("checkpoint file " + file + " has no tensor '" + name + "' " + shape_str(want) +
                  ", which the experiment's drafter has (the checkpoint holds " + std::to_string(m.tensors.size()) +
                  " tensors; was it written with another [drafter] table?)");
    if (have->shape != want)
      throw Error("checkpoint file " + file + ": tensor '" + name + "' has shape " + shape_str(have->shape) +
                  ", the experiment's drafter expects " + shape_str(want) +
                  " (was it written with another [drafter] table?)");
  }
  for (const auto& t : m.tensors) {
    bool found = false;
    for (const auto& e : expected) found = found || e.first == t.name;
    if (!found)
      throw Error("checkpoint file " + file + " holds tensor '" + t.name + "' " + shape_str(t.shape) +
                  ", which the experiment's drafter does not have (was it written with another [drafter] table?)");
  }
}

// Reads every tensor of weights.pt (by the manifest's order) and checks its shape.
std::vector<std::pair<std::string, at::Tensor>> read_weights(const fs::path& dir, const Manifest& m) {
  torch::serialize::InputArchive archive;
  open_archive(dir, m, kWeights, archive);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const std::string key = "p" + std::to_string(i);
    at::Tensor t;
    bool ok = false;
    try {
      ok = archive.try_read(key, t, /*is_buffer=*/true);
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok || !t.defined())
      throw Error("checkpoint file " + (dir / kWeights).string() + " has no tensor " + key + " ('" + m.tensors[i].name +
                  "', listed in the manifest)");
    const std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    if (shape != m.tensors[i].shape)
      throw Error("checkpoint file " + (dir / kWeights).string() + ": tensor '" + m.tensors[i].name + "' has shape " +
                  shape_str(shape) + ", the manifest says " + shape_str(m.tensors[i].shape));
    out.emplace_back(m.tensors[i].name, t);
  }
  return out;
}

int64_t step_of(const fs::path& p) {
  const std::string name = p.filename().string();
  if (name.rfind("step_", 0) != 0 || name.size() == 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// The checkpoint's archives (weights, optimizer, generators) as (file name, bytes), in
// the order they are written; lists the weights' tensors in m.tensors.
std::vector<std::pair<std::string, std::string>> archive_files(Manifest& m, const State& state) {
  std::vector<std::pair<std::string, std::string>> files;
  {
    torch::serialize::OutputArchive archive;
    m.tensors.clear();
    for (size_t i = 0; i < state.weights.size(); ++i) {
      const at::Tensor t = state.weights[i].second.detach().to(at::kCPU).clone();
      archive.write("p" + std::to_string(i), t, /*is_buffer=*/true);
      m.tensors.push_back({state.weights[i].first, std::vector<int64_t>(t.sizes().begin(), t.sizes().end())});
    }
    files.emplace_back(kWeights, archive_bytes(archive));
  }
  {
    torch::serialize::OutputArchive archive;
    state.optimizer->save(archive);
    files.emplace_back(kOptimizer, archive_bytes(archive));
  }
  {
    torch::serialize::OutputArchive archive;
    archive.write("anchor", state.anchor_rng.clone(), /*is_buffer=*/true);
    archive.write("cpu_default", state.cpu_default_rng.clone(), /*is_buffer=*/true);
    if (state.cuda_default_rng.defined())
      archive.write("cuda_default", state.cuda_default_rng.to(at::kCPU).clone(), /*is_buffer=*/true);
    files.emplace_back(kRng, archive_bytes(archive));
  }
  return files;
}

// The manifest's text, ending in the line "complete".
std::string manifest_text(const Manifest& m) {
  std::ostringstream os;
  os << kFormat << "\n";
  os << "step " << m.step << "\n";
  os << "data_position " << m.data_position << "\n";
  os << "log_file " << m.log_file << "\n";
  os << "drafter_plugin " << m.drafter_plugin << "\n";
  for (const auto& [ds, rows] : m.log_rows) os << "log_rows " << rows << " " << ds << "\n";
  for (const auto& t : m.tensors) {
    os << "tensor ";
    if (t.shape.empty()) os << "-";
    for (size_t i = 0; i < t.shape.size(); ++i) os << (i ? "," : "") << t.shape[i];
    os << " " << t.name << "\n";
  }
  for (const auto& f : m.files) os << "file " << f.bytes << " " << hex(f.checksum) << " " << f.name << "\n";
  std::vector<std::string> lines;
  {
    std::istringstream in(m.drafter_toml);
    std::string line;
    while (std::getline(in, line)) lines.push_back(line);
  }
  os << "drafter_toml " << lines.size() << "\n";
  for (const auto& l : lines) os << l << "\n";
  os << "complete\n";
  return os.str();
}

}  // namespace

uint64_t chunked_checksum(const void* data, size_t size, size_t chunk, unsigned threads) {
  const auto* p = static_cast<const unsigned char*>(data);
  chunk = std::max<size_t>(chunk, 1);
  const size_t n = std::max<size_t>(1, (size + chunk - 1) / chunk);
  std::vector<uint64_t> sums(n);
  auto piece = [&](size_t i) {
    const size_t begin = std::min(size, i * chunk), end = std::min(size, begin + chunk);
    sums[i] = fnv1a64(p + begin, end - begin);
  };
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const size_t workers = std::min<size_t>(threads, n);
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) piece(i);
  } else {
    std::atomic<size_t> next{0};
    std::vector<std::thread> pool;
    for (size_t w = 0; w < workers; ++w)
      pool.emplace_back([&] {
        for (size_t i = next++; i < n; i = next++) piece(i);
      });
    for (auto& t : pool) t.join();
  }
  uint64_t h = fnv1a64(nullptr, 0);
  for (uint64_t v : sums) {
    unsigned char le[8];
    for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(v >> (8 * b));
    h = fnv1a64(le, 8, h);
  }
  return h;
}

void remove_tree(const fs::path& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  // Depth first, links not followed: files, then the folders that held them.
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        ::remove(p);  // keep going: remove what can be removed
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

uintmax_t folder_bytes(const fs::path& dir) {
  uintmax_t total = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  return total;
}

std::string size_text(uintmax_t bytes) {
  char s[32];
  if (bytes >= 1000000000u)
    std::snprintf(s, sizeof(s), "%.2f GB", static_cast<double>(bytes) / 1e9);
  else
    std::snprintf(s, sizeof(s), "%.1f MB", static_cast<double>(bytes) / 1e6);
  return s;
}

std::string space_refusal(const std::string& name, uintmax_t need, uintmax_t available, const fs::path& root,
                          int64_t kept, uintmax_t kept_bytes, int64_t keep) {
  // Room to spare for the log's growth and the filesystem's own blocks: 1/16 of the
  // checkpoint, between 1 and 64 MiB.
  const uintmax_t spare = std::clamp<uintmax_t>(need / 16, uintmax_t(1) << 20, uintmax_t(64) << 20);
  if (available >= need + spare) return "";
  std::string why = "cannot write checkpoint " + name + ": it needs " + size_text(need) + " and " + root.string() +
                    " has " + size_text(available) + " free";
  if (kept > 0)
    why += " (the " + std::to_string(kept) + " checkpoint" + (kept == 1 ? "" : "s") + " kept there take " +
           size_text(kept_bytes) + "; [checkpoint] keep = " + std::to_string(keep) +
           " holds the newest until a new one is whole)";
  return why + "; free space there, lower [checkpoint] keep, or write the run elsewhere (--out)";
}

fs::path write(const fs::path& root, Manifest m, const State& state, int64_t keep) {
  fs::create_directories(root);
  // Leftovers of writes that crashed are never checkpoints; clear them.
  for (const auto& e : fs::directory_iterator(root))
    if (e.path().filename().string().rfind(".tmp-step_", 0) == 0) remove_tree(e.path());
  const std::string name = "step_" + std::to_string(m.step);
  const std::vector<std::pair<std::string, std::string>> files = archive_files(m, state);
  {
    uintmax_t need = 0, kept_bytes = 0;
    for (const auto& f : files) need += f.second.size();
    const std::vector<fs::path> kept = list(root);
    for (const auto& k : kept) kept_bytes += folder_bytes(k);
    std::error_code ec;
    const fs::space_info space = fs::space(root, ec);
    if (!ec) {
      const std::string why =
          space_refusal(name, need, space.available, root, static_cast<int64_t>(kept.size()), kept_bytes, keep);
      if (!why.empty()) throw Error(why);
    }
  }

  const fs::path tmp = root / (".tmp-" + name + "-" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  try {
    m.files.clear();
    for (const auto& [fname, bytes] : files) {
      m.files.push_back({fname, static_cast<int64_t>(bytes.size()), chunked_checksum(bytes.data(), bytes.size())});
      write_durable(tmp / fname, bytes);
    }
    // The manifest, last; its final line "complete" marks it whole.
    write_durable(tmp / kManifest, manifest_text(m));
    fsync_dir(tmp);
  } catch (...) {
    remove_tree(tmp);  // a half-written checkpoint is never one; give its space back now
    throw;
  }

  // Into place: rename is atomic. A folder of the same step (from an abandoned timeline)
  // is moved aside first and removed after.
  const fs::path final_dir = root / name;
  fs::path old;
  if (fs::exists(final_dir)) {
    old = root / (".old-" + name + "-" + std::to_string(::getpid()));
    remove_tree(old);
    fs::rename(final_dir, old);
  }
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  if (!old.empty()) remove_tree(old);

  const std::vector<fs::path> all = list(root);
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep, 1)); i < all.size(); ++i) remove_tree(all[i]);
  fsync_dir(root);
  return final_dir;
}

std::vector<fs::path> list(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (fs::is_directory(root))
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && step_of(e.path()) >= 0) found.emplace_back(step_of(e.path()), e.path());
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

Manifest read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifest;
  if (!fs::is_directory(dir)) throw Error("checkpoint folder " + dir.string() + " does not exist");
  if (!fs::exists(path))
    throw Error("checkpoint " + dir.string() + " has no manifest file " + path.string() +
                " (a partial checkpoint: the manifest is written last)");
  const std::string text = read_bytes(path);
  std::istringstream in(text);
  std::string line;
  auto bad = [&](const std::string& why) {
    return Error("checkpoint manifest " + path.string() + " is damaged: " + why);
  };
  if (!std::getline(in, line) || (line != kFormat && line != kFormat1))
    throw bad("first line is \"" + line + "\", expected \"" + kFormat + "\" (or \"" + kFormat1 + "\")");
  Manifest m;
  m.format = line == kFormat1 ? 1 : 2;
  bool complete = false, have_step = false;
  while (std::getline(in, line)) {
    if (line == "complete") {
      complete = true;
      break;
    }
    const auto sp = line.find(' ');
    const std::string key = line.substr(0, sp);
    const std::string rest = sp == std::string::npos ? "" : line.substr(sp + 1);
    std::istringstream fields(rest);
    try {
      if (key == "step") {
        m.step = std::stoll(rest);
        have_step = true;
      } else if (key == "data_position") {
        m.data_position = std::stoll(rest);
      } else if (key == "log_file") {
        m.log_file = rest;
      } else if (key == "drafter_plugin") {
        m.drafter_plugin = rest;
      } else if (key == "log_rows") {
        int64_t rows = 0;
        std::string name;
        fields >> rows >> name;
        m.log_rows[name] = rows;
      } else if (key == "tensor") {
        std::string shape, name;
        fields >> shape >> name;
        TensorEntry t{name, {}};
        if (shape != "-") {
          std::istringstream dims(shape);
          std::string d;
          while (std::getline(dims, d, ',')) t.shape.push_back(std::stoll(d));
        }
        m.tensors.push_back(t);
      } else if (key == "file") {
        FileEntry f;
        std::string sum;
        fields >> f.bytes >> sum >> f.name;
        f.checksum = std::stoull(sum, nullptr, 16);
        m.files.push_back(f);
      } else if (key == "drafter_toml") {
        const int64_t n = std::stoll(rest);
        for (int64_t i = 0; i < n && std::getline(in, line); ++i) m.drafter_toml += line + "\n";
      } else {
        throw bad("unknown line \"" + line + "\"");
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception&) {
      throw bad("unreadable line \"" + line + "\"");
    }
  }
  if (!complete) throw bad("it does not end with the line \"complete\" (a partial write)");
  if (!have_step) throw bad("no step line");
  for (const char* f : {kWeights, kOptimizer, kRng}) {
    bool listed = false;
    for (const auto& e : m.files) listed = listed || e.name == f;
    if (!listed) throw bad(std::string("the file ") + f + " is not listed");
  }
  return m;
}

std::string check(const fs::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& expected) {
  try {
    const Manifest m = read_manifest(dir);
    check_tensors(dir, m, expected);
    read_weights(dir, m);
    torch::serialize::InputArchive opt, rng;
    open_archive(dir, m, kOptimizer, opt);
    open_archive(dir, m, kRng, rng);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

Manifest load(const fs::path& dir, State& state) {
  const Manifest m = read_manifest(dir);
  check_tensors(dir, m, state.weights);
  const auto loaded = read_weights(dir, m);
  torch::serialize::InputArchive opt, rng;
  open_archive(dir, m, kOptimizer, opt);
  open_archive(dir, m, kRng, rng);
  at::Tensor anchor, cpu;
  if (!rng.try_read("anchor", anchor, true) || !rng.try_read("cpu_default", cpu, true))
    throw Error("checkpoint file " + (dir / kRng).string() +
                " lacks a generator state (\"anchor\" or \"cpu_default\")");
  // Everything checked: now change the run's state.
  {
    at::NoGradGuard no_grad;
    for (auto& [name, param] : state.weights)
      for (const auto& [lname, value] : loaded)
        if (lname == name) param.copy_(value.to(param.device(), param.scalar_type()));
  }
  try {
    state.optimizer->load(opt);
  } catch (const std::exception& e) {
    throw Error("checkpoint file " + (dir / kOptimizer).string() + " does not fit the optimizer (" +
                first_line(e.what()) + ")");
  }
  at::Tensor cuda;
  if (!rng.try_read("cuda_default", cuda, true)) cuda = at::Tensor();
  state.anchor_rng = anchor;
  state.cpu_default_rng = cpu;
  state.cuda_default_rng = cuda;
  return m;
}

fs::path latest(const fs::path& root, const std::vector<std::pair<std::string, at::Tensor>>& expected,
                const std::function<void(const std::string&)>& say) {
  const std::vector<fs::path> all = list(root);
  if (all.empty()) throw Error("no checkpoint to resume from: " + root.string() + " holds no step_<n> folder");
  std::string reasons;
  for (const auto& dir : all) {
    const std::string why = check(dir, expected);
    if (why.empty()) return dir;
    say("resume: skipping " + dir.string() + ": " + why);
    reasons += "\n  " + why;
  }
  throw Error("no usable checkpoint under " + root.string() + ":" + reasons);
}

// --- weights export (HDF5) -------------------------------------------------------------
namespace {}  // namespace

void export_weights(const std::string& path, const Manifest& info,
                    const std::vector<std::pair<std::string, at::Tensor>>& weights, const std::string& source) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  hid_t file = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) throw std::runtime_error("cannot create the weights file " + tmp + " (is the folder writable?)");
  try {
    hdf5::write_string_attribute(file, "format", "flashdraft-drafter-weights-v1");
    hdf5::write_string_attribute(file, "drafter_plugin", info.drafter_plugin);
    hdf5::write_string_attribute(file, "drafter_config", info.drafter_toml);
    hdf5::write_string_attribute(file, "step", std::to_string(info.step));
    hdf5::write_string_attribute(file, "source", source);
    hid_t group = H5Gcreate2(file, "weights", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (group < 0) throw std::runtime_error("HDF5: creating /weights failed");
    for (const auto& [name, tensor] : weights) {
      const at::Tensor t = tensor.detach().to(at::kCPU, at::kFloat).contiguous();
      std::vector<hsize_t> dims(t.sizes().begin(), t.sizes().end());
      hid_t space =
          dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
      hid_t ds = H5Dcreate2(group, name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      const herr_t st =
          ds >= 0 ? H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr<float>()) : -1;
      if (ds >= 0) H5Dclose(ds);
      H5Sclose(space);
      if (st < 0) throw std::runtime_error("HDF5: writing weights/" + name + " failed");
    }
    H5Gclose(group);
    if (H5Fclose(file) < 0) throw std::runtime_error("HDF5: closing " + tmp + " failed");
    file = -1;
  } catch (...) {
    if (file >= 0) H5Fclose(file);
    std::remove(tmp.c_str());
    throw;
  }
  fs::rename(tmp, path);
}

std::vector<std::pair<std::string, at::Tensor>> weights(const fs::path& dir) {
  return read_weights(dir, read_manifest(dir));
}

std::string export_checkpoint(const fs::path& dir, const std::string& path) {
  const Manifest m = read_manifest(dir);
  const auto weights = read_weights(dir, m);
  const std::string out = path.empty() ? (dir / "weights.h5").string() : path;
  export_weights(out, m, weights, "checkpoint " + fs::absolute(dir).string());
  return out;
}

}  // namespace flashdraft::checkpoint

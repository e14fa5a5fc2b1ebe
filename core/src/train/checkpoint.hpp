// Training checkpoints: what a run needs to continue exactly where it stopped, and the
// drafter weights export.
//
// A checkpoint is a folder <out>/checkpoints/step_<n>/ (n = optimizer steps completed,
// i.e. the next step to run) holding
//   weights.pt    the drafter's trainable tensors, keys "p0", "p1", ... in the order of
//                 Drafter::parameters() (LibTorch archives refuse dots in keys; the
//                 manifest maps index -> name and shape)
//   optimizer.pt  the AdamW state (optimizer.hpp): for the fused implementation
//                 "fused_adamw/step", "exp_avg/<i>", "exp_avg_sq/<i>" and, with float32
//                 master weights, "master/<i>" (i = position in Drafter::parameters());
//                 for torch::optim::AdamW its own save(). Shapes and dtypes checked on load.
//   rng.pt        generator states: "anchor" (the trainer's anchor generator),
//                 "cpu_default" (LibTorch's default CPU generator) and, on CUDA runs,
//                 "cuda_default" (the default generator of the run's GPU)
//   manifest      text, written last: format, step, data position, run-log row counts,
//                 the drafter's plugin and config, every tensor's name and shape, and
//                 every file's size and checksum (format 2: chunked_checksum, the FNV-1a 64
//                 of the file's 64 MiB chunks' FNV-1a 64s, computed on every core; format 1,
//                 still read: FNV-1a 64 of the whole file); its last line is "complete".
// Format choice: LibTorch archives (torch::serialize::OutputArchive), because the
// optimizer serialises itself into one; the weights export below is HDF5 so that other
// tools can read it without LibTorch.
//
// Atomicity: everything is written into <out>/checkpoints/.tmp-step_<n>-<pid>/, each
// file fsync'ed, the folder fsync'ed, then renamed to step_<n> and the parent
// fsync'ed. A step_<n> folder therefore only ever appears complete; a crash leaves at
// most a .tmp-* folder, which is never taken for a checkpoint (and is removed by the
// next write). Corruption after the fact (a truncated or edited file) is caught by the
// manifest's sizes and checksums and by the tensor checks on load.
#pragma once

#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {
class TrainOptimizer;
}

namespace flashdraft::checkpoint {

// A checkpoint that cannot be used; what() is a sentence naming the file and the problem.
class FLASHDRAFT_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct FileEntry {
  std::string name;
  int64_t bytes = 0;
  uint64_t checksum = 0;  // chunked_checksum of the bytes (a format-1 manifest: their FNV-1a 64)
};

// The checksum of a checkpoint file (format 2): FNV-1a 64 over the little-endian FNV-1a 64s
// of its `chunk`-byte pieces (the last one shorter), the pieces hashed on up to `threads`
// threads (0: every core). FNV-1a runs at ~1 GB/s on a core: a 14 GB optimizer state took
// ~15 s on one; on 16 cores ~1 s.
FLASHDRAFT_API uint64_t chunked_checksum(const void* data, size_t size, size_t chunk = size_t(64) << 20,
                                         unsigned threads = 0);

struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
};

struct Manifest {
  int format = 2;                           // the manifest's format: 2 (written now) or 1 (still read)
  int64_t step = 0;                         // optimizer steps completed; the run continues with this step
  int64_t data_position = 0;                // index of the next training batch
  std::string log_file;                     // the run log's file name, in the run's out folder
  std::map<std::string, int64_t> log_rows;  // rows of each log dataset at this step
  std::string drafter_plugin;               // name of the drafter plugin
  std::string drafter_toml;                 // the [drafter] table, every key resolved
  std::vector<TensorEntry> tensors;         // weights.pt, in order
  std::vector<FileEntry> files;
};

// Everything that is saved besides the manifest's bookkeeping.
struct State {
  std::vector<std::pair<std::string, at::Tensor>> weights;
  TrainOptimizer* optimizer = nullptr;
  at::Tensor anchor_rng;  // at::Generator::get_state()
  at::Tensor cpu_default_rng;
  at::Tensor cuda_default_rng;  // undefined: not a CUDA run (or not in the checkpoint)
};

// Removes a file or a folder with everything in it (what std::filesystem::remove_all
// does; that one resolves to a broken copy inside libtorch.so in this build and crashes).
FLASHDRAFT_API void remove_tree(const std::filesystem::path& path);

// Writes <root>/step_<manifest.step> atomically (see above) and deletes all but the
// newest `keep` step_* folders under root. Returns the folder written. Refuses (Error,
// space_refusal's sentence) before writing when the disk cannot hold it; a write that fails
// half-way removes what it wrote.
FLASHDRAFT_API std::filesystem::path write(const std::filesystem::path& root, Manifest manifest, const State& state,
                                           int64_t keep);

// write()'s check before it writes a byte: "" when `need` bytes fit in the `available` ones
// with room to spare (1/16 of `need`, 1 to 64 MiB), else the sentence it throws: the
// checkpoint, the bytes it needs and those free under root, what the kept ones take (keep
// holds the newest `keep` until a new one is whole), and what would make room.
FLASHDRAFT_API std::string space_refusal(const std::string& name, uintmax_t need, uintmax_t available,
                                         const std::filesystem::path& root, int64_t kept, uintmax_t kept_bytes,
                                         int64_t keep);

// The bytes of the files under a folder (a checkpoint's size).
FLASHDRAFT_API uintmax_t folder_bytes(const std::filesystem::path& dir);
// A size as people read it: "12.3 MB" under 1 GB, "1.23 GB" from there.
FLASHDRAFT_API std::string size_text(uintmax_t bytes);

// step_* folders under root, newest (largest step) first. Other names are ignored.
FLASHDRAFT_API std::vector<std::filesystem::path> list(const std::filesystem::path& root);

// Reads and checks the manifest and every file's size and checksum; throws Error.
FLASHDRAFT_API Manifest read_manifest(const std::filesystem::path& dir);

// Loads a checkpoint into a run: checks the manifest and files, that every expected
// tensor is there with the expected shape (expected = the drafter built from the
// experiment), copies the weights into `state.weights` (in place), loads the optimizer
// and returns the generator states in state.anchor_rng / cpu_default_rng. Throws Error
// before changing anything when the checkpoint does not fit.
FLASHDRAFT_API Manifest load(const std::filesystem::path& dir, State& state);

// Checks a checkpoint as load() would, without changing anything: "" if usable, else
// the reason (a sentence naming the file and the problem).
FLASHDRAFT_API std::string check(const std::filesystem::path& dir,
                                 const std::vector<std::pair<std::string, at::Tensor>>& expected);

// The newest usable checkpoint under root; every skipped one is reported through
// `say` with its reason. Throws Error when none is usable.
FLASHDRAFT_API std::filesystem::path latest(const std::filesystem::path& root,
                                            const std::vector<std::pair<std::string, at::Tensor>>& expected,
                                            const std::function<void(const std::string&)>& say);

// Drafter weights export (HDF5; the README of the drafter plugins shows how to read it):
//   root attributes (strings): format = "flashdraft-drafter-weights-v1", drafter_plugin,
//     drafter_config (the [drafter] table as TOML, every key resolved), step,
//     source (what it was exported from)
//   /weights/<name>: float32 dataset per trainable tensor, the tensor's shape, named as
//     Drafter::parameters() names it (e.g. "layers.0.self_attn.q_proj.weight")
FLASHDRAFT_API void export_weights(const std::string& path, const Manifest& info,
                                   const std::vector<std::pair<std::string, at::Tensor>>& weights,
                                   const std::string& source);
// The drafter weights of a checkpoint folder, by name, in the manifest's order (checked
// as load() checks them). Throws Error.
FLASHDRAFT_API std::vector<std::pair<std::string, at::Tensor>> weights(const std::filesystem::path& dir);
// Exports the weights of a checkpoint folder (no plugin needed). Returns the file written.
FLASHDRAFT_API std::string export_checkpoint(const std::filesystem::path& dir, const std::string& path);

}  // namespace flashdraft::checkpoint

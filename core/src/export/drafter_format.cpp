// The steps every drafter folder format shares (flashdraft/drafter_format.hpp).
#include <flashdraft/drafter_format.hpp>

#include "train/checkpoint.hpp"  // remove_tree

#include <flashdraft/safetensors.hpp>

#include <ATen/ATen.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace flashdraft {

DrafterFormat::~DrafterFormat() = default;

namespace drafter_format {

void write_folder(const std::string& folder, const NamedTensors& tensors, const std::string& config) {
  const fs::path dir(folder);
  if (fs::exists(dir) && !fs::is_empty(dir) && !fs::exists(dir / "config.json"))
    throw FormatError("cannot export to " + folder + ": the folder exists and is not a drafter folder (no " +
                      "config.json); give a new or empty folder");
  const fs::path tmp = dir.string() + ".tmp-" + std::to_string(::getpid());
  checkpoint::remove_tree(tmp);
  fs::create_directories(tmp);
  safetensors::write((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}});
  std::ofstream(tmp / "config.json") << config;
  checkpoint::remove_tree(dir);
  fs::rename(tmp, dir);
}

std::unique_ptr<safetensors::Checkpoint> open_checkpoint(const std::string& folder) {
  try {
    return std::make_unique<safetensors::Checkpoint>(folder);
  } catch (const safetensors::Error& e) {
    throw FormatError(e.what());
  }
}

void copy_into(const std::string& folder, const safetensors::Checkpoint& ck, const NamedTensors& params) {
  at::NoGradGuard no_grad;
  for (const auto& [name, param] : params) {
    if (!ck.find(name))
      throw FormatError(folder + ": tensor '" + name + "' is missing (the experiment's drafter has it)");
    param.copy_(ck.load(name, param.device(), param.scalar_type()));
  }
}

void check_sizes(const std::string& file, const std::vector<SizeField>& fields, const std::string& a_drafter) {
  for (const SizeField& f : fields)
    if (f.found != f.wanted)
      throw FormatError(file + ": " + f.key + " = " + std::to_string(f.found) + ", but the experiment's drafter has " +
                        std::to_string(f.wanted) + " (from " + f.from + "); accepted: " + a_drafter +
                        " exported with " + f.key + " = " + std::to_string(f.wanted));
}

}  // namespace drafter_format
}  // namespace flashdraft

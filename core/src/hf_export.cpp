// Exporting a run or a checkpoint as a Hugging Face DFlash folder (see hf_export.hpp).
#include "hf_export.hpp"

#include "bind.hpp"
#include "checkpoint.hpp"
#include "run_log.hpp"
#include "setup.hpp"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

namespace fs = std::filesystem;

namespace flashdraft::hf_export {

namespace {

// The float32 tensors of a finished run's weights file (checkpoint::export_weights).
hf_drafter::Named read_weights_file(const std::string& path) {
  LogReader r(path);
  hf_drafter::Named out;
  for (const auto& name : r.members("/weights")) {
    const std::vector<int64_t> shape = r.shape("weights/" + name);
    const std::vector<double> values = r.f64("weights/" + name);
    at::Tensor t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat).view(shape);
    out.emplace_back(name, t);
  }
  return out;
}

// The weights to export and what they came from.
std::pair<hf_drafter::Named, std::string> weights_of_run(const fs::path& log) {
  const fs::path dir = log.parent_path();
  const fs::path finished = dir / (log.stem().string() + ".weights.h5");
  if (fs::exists(finished)) return {read_weights_file(finished.string()), "the finished run's " + finished.string()};
  for (const auto& ckpt : checkpoint::list(dir / "checkpoints"))
    if (checkpoint::read_manifest(ckpt).log_file == log.filename().string())
      return {checkpoint::weights(ckpt), "checkpoint " + ckpt.string()};
  throw hf_drafter::Error("run " + log.string() + " has no weights to export: neither " + finished.string() +
                          " (written when a run finishes) nor a checkpoint of it under " +
                          (dir / "checkpoints").string());
}

}  // namespace

std::string layout_path(const std::string& log_path) {
  const fs::path log(log_path);
  return (log.parent_path() / (log.stem().string() + ".hf-layout.json")).string();
}

void write_layout(const std::string& log_path, const hf_drafter::Layout& layout) {
  const std::string path = layout_path(log_path), tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << hf_drafter::config_json(layout);
    if (!out) throw hf_drafter::Error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
}

namespace {
constexpr const char* kRefused = "flashdraft_export_refused";

// A run whose drafter cannot be exported: the layout file says why, so `flashdraft export`
// gives the same sentence later; the run itself goes on.
void write_refusal(const std::string& log_path, const std::string& why) {
  nlohmann::json j;
  j[kRefused] = why;
  const std::string path = layout_path(log_path), tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) throw hf_drafter::Error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
  std::cout << "export: this drafter will not be exported as a Hugging Face folder: " << why << std::endl;
}

// The sentence of a layout file written by write_refusal ("" for a layout).
std::string refusal_of(const std::string& layout_file) {
  std::ifstream in(layout_file);
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    if (j.is_object() && j.contains(kRefused) && j[kRefused].is_string()) return j[kRefused].get<std::string>();
  } catch (const std::exception&) {
  }
  return "";
}
}  // namespace

std::optional<hf_drafter::Layout> run_layout(const Setup& setup, BoundPlugins& plugins, const std::string& log_path) {
  const PluginUse& drafter = setup.use(PluginKind::drafter);
  if (drafter.name != "dflash") return std::nullopt;
  const PluginUse& mask = setup.use(PluginKind::mask);
  try {
    const hf_drafter::Layout layout = hf_drafter::describe(drafter.config, *plugins.drafter, plugins.target_model,
                                                           plugins.ctx.dtype, mask.name, mask.config);
    write_layout(log_path, layout);
    return layout;
  } catch (const hf_drafter::Error& e) {
    write_refusal(log_path, e.what());
    return std::nullopt;
  }
}

std::optional<hf_eagle3::Layout> run_eagle3_layout(const Setup& setup, BoundPlugins& plugins,
                                                   const std::string& log_path) {
  const PluginUse& drafter = setup.use(PluginKind::drafter);
  if (drafter.name != "eagle3") return std::nullopt;
  const std::string& mask = setup.use(PluginKind::mask).name;
  if (mask != "eagle3_ttt") {
    write_refusal(log_path, "[mask] plugin = \"" + mask + "\": an EAGLE-3 folder is served with causal attention over " +
                                "the context, the mask \"eagle3_ttt\" trains (accepted for export: \"eagle3_ttt\")");
    return std::nullopt;
  }
  const hf_eagle3::Layout layout = hf_eagle3::describe(drafter.config, *plugins.drafter, plugins.target_model,
                                                       plugins.ctx.dtype, plugins.dataset->seq_len());
  const std::string path = layout_path(log_path), tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << hf_eagle3::config_json(layout);
    if (!out) throw hf_drafter::Error("cannot write " + tmp);
  }
  fs::rename(tmp, path);
  return layout;
}

std::string export_folder(const std::string& run_or_checkpoint, const std::string& out_dir) {
  const fs::path source(run_or_checkpoint);
  fs::path log;
  std::pair<hf_drafter::Named, std::string> weights;
  if (!fs::exists(source))
    throw hf_drafter::Error("\"" + run_or_checkpoint +
                            "\" does not exist (a run log RUN.h5 or a checkpoint folder is expected)");
  if (fs::is_directory(source)) {
    const checkpoint::Manifest m = checkpoint::read_manifest(source);
    log = fs::absolute(source).parent_path().parent_path() / m.log_file;
    weights = {checkpoint::weights(source), "checkpoint " + source.string() + " (step " + std::to_string(m.step) + ")"};
  } else if (fs::is_regular_file(source) && source.extension() == ".h5") {
    log = source;
    weights = weights_of_run(source);
  } else {
    throw hf_drafter::Error("\"" + run_or_checkpoint + "\" is neither a run log (RUN.h5) nor a checkpoint folder " +
                            "(<out>/checkpoints/step_<n>)");
  }
  const std::string layout_file = layout_path(log.string());
  if (!fs::exists(layout_file))
    throw hf_drafter::Error("the run's layout file " + layout_file + " is missing: it is written when a DFlash or EAGLE-3 run " +
                            "binds its drafter (runs of other drafters, or of older flashdraft versions, have none)");
  const std::string refused = refusal_of(layout_file);
  if (!refused.empty()) throw hf_drafter::Error("cannot export " + run_or_checkpoint + ": " + refused);
  if (hf_eagle3::is_eagle3_config(layout_file)) {
    const hf_eagle3::Layout layout = hf_eagle3::read_config_file(layout_file);
    hf_eagle3::write(out_dir, layout, weights.first);
    return "drafter (Hugging Face EAGLE-3 layout, " + layout.dtype + "): " + out_dir + " from " + weights.second;
  }
  const hf_drafter::Layout layout = hf_drafter::read_config_file(layout_file);
  hf_drafter::write(out_dir, layout, weights.first);
  return "drafter (Hugging Face DFlash layout, " + layout.dtype + "): " + out_dir + " from " + weights.second;
}

}  // namespace flashdraft::hf_export

// Exporting a run or a checkpoint as its drafter's serving folder (see hf_export.hpp).
#include "export/hf_export.hpp"

#include "config/setup.hpp"
#include "log/run_log.hpp"
#include "registry/bind.hpp"
#include "registry/registry.hpp"
#include "train/checkpoint.hpp"

#include <flashdraft/model.hpp>

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

namespace fs = std::filesystem;

namespace flashdraft::hf_export {

namespace {

// The float32 tensors of a finished run's weights file (checkpoint::export_weights).
NamedTensors read_weights_file(const std::string& path) {
  LogReader r(path);
  NamedTensors out;
  for (const auto& name : r.members("/weights")) {
    const std::vector<int64_t> shape = r.shape("weights/" + name);
    const std::vector<double> values = r.f64("weights/" + name);
    at::Tensor t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat).view(shape);
    out.emplace_back(name, t);
  }
  return out;
}

// The weights to export and what they came from.
std::pair<NamedTensors, std::string> weights_of_run(const fs::path& log) {
  const fs::path dir = log.parent_path();
  const fs::path finished = dir / (log.stem().string() + ".weights.h5");
  if (fs::exists(finished)) return {read_weights_file(finished.string()), "the finished run's " + finished.string()};
  for (const auto& ckpt : checkpoint::list(dir / "checkpoints"))
    if (checkpoint::read_manifest(ckpt).log_file == log.filename().string())
      return {checkpoint::weights(ckpt), "checkpoint " + ckpt.string()};
  throw FormatError("run " + log.string() + " has no weights to export: neither " + finished.string() +
                    " (written when a run finishes) nor a checkpoint of it under " + (dir / "checkpoints").string());
}

}  // namespace

std::string layout_path(const std::string& log_path) {
  const fs::path log(log_path);
  return (log.parent_path() / (log.stem().string() + ".hf-layout.json")).string();
}

namespace {
// The layout file: {"flashdraft_layout": 1, "drafter": plugin, "format": name, "dtype": ...,
// "layout": the format's text}, or {"flashdraft_export_refused": sentence}.
constexpr const char* kVersion = "flashdraft_layout";
constexpr const char* kRefused = "flashdraft_export_refused";

void write_json(const std::string& path, const nlohmann::json& j) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) throw FormatError("cannot write " + tmp);
  }
  fs::rename(tmp, path);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    if (j.is_object()) return j;
  } catch (const std::exception&) {
  }
  throw FormatError("the run's layout file " + path + " is not a JSON object (written by flashdraft when the run " +
                    "bound its drafter; a damaged file cannot say how to export)");
}
}  // namespace

FormatInput format_input(const Setup& setup, BoundPlugins& plugins) {
  const PluginUse& mask = setup.use(PluginKind::mask);
  return FormatInput{setup.use(PluginKind::drafter).config,
                     plugins.target_model,
                     plugins.ctx.dtype,
                     mask.name,
                     mask.config,
                     plugins.dataset->seq_len()};
}

std::optional<RunLayout> run_layout(const Setup& setup, BoundPlugins& plugins, const std::string& log_path) {
  const DrafterFormat* format = plugins.drafter->format();
  if (!format) return std::nullopt;
  RunLayout run{format, {}, dtype_name(plugins.ctx.dtype)};
  try {
    run.layout = format->layout(*plugins.drafter, format_input(setup, plugins));
  } catch (const FormatError& e) {
    nlohmann::json j;
    j[kRefused] = e.what();
    write_json(layout_path(log_path), j);
    std::cout << "export: this drafter will not be exported (" << format->name() << "): " << e.what() << std::endl;
    return std::nullopt;
  }
  nlohmann::json j;
  j[kVersion] = 1;
  j["drafter"] = setup.use(PluginKind::drafter).name;
  j["drafter_library"] = setup.use(PluginKind::drafter).plugin->path;
  j["format"] = format->name();
  j["dtype"] = run.dtype;
  j["layout"] = run.layout;
  write_json(layout_path(log_path), j);
  return run;
}

std::string write_run_folder(const RunLayout& run, const std::string& folder, const NamedTensors& tensors) {
  run.format->write(folder, run.layout, tensors);
  return "drafter (" + run.format->name() + ", " + run.dtype + "): " + folder;
}

std::string export_folder(const std::string& run_or_checkpoint, const std::string& out_dir, const Registry& registry) {
  const fs::path source(run_or_checkpoint);
  fs::path log;
  std::pair<NamedTensors, std::string> weights;
  if (!fs::exists(source))
    throw FormatError("\"" + run_or_checkpoint +
                      "\" does not exist (a run log RUN.h5 or a checkpoint folder is expected)");
  if (fs::is_directory(source)) {
    const checkpoint::Manifest m = checkpoint::read_manifest(source);
    log = fs::absolute(source).parent_path().parent_path() / m.log_file;
    weights = {checkpoint::weights(source), "checkpoint " + source.string() + " (step " + std::to_string(m.step) + ")"};
  } else if (fs::is_regular_file(source) && source.extension() == ".h5") {
    log = source;
    weights = weights_of_run(source);
  } else {
    throw FormatError("\"" + run_or_checkpoint + "\" is neither a run log (RUN.h5) nor a checkpoint folder " +
                      "(<out>/checkpoints/step_<n>)");
  }
  const std::string layout_file = layout_path(log.string());
  if (!fs::exists(layout_file))
    throw FormatError("the run's layout file " + layout_file + " is missing: it is written when a run binds a " +
                      "drafter that has a serving format (runs of other drafters, or of older flashdraft versions, " +
                      "have none)");
  const nlohmann::json j = read_json(layout_file);
  if (j.contains(kRefused) && j[kRefused].is_string())
    throw FormatError("cannot export " + run_or_checkpoint + ": " + j[kRefused].get<std::string>());
  if (!j.contains(kVersion) || j[kVersion] != 1 || !j.contains("drafter") || !j["drafter"].is_string() ||
      !j.contains("layout") || !j["layout"].is_string())
    throw FormatError("the run's layout file " + layout_file + " was written by an older flashdraft (it holds no " +
                      "drafter plugin name); run the export with that version, or train again");
  const std::string plugin = j["drafter"].get<std::string>();
  // The drafter plugin with its table's defaults: its format does not depend on the table.
  const FoundPlugin* found_ptr = nullptr;
  try {
    found_ptr = &registry.get(PluginKind::drafter, plugin);
  } catch (const std::runtime_error& e) {
    const std::string library = j.contains("drafter_library") && j["drafter_library"].is_string()
                                    ? j["drafter_library"].get<std::string>()
                                    : std::string("?");
    throw FormatError("the run trained the drafter plugin \"" + plugin + "\" (" + library + "), which export needs " +
                      "to write its folder: " + e.what() + " (give its folder with --plugin-path)");
  }
  const FoundPlugin& found = *found_ptr;
  Config config("drafter", SourcePosition{"flashdraft export", 0, 0});
  const Schema schema = registry.schema(found);
  for (const KeySpec& key : schema.keys())
    if (key.fallback) config.set(key.name, *key.fallback, std::nullopt);
  const std::unique_ptr<Drafter> drafter = create_as<Drafter>(registry, found, config);
  const DrafterFormat* format = drafter->format();
  if (!format)
    throw FormatError("the drafter plugin \"" + plugin + "\" (" + found.path + ") that trained " + log.string() +
                      " has no serving format in this build");
  format->write(out_dir, j["layout"].get<std::string>(), weights.first);
  const std::string dtype = j.contains("dtype") && j["dtype"].is_string() ? j["dtype"].get<std::string>() : "";
  return "drafter (" + format->name() + (dtype.empty() ? "" : ", " + dtype) + "): " + out_dir + " from " +
         weights.second;
}

}  // namespace flashdraft::hf_export

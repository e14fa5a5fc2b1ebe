// `flashdraft export RUN_OR_CHECKPOINT --format hf OUT_DIR` and the export at the end of a
// run: a trained drafter as the folder a server loads, in the drafter's own format
// (Drafter::format(), flashdraft/drafter_format.hpp; e.g. a Hugging Face folder).
//
// What a folder needs that the weights alone do not carry (target layer ids, mask token,
// vocabulary, the target's depth, dtype) is resolved when the run binds its drafter: the
// format's layout, which the run writes next to its log as <out>/<log stem>.hf-layout.json
// with the drafter plugin's name and the format's. Export then takes the weights from
//   RUN.h5          the finished run's <out>/<log stem>.weights.h5, else its newest checkpoint
//   a checkpoint    <out>/checkpoints/step_<n> (the manifest names the run's log)
// loads the drafter plugin named in the layout file and has its format write OUT_DIR.
#pragma once

#include <flashdraft/drafter_format.hpp>

#include <optional>
#include <string>

namespace flashdraft {
struct Setup;
struct BoundPlugins;
class Registry;
}  // namespace flashdraft

namespace flashdraft::hf_export {

// The format and layout of a run's bound drafter, for the export at the end of the run.
struct RunLayout {
  const DrafterFormat* format = nullptr;
  std::string layout, dtype;
};

// <out>/<log stem>.hf-layout.json for the run log at `log_path`.
std::string layout_path(const std::string& log_path);
// What a format knows of a bound run.
FormatInput format_input(const Setup& setup, BoundPlugins& plugins);
// The layout of a run's bound drafter, its file written next to the log; nullopt when the
// drafter has no format (nothing written) or its format refuses this training (the file then
// holds the sentence, which is printed and which `flashdraft export` gives later).
std::optional<RunLayout> run_layout(const Setup& setup, BoundPlugins& plugins, const std::string& log_path);
// Writes the folder at the end of a run; returns the console line.
std::string write_run_folder(const RunLayout& run, const std::string& folder, const NamedTensors& tensors);
// Exports RUN.h5 or a checkpoint folder to out_dir with the drafter plugin found in
// `registry`; returns a line saying what was written from what. Throws FormatError (or
// checkpoint::Error) with a sentence.
FLASHDRAFT_API std::string export_folder(const std::string& run_or_checkpoint, const std::string& out_dir,
                                         const Registry& registry);

}  // namespace flashdraft::hf_export

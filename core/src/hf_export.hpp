// `flashdraft export RUN_OR_CHECKPOINT --format hf OUT_DIR` and the export at the end of a
// run: a trained DFlash drafter as a Hugging Face folder (hf_drafter.hpp has the layout).
//
// The sizes a folder needs that its weights alone do not carry (target layer ids, mask
// token, vocabulary, the target's depth, dtype) are resolved when the run binds its
// drafter; the run writes them next to its log as <out>/<log stem>.hf-layout.json (the
// config.json the export will write). Export then takes the weights from
//   RUN.h5          the finished run's <out>/<log stem>.weights.h5, else its newest checkpoint
//   a checkpoint    <out>/checkpoints/step_<n> (the manifest names the run's log)
// and writes OUT_DIR/config.json and OUT_DIR/model.safetensors in the run's dtype.
#pragma once

#include "hf_drafter.hpp"
#include "hf_eagle3.hpp"

#include <flashdraft/export.hpp>

#include <optional>
#include <string>

namespace flashdraft {
struct Setup;
struct BoundPlugins;
}  // namespace flashdraft

namespace flashdraft::hf_export {

// <out>/<log stem>.hf-layout.json for the run log at `log_path`.
std::string layout_path(const std::string& log_path);
// Writes the layout file of a run (config.json as the export will write it).
void write_layout(const std::string& log_path, const hf_drafter::Layout& layout);
// The layout of a run's bound drafter, its file written next to the log; nullopt when the
// drafter is not a DFlash drafter (nothing is written then).
std::optional<hf_drafter::Layout> run_layout(const Setup& setup, BoundPlugins& plugins, const std::string& log_path);
// The same for an EAGLE-3 drafter (hf_eagle3.hpp); nullopt for other drafters.
std::optional<hf_eagle3::Layout> run_eagle3_layout(const Setup& setup, BoundPlugins& plugins,
                                                   const std::string& log_path);
// Exports RUN.h5 or a checkpoint folder to out_dir; returns a line saying what was written
// from what. Throws hf_drafter::Error (or checkpoint::Error) with a sentence.
FLASHDRAFT_API std::string export_folder(const std::string& run_or_checkpoint, const std::string& out_dir);

}  // namespace flashdraft::hf_export

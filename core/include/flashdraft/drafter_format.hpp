// A drafter's serving format: the folder a server loads (a Hugging Face folder for DFlash
// and EAGLE-3). The drafter owns it (Drafter::format(), model.hpp): the engine asks the
// bound drafter for its layout before step 0, writes it next to the run's log, and calls the
// format to write the folder at the end of the run, for `flashdraft export` and to import
// `[drafter] init` folders. The helpers below are the steps every folder format shares.
#pragma once

#include <flashdraft/config.hpp>
#include <flashdraft/export.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flashdraft {

struct TargetModel;
class Drafter;
namespace safetensors {
class Checkpoint;
}

// A folder that cannot be described, written or imported; what() is a sentence naming the
// file or key, the value and what is accepted.
class FLASHDRAFT_API FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// What a format knows of the run besides the drafter's tensors.
struct FormatInput {
  const Config& drafter;      // the drafter's resolved [drafter] table
  const TargetModel& target;  // the target it was bound to
  c10::ScalarType dtype;      // the run's compute dtype: the folder's dtype
  const std::string& mask;    // the [mask] generator's plugin name
  const Config& mask_table;   // its resolved table
  int64_t seq_len;            // the data's sequence length
};

class FLASHDRAFT_API DrafterFormat {
 public:
  virtual ~DrafterFormat();
  // What a console line calls the folder, e.g. "Hugging Face DFlash layout".
  virtual std::string name() const = 0;
  // The layout of the bound drafter (for a Hugging Face folder, its config.json text): what
  // the folder needs that the tensors do not carry. Throws FormatError with a sentence when
  // this training cannot be served in the format (the run goes on; export is refused with it).
  virtual std::string layout(Drafter& drafter, const FormatInput& run) const = 0;
  // Writes the folder from a layout (possibly made by another process: `flashdraft export`)
  // and the drafter's parameters and buffers, under a temporary name renamed into place.
  virtual void write(const std::string& folder, const std::string& layout, const NamedTensors& tensors) const = 0;
  // Checks the folder against the bound drafter's layout and copies its tensors into
  // `tensors` (parameters and buffers, in place); throws FormatError before changing anything.
  virtual void import(const std::string& folder, Drafter& drafter, const FormatInput& run,
                      const NamedTensors& tensors) const = 0;
};

namespace drafter_format {
// Writes `tensors` as <folder>/model.safetensors and `config` as <folder>/config.json through
// a temporary folder renamed into place; refuses a folder that exists, is not empty and has
// no config.json (it is not a drafter folder).
FLASHDRAFT_API void write_folder(const std::string& folder, const NamedTensors& tensors, const std::string& config);
// <folder>'s safetensors checkpoint; its errors come back as FormatError.
FLASHDRAFT_API std::unique_ptr<safetensors::Checkpoint> open_checkpoint(const std::string& folder);
// Copies every tensor of `params` from ck (to the parameter's device and dtype, without
// autograd); a name ck lacks is a FormatError naming the folder and the tensor.
FLASHDRAFT_API void copy_into(const std::string& folder, const safetensors::Checkpoint& ck, const NamedTensors& params);
// One integer of a folder's layout: its key, the folder's value and the experiment's drafter's,
// and where the experiment's value comes from.
struct SizeField {
  const char* key;
  int64_t found, wanted;
  const char* from;
};
// The first field whose values differ is a FormatError: "<file>: <key> = <found>, but the
// experiment's drafter has <wanted> (from <from>); accepted: <a drafter> exported with <key> =
// <wanted>".
FLASHDRAFT_API void check_sizes(const std::string& file, const std::vector<SizeField>& fields,
                                const std::string& a_drafter);
}  // namespace drafter_format

}  // namespace flashdraft

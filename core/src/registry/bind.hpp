// Stage 2 of a run: the plugins instantiated and bound to each other before step 0:
// the dataset opened (data generated or read from its cache), the drafter built against
// the target and the data's shapes, and the attention kernel chosen for the drafter's
// problem. Everything `flashdraft run` can refuse before step 0 is refused here, so
// `flashdraft validate` runs exactly this stage.
#pragma once

#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>

#include "config/setup.hpp"
#include "dispatch/dispatch.hpp"
#include "dispatch/dtype_name.hpp"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flashdraft {

// The mixed-precision policy ([run] dtype and master_weights, [optimizer] implementation).
struct Precision {
  c10::ScalarType compute = c10::kFloat;  // the drafter's weights and activations
  c10::ScalarType master = c10::kFloat;   // what the optimizer updates, and its moments
  bool fused = false;                     // the engine's fused AdamW (else torch::optim::AdamW)
  std::string describe() const;
};

// RunContext::say for a run: every line to the console, and a line that starts with
// "warning: " also to the sink (the trainer's run-log events), or kept until a sink is set
// (warnings said while the plugins bind, before the log exists).
class SaidWarnings {
 public:
  void say(const std::string& line);
  void sink(std::function<void(const std::string&)> to);

 private:
  std::function<void(const std::string&)> to_;
  std::vector<std::string> waiting_;
};

struct BoundPlugins {
  RunContext ctx;  // its say goes through `warnings`
  std::shared_ptr<SaidWarnings> warnings = std::make_shared<SaidWarnings>();
  Precision precision;
  std::unique_ptr<Dataset> dataset;
  std::unique_ptr<Drafter> drafter;
  std::unique_ptr<MaskGenerator> mask;
  std::vector<std::unique_ptr<AttentionKernel>> kernels;  // objects of the kernels found
  KernelChoice choice;     // the kernel selected for the drafter's problem, with every reason
  LossChoice loss_choice;  // the LM-head loss variant of [loss], with every reason
  // An online target ([target]): the model, the layers it computes for the drafter, the
  // mask of its attention (causal within each document) and its kernel choice.
  std::unique_ptr<Target> target;
  std::unique_ptr<MaskGenerator> target_mask;
  std::vector<int64_t> target_layers;
  int64_t target_calls = 0;    // attention calls of one target forward
  KernelChoice target_choice;  // (none where it makes no call: hidden states read from a cache)
  bool target_attends() const { return target && target_calls > 0; }
  TargetModel target_model;  // what the drafter was bound to
  // Served validation ([eval] served, a drafter that decodes): the kernel choices of the
  // drafter's decoder and, with a target that decodes, of the target's; their masks
  // (served_mask null: the experiment's [mask]); the decoders' batch and cache capacity.
  bool served = false, served_by_target = false;
  std::string served_off;  // why served validation is off (when it is)
  KernelChoice served_choice, served_target_choice;
  std::unique_ptr<MaskGenerator> served_mask, served_target_mask;
  int64_t served_batch = 0, served_capacity = 0;
};

// Seeds LibTorch's default generator with [run].seed, creates the output folder,
// instantiates and binds. Throws ConfigError (bad value for these data), FallbackError
// (no acceptable kernel under the policy) or std::runtime_error.
FLASHDRAFT_API BoundPlugins bind_plugins(const Setup& setup);

}  // namespace flashdraft

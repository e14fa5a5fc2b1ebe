// Instantiating the plugins of an experiment and binding them before step 0.
#include "registry/bind.hpp"

#include "distributed/distributed.hpp"
#include "eval/served.hpp"
#include "export/hf_export.hpp"

#include <flashdraft/drafter_format.hpp>
#include <flashdraft/dtype.hpp>

#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <filesystem>
#include <iostream>

namespace flashdraft {

namespace {

// The target the drafter binds to: an online one from [target] (its layers chosen by the
// drafter), or the one the dataset carries.
TargetModel open_target(const Setup& s, BoundPlugins& b) {
  const PluginUse* target = s.find(PluginKind::target);
  if (!target) {
    TargetModel model = b.dataset->target();
    if (!model.embedding.defined()) {
      const PluginUse& dataset = s.use(PluginKind::dataset);
      dataset.config.fail("plugin", "dataset '" + dataset.name +
                                        "' carries token sequences only, no target model: add a [target] table "
                                        "(e.g. plugin = \"hf\", path = \"/models/Qwen3-8B\") to compute the target's "
                                        "hidden states online");
    }
    return model;
  }
  b.target = create_as<Target>(*s.registry, *target->plugin, target->config);
  b.target->open(b.ctx);
  TargetModel model = b.target->model();
  b.target_layers = b.drafter->target_layers(model);
  for (int64_t id : b.target_layers)
    if (id < 0 || id >= model.layers)
      s.use(PluginKind::drafter)
          .config.fail("target_layer_ids", "target layer " + std::to_string(id) + " does not exist: the target (" +
                                               model.source + ") has layers 0.." + std::to_string(model.layers - 1));
  model.exported_layers = b.target_layers;
  b.target_calls = b.target->prepare(b.target_layers);
  // Its mask: causal within each document of a row (the "document" generator).
  const FoundPlugin& document = s.registry->get(PluginKind::mask, "document");
  Config config("mask", SourcePosition{"the target's attention", 0, 0});
  const Schema schema = s.registry->schema(document);
  for (const KeySpec& key : schema.keys())
    if (key.fallback) config.set(key.name, *key.fallback, std::nullopt);
  b.target_mask = create_as<MaskGenerator>(*s.registry, document, config);
  return model;
}

Precision precision_of(const Setup& s, c10::Device device, c10::ScalarType compute) {
  const Config& run = s.experiment.run();
  const Config& opt = s.experiment.optimizer();
  Precision p;
  p.compute = compute;
  p.master = run.string("master_weights") == "compute" ? compute : c10::kFloat;
  const std::string impl = opt.string("implementation");
  if (impl == "torch" && p.master != compute)
    opt.fail("implementation",
             "\"torch\" (torch::optim::AdamW) updates the weights in their own dtype, but the run "
             "computes in " +
                 dtype_name(compute) +
                 " with float32 master weights; use \"fused\" "
                 "(or \"auto\"), or [run] master_weights = \"compute\" for pure " +
                 dtype_name(compute) + " training");
  p.fused = impl == "fused" || (impl == "auto" && (device.is_cuda() || p.master != compute));
  return p;
}

// [drafter] init: a folder in the drafter's serving format (a Hugging Face folder) whose
// weights replace the initial ones, checked against the drafter just bound (Drafter::format()).
void import_initial_weights(const Setup& s, BoundPlugins& b) {
  const PluginUse& drafter = s.use(PluginKind::drafter);
  if (!s.registry->schema(*drafter.plugin).find("init") || drafter.config.string("init").empty()) return;
  const std::string& folder = drafter.config.string("init");
  const DrafterFormat* format = b.drafter->format();
  if (!format)
    drafter.config.fail("init", "the drafter plugin \"" + drafter.name + "\" has no serving format to import " +
                                    folder + " from (accepted: an empty init)");
  auto tensors = b.drafter->parameters();
  for (auto& t : b.drafter->buffers()) tensors.push_back(t);
  try {
    format->import(folder, *b.drafter, hf_export::format_input(s, b), tensors);
  } catch (const FormatError& e) {
    drafter.config.fail("init", std::string("cannot initialise the drafter from ") + folder + ": " + e.what());
  }
  b.ctx.say("drafter: initial weights from " + folder + " (" + format->name() + ")");
}

// A mask generator made by the engine (not from the experiment): its defaults and `options`.
std::unique_ptr<MaskGenerator> engine_mask(const Setup& s, const std::string& name, const std::string& purpose,
                                           const std::map<std::string, Value>& options) {
  const FoundPlugin& found = s.registry->get(PluginKind::mask, name);
  Config config("mask", SourcePosition{purpose, 0, 0});
  const Schema schema = s.registry->schema(found);
  for (const KeySpec& key : schema.keys())
    if (key.fallback) config.set(key.name, *key.fallback, std::nullopt);
  for (const auto& [key, value] : options) config.set(key, value, std::nullopt);
  return create_as<MaskGenerator>(*s.registry, found, config);
}

// Served validation: the decoders' attention problems put to the kernels, as training's are.
void bind_served(const Setup& s, BoundPlugins& b, const std::vector<KernelCandidate>& candidates,
                 const std::string& on_fallback) {
  const Config& eval = s.experiment.eval();
  const PluginUse& drafter = s.use(PluginKind::drafter);
  const int64_t K = b.drafter->max_proposals();
  if (!eval.boolean("enabled"))
    b.served_off = "validation is off ([eval] enabled = false)";
  else if (!eval.boolean("served"))
    b.served_off = "[eval] served = false";
  else if (K < 1)
    b.served_off = "the drafter '" + drafter.name + "' does not decode (it drafts no token at serving time)";
  const double temperature = eval.real("temperature");
  if (!b.served_off.empty()) {
    if (temperature > 0 && eval.boolean("enabled"))
      eval.fail("temperature", "temperature = " + std::to_string(temperature) +
                                   " applies to served validation, which is off: " + b.served_off);
    return;
  }
  b.served = true;
  b.served_batch = eval.integer("served_batch");
  b.served_capacity = served_capacity(b.dataset->seq_len(), K);
  std::vector<AttentionProblem> problems = b.drafter->decoder_problems(b.served_batch, b.served_capacity);
  const Drafter::DecoderMask mask = b.drafter->decoder_mask();
  const std::string mask_name = mask.generator.empty() ? s.use(PluginKind::mask).name : mask.generator;
  for (AttentionProblem& p : problems) p.mask = mask_name;
  if (!mask.generator.empty()) b.served_mask = engine_mask(s, mask.generator, "the drafter's decoder", mask.options);
  b.served_choice = choose_kernel(problems, candidates, on_fallback);
  b.served_by_target = b.target && b.target->decodes();
  if (b.served_by_target) {
    // One verification block per call, and prompts of up to a whole sequence (prefill).
    std::vector<AttentionProblem> tp = b.target->decoder_problems(b.served_batch, b.served_capacity, K + 1);
    for (const AttentionProblem& p :
         b.target->decoder_problems(b.served_batch, b.served_capacity, b.dataset->seq_len()))
      tp.push_back(p);
    for (AttentionProblem& p : tp) p.mask = "causal";
    b.served_target_mask = engine_mask(s, "causal", "the target's decoder",
                                       {{"bottom_right", Value(false)}, {"offset", Value(int64_t{0})}});
    b.served_target_choice = choose_kernel(tp, candidates, on_fallback);
  }
  if (temperature > 0 && !b.served_by_target)
    eval.fail("temperature", "temperature = " + std::to_string(temperature) +
                                 " samples the served responses, which needs an online target that decodes " +
                                 (b.target ? "(this target cannot decode)"
                                           : "(add a [target] table, e.g. plugin = \"hf\", path = \"/models/...\")") +
                                 "; use 0 for greedy decoding on the data's tokens");
}

}  // namespace

std::string Precision::describe() const {
  std::string s = "compute " + dtype_name(compute) + ", ";
  s += master == compute ? "weights and AdamW moments in " + dtype_name(master)
                         : "float32 master weights and AdamW moments (" + dtype_name(compute) + " copies for compute)";
  return s + (fused ? ", fused AdamW" : ", torch::optim::AdamW");
}

void SaidWarnings::say(const std::string& line) {
  std::cout << line << std::endl;
  const std::string prefix = "warning: ";
  if (line.compare(0, prefix.size(), prefix) != 0) return;
  if (to_)
    to_(line.substr(prefix.size()));
  else
    waiting_.push_back(line.substr(prefix.size()));
}

void SaidWarnings::sink(std::function<void(const std::string&)> to) {
  to_ = std::move(to);
  for (const std::string& w : waiting_) to_(w);
  waiting_.clear();
}

BoundPlugins bind_plugins(const Setup& s) {
  const Config& run = s.experiment.run();
  const uint64_t seed = static_cast<uint64_t>(run.integer("seed"));
  // One process per GPU: the launch's local rank picks it (0 for a single process).
  const c10::Device device = run.string("device") == "cuda"
                                 ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(read_launch().local_rank))
                                 : c10::Device(c10::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available())
    run.fail("device", "\"cuda\" was asked for, but no CUDA device is available to LibTorch here (use \"cpu\")");
  std::filesystem::create_directories(run.string("out"));

  torch::manual_seed(seed);
  BoundPlugins b;
  b.ctx.out_dir = run.string("out");
  b.ctx.device = device;
  b.ctx.dtype = dtype_named(run.string("dtype"), device);
  b.precision = precision_of(s, device, b.ctx.dtype);
  b.ctx.seed = seed;
  b.ctx.say = [warnings = b.warnings](const std::string& line) { warnings->say(line); };

  const PluginUse& dataset = s.use(PluginKind::dataset);
  const PluginUse& drafter = s.use(PluginKind::drafter);
  const PluginUse& mask = s.use(PluginKind::mask);
  b.dataset = create_as<Dataset>(*s.registry, *dataset.plugin, dataset.config);
  b.drafter = create_as<Drafter>(*s.registry, *drafter.plugin, drafter.config);
  b.mask = create_as<MaskGenerator>(*s.registry, *mask.plugin, mask.config);
  std::vector<KernelCandidate> candidates;
  for (const PluginUse& k : s.kernels) {
    KernelCandidate c;
    c.name = k.name;
    if (k.plugin) {
      b.kernels.push_back(create_as<AttentionKernel>(*s.registry, *k.plugin, k.config));
      c.kernel = b.kernels.back().get();
    } else {
      c.support = Support::no(kernel_not_found(*s.registry, k.name));
    }
    candidates.push_back(std::move(c));
  }

  b.dataset->open(b.ctx);
  Dataset* data = b.dataset.get();
  b.ctx.train_batch = [data](int64_t index) { return data->train_batch(index); };
  b.target_model = open_target(s, b);
  b.drafter->bind(b.target_model, b.ctx, b.dataset->batch_size(), b.dataset->seq_len());
  import_initial_weights(s, b);
  std::vector<AttentionProblem> problems = b.drafter->attention_problems();
  if (static_cast<int64_t>(problems.size()) != b.drafter->attention_layers())
    throw std::runtime_error("drafter '" + drafter.name + "' declares " +
                             std::to_string(b.drafter->attention_layers()) + " attention calls per step but " +
                             std::to_string(problems.size()) +
                             " attention problems (Drafter::attention_problems() needs one per call)");
  // A drafter poses its attention for the mask generator it builds MaskInput for (the problem's
  // mask; empty: any generator). The experiment's [mask] must be that one.
  for (AttentionProblem& p : problems) {
    if (!p.mask.empty() && p.mask != mask.plugin->name)
      mask.config.fail("plugin", "\"" + mask.plugin->name + "\" cannot mask the attention of the drafter '" +
                                     drafter.name + "', which poses it for the mask generator \"" + p.mask +
                                     "\" (accepted: plugin = \"" + p.mask + "\")");
    p.mask = mask.plugin->name;
  }
  const std::string& on_fallback = s.experiment.attention().string("on_fallback");
  if (b.target_attends()) {
    // The target's attention: forward only, the same kernel preferences and policy.
    std::vector<KernelCandidate> target_candidates = candidates;
    std::vector<AttentionProblem> tp = b.target->attention_problems(b.dataset->batch_size(), b.dataset->seq_len());
    for (AttentionProblem& p : tp) p.mask = "document";
    b.target_choice = choose_kernel(tp, std::move(target_candidates), on_fallback);
  }
  bind_served(s, b, candidates, on_fallback);
  b.choice = choose_kernel(problems, std::move(candidates), on_fallback);
  const Config& loss = s.experiment.loss();
  try {
    b.loss_choice = choose_loss(loss.strings("kernels"), loss.integer("chunk_rows"),
                                {b.ctx.device, b.ctx.dtype, b.target_model.vocab}, loss.string("on_fallback"));
  } catch (const std::invalid_argument& e) {
    loss.fail("kernels", e.what());  // with the file, line and column of the key
  }
  return b;
}

}  // namespace flashdraft

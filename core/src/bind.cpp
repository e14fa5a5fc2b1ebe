// Instantiating the plugins of an experiment and binding them before step 0.
#include "bind.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>

namespace flashdraft {

namespace {

c10::ScalarType dtype_of(const std::string& s) {
  if (s == "bfloat16") return torch::kBFloat16;
  if (s == "float16") return torch::kHalf;
  return torch::kFloat;
}

}  // namespace

BoundPlugins bind_plugins(const Setup& s) {
  const Config& run = s.experiment.run();
  const uint64_t seed = static_cast<uint64_t>(run.integer("seed"));
  const c10::Device device = run.string("device") == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available())
    run.fail("device", "\"cuda\" was asked for, but no CUDA device is available to LibTorch here (use \"cpu\")");
  std::filesystem::create_directories(run.string("out"));

  torch::manual_seed(seed);
  BoundPlugins b;
  b.ctx.out_dir = run.string("out");
  b.ctx.device = device;
  b.ctx.dtype = dtype_of(run.string("dtype"));
  b.ctx.seed = seed;
  b.ctx.say = [](const std::string& line) { std::cout << line << std::endl; };

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
  const TargetModel target = b.dataset->target();
  b.drafter->bind(target, b.ctx, b.dataset->batch_size(), b.dataset->seq_len());
  AttentionProblem problem = b.drafter->attention_problem();
  problem.mask = mask.plugin->name;
  b.choice = choose_kernel(problem, std::move(candidates), s.experiment.attention().string("on_fallback"));
  return b;
}

}  // namespace flashdraft

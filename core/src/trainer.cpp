// The training loop: every part is a plugin; the engine owns the schedule, the
// optimizer, memory accounting, the kernel ledger and the run log.
#include "trainer.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>

#include "dispatch.hpp"
#include "experiment.hpp"
#include "ledger.hpp"
#include "memory.hpp"
#include "registry.hpp"
#include "run_log.hpp"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#ifdef FLASHDRAFT_ENGINE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace fs = std::filesystem;

namespace flashdraft {

namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < (int64_t(10) << 20) ? 2 : 1) << double(bytes) / (1 << 20) << " MiB";
  return os.str();
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "cpu";
}

std::string device_name(c10::Device device) {
#ifdef FLASHDRAFT_ENGINE_CUDA
  if (device.is_cuda()) return at::cuda::getCurrentDeviceProperties()->name;
#endif
  return cpu_name();
}

c10::ScalarType dtype_of(const std::string& s) {
  if (s == "bfloat16") return torch::kBFloat16;
  if (s == "float16") return torch::kHalf;
  return torch::kFloat;
}

// Everything an experiment is made of, loaded and checked.
struct Setup {
  Experiment experiment;
  std::unique_ptr<Registry> registry;
  const FoundPlugin* drafter_plugin = nullptr;
  const FoundPlugin* dataset_plugin = nullptr;
  const FoundPlugin* mask_plugin = nullptr;
  Config drafter_config, dataset_config, mask_config;
  std::vector<std::pair<std::string, const FoundPlugin*>> kernels;  // null: not found
  std::vector<Config> kernel_configs;
  std::vector<std::string> missing_kernels;  // reasons
};

Setup load_setup(const RunOptions& options) {
  Setup s{Experiment::load(options.experiment), nullptr, nullptr, nullptr, nullptr, {}, {}, {}, {}, {}, {}};
  if (!options.out.empty()) s.experiment.override_string("run", "out", options.out);
  if (options.steps > 0) s.experiment.override_integer("run", "steps", options.steps);
  s.registry = std::make_unique<Registry>(Registry::search_path(
      options.plugin_paths, s.experiment.plugins().strings("paths"), options.experiment));
  auto pick = [&](PluginKind kind, const PluginChoice& choice) -> const FoundPlugin& {
    try {
      return s.registry->get(kind, choice.plugin);
    } catch (const std::runtime_error& e) {
      throw ConfigError(choice.where.str() + ": [" + choice.section + "] plugin: " + e.what());
    }
  };
  s.drafter_plugin = &pick(PluginKind::drafter, s.experiment.drafter());
  s.dataset_plugin = &pick(PluginKind::dataset, s.experiment.dataset());
  s.mask_plugin = &pick(PluginKind::mask, s.experiment.mask());
  s.drafter_config = s.experiment.plugin_config("drafter", s.registry->schema(*s.drafter_plugin));
  s.dataset_config = s.experiment.plugin_config("dataset", s.registry->schema(*s.dataset_plugin));
  s.mask_config = s.experiment.plugin_config("mask", s.registry->schema(*s.mask_plugin));
  for (const auto& name : s.experiment.attention().strings("kernels")) {
    const FoundPlugin* found = nullptr;
    for (const auto* k : s.registry->of_kind(PluginKind::kernel))
      if (k->name == name) found = k;
    s.kernels.emplace_back(name, found);
    if (found)
      s.kernel_configs.push_back(s.experiment.kernel_config(name, s.registry->schema(*found)));
    else
      s.kernel_configs.emplace_back();
  }
  return s;
}

std::string kernel_not_found(const Setup& s, const std::string& name) {
  std::string names;
  for (const auto* k : s.registry->of_kind(PluginKind::kernel)) names += (names.empty() ? "" : ", ") + k->name;
  return "no kernel plugin named '" + name + "' was found (kernels found: [" + names + "])";
}

struct Schedule {
  double lr, min_ratio;
  int64_t warmup, steps;
  double at(int64_t step) const {
    if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
    const int64_t span = std::max<int64_t>(1, steps - warmup);
    const double t = std::min(1.0, double(step - warmup) / double(span));
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * t)));
  }
};

std::string unique_log_path(const fs::path& dir, const std::string& name) {
  fs::path p = dir / (name + ".h5");
  for (int i = 1; fs::exists(p); ++i) p = dir / (name + "-" + std::to_string(i) + ".h5");
  return p.string();
}

}  // namespace

int validate_experiment(const RunOptions& options) {
  try {
    Setup s = load_setup(options);
    std::cout << options.experiment << ": valid\n";
    std::cout << "  drafter : " << s.drafter_plugin->name << " (" << s.drafter_plugin->path << ")\n";
    std::cout << "  dataset : " << s.dataset_plugin->name << " (" << s.dataset_plugin->path << ")\n";
    std::cout << "  mask    : " << s.mask_plugin->name << " (" << s.mask_plugin->path << ")\n";
    for (const auto& [name, p] : s.kernels)
      std::cout << "  kernel  : " << name << " " << (p ? "(" + p->path + ")" : "NOT FOUND: " + kernel_not_found(s, name))
                << "\n";
    std::cout << "  run     : " << s.experiment.run().integer("steps") << " steps on " << s.experiment.run().string("device")
              << " (" << s.experiment.run().string("dtype") << "), on_fallback = "
              << s.experiment.attention().string("on_fallback") << "\n";
    std::cout << "(kernel support is checked against the real problem when `flashdraft run` starts)\n";
    return 0;
  } catch (const ConfigError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}

int run_experiment(const RunOptions& options) {
  MemoryTracker::install();
  std::unique_ptr<RunLog> log;
  std::vector<std::pair<int64_t, std::pair<std::string, std::string>>> pending_events;
  int64_t current_step = -1;
  auto event = [&](const std::string& kind, const std::string& message) {
    if (log && log->has("events/step")) {
      log->append("events/step", current_step);
      log->append("events/kind", kind);
      log->append("events/message", message);
      log->flush();
    } else {
      pending_events.push_back({current_step, {kind, message}});
    }
  };

  Setup s;
  try {
    s = load_setup(options);
  } catch (const ConfigError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  const Experiment& ex = s.experiment;
  const Config& run = ex.run();
  const int64_t steps = run.integer("steps");
  const uint64_t seed = static_cast<uint64_t>(run.integer("seed"));
  if (run.integer("threads") > 0) at::set_num_threads(static_cast<int>(run.integer("threads")));

  int exit_code = 0;
  try {
    const c10::Device device = run.string("device") == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    if (device.is_cuda() && !torch::cuda::is_available())
      run.fail("device", "\"cuda\" was asked for, but no CUDA device is available to LibTorch here (use \"cpu\")");
    const fs::path out_dir(run.string("out"));
    fs::create_directories(out_dir);

    torch::manual_seed(seed);
    RunContext ctx;
    ctx.out_dir = out_dir.string();
    ctx.device = device;
    ctx.dtype = dtype_of(run.string("dtype"));
    ctx.seed = seed;
    ctx.say = [](const std::string& line) { std::cout << line << std::endl; };

    auto dataset = create_as<Dataset>(*s.registry, *s.dataset_plugin, s.dataset_config);
    auto drafter = create_as<Drafter>(*s.registry, *s.drafter_plugin, s.drafter_config);
    auto mask = create_as<MaskGenerator>(*s.registry, *s.mask_plugin, s.mask_config);
    std::vector<std::unique_ptr<AttentionKernel>> kernel_objects;
    std::vector<KernelCandidate> candidates;
    for (size_t i = 0; i < s.kernels.size(); ++i) {
      KernelCandidate c;
      c.name = s.kernels[i].first;
      if (s.kernels[i].second) {
        kernel_objects.push_back(create_as<AttentionKernel>(*s.registry, *s.kernels[i].second, s.kernel_configs[i]));
        c.kernel = kernel_objects.back().get();
      } else {
        c.support = Support::no(kernel_not_found(s, c.name));
      }
      candidates.push_back(std::move(c));
    }

    dataset->open(ctx);
    const TargetModel target = dataset->target();
    drafter->bind(target, ctx, dataset->batch_size(), dataset->seq_len());
    AttentionProblem problem = drafter->attention_problem();
    problem.mask = s.mask_plugin->name;
    KernelChoice choice = choose_kernel(problem, std::move(candidates), ex.attention().string("on_fallback"));
    std::cout << choice.report();
    if (choice.fallback)
      event("fallback", "kernel '" + choice.candidates[0].name + "' refused the problem (" +
                            choice.candidates[0].support.reason + "); running on '" +
                            choice.candidates[choice.selected].name + "' ([attention].on_fallback = \"warn\")");

    KernelLedger ledger;
    AttentionDispatcher dispatcher(std::move(choice), mask.get(), ex.attention().string("on_fallback"), &ledger,
                                   [&](const std::string& k, const std::string& m) { event(k, m); });

    // --- the log --------------------------------------------------------------------
    const std::string log_path = unique_log_path(out_dir, run.string("name"));
    std::map<std::string, std::string> attrs;
    attrs["experiment"] = ex.text();
    attrs["experiment_path"] = fs::absolute(ex.path()).string();
    attrs["flashdraft_version"] = FLASHDRAFT_VERSION;
    attrs["git_revision"] = FLASHDRAFT_GIT_REVISION;
    attrs["torch_version"] = FLASHDRAFT_TORCH_VERSION;
    attrs["torch_cuda"] = FLASHDRAFT_WITH_CUDA ? "yes" : "no";
    attrs["device"] = device.str();
    attrs["device_name"] = device_name(device);
    attrs["start_time"] = now_iso();
    attrs["dtype"] = run.string("dtype");
    attrs["data_source"] = dataset->source();
    std::string plugins;
    auto plugin_line = [&](const char* role, const FoundPlugin& p) {
      attrs[std::string("plugin.") + role] = p.name + " " + p.version + " " + p.path;
      plugins += std::string(role) + " " + p.name + " " + p.version + " " + p.path + "\n";
    };
    plugin_line("drafter", *s.drafter_plugin);
    plugin_line("dataset", *s.dataset_plugin);
    plugin_line("mask", *s.mask_plugin);
    for (const auto& [name, p] : s.kernels)
      if (p) plugin_line("kernel", *p);
    attrs["plugins"] = plugins;
    log = std::make_unique<RunLog>(log_path, attrs);
    const int64_t layers = drafter->attention_layers();
    const int64_t positions = drafter->positions();
    const std::vector<std::string> scalar_names = drafter->scalar_names();
    log->declare("steps/step", RunLog::Type::i64, 0, 0, "optimizer step (0-based)");
    log->declare("steps/loss", RunLog::Type::f64, 0, 0, "training loss");
    log->declare("steps/lr", RunLog::Type::f64, 0, 0, "learning rate used at this step");
    log->declare("steps/grad_norm", RunLog::Type::f64, 0, 0, "global gradient norm before clipping");
    log->declare("steps/step_time_s", RunLog::Type::f64, 0, 0, "wall time of the step, seconds");
    log->declare("steps/tokens_per_s", RunLog::Type::f64, 0, 0, "loss-carrying tokens per second");
    log->declare("steps/position_accuracy", RunLog::Type::f64, positions, 0, "accuracy per block position 1..BS-1");
    for (const auto& n : scalar_names) log->declare("steps/" + n, RunLog::Type::f64, 0, 0, "drafter metric");
    log->declare("memory/forward", RunLog::Type::i64, 0, 0, "peak bytes during the forward pass");
    log->declare("memory/backward", RunLog::Type::i64, 0, 0, "peak bytes during the backward pass");
    log->declare("memory/optimizer", RunLog::Type::i64, 0, 0, "peak bytes during clipping and the optimizer step");
    log->declare("memory/step", RunLog::Type::i64, 0, 0, "peak bytes over the whole step");
    log->declare("kernels/forward", RunLog::Type::i32, layers, 0, "variant id per layer (forward); -1 = no call");
    log->declare("kernels/backward", RunLog::Type::i32, layers, 0, "variant id per layer (backward); -1 = no call");
    log->declare("kernels/names", RunLog::Type::str, 0, 256, "variant names; ids index this list");
    log->declare("events/step", RunLog::Type::i64, 0, 0, "step of the event (-1: before step 0)");
    log->declare("events/kind", RunLog::Type::str, 0, 32, "fallback, nan, oom, error, interrupted, finished, ...");
    log->declare("events/message", RunLog::Type::str, 0, 2048, "what happened");
    log->set_group_attribute("memory", "device", device.str());
    log->set_group_attribute("memory", "method", device.is_cpu() ? "tracking CPU allocator (live tensor bytes)"
                                                                 : "CUDA caching allocator statistics (allocated bytes)");
    log->set_group_attribute("kernels", "selected", dispatcher.kernel_name());
    log->set_group_attribute("kernels", "problem", dispatcher.choice().problem.str());
    log->set_group_attribute("kernels", "selection", dispatcher.choice().report());
    log->set_group_attribute("kernels", "on_fallback", ex.attention().string("on_fallback"));
    log->start();
    for (const auto& [st, ev] : pending_events) {
      log->append("events/step", st);
      log->append("events/kind", ev.first);
      log->append("events/message", ev.second);
    }
    log->flush();
    std::cout << "log: " << log_path << std::endl;

    // --- optimizer --------------------------------------------------------------------
    std::vector<at::Tensor> params;
    for (auto& [name, p] : drafter->parameters()) params.push_back(p);
    const Config& oc = ex.optimizer();
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(oc.real("lr"))
                                              .betas({oc.real("beta1"), oc.real("beta2")})
                                              .eps(oc.real("eps"))
                                              .weight_decay(oc.real("weight_decay")));
    const Schedule schedule{oc.real("lr"), oc.real("min_lr_ratio"), oc.integer("warmup_steps"), steps};
    const double clip = oc.real("grad_clip");
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(seed + 0x5eed);

    g_signal = 0;
    auto old_int = std::signal(SIGINT, on_signal);
    auto old_term = std::signal(SIGTERM, on_signal);
    int64_t names_written = 0;
    const int64_t print_every = run.integer("print_every");
    std::cout << "training: " << steps << " steps, " << params.size() << " parameter tensors ("
              << [&] { int64_t n = 0; for (auto& p : params) n += p.numel(); return n; }() << " values)" << std::endl;

    for (int64_t step = 0; step < steps; ++step) {
      current_step = step;
      if (g_signal) {
        event("interrupted", "signal " + std::to_string(g_signal.load()) + " received; stopped before step " +
                                 std::to_string(step));
        std::cout << "interrupted before step " << step << "; the log keeps steps 0.." << step - 1 << std::endl;
        exit_code = 130;
        break;
      }
      const auto t0 = std::chrono::steady_clock::now();
      const double lr = schedule.at(step);
      for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      ledger.begin_step(step, layers);
      Batch batch = dataset->train_batch(step);

      MemoryTracker::reset_peak(device);
      StepResult result = drafter->step(batch, dispatcher, rng, /*training=*/true);
      const int64_t peak_forward = MemoryTracker::peak_bytes(device);
      const double loss = result.loss.item<double>();
      if (!std::isfinite(loss)) {
        event("nan", "loss is " + std::to_string(loss) + " at step " + std::to_string(step));
        throw std::runtime_error("loss is not finite (" + std::to_string(loss) + ") at step " + std::to_string(step) +
                                 "; the run stops (the log keeps every step before it)");
      }

      MemoryTracker::reset_peak(device);
      result.loss.backward();
      const int64_t peak_backward = MemoryTracker::peak_bytes(device);
      result.loss = at::Tensor();

      MemoryTracker::reset_peak(device);
      const double grad_norm =
          torch::nn::utils::clip_grad_norm_(params, clip > 0 ? clip : std::numeric_limits<double>::infinity());
      optimizer.step();
      optimizer.zero_grad(/*set_to_none=*/true);
      const int64_t peak_optimizer = MemoryTracker::peak_bytes(device);
      if (device.is_cuda()) torch::cuda::synchronize();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

      // --- record the step ------------------------------------------------------------
      for (; names_written < static_cast<int64_t>(ledger.names().size()); ++names_written)
        log->append("kernels/names", ledger.names()[static_cast<size_t>(names_written)]);
      log->append("kernels/forward", ledger.ids(Phase::forward));
      log->append("kernels/backward", ledger.ids(Phase::backward));
      log->append("steps/step", step);
      log->append("steps/loss", loss);
      log->append("steps/lr", lr);
      log->append("steps/grad_norm", grad_norm);
      log->append("steps/step_time_s", seconds);
      log->append("steps/tokens_per_s", seconds > 0 ? double(result.tokens) / seconds : 0.0);
      std::vector<double> acc = result.position_accuracy;
      acc.resize(static_cast<size_t>(positions), std::nan(""));
      log->append("steps/position_accuracy", acc);
      std::map<std::string, double> scalars(result.scalars.begin(), result.scalars.end());
      for (const auto& n : scalar_names) log->append("steps/" + n, scalars.count(n) ? scalars[n] : std::nan(""));
      log->append("memory/forward", peak_forward);
      log->append("memory/backward", peak_backward);
      log->append("memory/optimizer", peak_optimizer);
      log->append("memory/step", std::max({peak_forward, peak_backward, peak_optimizer}));
      log->flush();

      if (step % print_every == 0 || step + 1 == steps) {
        std::ostringstream os;
        os << "step " << std::setw(5) << step + 1 << "/" << steps << "  loss " << std::fixed << std::setprecision(4)
           << loss;
        for (const auto& n : scalar_names) os << "  " << n << " " << std::setprecision(3) << scalars[n];
        os << "  lr " << std::scientific << std::setprecision(2) << lr << std::fixed << "  |g| " << std::setprecision(3)
           << grad_norm << "  " << std::setprecision(3) << seconds << " s"
           << "  peak fwd " << mib(peak_forward) << " bwd " << mib(peak_backward) << "  kernels fwd "
           << ledger.summary(Phase::forward) << " bwd " << ledger.summary(Phase::backward);
        std::cout << os.str() << std::endl;
      }
    }
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
    if (exit_code == 0) {
      current_step = steps;
      event("finished", "completed " + std::to_string(steps) + " steps");
      std::cout << "done: " << steps << " steps; log: " << log_path << std::endl;
    }
  } catch (const ConfigError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    if (log) event("error", e.what());
    return 2;
  } catch (const FallbackError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    if (log) event("fallback_error", e.what());
    if (log) std::cerr << "log (every finished step kept): " << log->path() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::string what = e.what();
    const bool oom = what.find("out of memory") != std::string::npos;
    std::cerr << "error" << (current_step >= 0 ? " at step " + std::to_string(current_step) : std::string()) << ": "
              << what << std::endl;
    if (log) {
      event(oom ? "oom" : "error", what.substr(0, 2000));
      std::cerr << "log (every finished step kept): " << log->path() << std::endl;
    }
    return 1;
  }
  return exit_code;
}

}  // namespace flashdraft

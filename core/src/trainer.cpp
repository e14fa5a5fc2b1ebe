// The training loop: every part is a plugin; the engine owns the schedule, the
// optimizer, memory accounting, the kernel ledger and the run log.
#include "trainer.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/mask_generator.hpp>
#include <flashdraft/model.hpp>

#include "checkpoint.hpp"
#include "dispatch.hpp"
#include "experiment.hpp"
#include "ledger.hpp"
#include "memory.hpp"
#include "registry.hpp"
#include "run_log.hpp"

#include <ATen/CPUGeneratorImpl.h>
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
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace fs = std::filesystem;

namespace flashdraft {

namespace detail {
const char* git_revision();  // generated at build time (cmake/FlashdraftRevision.cmake)
}  // namespace detail

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

// The plugin's table as TOML with every declared key resolved (defaults filled in): what
// a checkpoint and the weights export record of the drafter.
std::string table_toml(const std::string& table, const std::string& plugin, const Schema& schema, const Config& c) {
  std::ostringstream os;
  os << "[" << table << "]\nplugin = \"" << plugin << "\"\n";
  for (const auto& k : schema.keys()) {
    Value v;
    switch (k.type) {
      case ValueType::integer: v = c.integer(k.name); break;
      case ValueType::real: v = c.real(k.name); break;
      case ValueType::boolean: v = c.boolean(k.name); break;
      case ValueType::string: v = c.string(k.name); break;
      case ValueType::integer_list: v = c.integers(k.name); break;
      case ValueType::real_list: v = c.reals(k.name); break;
      case ValueType::string_list: v = c.strings(k.name); break;
    }
    os << k.name << " = " << to_string(v) << "\n";
  }
  return os.str();
}

// tau_sim = 1 + sum_k prod_{j<=k} acc_j: the acceptance length if block positions were
// accepted independently with their marginal accuracies.
double simulated_tau(const std::vector<double>& acc) {
  double tau = 1.0, run = 1.0;
  for (double a : acc) {
    run *= a;
    tau += run;
  }
  return tau;
}

std::string unique_log_path(const fs::path& dir, const std::string& name) {
  fs::path p = dir / (name + ".h5");
  for (int i = 1; fs::exists(p); ++i) p = dir / (name + "-" + std::to_string(i) + ".h5");
  return p.string();
}

}  // namespace

Acceptance greedy_acceptance(const int64_t* predictions, const int64_t* labels, const uint8_t* block_valid,
                             int64_t blocks, int64_t block_size) {
  Acceptance out;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t* pred = predictions + b * block_size;
    const int64_t* lab = labels + b * block_size;
    if ((block_valid && !block_valid[b]) || block_size < 2 || lab[1] < 0) continue;
    int64_t accepted = 0;
    for (int64_t j = 1; j < block_size && lab[j] >= 0 && pred[j] == lab[j]; ++j) ++accepted;
    ++out.blocks;
    out.accepted += accepted;
  }
  return out;
}

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

    // --- resume: which checkpoint --------------------------------------------------------
    const Config& ckpt_cfg = ex.checkpoint();
    const Config& eval_cfg = ex.eval();
    fs::path checkpoint_root = out_dir / "checkpoints";
    fs::path resume_dir;
    checkpoint::Manifest resume_manifest;
    std::vector<std::string> resume_kernel_names;
    if (!options.resume.empty()) {
      if (options.resume == "latest") {
        resume_dir = checkpoint::latest(checkpoint_root, drafter->parameters(), ctx.say);
      } else {
        resume_dir = options.resume;
        const std::string why = checkpoint::check(resume_dir, drafter->parameters());
        if (!why.empty()) throw checkpoint::Error("cannot resume: " + why);
      }
      resume_manifest = checkpoint::read_manifest(resume_dir);
      // The run continues in the folder of the checkpoint it resumes.
      checkpoint_root = fs::absolute(resume_dir).parent_path();
    }

    // --- the log --------------------------------------------------------------------
    // A resumed run appends to the log of the run it continues: <run folder>/<log_file>,
    // the run folder being the one that holds checkpoints/step_<n>.
    const std::string log_path =
        resume_dir.empty() ? unique_log_path(out_dir, run.string("name"))
                           : (fs::absolute(resume_dir).parent_path().parent_path() / resume_manifest.log_file).string();
    std::map<std::string, std::string> attrs;
    attrs["experiment"] = ex.text();
    attrs["experiment_path"] = fs::absolute(ex.path()).string();
    attrs["flashdraft_version"] = FLASHDRAFT_VERSION;
    attrs["git_revision"] = detail::git_revision();
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
    if (resume_dir.empty()) {
      log = std::make_unique<RunLog>(log_path, attrs);
    } else {
      if (!fs::exists(log_path))
        throw checkpoint::Error("cannot resume from " + resume_dir.string() + ": its run log " + log_path +
                                " does not exist (the log is appended to; it must stay next to checkpoints/)");
      {
        LogReader reader(log_path);
        if (reader.exists("kernels/names")) resume_kernel_names = reader.strings("kernels/names");
      }
      log = RunLog::reopen(log_path);
    }
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
    log->declare("eval/step", RunLog::Type::i64, 0, 0, "optimizer steps completed when the validation ran");
    log->declare("eval/loss", RunLog::Type::f64, 0, 0, "mean loss over the held-out batches");
    log->declare("eval/tau", RunLog::Type::f64, 0, 0,
                 "exact greedy acceptance length: 1 + mean leading matches of the block proposals with the "
                 "target's greedy continuation (NaN if the drafter returns no predictions)");
    log->declare("eval/tau_sim", RunLog::Type::f64, 0, 0, "1 + sum_k prod_{j<=k} acc_j from eval/position_accuracy");
    log->declare("eval/blocks", RunLog::Type::i64, 0, 0, "blocks (anchors) the acceptance length averages over");
    log->declare("eval/position_accuracy", RunLog::Type::f64, positions, 0, "held-out accuracy per block position 1..BS-1");
    log->set_group_attribute("memory", "device", device.str());
    log->set_group_attribute("memory", "method", device.is_cpu() ? "tracking CPU allocator (live tensor bytes)"
                                                                 : "CUDA caching allocator statistics (allocated bytes)");
    log->set_group_attribute("kernels", "selected", dispatcher.kernel_name());
    log->set_group_attribute("kernels", "problem", dispatcher.choice().problem.str());
    log->set_group_attribute("kernels", "selection", dispatcher.choice().report());
    log->set_group_attribute("kernels", "on_fallback", ex.attention().string("on_fallback"));
    if (!resume_dir.empty()) {
      // Cut every dataset back to its rows at the checkpoint, so the resumed steps follow
      // the checkpoint's exactly. /events is history and is kept whole.
      for (const auto& name : log->names())
        if (name.rfind("events/", 0) != 0) {
          const auto it = resume_manifest.log_rows.find(name);
          log->truncate(name, it == resume_manifest.log_rows.end() ? 0 : it->second);
        }
      const auto it = resume_manifest.log_rows.find("kernels/names");
      resume_kernel_names.resize(std::min(resume_kernel_names.size(),
                                          static_cast<size_t>(it == resume_manifest.log_rows.end() ? 0 : it->second)));
    }
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
    at::Generator default_rng = at::detail::getDefaultCPUGenerator();  // shares the default generator
    const std::string drafter_toml =
        table_toml("drafter", s.drafter_plugin->name, s.registry->schema(*s.drafter_plugin), s.drafter_config);

    // --- resume: load the state ------------------------------------------------------------
    int64_t first_step = 0;
    int64_t names_written = 0;
    if (!resume_dir.empty()) {
      checkpoint::State state{drafter->parameters(), &optimizer, {}, {}, {}};
      const checkpoint::Manifest m = checkpoint::load(resume_dir, state);
      rng.set_state(state.anchor_rng);
      {
        std::lock_guard<std::mutex> lock(default_rng.mutex());
        default_rng.set_state(state.cpu_default_rng);
      }
#ifdef FLASHDRAFT_ENGINE_CUDA
      if (device.is_cuda() && state.cuda_default_rng.defined()) {
        at::Generator cuda_rng = at::cuda::detail::getDefaultCUDAGenerator(device.index());
        std::lock_guard<std::mutex> lock(cuda_rng.mutex());
        cuda_rng.set_state(state.cuda_default_rng);
      }
#endif
      first_step = m.step;
      // The ledger hands out variant ids in order of first sight; the log's names list
      // must keep meaning the same ids.
      for (const auto& n : resume_kernel_names) ledger.id(n);
      names_written = static_cast<int64_t>(resume_kernel_names.size());
      // Checkpoints past this one belong to the abandoned continuation: set aside (renamed
      // abandoned_step_<n>), not deleted, so that `latest` and `keep` never pick them.
      for (const auto& dir : checkpoint::list(checkpoint_root)) {
        if (fs::equivalent(dir, resume_dir)) continue;
        const int64_t other = std::stoll(dir.filename().string().substr(5));  // list() only returns step_<digits>
        if (other > m.step) {
          const fs::path aside = checkpoint_root / ("abandoned_" + dir.filename().string());
          checkpoint::remove_tree(aside);
          fs::rename(dir, aside);
          std::cout << "resume: " << dir.string() << " is past the resumed step; moved to " << aside.string() << std::endl;
        }
      }
      const std::string msg = "resumed from " + resume_dir.string() + " at step " + std::to_string(m.step) +
                              " (data position " + std::to_string(m.data_position) + "); log cut back to " +
                              std::to_string(m.step) + " steps";
      current_step = m.step;
      event("resume", msg);
      std::cout << "resume: " << msg << std::endl;
    }

    // --- validation and checkpoints ------------------------------------------------------
    const bool eval_on = eval_cfg.boolean("enabled");
    const int64_t eval_every = eval_cfg.integer("every");
    const bool ckpt_on = ckpt_cfg.boolean("enabled");
    const int64_t ckpt_every = ckpt_cfg.integer("every");
    int64_t last_checkpoint = first_step;
    // Validation: the held-out batches with anchors from a generator of its own, seeded
    // the same way every time (every validation sees the same blocks; training's
    // generators are not touched, so enabling validation does not change training).
    auto validate = [&](int64_t done) {
      const int64_t available = dataset->eval_batches();
      const int64_t n = eval_cfg.integer("batches") > 0 ? std::min(eval_cfg.integer("batches"), available) : available;
      if (n == 0) {
        std::cout << "eval: the dataset has no held-out batch; nothing to validate" << std::endl;
        return;
      }
      at::Generator eval_rng = at::make_generator<at::CPUGeneratorImpl>(seed * 0x9E3779B97F4A7C15ULL + 0xe7a1);
      double loss_sum = 0.0;
      std::vector<int64_t> correct(static_cast<size_t>(positions), 0), count(static_cast<size_t>(positions), 0);
      std::vector<double> acc_sum(static_cast<size_t>(positions), 0.0);
      Acceptance total;
      bool exact = true;
      for (int64_t i = 0; i < n; ++i) {
        Batch batch = dataset->eval_batch(i);
        ledger.begin_step(done, layers);
        StepResult r = drafter->step(batch, dispatcher, eval_rng, /*training=*/false);
        loss_sum += r.loss.item<double>();
        for (size_t j = 0; j < acc_sum.size() && j < r.position_accuracy.size(); ++j) acc_sum[j] += r.position_accuracy[j];
        if (!r.predictions.defined() || !r.labels.defined()) {
          exact = false;
          continue;
        }
        const at::Tensor pred = r.predictions.to(at::kCPU, at::kLong).contiguous();
        const at::Tensor lab = r.labels.to(at::kCPU, at::kLong).contiguous();
        const int64_t bs = pred.size(-1), blocks = pred.numel() / bs;
        const at::Tensor valid = r.block_valid.defined() ? r.block_valid.to(at::kCPU, at::kByte).contiguous().view({-1})
                                                         : at::ones({blocks}, at::kByte);
        const Acceptance a = greedy_acceptance(pred.data_ptr<int64_t>(), lab.data_ptr<int64_t>(),
                                               valid.data_ptr<uint8_t>(), blocks, bs);
        total.blocks += a.blocks;
        total.accepted += a.accepted;
        // Per-position accuracy pooled over every block (not a mean of batch ratios).
        const int64_t* p = pred.data_ptr<int64_t>();
        const int64_t* l = lab.data_ptr<int64_t>();
        const uint8_t* v = valid.data_ptr<uint8_t>();
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t j = 1; j < bs && j - 1 < positions; ++j)
            if (v[b] && l[b * bs + j] >= 0) {
              ++count[static_cast<size_t>(j - 1)];
              correct[static_cast<size_t>(j - 1)] += p[b * bs + j] == l[b * bs + j];
            }
      }
      std::vector<double> acc(static_cast<size_t>(positions));
      for (size_t j = 0; j < acc.size(); ++j)
        acc[j] = exact ? (count[j] > 0 ? double(correct[j]) / double(count[j]) : 0.0) : acc_sum[j] / double(n);
      const double loss = loss_sum / double(n);
      const double tau = exact && total.blocks > 0 ? 1.0 + double(total.accepted) / double(total.blocks) : std::nan("");
      const double tau_sim = simulated_tau(acc);
      log->append("eval/step", done);
      log->append("eval/loss", loss);
      log->append("eval/tau", tau);
      log->append("eval/tau_sim", tau_sim);
      log->append("eval/blocks", total.blocks);
      log->append("eval/position_accuracy", acc);
      log->flush();
      std::ostringstream os;
      os << "eval  after step " << done << ": loss " << std::fixed << std::setprecision(4) << loss << "  tau "
         << std::setprecision(3) << tau << " (exact greedy, " << total.blocks << " blocks)  tau_sim " << tau_sim
         << "  acc[1..]";
      for (size_t j = 0; j < acc.size() && j < 6; ++j) os << " " << std::setprecision(2) << acc[j];
      if (acc.size() > 6) os << " ...";
      std::cout << os.str() << std::endl;
    };
    auto save_checkpoint = [&](int64_t done) {
      checkpoint::Manifest m;
      m.step = done;
      m.data_position = done;  // train_batch(i) is a function of (seed, i): the position is the step
      m.log_file = fs::path(log_path).filename().string();
      m.drafter_plugin = s.drafter_plugin->name;
      m.drafter_toml = drafter_toml;
      for (const auto& name : log->names())
        if (name.rfind("events/", 0) != 0) m.log_rows[name] = log->rows(name);
      checkpoint::State state{drafter->parameters(), &optimizer, rng.get_state(), {}, {}};
      {
        std::lock_guard<std::mutex> lock(default_rng.mutex());
        state.cpu_default_rng = default_rng.get_state();
      }
#ifdef FLASHDRAFT_ENGINE_CUDA
      if (device.is_cuda()) {
        at::Generator cuda_rng = at::cuda::detail::getDefaultCUDAGenerator(device.index());
        std::lock_guard<std::mutex> lock(cuda_rng.mutex());
        state.cuda_default_rng = cuda_rng.get_state();
      }
#endif
      const fs::path dir = checkpoint::write(checkpoint_root, m, state, ckpt_cfg.integer("keep"));
      last_checkpoint = done;
      std::cout << "checkpoint: " << dir.string() << std::endl;
      event("checkpoint", "wrote " + dir.string());
    };

    g_signal = 0;
    auto old_int = std::signal(SIGINT, on_signal);
    auto old_term = std::signal(SIGTERM, on_signal);
    const int64_t print_every = run.integer("print_every");
    std::cout << "training: " << steps << " steps, " << params.size() << " parameter tensors ("
              << [&] { int64_t n = 0; for (auto& p : params) n += p.numel(); return n; }() << " values)" << std::endl;

    if (eval_on && first_step == 0) validate(0);  // the untrained drafter: where tau starts
    for (int64_t step = first_step; step < steps; ++step) {
      current_step = step;
      if (g_signal) {
        event("interrupted", "signal " + std::to_string(g_signal.load()) + " received; stopped before step " +
                                 std::to_string(step));
        std::cout << "interrupted before step " << step << "; the log keeps steps 0.." << step - 1 << std::endl;
        if (ckpt_on && step > last_checkpoint) save_checkpoint(step);
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
      const int64_t done = step + 1;
      if (eval_on && ((eval_every > 0 && done % eval_every == 0) || done == steps)) validate(done);
      if (ckpt_on && ((ckpt_every > 0 && done % ckpt_every == 0) || done == steps)) save_checkpoint(done);
    }
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
    if (exit_code == 0) {
      current_step = steps;
      event("finished", "completed " + std::to_string(steps) + " steps");
      // The trained drafter in the documented HDF5 layout (plugins/dflash/README.md).
      checkpoint::Manifest info;
      info.step = steps;
      info.drafter_plugin = s.drafter_plugin->name;
      info.drafter_toml = drafter_toml;
      const std::string weights_path = (out_dir / (fs::path(log_path).stem().string() + ".weights.h5")).string();
      checkpoint::export_weights(weights_path, info, drafter->parameters(), "run log " + log_path);
      std::cout << "weights: " << weights_path << std::endl;
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

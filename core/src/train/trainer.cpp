// A training run, stage by stage (see trainer.hpp for where each stage lives).
#include "train/trainer.hpp"

#include "config/setup.hpp"
#include "dispatch/ledger.hpp"
#include "dispatch/lm_head_loss.hpp"
#include "distributed/distributed.hpp"
#include "distributed/rank_stats.hpp"
#include "eval/eval.hpp"
#include "export/hf_export.hpp"
#include "log/run_log_setup.hpp"
#include "log/step_record.hpp"
#include "registry/bind.hpp"
#include "train/batches.hpp"
#include "train/checkpointing.hpp"
#include "train/device_mark.hpp"
#include "train/grad_sync.hpp"
#include "train/memory.hpp"
#include "train/optimizer.hpp"
#include "train/profile.hpp"
#include "train/resume.hpp"
#include "train/rng_state.hpp"
#include "train/run_errors.hpp"
#include "train/train_step.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <flashdraft/text.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <streambuf>

namespace fs = std::filesystem;

namespace flashdraft {

namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

// SIGINT/SIGTERM finish the step in flight, then stop the run (handlers restored on exit).
class InterruptGuard {
 public:
  InterruptGuard() : int_(std::signal(SIGINT, on_signal)), term_(std::signal(SIGTERM, on_signal)) { g_signal = 0; }
  ~InterruptGuard() {
    std::signal(SIGINT, int_);
    std::signal(SIGTERM, term_);
  }
  int pending() const { return g_signal.load(); }

 private:
  void (*int_)(int);
  void (*term_)(int);
};

// Ranks other than 0 print nothing on stdout (errors still go to stderr).
class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return traits_type::not_eof(c); }
};

class QuietStdout {
 public:
  explicit QuietStdout(bool quiet) : saved_(quiet ? std::cout.rdbuf(&null_) : nullptr) {}
  ~QuietStdout() {
    if (saved_) std::cout.rdbuf(saved_);
  }

 private:
  NullBuffer null_;
  std::streambuf* saved_;
};

class Trainer {
 public:
  Trainer(const RunOptions& options, Setup setup) : options_(options), setup_(std::move(setup)) {}
  int run();

 private:
  const Config& run_table() const { return setup_.experiment.run(); }
  void prepare();
  void prepare_target_attention();
  void prepare_loss(int64_t loss_column);
  void restore();
  int train();
  void print_training_size() const;
  StepContext make_step_context();
  bool queue_ahead(const StepContext& context) const;
  int stop_before(int64_t step, int signal, bool ckpt_on);
  void finish();
  void validate(int64_t done);
  StepOutcome run_step(StepContext& context, StepProfiler& profiler, int64_t step, bool queue,
                       const std::function<void()>& read_previous);
  void read_step(StepOutcome& o, const DeviceMark* after, StepRecorder* recorder, StepProfiler& profiler, int signal);
  void save(int64_t done);
  void connect();
  void share_weights();
  void share(StepOutcome& outcome, int signal);
  int agreed_signal(int local) const { return dist_->active() ? ranks_signal_ : local; }
  bool root() const { return dist_->root(); }
  // The drafter's weights and its untrained buffers: what checkpoints and exports hold.
  std::vector<std::pair<std::string, at::Tensor>> model_tensors() const {
    auto all = plugins_.drafter->parameters();
    for (auto& b : plugins_.drafter->buffers()) all.push_back(b);
    return all;
  }

  RunOptions options_;
  Setup setup_;
  Launch launch_;
  std::unique_ptr<Distributed> dist_ = std::make_unique<Distributed>();
  std::unique_ptr<GradientSync> grads_;
  int ranks_signal_ = 0;
  BoundPlugins plugins_;
  KernelLedger ledger_;
  EventLog events_;
  std::unique_ptr<AttentionDispatcher> dispatcher_;
  std::unique_ptr<AttentionDispatcher> target_dispatcher_;  // the online target's attention
  std::unique_ptr<AttentionContext> target_attention_;  // OffsetAttention over the target's dispatcher, or NoAttention
  std::unique_ptr<BatchSource> batches_;
  std::unique_ptr<ServedValidation> served_;  // served validation ([eval] served; null when off)
  ResumePoint resume_;
  LogShape shape_;
  OpenedLog log_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<TrainOptimizer> optimizer_;
  at::Generator anchors_;
  RunCheckpoint checkpoint_;
  std::optional<hf_export::RunLayout> export_;  // a drafter with a serving format: exported at the end
  int64_t steps_ = 0, first_step_ = 0, current_step_ = -1, last_checkpoint_ = 0;
};

int Trainer::run() {
  steps_ = run_table().integer("steps");
  if (run_table().integer("threads") > 0) at::set_num_threads(static_cast<int>(run_table().integer("threads")));
  try {
    connect();
    QuietStdout quiet(!root());
    prepare();
    const int code = train();
    if (code == kFinished) finish();
    return code;
  } catch (const std::exception& e) {
    if (!dist_->active()) return report_run_error(e, current_step_, &events_, resume_.log_path);
    // Another rank's failure is reported as such; this rank's own is left for the others.
    if (!dynamic_cast<const DistributedError*>(&e)) dist_->announce_failure(e.what());
    std::cerr << "rank " << dist_->rank() << ": ";
    const int code = report_run_error(e, current_step_, &events_, resume_.log_path);
    grads_.reset();
    dist_->abandon();
    return code;
  }
}

// The launch (torchrun, Slurm or none) and, for several processes, the process group.
void Trainer::connect() {
  launch_ = read_launch();
  if (launch_.world <= 1) return;
  const bool cuda = run_table().string("device") == "cuda";
  const c10::Device device = cuda ? local_cuda_device(launch_) : c10::Device(c10::kCPU);
  dist_ = Distributed::connect(launch_, setup_.experiment.distributed(), device);
  if (root())
    std::cout << "distributed: " << dist_->world() << " ranks (" << launch_.source << "), backend " << dist_->backend()
              << ", timeout " << dist_->timeout_s() << " s" << std::endl;
}

// Rank 0's weights on every rank, checked by checksum.
void Trainer::share_weights() {
  if (!dist_->active()) return;
  dist_->broadcast(params_, "the broadcast of the initial weights");
  const auto [sum, sumsq] = weight_checksums(params_);
  const auto rows = dist_->all_gather(std::vector<double>{sum, sumsq}, "the check of the initial weights");
  for (size_t r = 1; r < rows.size(); ++r)
    if (rows[r] != rows[0])
      throw std::runtime_error("distributed: rank " + std::to_string(r) +
                               " holds other initial weights than rank 0 after the broadcast");
  std::cout << "weights: identical on " << rows.size() << " ranks (checksum " << sum << ")" << std::endl;
}

// Every stage before step 0.
void Trainer::prepare() {
  plugins_ = bind_plugins(setup_);
  plugins_.warnings->sink([this](const std::string& w) { events_.add(current_step_, "warning", w); });
  const KernelChoice& choice = plugins_.choice;
  std::cout << choice.report();
  if (choice.fallback) events_.add(current_step_, "fallback", choice.fallback_note());
  dispatcher_ = std::make_unique<AttentionDispatcher>(
      choice, plugins_.mask.get(), setup_.experiment.attention().string("on_fallback"), &ledger_,
      [this](const std::string& kind, const std::string& message) { events_.add(current_step_, kind, message); });

  Drafter& drafter = *plugins_.drafter;
  if (plugins_.target) prepare_target_attention();
  batches_ = std::make_unique<BatchSource>(*plugins_.dataset, plugins_.target.get(), plugins_.target_layers,
                                           target_attention_.get(), plugins_.ctx.device);
  const int64_t accumulate = setup_.experiment.optimizer().integer("accumulate");
  if (plugins_.target && plugins_.target->reads_states())  // (the batches this rank reads: GradientSync::batch_index)
    check_states_read(*plugins_.dataset, *plugins_.target, dist_->rank(), steps_ * accumulate * dist_->world(),
                      dist_->world(), setup_.experiment.eval().boolean("enabled"), plugins_.ctx.say);
  resume_ = find_resume_point(options_, run_table().string("out"), run_table().string("name"), model_tensors(),
                              plugins_.ctx.say);
  const LedgerColumns columns{drafter.attention_layers(), plugins_.target_calls};
  prepare_loss(columns.loss());
  std::cout << "precision: " << plugins_.precision.describe() << std::endl;
  shape_ = LogShape{columns,
                    drafter.position_names(),
                    drafter.scalar_names(),
                    plugins_.target != nullptr,
                    dist_->world(),
                    accumulate,
                    plugins_.served ? drafter.max_proposals() + 2 : 0};
  if (plugins_.served) {
    std::cout << "served validation: drafter decoder " << plugins_.served_choice.report();
    if (plugins_.served_by_target)
      std::cout << "served validation: target decoder " << plugins_.served_target_choice.report();
    served_ = std::make_unique<ServedValidation>(plugins_, setup_.experiment.eval(),
                                                 static_cast<uint64_t>(run_table().integer("seed")),
                                                 setup_.experiment.attention().string("on_fallback"),
                                                 [this](const std::string& kind, const std::string& message) {
                                                   events_.add(current_step_, kind, "served validation: " + message);
                                                 });
  }
  if (root()) {
    if (resume_.resumed()) check_same_world(resume_, shape_.ranks, shape_.accumulate);
    log_ = open_run_log(setup_, plugins_, resume_, shape_, events_);
    export_ = hf_export::run_layout(setup_, plugins_, resume_.log_path);
  }

  for (auto& [name, p] : drafter.parameters()) params_.push_back(p);
  optimizer_ =
      make_optimizer(params_, setup_.experiment.optimizer(), plugins_.precision.master, plugins_.precision.fused);
  std::cout << "optimizer: " << optimizer_->name() << std::endl;
  const uint64_t seed = static_cast<uint64_t>(run_table().integer("seed"));
  // Every micro-batch sets it to its own stream before it draws (GradientSync::seed_anchors).
  anchors_ = at::make_generator<at::CPUGeneratorImpl>(seed + 0x5eed);
  const PluginUse& d = setup_.use(PluginKind::drafter);
  checkpoint_ = RunCheckpoint{resume_.checkpoint_root, setup_.experiment.checkpoint().integer("keep"), resume_.log_path,
                              d.plugin->name,
                              table_toml("drafter", d.plugin->name, setup_.registry->schema(*d.plugin), d.config)};
  if (resume_.resumed()) restore();
  share_weights();
  grads_ = std::make_unique<GradientSync>(
      *dist_, params_, accumulate, setup_.experiment.distributed().real("bucket_mb"), seed, drafter.step_parts());
  if (drafter.step_parts() > 1)
    std::cout << "steps in parts: each batch's step runs in " << drafter.step_parts()
              << " parts (forward and backward each, on one batch and one target forward)" << std::endl;
}

// The online target's attention: its own dispatcher, its calls after the drafter's.
void Trainer::prepare_target_attention() {
  if (!plugins_.target_attends()) {  // (its hidden states are read, not computed: no attention runs)
    target_attention_ = std::make_unique<NoAttention>("the target (" + plugins_.target_model.source + ")");
    std::cout << "target: " << plugins_.target_model.source << "; layers " << list_str(plugins_.target_layers)
              << " feed the drafter (read, no attention call)" << std::endl;
    return;
  }
  std::cout << "target " << plugins_.target_choice.report();
  if (plugins_.target_choice.fallback)
    events_.add(current_step_, "fallback", "target: " + plugins_.target_choice.fallback_note());
  target_dispatcher_ = std::make_unique<AttentionDispatcher>(
      plugins_.target_choice, plugins_.target_mask.get(), setup_.experiment.attention().string("on_fallback"), &ledger_,
      [this](const std::string& kind, const std::string& message) {
        events_.add(current_step_, kind, "target: " + message);
      });
  target_attention_ = std::make_unique<OffsetAttention>(*target_dispatcher_, plugins_.drafter->attention_layers());
  std::cout << "target: " << plugins_.target_model.source << "; layers " << list_str(plugins_.target_layers)
            << " feed the drafter" << std::endl;
}

// The LM-head loss op chosen at bind ([loss]) in ledger column `loss_column`, and the report.
void Trainer::prepare_loss(int64_t loss_column) {
  dispatcher_->set_loss(plugins_.loss_choice, loss_column);
  std::cout << plugins_.loss_choice.report();
}

// A resumed run: the checkpoint's weights, optimizer, generators and position.
void Trainer::restore() {
  checkpoint::State state{model_tensors(), optimizer_.get(), {}, {}, {}};
  const checkpoint::Manifest m = checkpoint::load(resume_.dir, state);
  restore_generators(state, anchors_, plugins_.ctx.device);
  first_step_ = last_checkpoint_ = m.step;
  // The ledger hands out variant ids in order of first sight; the log's names list must
  // keep meaning the same ids.
  for (const auto& n : log_.kernel_names) ledger_.id(n);
  if (root()) set_aside_later_checkpoints(resume_);
  const std::string msg = "resumed from " + resume_.dir.string() + " at step " + std::to_string(m.step) +
                          " (data position " + std::to_string(m.data_position) + "); log cut back to " +
                          std::to_string(m.step) + " steps";
  current_step_ = m.step;
  events_.add(current_step_, "resume", msg);
  std::cout << "resume: " << msg << std::endl;
}

// Prints the run's length and the drafter's trained parameters.
void Trainer::print_training_size() const {
  int64_t values = 0;
  for (const auto& p : params_) values += p.numel();
  std::cout << "training: " << steps_ << " steps, " << params_.size() << " parameter tensors (" << values << " values)"
            << std::endl;
}

// What every training step runs with.
StepContext Trainer::make_step_context() {
  return StepContext{*plugins_.drafter,
                     *batches_,
                     *dispatcher_,
                     ledger_,
                     *optimizer_,
                     params_,
                     anchors_,
                     make_schedule(setup_.experiment.optimizer(), steps_),
                     setup_.experiment.optimizer().real("grad_clip"),
                     plugins_.ctx.device,
                     shape_.columns.count(),
                     grads_.get()};
}

// Whether steps are queued ahead ([run] queue_ahead, where can_queue_steps allows it); says so when they are.
bool Trainer::queue_ahead(const StepContext& context) const {
  const bool queue = run_table().boolean("queue_ahead") && can_queue_steps(context);
  if (queue)
    std::cout << "steps: queued ahead (the device runs step t while the host prepares step t+1; a step's loss and "
                 "metrics are read once the next step is queued)"
              << std::endl;
  return queue;
}

// An interrupted run, stopped before `step`: the event, the line and (when checkpoints are
// on and the step has none yet) a checkpoint.
int Trainer::stop_before(int64_t step, int signal, bool ckpt_on) {
  events_.add(step, "interrupted",
              "signal " + std::to_string(signal) + " received; stopped before step " + std::to_string(step));
  std::cout << "interrupted before step " << step << "; the log keeps steps 0.." << step - 1 << std::endl;
  if (ckpt_on && step > last_checkpoint_ && root()) save(step);
  return kInterrupted;
}

int Trainer::train() {
  const Config& eval = setup_.experiment.eval();
  const Config& ckpt = setup_.experiment.checkpoint();
  const bool eval_on = eval.boolean("enabled"), ckpt_on = ckpt.boolean("enabled");
  const int64_t eval_every = eval.integer("every"), ckpt_every = ckpt.integer("every");
  InterruptGuard interrupts;
  print_training_size();

  if (eval_on && first_step_ == 0) validate(0);  // the untrained drafter: where tau starts
  StepContext step_context = make_step_context();
  std::unique_ptr<StepRecorder> recorder;
  if (root())
    recorder = std::make_unique<StepRecorder>(*log_.log, shape_, static_cast<int64_t>(log_.kernel_names.size()));
  const std::string trace = resume_.log_path.substr(0, resume_.log_path.size() - 3) + ".trace.json";
  const ProfileWindow window =
      options_.profile.empty() || !root() ? ProfileWindow{} : parse_profile_window(options_.profile);
  StepProfiler profiler(window, trace);
  const bool queue = queue_ahead(step_context);

  // A queued step not read yet, and the end of the step queued just before it (its time
  // runs from there when nothing waited in between).
  std::optional<StepOutcome> pending;
  std::shared_ptr<const DeviceMark> pending_after;
  auto finish = [&](StepOutcome& o, const std::shared_ptr<const DeviceMark>& after) {
    read_step(o, after.get(), recorder.get(), profiler, interrupts.pending());
  };
  auto finish_pending = [&] {
    if (!pending) return;
    StepOutcome o = std::move(*pending);
    pending.reset();
    finish(o, pending_after);
  };

  for (int64_t step = first_step_; step < steps_; ++step) {
    current_step_ = step;
    if (const int signal = agreed_signal(interrupts.pending())) {
      finish_pending();
      return stop_before(step, signal, ckpt_on);
    }
    StepOutcome outcome = run_step(step_context, profiler, step, queue, finish_pending);
    // With queued steps: read the previous step now, while the device runs this one.
    const std::shared_ptr<const DeviceMark> after = pending ? pending->end : nullptr;
    if (pending) {
      current_step_ = step - 1;
      finish_pending();
      current_step_ = step;
    }
    const int64_t done = step + 1;
    const bool eval_now = eval_on && ((eval_every > 0 && done % eval_every == 0) || done == steps_);
    const bool ckpt_now = ckpt_on && ((ckpt_every > 0 && done % ckpt_every == 0) || done == steps_);
    // Where the host must see this step's results before the next step is queued: an
    // evaluation, a checkpoint, the end, the edges of the profiled window.
    const bool read_now = !outcome.queued || eval_now || ckpt_now || done == steps_ ||
                          (window.on() && (done == window.first || done == window.last));
    if (!read_now) {
      pending = std::move(outcome);
      pending_after = after;
      continue;
    }
    finish(outcome, after);
    profiler.after_step(step);
    if (eval_now) validate(done);
    if (ckpt_now && root()) save(done);
  }
  return kFinished;
}

// One step (queued or run to its end); on an error, the step before it (still unread when
// steps are queued) is read into the log first.
StepOutcome Trainer::run_step(StepContext& context, StepProfiler& profiler, int64_t step, bool queue,
                              const std::function<void()>& read_previous) {
  try {
    profiler.before_step(step);
    return train_step(context, step, queue);
  } catch (const NonFiniteLoss& e) {
    events_.add(step, "nan", e.quantity + " is " + std::to_string(e.loss) + " at step " + std::to_string(step));
    throw;
  } catch (...) {
    current_step_ = step - 1;
    try {
      read_previous();
    } catch (...) {
    }
    current_step_ = step;
    throw;
  }
}

// Reads a step (when it was queued: its loss, metrics and time from the device), shares
// it across ranks, records it and prints its line.
void Trainer::read_step(StepOutcome& o, const DeviceMark* after, StepRecorder* recorder, StepProfiler& profiler,
                        int signal) {
  try {
    finish_step(o, after);
  } catch (const NonFiniteLoss& e) {
    events_.add(o.step, "nan", e.quantity + " is " + std::to_string(e.loss) + " at step " + std::to_string(o.step));
    throw;
  }
  const auto t0 = std::chrono::steady_clock::now();
  share(o, signal);
  const int64_t print_every = run_table().integer("print_every");
  if (root()) recorder->record(o);
  if (root() && (o.step % print_every == 0 || o.step + 1 == steps_))
    std::cout << recorder->line(o, steps_) << std::endl;
  o.host.emplace_back("record", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  profiler.note_host(o.host);
}

// Every rank's share of a step (data-parallel runs): the step's metrics made global, the
// ranks/* columns, the signals and kernel variants compared.
void Trainer::share(StepOutcome& outcome, int signal) {
  if (!dist_->active()) return;
  const RankStep ranks = gather_step(*dist_, outcome, *grads_, ledger_, params_, signal,
                                     setup_.experiment.attention().string("on_fallback"));
  ranks_signal_ = ranks.signal;
  outcome.kernels = ledger_;  // with the names of other ranks' variants (data-parallel steps are never queued)
  if (!ranks.kernel_difference.empty()) events_.add(outcome.step, "fallback", ranks.kernel_difference);
  if (root()) record_ranks(*log_.log, ranks);
  if (outcome.step == first_step_)
    std::cout << "distributed: gradients all-reduced in " << grads_->buckets() << " buckets, "
              << grads_->sent_during_backward() << " of them sent during the backward" << std::endl;
}

void Trainer::validate(int64_t done) {
  const EvalContext context{*plugins_.drafter,
                            *batches_,
                            *dispatcher_,
                            ledger_,
                            setup_.experiment.eval(),
                            static_cast<uint64_t>(run_table().integer("seed")),
                            shape_.columns.count(),
                            static_cast<int64_t>(shape_.position_names.size()),
                            plugins_.target.get(),
                            nullptr,
                            served_.get(),
                            plugins_.served_off};
  const std::optional<EvalResult> r = evaluate(context, done);
  if (!r) {
    std::cout << "eval: the dataset has no held-out batch; nothing to validate" << std::endl;
    return;
  }
  if (!root()) return;  // every rank validates alike; rank 0 records it
  record_eval(*log_.log, *r);
  std::cout << eval_line(*r) << std::endl;
}

void Trainer::save(int64_t done) {
  // A large drafter's checkpoint (fp32 master weights and two AdamW moments: 12 bytes a value)
  // takes a minute on a slow disk: say so before, and what it took after.
  std::cout << "checkpoint: writing step " << done << " ..." << std::endl;
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path dir =
      save_checkpoint(checkpoint_, done, *log_.log, model_tensors(), *optimizer_, anchors_, plugins_.ctx.device);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_checkpoint_ = done;
  const uintmax_t bytes = checkpoint::folder_bytes(dir);
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f s)", s);
  const std::string took = " (" + checkpoint::size_text(bytes) + " in " + seconds;
  std::cout << "checkpoint: " << dir.string() << took << std::endl;
  events_.add(current_step_, "checkpoint", "wrote " + dir.string() + took);
  // The next one is written beside the kept ones: say now, not at the next checkpoint, when it
  // will not fit.
  std::error_code ec;
  const fs::space_info space = fs::space(checkpoint_.root, ec);
  if (!ec && done < steps_) {
    const std::string why =
        checkpoint::space_refusal("", bytes, space.available, checkpoint_.root, 0, 0, checkpoint_.keep);
    if (!why.empty())  // "cannot write checkpoint : it needs ..." -> "... will not fit: it needs ..."
      plugins_.ctx.say("warning: the next checkpoint will not fit" + why.substr(why.find(": it needs")));
  }
}

// The end of a finished run: the event, the trained drafter in the documented HDF5 layout
// (checkpoint.hpp, export_weights) and, with a serving format, its folder.
void Trainer::finish() {
  current_step_ = steps_;
  if (!root()) return;
  events_.add(current_step_, "finished", "completed " + std::to_string(steps_) + " steps");
  checkpoint::Manifest info;
  info.step = steps_;
  info.drafter_plugin = checkpoint_.drafter_plugin;
  info.drafter_toml = checkpoint_.drafter_toml;
  const std::string weights_path =
      (fs::path(run_table().string("out")) / (fs::path(resume_.log_path).stem().string() + ".weights.h5")).string();
  checkpoint::export_weights(weights_path, info, model_tensors(), "run log " + resume_.log_path);
  std::cout << "weights: " << weights_path << std::endl;
  if (export_) {
    const fs::path folder = fs::path(run_table().string("out")) / (fs::path(resume_.log_path).stem().string() + ".hf");
    std::cout << hf_export::write_run_folder(*export_, folder.string(), model_tensors()) << std::endl;
  }
  std::cout << "done: " << steps_ << " steps; log: " << resume_.log_path << std::endl;
}

}  // namespace

int run_experiment(const RunOptions& options) {
  MemoryTracker::install();
  Setup setup;
  try {
    setup = load_setup(options);
  } catch (const std::exception& e) {
    return report_setup_error(e);
  }
  return Trainer(options, std::move(setup)).run();
}

int validate_experiment(const RunOptions& options) {
  Setup s;
  try {
    s = load_setup(options);
  } catch (const std::exception& e) {
    return report_setup_error(e);
  }
  try {
    BoundPlugins b = bind_plugins(s);
    if (b.target && b.target->reads_states())
      check_states_read(*b.dataset, *b.target, 0,
                        s.experiment.run().integer("steps") * s.experiment.optimizer().integer("accumulate"), 1,
                        s.experiment.eval().boolean("enabled"), b.ctx.say);
    if (b.target_attends()) std::cout << "target " << b.target_choice.report();
    std::cout << b.choice.report();
    if (b.served) {
      std::cout << "served validation: drafter decoder " << b.served_choice.report();
      if (b.served_by_target) std::cout << "served validation: target decoder " << b.served_target_choice.report();
    }
    std::cout << b.loss_choice.report();
    std::cout << options.experiment << ": valid (every check `flashdraft run` makes before step 0 passed)\n";
    for (const auto& [kind, use] : s.named)
      std::cout << "  " << to_string(kind) << std::string(8 - std::string(to_string(kind)).size(), ' ') << ": "
                << use.name << " (" << use.plugin->path << ")\n";
    for (const PluginUse& k : s.kernels)
      std::cout << "  kernel  : " << k.name << " " << (k.plugin ? "(" + k.plugin->path + ")" : "(not found)") << "\n";
    const Config& run = s.experiment.run();
    std::cout << "  run     : " << run.integer("steps") << " steps on " << run.string("device") << " ("
              << run.string("dtype") << "), on_fallback = " << s.experiment.attention().string("on_fallback")
              << " (attention), " << s.experiment.loss().string("on_fallback") << " (loss)\n";
    return kFinished;
  } catch (const std::exception& e) {
    return report_run_error(e, -1, nullptr, "");
  }
}

}  // namespace flashdraft

// The run log's columns (the README's "run log" table describes the same).
#include "log/log_schema.hpp"

namespace flashdraft {

namespace {

// steps/*: one row per optimizer step, then the drafter's extra scalars and the online
// target's forward time.
std::vector<LogColumn> steps_columns(const LogShape& shape) {
  using T = RunLog::Type;
  std::vector<LogColumn> c = {
      {"steps/step", T::i64, 0, 0, "optimizer step (0-based)"},
      {"steps/loss", T::f64, 0, 0, "training loss"},
      {"steps/lr", T::f64, 0, 0, "learning rate used at this step"},
      {"steps/grad_norm", T::f64, 0, 0, "global gradient norm before clipping"},
      {"steps/step_time_s", T::f64, 0, 0, "wall time of the step, seconds"},
      {"steps/tokens_per_s", T::f64, 0, 0, "loss-carrying (labelled) tokens per second"},
      {"steps/input_tokens_per_s", T::f64, 0, 0,
       "the batches' real input tokens (every non-padding position, prompt included; all micro-batches and ranks) "
       "per second: the rate other trainers report as tokens/s"},
      {"steps/position_accuracy", T::f64, static_cast<int64_t>(shape.position_names.size()), 0,
       "accuracy per position (the drafter's positions: e.g. block positions 1..BS-1, or unroll steps)"},
  };
  for (const auto& n : shape.scalar_names) c.push_back({"steps/" + n, T::f64, 0, 0, "drafter metric"});
  if (shape.target)
    c.push_back({"steps/target_time_s", T::f64, 0, 0, "wall time of the online target's forward, seconds"});
  return c;
}

// memory/*, kernels/* and events/*: peaks per phase, the attention variants that ran,
// and what happened during the run.
std::vector<LogColumn> memory_kernel_event_columns(const LogShape& shape) {
  using T = RunLog::Type;
  return {
      {"memory/forward", T::i64, 0, 0, "peak bytes during the forward pass"},
      {"memory/backward", T::i64, 0, 0, "peak bytes during the backward pass"},
      {"memory/optimizer", T::i64, 0, 0, "peak bytes during clipping and the optimizer step"},
      {"memory/step", T::i64, 0, 0, "peak bytes over the whole step"},
      {"kernels/forward", T::i32, shape.columns.attention(), 0,
       "variant id per attention call (forward): the drafter's calls (e.g. its layers, or its unroll steps), then the "
       "online target's; -1 = no call"},
      {"kernels/backward", T::i32, shape.columns.attention(), 0,
       "variant id per attention call (backward), columns as in forward; -1 = no call"},
      {"kernels/loss", T::i32, 2, 0,
       "variant id of the LM-head loss op: forward, backward; -1 = no call (also for a drafter with its own loss)"},
      {"kernels/names", T::str, 0, 256, "variant names; ids index this list"},
      {"events/step", T::i64, 0, 0, "step of the event (-1: before step 0)"},
      {"events/kind", T::str, 0, 32, "fallback, nan, oom, error, warning, interrupted, finished, ..."},
      {"events/message", T::str, 0, 2048, "what happened"},
  };
}

// eval/*: one row per validation, and the served histogram when served validation is on.
std::vector<LogColumn> eval_columns(const LogShape& shape) {
  using T = RunLog::Type;
  std::vector<LogColumn> c = {
      {"eval/step", T::i64, 0, 0, "optimizer steps completed when the validation ran"},
      {"eval/loss", T::f64, 0, 0, "mean loss over the held-out batches"},
      {"eval/tau_served", T::f64, 0, 0,
       "THE acceptance length to trust: the held-out responses decoded speculatively as a server does it "
       "(block after block, the next block after the accepted tokens and the target's own), tokens produced per "
       "verification step over every step; eval/tau_served_method says how; NaN when served validation is off"},
      {"eval/tau_served_se", T::f64, 0, 0, "standard error of eval/tau_served over the held-out responses"},
      {"eval/tau_served_method", T::str, 0, 128,
       "\"target (greedy)\", \"target (temperature T, top_p P, rejection sampling)\": the online target decoded the "
       "responses from their prompts; \"data tokens (greedy)\": the data's responses stood for the target's choices; "
       "\"none (why)\""},
      {"eval/tau_served_data", T::f64, 0, 0,
       "the served walk on the data's tokens, greedy (equals eval/tau_served by the target when the data is the "
       "target's greedy text)"},
      {"eval/served_responses", T::i64, 0, 0, "held-out responses (assistant turns) decoded"},
      {"eval/served_steps", T::i64, 0, 0, "verification steps of eval/tau_served"},
      {"eval/served_seconds", T::f64, 0, 0, "time of served validation (every walk), seconds"},
      {"eval/served_target_seconds", T::f64, 0, 0,
       "time of the target's forwards within it (prefills and verifications; device time on CUDA), seconds"},
      {"eval/served_kernels", T::str, 0, 512, "the attention variants the decoders ran"},
      {"eval/tau_anchor", T::f64, 0, 0,
       "diagnostic: exact greedy acceptance of blocks at uniformly drawn anchors, 1 + mean accepted per block "
       "(by target verification with an online target, eval/tau_anchor_method). It weighs a long accepted run once "
       "per position instead of once per block, so it overstates eval/tau_served when acceptance is uneven"},
      {"eval/tau_data", T::f64, 0, 0,
       "1 + mean leading matches of the anchor blocks' proposals with the data's tokens (equals eval/tau_anchor "
       "when the data is the target's own greedy output)"},
      {"eval/tau_anchor_method", T::str, 0, 64,
       "how eval/tau_anchor was measured: \"target verification\" (the online target verifies each drafted "
       "block) or \"data tokens (...)\" (then eval/tau_anchor = eval/tau_data)"},
      {"eval/tau_sim", T::f64, 0, 0, "1 + sum_k prod_{j<=k} acc_j from eval/position_accuracy"},
      {"eval/blocks", T::i64, 0, 0, "blocks (anchors) the acceptance length averages over"},
      {"eval/position_accuracy", T::f64, static_cast<int64_t>(shape.position_names.size()), 0,
       "held-out accuracy per position, as in steps/position_accuracy"},
  };
  if (shape.served_width > 0)
    c.push_back({"eval/served_histogram", T::i64, shape.served_width, 0,
                 "served validation: column n = verification steps that produced n tokens"});
  return c;
}

// ranks/*: per rank of a data-parallel run (none for a single process).
std::vector<LogColumn> rank_columns(const LogShape& shape) {
  using T = RunLog::Type;
  if (shape.ranks <= 1) return {};
  const int64_t n = shape.ranks;
  const std::vector<LogColumn> ranks = {
      {"ranks/step_time_s", T::f64, n, 0, "per rank: wall time of the step, seconds"},
      {"ranks/tokens", T::f64, n, 0, "per rank: loss-carrying tokens of its micro-batches"},
      {"ranks/loss", T::f64, n, 0, "per rank: loss of its own micro-batches (steps/loss is the union's)"},
      {"ranks/memory_step", T::i64, n, 0, "per rank: peak bytes over the step (memory/* hold the largest)"},
      {"ranks/weights_sum", T::f64, n, 0, "per rank: sum of every trainable value after the step (float64)"},
      {"ranks/weights_sumsq", T::f64, n, 0, "per rank: sum of squares of every trainable value after the step"},
      {"ranks/kernels_forward", T::i32, n * shape.columns.count(), 0,
       "per rank, then per attention call as in kernels/forward and last the LM-head loss: variant id "
       "(kernels/names)"},
      {"ranks/kernels_backward", T::i32, n * shape.columns.count(), 0,
       "per rank, then per attention call as in kernels/backward and last the LM-head loss: variant id "
       "(kernels/names)"},
  };
  return ranks;
}

// Appends the columns of one group at the end of c.
void append(std::vector<LogColumn>& c, const std::vector<LogColumn>& group) {
  c.insert(c.end(), group.begin(), group.end());
}

}  // namespace

std::vector<LogColumn> log_columns(const LogShape& shape) {
  std::vector<LogColumn> c = steps_columns(shape);
  append(c, memory_kernel_event_columns(shape));
  append(c, eval_columns(shape));
  append(c, rank_columns(shape));
  return c;
}

std::vector<LogColumn> log_columns(const std::string& group) {
  std::vector<LogColumn> out;
  for (auto& c : log_columns(LogShape{}))
    if (c.name.compare(0, group.size() + 1, group + "/") == 0) out.push_back(std::move(c));
  return out;
}

void declare_log_columns(RunLog& log, const LogShape& shape) {
  for (const auto& c : log_columns(shape)) log.declare(c.name, c.type, c.width, c.str_len, c.doc);
}

}  // namespace flashdraft

// The run log's columns (the README's "run log" table describes the same).
#include "log_schema.hpp"

namespace flashdraft {

std::vector<LogColumn> log_columns(const LogShape& shape) {
  using T = RunLog::Type;
  std::vector<LogColumn> c = {
      {"steps/step", T::i64, 0, 0, "optimizer step (0-based)"},
      {"steps/loss", T::f64, 0, 0, "training loss"},
      {"steps/lr", T::f64, 0, 0, "learning rate used at this step"},
      {"steps/grad_norm", T::f64, 0, 0, "global gradient norm before clipping"},
      {"steps/step_time_s", T::f64, 0, 0, "wall time of the step, seconds"},
      {"steps/tokens_per_s", T::f64, 0, 0, "loss-carrying tokens per second"},
      {"steps/position_accuracy", T::f64, shape.positions, 0, "accuracy per position (DFlash: block positions 1..BS-1; EAGLE-3: unroll steps 0..ttt_steps-1)"},
  };
  for (const auto& n : shape.scalar_names) c.push_back({"steps/" + n, T::f64, 0, 0, "drafter metric"});
  if (shape.target)
    c.push_back({"steps/target_time_s", T::f64, 0, 0, "wall time of the online target's forward, seconds"});
  const std::vector<LogColumn> rest = {
      {"memory/forward", T::i64, 0, 0, "peak bytes during the forward pass"},
      {"memory/backward", T::i64, 0, 0, "peak bytes during the backward pass"},
      {"memory/optimizer", T::i64, 0, 0, "peak bytes during clipping and the optimizer step"},
      {"memory/step", T::i64, 0, 0, "peak bytes over the whole step"},
      {"kernels/forward", T::i32, shape.layers, 0,
       "variant id per attention call (forward): the drafter's calls (DFlash: layers; EAGLE-3: unroll steps), then the online target's; -1 = no call"},
      {"kernels/backward", T::i32, shape.layers, 0,
       "variant id per attention call (backward), columns as in forward; -1 = no call"},
      {"kernels/loss", T::i32, 2, 0, "variant id of the LM-head loss op: forward, backward; -1 = no call (also for a drafter with its own loss)"},
      {"kernels/names", T::str, 0, 256, "variant names; ids index this list"},
      {"events/step", T::i64, 0, 0, "step of the event (-1: before step 0)"},
      {"events/kind", T::str, 0, 32, "fallback, nan, oom, error, interrupted, finished, ..."},
      {"events/message", T::str, 0, 2048, "what happened"},
      {"eval/step", T::i64, 0, 0, "optimizer steps completed when the validation ran"},
      {"eval/loss", T::f64, 0, 0, "mean loss over the held-out batches"},
      {"eval/tau", T::f64, 0, 0,
       "exact greedy acceptance length: 1 + mean leading block proposals the target accepts (eval/tau_method "
       "says how it was measured; NaN if the drafter returns no predictions)"},
      {"eval/tau_data", T::f64, 0, 0,
       "1 + mean leading matches of the block proposals with the data's tokens (equals eval/tau when the data "
       "is the target's own greedy output)"},
      {"eval/tau_method", T::str, 0, 64,
       "how eval/tau was measured: \"target verification\" (the online target verifies each drafted block) or "
       "\"data tokens (no online target to verify)\" (then eval/tau = eval/tau_data)"},
      {"eval/tau_sim", T::f64, 0, 0, "1 + sum_k prod_{j<=k} acc_j from eval/position_accuracy"},
      {"eval/blocks", T::i64, 0, 0, "blocks (anchors) the acceptance length averages over"},
      {"eval/position_accuracy", T::f64, shape.positions, 0, "held-out accuracy per position, as in steps/position_accuracy"},
  };
  c.insert(c.end(), rest.begin(), rest.end());
  if (shape.ranks > 1) {
    const int64_t n = shape.ranks;
    const std::vector<LogColumn> ranks = {
        {"ranks/step_time_s", T::f64, n, 0, "per rank: wall time of the step, seconds"},
        {"ranks/tokens", T::f64, n, 0, "per rank: loss-carrying tokens of its micro-batches"},
        {"ranks/loss", T::f64, n, 0, "per rank: loss of its own micro-batches (steps/loss is the union's)"},
        {"ranks/memory_step", T::i64, n, 0, "per rank: peak bytes over the step (memory/* hold the largest)"},
        {"ranks/weights_sum", T::f64, n, 0, "per rank: sum of every trainable value after the step (float64)"},
        {"ranks/weights_sumsq", T::f64, n, 0, "per rank: sum of squares of every trainable value after the step"},
        {"ranks/kernels_forward", T::i32, n * (shape.layers + 1), 0,
         "per rank, then per attention call as in kernels/forward and last the LM-head loss: variant id "
         "(kernels/names)"},
        {"ranks/kernels_backward", T::i32, n * (shape.layers + 1), 0,
         "per rank, then per attention call as in kernels/backward and last the LM-head loss: variant id "
         "(kernels/names)"},
    };
    c.insert(c.end(), ranks.begin(), ranks.end());
  }
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

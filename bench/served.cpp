// Served validation at a real model's size: the time of one served validation (held-out
// responses decoded speculatively, core/src/eval/served.hpp) against its floor, the target's
// forwards alone (every verified token must pass through the target once).
//
//   bench_served EXP.toml [--responses 64] [--prompt 512] [--response 512] [--warmup 8]
//
// The experiment names the target ([target], an hf checkpoint that decodes), the drafter
// and the kernels; [eval] served_batch the rows decoded at once. The responses are made
// here: random prompt tokens (seeded), each decoded by the target for --response tokens
// (greedy, or [eval] temperature), so no dataset is read (the experiment's [dataset] only
// satisfies the setup; its seq_len must hold prompt + response). One warm-up walk over
// --warmup responses (untimed), then the timed walk over all of them, whose target forwards
// are recorded and replayed alone, back to back, on a fresh cache: the floor.
// Prints one table row (markdown) and the kernels that ran.
#include "eval/served.hpp"
#include "config/setup.hpp"
#include "eval/eval.hpp"
#include "registry/bind.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <iostream>
#include <random>
#include <string>

namespace fd = flashdraft;

namespace {

int64_t flag(int argc, char** argv, const std::string& name, int64_t fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return std::stoll(argv[i + 1]);
  return fallback;
}

std::vector<fd::ServedSequence> responses(int64_t n, int64_t prompt, int64_t response, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  std::vector<fd::ServedSequence> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    fd::ServedSequence& s = out[static_cast<size_t>(i)];
    s.tokens.resize(static_cast<size_t>(prompt + response));
    for (auto& t : s.tokens) t = token(rng);
    s.prompt = prompt;
    s.end = prompt + response;
    s.source = i;
  }
  return out;
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: bench_served EXP.toml [--responses 64] [--prompt 512] [--response 512] [--warmup 8]\n";
    return 2;
  }
  const int64_t n = flag(argc, argv, "responses", 64), prompt = flag(argc, argv, "prompt", 512),
                response = flag(argc, argv, "response", 512), warmup = flag(argc, argv, "warmup", 8);
  fd::RunOptions options;
  options.experiment = argv[1];
  const fd::Setup setup = fd::load_setup(options);
  fd::BoundPlugins b = fd::bind_plugins(setup);
  if (!b.served_by_target)
    throw std::runtime_error("served validation by the target is off here (" +
                             (b.served_off.empty() ? std::string("the target cannot decode") : b.served_off) + ")");
  if (prompt + response > b.dataset->seq_len())
    throw std::runtime_error("prompt + response = " + std::to_string(prompt + response) +
                             " exceeds the experiment's [dataset] seq_len " + std::to_string(b.dataset->seq_len()) +
                             " (the decoders' capacity is made for it)");
  std::cout << "served validation: drafter decoder " << b.served_choice.report() << "served validation: target decoder "
            << b.served_target_choice.report();
  const fd::Config& eval = setup.experiment.eval();
  fd::ServedValidation served(b, eval, 0, setup.experiment.attention().string("on_fallback"), nullptr);
  fd::ServedContext& c = served.context();
  const uint64_t seed = static_cast<uint64_t>(setup.experiment.run().integer("seed"));
  at::Generator gen = b.ctx.device.is_cuda() ? at::globalContext().defaultGenerator(b.ctx.device)
                                             : at::make_generator<at::CPUGeneratorImpl>(seed);
  gen.set_current_seed(seed);
  const fd::Sampling sampling{eval.real("temperature"), eval.real("top_p"), &gen};
  served.ledger().begin_step(0, served.ledger_columns());
  if (warmup > 0) fd::serve(c, responses(warmup, prompt, response, b.target_model.vocab, seed + 1), true, sampling);
  c.replay_floor = true;
  const fd::ServedTally t = fd::serve(c, responses(n, prompt, response, b.target_model.vocab, seed), true, sampling);
  const double tokens_verified = double(t.target_tokens);
  std::printf(
      "| responses x tokens | prompt | batch | tau_served | steps | served validation s | target forwards in it s | "
      "target forwards alone (floor) s | validation / floor |\n|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %lld x %lld | %lld | %lld | %.3f | %lld | %.2f | %.2f | %.2f | %.2fx |\n", (long long)n,
              (long long)response, (long long)prompt, (long long)c.batch, t.tau(), (long long)t.steps, t.seconds,
              t.target_seconds, t.floor_seconds, t.seconds / t.floor_seconds);
  std::printf("target forwards: %lld (prefills included), %.0f positions run; drafter: %s\n",
              (long long)t.target_forwards, tokens_verified, setup.use(fd::PluginKind::drafter).name.c_str());
  std::printf("kernels: %s\n", served.ledger().summary(fd::Phase::forward).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

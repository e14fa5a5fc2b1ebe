// target_states: runs a [target] plugin on tokens from a safetensors file and writes the
// hidden states it computes (and the final logits), for the tests that compare our
// targets with transformers (tests/python/test_hf_target.py).
//
//   target_states PLUGIN MODEL_DIR IN.safetensors OUT.safetensors LAYERS [KERNEL] [DTYPE] [DEVICE] [TARGET_KERNELS]
//                 [KEY=VALUE ...]
// (KERNEL: an attention kernel, or several in preference order, "flash_cpu,dense_ref", chosen per problem as
// [attention] kernels with on_fallback = "warn" (the choice is printed); TARGET_KERNELS: the hf target's [target]
// kernels, "engine" or "aten"; KEY=VALUE: more [target] keys of string values, e.g. mxfp4=keep.) IN: "tokens" [B, S]
// int64, "lengths" [B] int64; optionally "documents" [B, K] int64
//     (per row, the lengths of packed documents, 0-padded). LAYERS: "0,1,3" (ids).
// OUT: "hidden" [B, S, E, H] (float32) and, when the model's last layer is requested (its
//     state is after the final RMSNorm), "logits" [B, S, V] = that state times the LM head (times the target's logit
//     scale). Errors: one line on stderr, exit status 1.
//
//   target_states --serve
// runs many of those in one process (LibTorch's start costs ~0.4 s a process; test_hf_target.py makes hundreds of
// runs): each line of stdin is STDOUT_FILE, STDERR_FILE and the arguments above, separated by tabs; the run's output
// goes to the two files and its exit status, as a line, to stdout. Ends at the end of stdin.
#include "../built_plugins.hpp"
#include "dispatch/dispatch.hpp"
#include "dispatch/ledger.hpp"
#include "registry/registry.hpp"

#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>

#include <ATen/ATen.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

template <class T>
std::unique_ptr<T> create(const fd::Registry& reg, fd::PluginKind kind, const std::string& name,
                          const std::map<std::string, fd::Value>& values) {
  const fd::FoundPlugin& p = reg.get(kind, name);
  const fd::Schema schema = reg.schema(p);
  fd::Config config(fd::to_string(kind), fd::SourcePosition{"target_states", 0, 0});
  for (const fd::KeySpec& key : schema.keys()) {
    const auto v = values.find(key.name);
    if (v != values.end())
      config.set(key.name, v->second, std::nullopt);
    else if (key.fallback)
      config.set(key.name, *key.fallback, std::nullopt);
  }
  return fd::create_as<T>(reg, p, config);
}

int run(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: target_states PLUGIN MODEL_DIR IN.safetensors OUT.safetensors LAYERS [KERNEL] [DTYPE]\n";
    return 2;
  }
  const std::string kernel_list = argc > 6 ? argv[6] : "dense_ref", dtype = argc > 7 ? argv[7] : "float32";
  std::vector<int64_t> layers;
  std::stringstream ls(argv[5]);
  for (std::string item; std::getline(ls, item, ',');) layers.push_back(std::stoll(item));
  static const fd::Registry reg({built_plugin_dir()});  // (once for every run of --serve)
  std::map<std::string, fd::Value> values = {{"path", std::string(argv[2])}, {"dtype", dtype}};
  if (argc > 9) values["kernels"] = std::string(argv[9]);
  for (int i = 10; i < argc; ++i) {  // more [target] keys, KEY=VALUE (string values)
    const std::string kv = argv[i];
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      std::cerr << "target_states: argument '" << kv << "' is not KEY=VALUE\n";
      return 2;
    }
    values[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto target = create<fd::Target>(reg, fd::PluginKind::target, argv[1], values);
  fd::RunContext ctx;
  ctx.say = [](const std::string& line) { std::cout << line << "\n"; };
  if (argc > 8) ctx.device = c10::Device(argv[8]);
  target->open(ctx);
  const fd::TargetModel model = target->model();
  const int64_t calls = target->prepare(layers);

  const fd::safetensors::File in(argv[3]);
  fd::Batch batch;
  batch.tokens = in.load("tokens", c10::kCPU, at::kLong);
  batch.lengths = in.load("lengths", c10::kCPU, at::kLong);
  if (in.find("documents")) {
    const at::Tensor docs = in.load("documents", c10::kCPU, at::kLong).contiguous();
    for (int64_t b = 0; b < docs.size(0); ++b) {
      std::vector<int64_t> row;
      for (int64_t k = 0; k < docs.size(1); ++k)
        if (docs[b][k].item<int64_t>() > 0) row.push_back(docs[b][k].item<int64_t>());
      batch.documents.push_back(row);
    }
  }
  auto mask = create<fd::MaskGenerator>(reg, fd::PluginKind::mask, "document", {});
  std::vector<fd::AttentionProblem> problems = target->attention_problems(batch.tokens.size(0), batch.tokens.size(1));
  for (fd::AttentionProblem& p : problems) p.mask = "document";
  std::vector<std::unique_ptr<fd::AttentionKernel>> kernels;
  std::vector<fd::KernelCandidate> candidates;
  std::stringstream ks(kernel_list);
  for (std::string name; std::getline(ks, name, ',');) {
    kernels.push_back(create<fd::AttentionKernel>(reg, fd::PluginKind::kernel, name, {}));
    candidates.push_back({name, kernels.back().get(), {}});
  }
  const std::string policy = candidates.size() > 1 ? "warn" : "error";
  const fd::KernelChoice choice = fd::choose_kernel(problems, candidates, policy);
  if (candidates.size() > 1) std::cout << choice.report();
  fd::KernelLedger ledger;
  ledger.begin_step(0, calls);
  fd::AttentionDispatcher dispatcher(choice, mask.get(), policy, &ledger, nullptr);
  at::NoGradGuard no_grad;
  const at::Tensor hidden = target->hidden_states(batch, layers, dispatcher).to(c10::kCPU, at::kFloat);
  std::vector<std::pair<std::string, at::Tensor>> out = {{"hidden", hidden.contiguous()}};
  for (size_t i = 0; i < layers.size(); ++i)
    if (layers[i] == model.layers - 1)
      out.push_back({"logits", fd::served_logits(
                                   at::linear(hidden.select(2, int64_t(i)), model.lm_head.to(c10::kCPU, at::kFloat)),
                                   model.logit_scale, model.logit_softcap)
                                   .contiguous()});
  fd::safetensors::write(argv[4], out, {{"source", model.source}, {"kernels", ledger.summary(fd::Phase::forward)}});
  std::cout << model.source << "\nkernels " << ledger.summary(fd::Phase::forward) << "\n";
  return 0;
}

int run_caught(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

// fd (1 or 2) onto `path`, truncated; false when it cannot be opened.
bool redirect(int fd, const std::string& path) {
  const int f = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (f < 0) return false;
  ::dup2(f, fd);
  ::close(f);
  return true;
}

int serve() {
  const int status = ::dup(1);  // the exit statuses' stream; runs write to their files
  FILE* statuses = ::fdopen(status, "w");
  if (!statuses) return 2;
  for (std::string line; std::getline(std::cin, line);) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, '\t');) fields.push_back(f);
    int rc = 2;
    if (fields.size() >= 2 && redirect(1, fields[0]) && redirect(2, fields[1])) {
      std::vector<char*> args = {const_cast<char*>("target_states")};
      for (size_t i = 2; i < fields.size(); ++i) args.push_back(fields[i].data());
      rc = run_caught(static_cast<int>(args.size()), args.data());
      std::cout.flush();
      std::cerr.flush();
      std::fflush(stdout);
      std::fflush(stderr);
    }
    redirect(1, "/dev/null"), redirect(2, "/dev/null");
    std::fprintf(statuses, "%d\n", rc);
    std::fflush(statuses);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--serve") return serve();
  return run_caught(argc, argv);
}

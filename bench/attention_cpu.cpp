// bench_attention_cpu: flash_cpu against dense_ref on CPU, time and peak memory.
//
// Problems (fp32, B = 1, H = 4 query and kv heads, D = 64):
//   dflash : S = 1024 context keys, N = 128 anchors x BS = 16 block tokens:
//            Lq = N * BS = 2048, Lkv = S + N * BS = 3072; block n sees the context keys
//            before its anchor and its own 16 block keys (anchors: fixed-seed sample).
//   causal : Lq = Lkv = 2048, k <= q.
// For each kernel (its mask built at the kernel's own block_size()):
//   fwd      : median time of forward over the reps
//   fwd+bwd  : median time of forward then backward (dout random, given)
//   peak     : peak bytes tracked by the engine's CPU allocator (MemoryTracker) during
//              the call, above what was live before it (inputs, dout and mask
//              excluded; outputs, lse, gradients and all scratch included)
// Napkin math: useful FLOPs count only visible (q, k) pairs: forward 4 * pairs * D
// (QK^T and PV), forward+backward 3.5x that (backward: 5 GEMMs of which one recomputes
// S, the FlashAttention-2 convention); GFLOP/s = useful FLOPs / median time.
//
// Usage: bench_attention_cpu [reps=5]. Prints a Markdown table.
#include "registry/registry.hpp"
#include "train/memory.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace fd = flashdraft;

namespace {

using Visible = std::function<bool(int64_t q, int64_t k)>;

std::unique_ptr<fd::AttentionKernel> load_kernel(const fd::Registry& reg, const std::string& name) {
  const fd::FoundPlugin& plugin = reg.get(fd::PluginKind::kernel, name);
  const fd::Schema schema = reg.schema(plugin);
  fd::Config config("kernels." + name, fd::SourcePosition{});
  for (const fd::KeySpec& key : schema.keys()) config.set(key.name, *key.fallback, std::nullopt);
  return fd::create_as<fd::AttentionKernel>(reg, plugin, config);
}

fd::BlockMask build_mask(int64_t q_len, int64_t kv_len, fd::BlockSize bs, const Visible& visible) {
  fd::BlockMaskBuilder builder(1, 1, q_len, kv_len, bs.q, bs.kv);
  const int64_t nq = (q_len + bs.q - 1) / bs.q, nk = (kv_len + bs.kv - 1) / bs.kv;
  for (int64_t i = 0; i < nq; ++i) {
    builder.begin_row();
    for (int64_t j = 0; j < nk; ++j) builder.add_tile(static_cast<int32_t>(j), visible);
  }
  return builder.finish();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.size() % 2 ? x[x.size() / 2] : 0.5 * (x[x.size() / 2 - 1] + x[x.size() / 2]);
}

struct Measure {
  double fwd_s = 0, fwd_bwd_s = 0;
  int64_t fwd_peak = 0, fwd_bwd_peak = 0;
  std::string fwd_variant, bwd_variant;
  double density = 0;  // listed tiles' area / (Lq * Lkv)
};

Measure measure(fd::AttentionKernel& kernel, const fd::AttentionProblem& problem, const Visible& visible, int reps) {
  const fd::BlockMask mask = build_mask(problem.q_len, problem.kv_len, kernel.block_size(problem), visible);
  const fd::BlockMaskTensors tensors = fd::to_tensors(mask, c10::kCPU);
  const double scale = 1.0 / std::sqrt(double(problem.head_dim));
  at::manual_seed(7);
  const at::Tensor q = at::randn({problem.batch, problem.heads_q, problem.q_len, problem.head_dim});
  const at::Tensor k = at::randn({problem.batch, problem.heads_kv, problem.kv_len, problem.head_dim});
  const at::Tensor v = at::randn({problem.batch, problem.heads_kv, problem.kv_len, problem.head_dim});
  const at::Tensor dout = at::randn_like(q);

  Measure m;
  m.density = double((mask.full_count() + mask.partial_count()) * mask.block_q * mask.block_kv) /
              double(problem.q_len * problem.kv_len);
  std::vector<double> fwd, fwd_bwd;
  for (int r = 0; r < reps + 1; ++r) {  // rep 0 warms up and is not timed
    int64_t base = fd::MemoryTracker::live_bytes();
    fd::MemoryTracker::reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    {
      const fd::AttentionForward f = kernel.forward(q, k, v, tensors, scale);
      if (r > 0) fwd.push_back(seconds_since(t0));
      m.fwd_variant = f.variant;
    }
    m.fwd_peak = std::max(m.fwd_peak, fd::MemoryTracker::peak_bytes() - base);

    base = fd::MemoryTracker::live_bytes();
    fd::MemoryTracker::reset_peak();
    t0 = std::chrono::steady_clock::now();
    {
      const fd::AttentionForward f = kernel.forward(q, k, v, tensors, scale);
      const fd::AttentionBackward g = kernel.backward(dout, q, k, v, f.out, f.lse, tensors, scale);
      if (r > 0) fwd_bwd.push_back(seconds_since(t0));
      m.bwd_variant = g.variant;
    }
    m.fwd_bwd_peak = std::max(m.fwd_bwd_peak, fd::MemoryTracker::peak_bytes() - base);
  }
  m.fwd_s = median(fwd);
  m.fwd_bwd_s = median(fwd_bwd);
  return m;
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  fd::MemoryTracker::install();
  const fd::Registry reg({FLASHDRAFT_PLUGIN_DIR});
  std::unique_ptr<fd::AttentionKernel> flash = load_kernel(reg, "flash_cpu");
  std::unique_ptr<fd::AttentionKernel> dense = load_kernel(reg, "dense_ref");

  // DFlash: 128 distinct anchors in [1, S - BS], sorted (fixed seed).
  const int64_t S = 1024, N = 128, BS = 16;
  std::vector<int64_t> positions;
  for (int64_t p = 1; p <= S - BS; ++p) positions.push_back(p);
  std::mt19937_64 rng(2026);
  std::shuffle(positions.begin(), positions.end(), rng);
  std::vector<int64_t> anchor(positions.begin(), positions.begin() + N);
  std::sort(anchor.begin(), anchor.end());
  const Visible dflash = [anchor, S, BS](int64_t q, int64_t k) {
    const int64_t n = q / BS;
    return k < anchor[n] || (k >= S && (k - S) / BS == n);
  };
  const Visible causal = [](int64_t q, int64_t k) { return k <= q; };

  struct Problem {
    std::string name;
    int64_t q_len, kv_len;
    Visible visible;
  };
  const std::vector<Problem> problems = {{"dflash", N * BS, S + N * BS, dflash}, {"causal", 2048, 2048, causal}};

  std::printf("attention_cpu: fp32, B=1, H=4, D=64, %d reps (median), %d threads\n\n", reps, at::get_num_threads());
  std::printf(
      "| mask | Lq x Lkv | kernel | tiles | fwd ms | fwd+bwd ms | fwd GFLOP/s | fwd+bwd GFLOP/s |"
      " peak fwd MiB | peak fwd+bwd MiB |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Problem& p : problems) {
    fd::AttentionProblem problem;
    problem.batch = 1, problem.heads_q = 4, problem.heads_kv = 4, problem.head_dim = 64;
    problem.q_len = p.q_len, problem.kv_len = p.kv_len, problem.mask = p.name;
    int64_t pairs = 0;
    for (int64_t q = 0; q < p.q_len; ++q)
      for (int64_t k = 0; k < p.kv_len; ++k) pairs += p.visible(q, k);
    const double flops = 4.0 * double(pairs) * problem.head_dim * problem.heads_q * problem.batch;

    const Measure f = measure(*flash, problem, p.visible, reps);
    const Measure d = measure(*dense, problem, p.visible, reps);
    auto row = [&](const char* name, const Measure& m) {
      std::printf("| %s | %lld x %lld | %s (%s, %s) | %.0f%% | %.1f | %.1f | %.1f | %.1f | %s | %s |\n", p.name.c_str(),
                  (long long)p.q_len, (long long)p.kv_len, name, m.fwd_variant.c_str(), m.bwd_variant.c_str(),
                  100.0 * m.density, 1e3 * m.fwd_s, 1e3 * m.fwd_bwd_s, flops / m.fwd_s * 1e-9,
                  3.5 * flops / m.fwd_bwd_s * 1e-9, mib(m.fwd_peak).c_str(), mib(m.fwd_bwd_peak).c_str());
    };
    row("flash_cpu", f);
    row("dense_ref", d);
    std::printf("| %s | | flash / dense | | %.2f | %.2f | | | %.3f | %.3f |\n", p.name.c_str(), f.fwd_s / d.fwd_s,
                f.fwd_bwd_s / d.fwd_bwd_s, double(f.fwd_peak) / double(d.fwd_peak),
                double(f.fwd_bwd_peak) / double(d.fwd_bwd_peak));
  }
  std::printf("\ntiles: area of the listed (full + partial) tiles at the kernel's block size / (Lq x Lkv).\n");
  return 0;
}

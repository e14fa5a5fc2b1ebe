// bench_flash_cuda: timing and an external cross-check of the flash_cuda kernel plugin.
//
//   bench_flash_cuda table <rows.md> <xchg dir>
//     bf16, B = 1, H = 32, D = 128: the DFlash mask (S = 4096 context, 512 anchors x 16:
//     Lq = 8192, Lkv = 12288; anchors drawn at random, seed 7) and causal L = 8192, for
//     the sm90a, sm90 and sm120 configurations, each forced the way an experiment forces it
//     ([kernels.flash_cuda] config = "sm90a"; FLASHDRAFT_FLASH_CUDA_CONFIG, which would
//     override every row, is unset first; FLASHDRAFT_BENCH_CONFIGS=sm90a,sm90 limits the list;
//     FLASHDRAFT_BENCH_SCHEDULE=grid sets [kernels.flash_cuda].schedule, default longest-first).
//     Appends markdown rows to <rows.md>; writes the DFlash anchors and the visible-pair
//     counts to <xchg dir> so bench/flex_reference.py times FlexAttention on the same mask.
//   bench_flash_cuda dump <xchg dir> [config]
//     A smaller DFlash problem (B = 2, Hq = 4, Hkv = 2 (GQA), S = 1024, 64 anchors x 16
//     with padding blocks, D = 128, bf16): writes q, k, v, dout (bf16) and flash_cuda's
//     out, lse (fp32), dq, dk, dv (bf16) as raw little-endian files plus meta.json, for
//     bench/flex_reference.py to recompute with PyTorch's own flex_attention. `config`
//     ("auto" unless given) is the [kernels.flash_cuda] config key the kernel is loaded with;
//     meta.json records it with supports()'s note and the variants that ran.
//
// Timing: CUDA events around each call on the current stream, 10 warm-ups, median of
// 30. "bwd" is the backward call alone (preprocess + dK/dV + dQ) given the forward's
// out and lse. TFLOP/s over visible pairs: forward 4 * pairs * D (QK^T and PV, 2 flops
// per multiply-add) per head, backward 2.5x that (the usual FlashAttention accounting:
// 5 GEMMs of which the forward has 2). Peak GiB: the caching allocator's peak during
// one forward + backward minus what was allocated before (q, k, v, dout, mask lists),
// i.e. out, lse, dq, dk, dv and the workspace: the memory attention itself adds.
#include "plugin_loading.hpp"
#include "registry/registry.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/block_mask.hpp>
#include <flashdraft/mask_generator.hpp>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#if FLASHDRAFT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fd = flashdraft;

#if FLASHDRAFT_WITH_CUDA
namespace {

using test::load;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Median milliseconds of fn over `reps` event-timed calls after `warm` warm-ups.
double median_ms(const std::function<void()>& fn, int warm = 10, int reps = 30) {
  for (int i = 0; i < warm; ++i) fn();
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(ev[2 * i], s), "cudaEventRecord");
    fn();
    check(cudaEventRecord(ev[2 * i + 1], s), "cudaEventRecord");
  }
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  std::vector<double> ms(reps);
  for (int i = 0; i < reps; ++i) {
    float t = 0;
    check(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
    ms[i] = t;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// DFlash input: B elements, S context, N anchors of block BS, sorted distinct anchors in
// [0, S - BS]; `pad` blocks per element (the last ones) are padding.
fd::MaskInput dflash_input(int64_t B, int64_t S, int64_t N, int64_t BS, int64_t pad, uint64_t seed) {
  std::mt19937_64 rng(seed);
  fd::MaskInput in;
  in.batch = B, in.blocks.context_len = S, in.blocks.block_size = BS, in.q_len = N * BS, in.kv_len = S + N * BS;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> all(S - BS + 1);
    for (int64_t i = 0; i < int64_t(all.size()); ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> a(all.begin(), all.begin() + N);
    std::sort(a.begin(), a.end());
    std::vector<uint8_t> valid(N, 1);
    for (int64_t n = N - pad; n < N; ++n) valid[n] = 0;
    in.blocks.anchors.push_back(a);
    in.blocks.valid.push_back(valid);
  }
  return in;
}

struct Shape {
  std::string name;
  fd::BlockMask mask;
  int64_t B, H, Lq, Lkv, D;
  double pairs;  // visible (query, key) pairs summed over batch and heads
};

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

int table(const std::string& rows_path, const std::string& xdir) {
  if (const char* env = std::getenv("FLASHDRAFT_FLASH_CUDA_CONFIG")) {
    std::printf("bench_flash_cuda: FLASHDRAFT_FLASH_CUDA_CONFIG=%s unset: each row forces its own configuration\n",
                env);
    unsetenv("FLASHDRAFT_FLASH_CUDA_CONFIG");
  }
  // [kernels.flash_cuda].schedule of every row: FLASHDRAFT_BENCH_SCHEDULE, else the default
  const char* sched_env = std::getenv("FLASHDRAFT_BENCH_SCHEDULE");
  const std::string schedule = sched_env != nullptr && *sched_env ? sched_env : "longest-first";
  const int64_t B = 1, H = 32, D = 128;
  std::vector<Shape> shapes;
  {
    auto gen = load<fd::MaskGenerator>(fd::PluginKind::mask, "dflash", "mask");
    const fd::MaskInput in = dflash_input(B, 4096, 512, 16, 0, 7);
    fd::BlockMask m = gen->build(in, 128, 64);
    const double pairs = double(m.visible_pairs()) * (B / m.batch) * (H / m.heads);
    std::ofstream a(xdir + "/dflash_anchors.txt");
    for (int64_t x : in.blocks.anchors[0]) a << x << "\n";
    shapes.push_back({"DFlash S=4096, 512x16 (Lq 8192, Lkv 12288)", std::move(m), B, H, in.q_len, in.kv_len, D, pairs});
  }
  {
    auto gen = load<fd::MaskGenerator>(fd::PluginKind::mask, "causal", "mask");
    fd::MaskInput in;
    in.batch = B, in.q_len = in.kv_len = 8192;
    fd::BlockMask m = gen->build(in, 128, 64);
    const double pairs = double(m.visible_pairs()) * (B / m.batch) * (H / m.heads);
    shapes.push_back({"causal 8192", std::move(m), B, H, 8192, 8192, D, pairs});
  }
  {
    std::ofstream p(xdir + "/pairs.txt");
    p << "dflash " << size_t(shapes[0].pairs) << "\ncausal " << size_t(shapes[1].pairs) << "\n";
  }
  std::ofstream rows(rows_path, std::ios::app);
  const c10::DeviceIndex dev = 0;
  for (const Shape& sh : shapes) {
    const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::manual_seed(11);
    const at::Tensor q = at::randn({sh.B, sh.H, sh.Lq, sh.D}, opt), k = at::randn({sh.B, sh.H, sh.Lkv, sh.D}, opt),
                     v = at::randn({sh.B, sh.H, sh.Lkv, sh.D}, opt), dout = at::randn({sh.B, sh.H, sh.Lq, sh.D}, opt);
    const fd::BlockMaskTensors t = fd::to_tensors(sh.mask, c10::Device(c10::kCUDA, 0));
    const double scale = 1.0 / std::sqrt(double(sh.D));
    std::vector<std::string> cfgs = {"sm90a", "sm90", "sm120"};
    if (const char* only = std::getenv("FLASHDRAFT_BENCH_CONFIGS")) {  // e.g. "sm90a" or "sm90a,sm90"
      cfgs.clear();
      std::stringstream ss(only);
      for (std::string c; std::getline(ss, c, ',');) cfgs.push_back(c);
    }
    for (const std::string& cfg : cfgs) {
      auto flash = load<fd::AttentionKernel>(fd::PluginKind::kernel, "flash_cuda", "kernels.flash_cuda",
                                             {{"config", cfg}, {"schedule", schedule}});
      fd::AttentionProblem problem;
      problem.device = c10::Device(c10::kCUDA, 0), problem.dtype = at::kBFloat16;
      problem.batch = sh.B, problem.heads_q = problem.heads_kv = sh.H;
      problem.q_len = sh.Lq, problem.kv_len = sh.Lkv, problem.head_dim = sh.D;
      const fd::Support s = flash->supports(problem);
      if (!s.ok) {
        std::printf("| %s | flash_cuda %s: not run: %s |\n", sh.name.c_str(), cfg.c_str(), s.reason.c_str());
        continue;
      }
      torch::cuda::synchronize();
      // peak: one forward + backward
      c10::cuda::CUDACachingAllocator::emptyCache();
      const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(dev).allocated_bytes[0].current;
      c10::cuda::CUDACachingAllocator::resetPeakStats(dev);
      std::string vf, vb;
      {
        fd::AttentionForward f = flash->forward(q, k, v, t, scale);
        fd::AttentionBackward g = flash->backward(dout, q, k, v, f.out, f.lse, t, scale);
        vf = f.variant, vb = g.variant;
        torch::cuda::synchronize();
      }
      const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(dev).allocated_bytes[0].peak;
      const double peak_gib = double(peak - before) / (1024.0 * 1024.0 * 1024.0);
      fd::AttentionForward f = flash->forward(q, k, v, t, scale);
      const double fwd = median_ms([&] { flash->forward(q, k, v, t, scale); });
      const double bwd = median_ms([&] { flash->backward(dout, q, k, v, f.out, f.lse, t, scale); });
      const double fwd_tf = 4.0 * sh.pairs * sh.D / (fwd * 1e-3) / 1e12;
      const double bwd_tf = 2.5 * 4.0 * sh.pairs * sh.D / (bwd * 1e-3) / 1e12;
      const std::string row = "| " + sh.name + " | flash_cuda " + cfg + " (" + vf + ", " + vb + ") | " +
                              fmt("%.3f", fwd) + " | " + fmt("%.3f", bwd) + " | " + fmt("%.3f", fwd + bwd) + " | " +
                              fmt("%.0f", fwd_tf) + " | " + fmt("%.0f", bwd_tf) + " | " + fmt("%.3f", peak_gib) + " |";
      std::printf("%s\n", row.c_str());
      std::fflush(stdout);
      rows << row << "\n";
    }
  }
  return 0;
}

void write_raw(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.contiguous().cpu();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

int dump(const std::string& xdir, const std::string& config) {
  auto flash =
      load<fd::AttentionKernel>(fd::PluginKind::kernel, "flash_cuda", "kernels.flash_cuda", {{"config", config}});
  auto gen = load<fd::MaskGenerator>(fd::PluginKind::mask, "dflash", "mask");
  const int64_t B = 2, Hq = 4, Hkv = 2, S = 1024, N = 64, BS = 16, D = 128;
  const fd::MaskInput in = dflash_input(B, S, N, BS, 3, 1234);
  fd::AttentionProblem problem;
  problem.device = c10::Device(c10::kCUDA, 0), problem.dtype = at::kBFloat16;
  problem.batch = B, problem.heads_q = Hq, problem.heads_kv = Hkv;
  problem.q_len = in.q_len, problem.kv_len = in.kv_len, problem.head_dim = D;
  const fd::Support support = flash->supports(problem);
  if (!support.ok) throw std::runtime_error("[kernels.flash_cuda] config = \"" + config + "\": " + support.reason);
  const fd::BlockMask mask = gen->build(in, 128, 64);
  const fd::BlockMaskTensors t = fd::to_tensors(mask, c10::Device(c10::kCUDA, 0));
  at::manual_seed(2026);
  const auto opt = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor q = at::randn({B, Hq, in.q_len, D}, opt), k = at::randn({B, Hkv, in.kv_len, D}, opt),
                   v = at::randn({B, Hkv, in.kv_len, D}, opt), dout = at::randn({B, Hq, in.q_len, D}, opt);
  const double scale = 1.0 / std::sqrt(double(D));
  const fd::AttentionForward f = flash->forward(q, k, v, t, scale);
  const fd::AttentionBackward g = flash->backward(dout, q, k, v, f.out, f.lse, t, scale);
  torch::cuda::synchronize();
  for (const auto& [name, x] : std::vector<std::pair<std::string, at::Tensor>>{{"q", q},
                                                                               {"k", k},
                                                                               {"v", v},
                                                                               {"dout", dout},
                                                                               {"out", f.out},
                                                                               {"lse", f.lse},
                                                                               {"dq", g.dq},
                                                                               {"dk", g.dk},
                                                                               {"dv", g.dv}})
    write_raw(xdir + "/" + name + ".bin", x);
  std::ofstream m(xdir + "/meta.json");
  m << "{\"B\": " << B << ", \"Hq\": " << Hq << ", \"Hkv\": " << Hkv << ", \"Lq\": " << in.q_len
    << ", \"Lkv\": " << in.kv_len << ", \"D\": " << D << ", \"S\": " << S << ", \"BS\": " << BS
    << ", \"scale\": " << fmt("%.17g", scale) << ", \"config\": \"" << config << "\", \"note\": \"" << support.reason
    << "\", \"variant_fwd\": \"" << f.variant << "\", \"variant_bwd\": \"" << g.variant << "\", \"anchors\": [";
  for (int64_t b = 0; b < B; ++b) {
    m << (b ? ", " : "") << "[";
    for (int64_t n = 0; n < N; ++n) m << (n ? ", " : "") << in.blocks.anchors[b][n];
    m << "]";
  }
  m << "], \"valid\": [";
  for (int64_t b = 0; b < B; ++b) {
    m << (b ? ", " : "") << "[";
    for (int64_t n = 0; n < N; ++n) m << (n ? ", " : "") << int(in.blocks.valid[b][n]);
    m << "]";
  }
  m << "]}\n";
  std::printf("dump: DFlash B=%lld Hq=%lld Hkv=%lld Lq=%lld Lkv=%lld D=%lld, config \"%s\": %s -> %s (%s, %s)\n",
              (long long)B, (long long)Hq, (long long)Hkv, (long long)in.q_len, (long long)in.kv_len, (long long)D,
              config.c_str(), support.reason.c_str(), xdir.c_str(), f.variant.c_str(), g.variant.c_str());
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
#if FLASHDRAFT_WITH_CUDA
  if (!torch::cuda::is_available()) {
    std::printf("bench_flash_cuda: no CUDA device here; run it on the GPU machine (bench/flash_cuda_device.sh)\n");
    return 0;
  }
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "table" && argc == 4) return table(argv[2], argv[3]);
    if (mode == "dump" && (argc == 3 || argc == 4)) return dump(argv[2], argc == 4 ? argv[3] : "auto");
    std::fprintf(stderr, "usage: %s table <rows.md> <xchg dir> | dump <xchg dir> [auto|sm90a|sm90|sm120]\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_flash_cuda: %s\n", e.what());
    return 1;
  }
#else
  (void)argc, (void)argv;
  std::printf("bench_flash_cuda: this LibTorch has no CUDA; nothing to run\n");
  return 0;
#endif
}

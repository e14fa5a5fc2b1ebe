// bench_decoder_ops: the online target's memory-bound passes (the engine's frozen decoder-layer
// kernels, core/cuda/decoder_ops.cu) against the card's copy rate, at one layer of a
// Qwen3-8B-shaped target (hidden 4096, 32 / 8 heads of 128, ffn 12288), bf16.
//
//   bench_decoder_ops [tokens]        (default 3072: the target_forward benchmark's S, B = 1)
//
// Rows: add_rms_norm (x + delta -> sum, normed), the q|k|v RoPE (per-head norms, heads split),
// SwiGLU, and a plain device-to-device copy of the q|k|v buffer (at::Tensor::copy_) as the memory rate to compare
// with. Timing: CUDA events around each call, the L2 cache overwritten before every call (a
// 256 MiB memset outside the events: every pass reads from memory, as the target's passes read
// most of what a GEMM wrote before them), 5 warm-ups, median of 40. Bytes: what each pass must
// read and write once (the RoPE tables and norm weights, a few hundred KB, not counted).
// FLASHDRAFT_PDL=0 in the environment launches the kernels without programmatic dependent launch.
#include "dispatch/cuda_ops.hpp"  // cuda_ops_built

#include <flashdraft/ops.hpp>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#if FLASHDRAFT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "bench_common.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace fd = flashdraft;

#if FLASHDRAFT_WITH_CUDA
namespace {

double median_us(const std::function<void()>& call, const at::Tensor& scratch) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int i = 0; i < 45; ++i) {
    scratch.fill_(static_cast<int64_t>(i & 1));  // overwrites L2
    cudaEventRecord(start, stream);
    call();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 5) times.push_back(1e3 * ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int run(int64_t tokens) {
  const int64_t H = 4096, Hq = 32, Hkv = 8, D = 128, I = 12288;
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::manual_seed(0);
  const at::Tensor scratch = at::empty({256 << 20}, at::TensorOptions().device(at::kCUDA).dtype(at::kByte));
  const at::Tensor x = at::randn({1, tokens, H}, opts), delta = at::randn({1, tokens, H}, opts);
  const at::Tensor w = 1 + 0.1 * at::randn({H}, opts);
  const at::Tensor qkv = at::randn({1, tokens, (Hq + 2 * Hkv) * D}, opts);
  const at::Tensor qn = 1 + 0.1 * at::randn({D}, opts), kn = 1 + 0.1 * at::randn({D}, opts);
  const auto [cos, sin] = fd::rope_tables(at::arange(tokens, at::TensorOptions().device(at::kCUDA).dtype(at::kLong)),
                                          1e6, D, at::kBFloat16);
  const at::Tensor gate_up = at::randn({1, tokens, 2 * I}, opts);
  at::Tensor copy_dst = at::empty_like(qkv);
  const double MB = 1e6, e = 2;  // bytes per bf16 value

  struct Row {
    std::string name;
    double bytes, us;
  };
  std::vector<Row> rows;
  const double copy_bytes = 2 * qkv.numel() * e;
  rows.push_back(
      {"copy of the q|k|v buffer (memory rate)", copy_bytes, median_us([&] { copy_dst.copy_(qkv); }, scratch)});
  rows.push_back({"add_rms_norm (x + delta -> sum, normed)", 4 * tokens * H * e,
                  median_us([&] { fd::frozen::add_rms_norm(x, delta, w, 1e-6, true); }, scratch)});
  rows.push_back({"q|k|v RoPE (per-head q/k norms, heads split)", copy_bytes,
                  median_us([&] { fd::frozen::qkv_rope(qkv, Hq, Hkv, qn, kn, 1e-6, cos, sin, true); }, scratch)});
  rows.push_back({"SwiGLU (gate|up -> out)", 3 * tokens * I * e,
                  median_us([&] { fd::frozen::swiglu_packed(gate_up, true); }, scratch)});
  const double copy_rate = rows[0].bytes / rows[0].us;
  const char* pdl = std::getenv("FLASHDRAFT_PDL");
  std::printf(
      "bf16, %lld tokens, hidden %lld, %lld / %lld heads of %lld, ffn %lld; programmatic dependent launch %s\n\n",
      static_cast<long long>(tokens), static_cast<long long>(H), static_cast<long long>(Hq),
      static_cast<long long>(Hkv), static_cast<long long>(D), static_cast<long long>(I),
      pdl && std::string(pdl) == "0" ? "off (FLASHDRAFT_PDL=0)" : "on where the card has it");
  std::printf(
      "| pass | MB moved | us | GB/s | / copy rate | x 34 layers, ms |\n| --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows)
    std::printf("| %s | %.1f | %.1f | %.0f | %.2f | %.2f |\n", r.name.c_str(), r.bytes / MB, r.us, r.bytes / r.us / 1e3,
                (r.bytes / r.us) / copy_rate, 34 * r.us / 1e3 * (r.name.rfind("add_rms_norm", 0) == 0 ? 2 : 1));
  std::printf("\n(add_rms_norm runs twice per layer: its last column counts 68 calls; the copy's counts 34.)\n");
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
#if FLASHDRAFT_WITH_CUDA
  if (!torch::cuda::is_available() || !fd::cuda_ops::cuda_ops_built()) {
    std::fprintf(stderr, "bench_decoder_ops: needs a CUDA device and the engine's CUDA kernels\n");
    return 1;
  }
  return run(flashdraft::bench::whole_arg(argc, argv, 1, 3072, 1, 1 << 20, "bench_decoder_ops", "tokens"));
#else
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "bench_decoder_ops: built without CUDA\n");
  return 1;
#endif
}

// bench_gemm_swiglu: the online target's gate / up product and SwiGLU (Qwen3-8B: x [M, 4096],
// W = [Wg; Wu] [2 x 12288, 4096], bf16) as the engine runs it on Hopper -- one kernel with SwiGLU
// in its epilogue (frozen::linear_swiglu, core/cuda/gemm_sm90a.cu) -- against cuBLAS's product
// (torch's choice) followed by the engine's swiglu_packed pass, and cuBLAS's product alone.
//
//   bench_gemm_swiglu [tokens] [hidden] [ffn] [rounds]   (defaults 3072 4096 12288 10)
//
// First a check on fresh random normal inputs (never zeros), at the given shape and at row
// counts that end inside a tile (1, 77, tokens - 45): both ways against a float32 product
// rounded to bf16 and put through the same SwiGLU roundings; the fused kernel must be as close
// to it as cuBLAS's way is (exit 1 otherwise). Then the three ways alternate in `rounds` rounds
// (the first a warm-up), each timing 3 calls back to back between CUDA events; the median per call.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include "dispatch/cuda_ops.hpp"

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

#if FLASHDRAFT_WITH_CUDA
namespace {

using namespace flashdraft;

struct Closeness {
  double max_rel = 0, equal = 0;  // max |a - ref| / max |ref|; share of values equal to ref
};
Closeness closeness(const at::Tensor& a, const at::Tensor& ref) {
  const at::Tensor af = a.to(at::kFloat), rf = ref.to(at::kFloat);
  return {(af - rf).abs().max().item<double>() / std::max(rf.abs().max().item<double>(), 1e-30),
          af.eq(rf).to(at::kDouble).mean().item<double>()};
}

// false: the fused kernel is further from the float32 reference than cuBLAS's way
bool check(int64_t M, int64_t K, int64_t I, uint64_t seed) {
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::manual_seed(seed);
  const at::Tensor x = at::randn({M, K}, opts), w = at::randn({2 * I, K}, opts).mul_(1.0 / std::sqrt(double(K)));
  const at::Tensor ref = cuda_ops::swiglu_packed(at::mm(x.to(at::kFloat), w.to(at::kFloat).t()).to(at::kBFloat16));
  const at::Tensor fused = cuda_ops::linear_swiglu(x, w), cublas = cuda_ops::swiglu_packed(at::linear(x, w));
  const Closeness f = closeness(fused, ref), c = closeness(cublas, ref);
  const bool ok = f.max_rel <= 2 * c.max_rel + 1e-3 && f.equal >= c.equal - 0.01;
  std::printf("check M %lld K %lld I %lld: fused max %.2e, %.2f%% equal; cuBLAS + pass max %.2e, %.2f%% equal: %s\n",
              static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(I), f.max_rel, 100 * f.equal,
              c.max_rel, 100 * c.equal, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  using flashdraft::bench::whole_arg;
  const char* me = "bench_gemm_swiglu";
  const int64_t M = whole_arg(argc, argv, 1, 3072, 1, 1 << 20, me, "tokens");
  const int64_t K = whole_arg(argc, argv, 2, 4096, 64, 1 << 16, me, "hidden");
  const int64_t I = whole_arg(argc, argv, 3, 12288, 128, 1 << 18, me, "ffn");
  const int64_t rounds = whole_arg(argc, argv, 4, 10, 2, 1000, me, "rounds");
  if (!torch::cuda::is_available()) {
    std::printf("bench_gemm_swiglu: no CUDA device\n");
    return 0;
  }
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  if (!cuda_ops::linear_swiglu_applies(at::empty({M, K}, opts), at::empty({2 * I, K}, opts))) {
    std::printf(
        "bench_gemm_swiglu: the fused kernel does not apply here (it needs a compute capability 9.0 device, "
        "K %% 64 == 0, I %% 128 == 0): nothing to compare\n");
    return 0;
  }
  bool ok = true;
  for (const int64_t m : {M, int64_t(1), int64_t(77), std::max<int64_t>(1, M - 45)})
    ok = check(m, K, I, 1234 + m) && ok;
  if (!ok) return 1;

  at::manual_seed(7);
  const at::Tensor x = at::randn({M, K}, opts), w = at::randn({2 * I, K}, opts).mul_(1.0 / std::sqrt(double(K)));
  struct Way {
    const char* name;
    std::function<at::Tensor()> call;
    std::vector<float> ms;
  };
  std::vector<Way> ways = {{"fused (linear_swiglu)", [&] { return cuda_ops::linear_swiglu(x, w); }, {}},
                           {"cuBLAS + swiglu_packed", [&] { return cuda_ops::swiglu_packed(at::linear(x, w)); }, {}},
                           {"cuBLAS product alone", [&] { return at::linear(x, w); }, {}}};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  flashdraft::bench::alternating_rounds(ways, static_cast<int>(rounds), 3, stream);
  const double flop = 2.0 * M * K * 2 * I;
  std::printf("\n| way | us per call (median of %lld rounds) | TFLOP/s of the product | / cuBLAS + pass |\n",
              static_cast<long long>(rounds - 1));
  std::printf("| --- | --- | --- | --- |\n");
  std::vector<double> med;
  for (Way& way : ways) {
    std::sort(way.ms.begin(), way.ms.end());
    med.push_back(way.ms[way.ms.size() / 2]);
  }
  for (size_t i = 0; i < ways.size(); ++i)
    std::printf("| %s | %.1f | %.0f | %.3f |\n", ways[i].name, 1e3 * med[i], flop / (med[i] * 1e-3) / 1e12,
                med[i] / med[1]);
  std::printf("per forward of 34 layers: fused %.2f ms, cuBLAS + pass %.2f ms (%+.2f ms)\n", 34 * med[0], 34 * med[1],
              34 * (med[0] - med[1]));
  return 0;
}
#else
int main() {
  std::printf("bench_gemm_swiglu: built without CUDA\n");
  return 0;
}
#endif

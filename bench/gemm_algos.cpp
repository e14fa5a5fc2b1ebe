// bench_gemm_algos: the online target's four matrix products at their shapes (Qwen3-8B: hidden
// 4096, 32 / 8 heads of 128, ffn 12288; bf16, fp32 accumulation), as torch runs them (at::mm_out /
// addmm_, cuBLAS's own choice) against every algorithm cuBLASLt's heuristic offers for the same
// product: is there a faster one than the one taken?
//
//   bench_gemm_algos [tokens] [candidates]   (defaults 3072 and 24; at most 2^20 and 64)
//
// Rows: qkv [M x 4096] x [4096 x 6144], o [.. x 4096] x [4096 x 4096], gate_up x [4096 x 24576],
// down [.. x 12288] x [12288 x 4096]; "+add" rows add the product into an existing [M x N]
// (beta = 1), as the target's o and down products do. Timing: the candidates of a row alternate
// in 10 rounds, the first a warm-up; each round times 3 calls back to back between CUDA events (the card is busy the
// whole row, as in the step, where the products run between memory-bound passes); the median
// of the rounds, per call. Every candidate's result is compared with torch's on the same inputs
// (random normal, never zeros): max |diff| / max |torch's|.
//
// What it found (RESULTS.md, "target_forward v5"): alone, one of cuBLASLt's other candidates is
// 1-4% faster than torch's choice at each of the four shapes, every one equal to torch's values bit
// for bit. Inside the target's step it is not: the hf target running each shape on the candidate
// timed fastest at its first product took 67.69 ms per forward against 67.44 with torch's choice
// (H100, three alternating pairs of runs), so the target keeps torch's choice.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#if FLASHDRAFT_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
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

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_gemm_algos: %s failed: cublasStatus %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

// One product C[M, N] (+)= A[M, K] W[N, K]^T, row-major, as cuBLASLt sees it: column-major
// C^T[N, M] = op(W)^T A^T, i.e. transa = T on W (K x N, ld K), transb = N on A (K x M, ld K).
struct LtProduct {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, c = nullptr;
  LtProduct(int64_t m, int64_t k, int64_t n) {
    lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "TRANSA");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)), "TRANSB");
    lt_check(cublasLtMatrixLayoutCreate(&w, CUDA_R_16BF, k, n, k), "layout W");
    lt_check(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, m, k), "layout A");
    lt_check(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, n, m, n), "layout C");
  }
  ~LtProduct() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(w);
    cublasLtMatmulDescDestroy(op);
  }
};

struct Candidate {
  std::string name;
  std::function<void()> call;
  std::vector<float> ms;  // per call, one entry a round
  double err = 0;
};

template <class T>
T algo_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}

int run(int64_t M, int want) {
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const size_t ws_bytes = size_t(64) << 20;
  // (a tensor first: it initialises torch's CUDA allocator, which the handle's workspace uses)
  const at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, opts.dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  struct Row {
    const char* name;
    int64_t k, n;
    bool add;
    int per_layer;  // how many of the 34 layers' products take this row's form (o, down: the adds)
  };
  const std::vector<Row> rows = {{"qkv", 4096, 6144, false, 1},      {"o +add", 4096, 4096, true, 1},
                                 {"gate_up", 4096, 24576, false, 1}, {"down +add", 12288, 4096, true, 1},
                                 {"o", 4096, 4096, false, 0},        {"down", 12288, 4096, false, 0}};
  std::printf("M = %ld tokens, bf16, fp32 accumulation; %d heuristic candidates asked for each product\n\n",
              static_cast<long>(M), want);
  std::printf(
      "| product | torch us | TFLOP/s | best cuBLASLt candidate | us | TFLOP/s | best / torch | heuristic #0 / torch | "
      "candidates |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  double layer_torch = 0, layer_best = 0;
  for (const Row& r : rows) {
    at::manual_seed(1234);
    const at::Tensor a = at::randn({M, r.k}, opts);
    const at::Tensor w = at::randn({r.n, r.k}, opts).mul_(1.0 / std::sqrt(double(r.k)));
    const at::Tensor c0 = at::randn({M, r.n}, opts);
    at::Tensor c = c0.clone();
    const at::Tensor ref = r.add ? at::addmm(c0, a, w.t()) : at::mm(a, w.t());
    const double ref_max = ref.abs().max().item<double>();
    LtProduct lt(M, r.k, r.n);
    cublasLtMatmulPreference_t pref = nullptr;
    lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                  sizeof(ws_bytes)),
             "MAX_WORKSPACE_BYTES");
    std::vector<cublasLtMatmulHeuristicResult_t> found(static_cast<size_t>(want));
    int count = 0;
    lt_check(cublasLtMatmulAlgoGetHeuristic(handle, lt.op, lt.w, lt.a, lt.c, lt.c, pref, want, found.data(), &count),
             "AlgoGetHeuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    std::vector<Candidate> cands;
    cands.push_back({"torch",
                     [&] {
                       if (r.add)
                         c.addmm_(a, w.t());
                       else
                         at::mm_out(c, a, w.t());
                     },
                     {},
                     0.0});
    const float one = 1.f, zero = 0.f;
    for (int i = 0; i < count; ++i) {
      const cublasLtMatmulAlgo_t algo = found[static_cast<size_t>(i)].algo;
      char name[160];
      std::snprintf(name, sizeof(name), "#%d (id %d tile %u stages %u splitk %d cluster %u ws %zu KB)", i,
                    algo_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID),
                    algo_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                    algo_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                    algo_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                    static_cast<unsigned>(algo_attr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)),
                    found[static_cast<size_t>(i)].workspaceSize >> 10);
      cands.push_back({name,
                       [&, algo] {
                         lt_check(cublasLtMatmul(handle, lt.op, &one, w.data_ptr(), lt.w, a.data_ptr(), lt.a,
                                                 r.add ? &one : &zero, c.data_ptr(), lt.c, c.data_ptr(), lt.c, &algo,
                                                 ws.data_ptr(), ws_bytes, stream),
                                  "Matmul");
                       },
                       {},
                       0.0});
    }
    // correctness first: each candidate once on c = c0
    for (Candidate& cd : cands) {
      c.copy_(c0);
      cd.call();
      cd.err = (c.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<double>() / ref_max;
    }
    flashdraft::bench::alternating_rounds(cands, 10, 3, stream);  // round 0 warms up
    const double flop = 2.0 * double(M) * double(r.k) * double(r.n);
    auto med = [](std::vector<float> v) {
      std::sort(v.begin(), v.end());
      return double(v[v.size() / 2]);
    };
    const double torch_ms = med(cands[0].ms);
    size_t best = 0;  // the fastest candidate whose result agrees with torch's (0: none does)
    for (size_t i = 1; i < cands.size(); ++i)
      if (cands[i].err < 1e-2 && (best == 0 || med(cands[i].ms) < med(cands[best].ms))) best = i;
    const double best_ms = med(cands[best].ms);
    const double first_ms = cands.size() > 1 ? med(cands[1].ms) : torch_ms;
    std::printf("| %s | %.1f | %.0f | %s | %.1f | %.0f | %.3f | %.3f | %d |\n", r.name, 1e3 * torch_ms,
                flop / torch_ms / 1e9, best > 0 ? cands[best].name.c_str() : "-", 1e3 * best_ms, flop / best_ms / 1e9,
                best_ms / torch_ms, first_ms / torch_ms, count);
    layer_torch += r.per_layer * torch_ms;
    layer_best += r.per_layer * std::min(best_ms, torch_ms);
    std::fprintf(stderr, "%s: every candidate (median us of 9 rounds, max |diff| / max |torch|)\n", r.name);
    for (const Candidate& cd : cands)
      std::fprintf(stderr, "  %8.1f  %.2e  %s\n", 1e3 * med(cd.ms), cd.err, cd.name.c_str());
  }
  std::printf(
      "\none layer (qkv, o +add, gate_up, down +add) x 34: torch's choices %.2f ms, the best candidates %.2f ms "
      "(%.3f)\n",
      34 * layer_torch, 34 * layer_best, layer_best / layer_torch);
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
#if FLASHDRAFT_WITH_CUDA
  // [tokens] in 1..1048576, [candidates] in 1..64: whole numbers, else a sentence naming the value
  const int64_t M =
      flashdraft::bench::whole_arg(argc, argv, 1, 3072, 1, int64_t(1) << 20, "bench_gemm_algos", "tokens");
  const int want =
      static_cast<int>(flashdraft::bench::whole_arg(argc, argv, 2, 24, 1, 64, "bench_gemm_algos", "candidates"));
  if (!torch::cuda::is_available()) {
    std::printf("bench_gemm_algos: no CUDA device here; run it on the GPU machine\n");
    return 0;
  }
  return run(M, want);
#else
  (void)argc;
  (void)argv;
  std::printf("bench_gemm_algos: built without CUDA\n");
  return 0;
#endif
}

// tuned_products.hpp: the fastest cuBLASLt algorithm per product shape, equal to torch's bit for bit.
#include "dispatch/tuned_products.hpp"

#include <cstdlib>
#include <mutex>

#if FLASHDRAFT_CUDA_OPS
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <tuple>
#endif

namespace flashdraft::tuned {

namespace {

std::mutex reports_mu;
std::vector<std::string>& reports() {
  static std::vector<std::string> r;
  return r;
}
[[maybe_unused]] void report(std::string line) {
  std::lock_guard<std::mutex> lock(reports_mu);
  reports().push_back(std::move(line));
}

}  // namespace

std::vector<std::string> take_reports() {
  std::lock_guard<std::mutex> lock(reports_mu);
  std::vector<std::string> r;
  r.swap(reports());
  return r;
}

#if FLASHDRAFT_CUDA_OPS

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("FLASHDRAFT_TUNE_PRODUCTS");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

namespace {

constexpr size_t kMaxShapes = 64;  // shapes tuned per process; later shapes take torch's choice
constexpr int kRounds = 5;         // timed rounds per candidate (after one warm-up round)

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("tuned product: cuBLASLt ") + what + " failed: " + cublasLtGetStatusString(s));
}

// The product as cuBLASLt sees it: row-major out[M, N] = a[M, K] w[N, K]^T is column-major
// out^T[N, M] = op(w)^T a^T, w a K x N matrix (ld K) taken transposed, a a K x M matrix (ld K).
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, c = nullptr;
  Descs(int64_t m, int64_t k, int64_t n, cudaDataType_t type) {
    lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "TRANSA");
    lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)), "TRANSB");
    lt_check(cublasLtMatrixLayoutCreate(&w, type, static_cast<uint64_t>(k), static_cast<uint64_t>(n), k), "layout w");
    lt_check(cublasLtMatrixLayoutCreate(&a, type, static_cast<uint64_t>(k), static_cast<uint64_t>(m), k), "layout a");
    lt_check(cublasLtMatrixLayoutCreate(&c, type, static_cast<uint64_t>(n), static_cast<uint64_t>(m), n), "layout out");
  }
  ~Descs() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;
};

struct Key {
  int device;
  int64_t m, k, n;
  int dtype;
  bool acc;
  uint32_t align_a, align_w, align_c;  // bytes: the heuristic's candidates assume them
  bool operator<(const Key& o) const {
    return std::tie(device, m, k, n, dtype, acc, align_a, align_w, align_c) <
           std::tie(o.device, o.m, o.k, o.n, o.dtype, o.acc, o.align_a, o.align_w, o.align_c);
  }
};

struct Plan {
  bool torch = true;  // torch's own op (it was fastest, or no candidate qualified)
  cublasLtMatmulAlgo_t algo{};
  std::shared_ptr<Descs> d;
};

uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

void torch_product(at::Tensor out2, const at::Tensor& a2, const at::Tensor& w, bool acc) {
  if (acc)
    out2.addmm_(a2, w.t());
  else
    at::mm_out(out2, a2, w.t());
}

cublasStatus_t lt_product(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const at::Tensor& out2,
                          const at::Tensor& a2, const at::Tensor& w, bool acc, cudaStream_t stream) {
  const float one = 1.f, zero = 0.f;
  return cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), plan.d->op, &one, w.data_ptr(), plan.d->w,
                        a2.data_ptr(), plan.d->a, acc ? &one : &zero, out2.data_ptr(), plan.d->c, out2.data_ptr(),
                        plan.d->c, &algo, nullptr, 0, stream);
}

template <class T>
T config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
  return v;
}

std::string shape_text(const Key& k) {
  char s[128];
  std::snprintf(s, sizeof(s), "[%ld x %ld] x [%ld x %ld]%s", static_cast<long>(k.m), static_cast<long>(k.k),
                static_cast<long>(k.k), static_cast<long>(k.n), k.acc ? " added into its output" : "");
  return s;
}

// Times every qualified candidate (index -1: torch's op) on the call's operands into scratch
// outputs, interleaved round by round; keeps the fastest by median.
Plan tune(const Key& key, const at::Tensor& out2, const at::Tensor& a2, const at::Tensor& w) {
  Plan plan;
  plan.d = std::make_shared<Descs>(key.m, key.k, key.n,
                                   out2.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  const uint64_t no_workspace = 0;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace,
                                       sizeof(no_workspace));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_w,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c,
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c,
                                       sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t found[16];
  int count = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), plan.d->op,
                                                           plan.d->w, plan.d->a, plan.d->c, plan.d->c, pref, 16,
                                                           found, &count);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS) count = 0;

  // torch's result, and each candidate's on the same operands: only those equal to it bit for bit
  const at::Tensor base = key.acc ? out2.clone() : at::Tensor();
  const at::Tensor ref = key.acc ? base.clone() : at::empty_like(out2);
  torch_product(ref, a2, w, key.acc);
  at::Tensor scratch = at::empty_like(out2);
  auto reset = [&] {
    if (key.acc) scratch.copy_(base);
  };
  std::vector<cublasLtMatmulAlgo_t> qualified;
  for (int i = 0; i < count; ++i) {
    const cublasLtMatmulAlgo_t& algo = found[i].algo;
    if (found[i].workspaceSize != 0 || config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) continue;
    reset();
    if (lt_product(plan, algo, scratch, a2, w, key.acc, stream) != CUBLAS_STATUS_SUCCESS) continue;
    if (at::equal(scratch, ref)) qualified.push_back(algo);
  }
  const int n = static_cast<int>(qualified.size());
  std::vector<std::vector<float>> ms(static_cast<size_t>(n) + 1);
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int round = 0; round <= kRounds && n > 0; ++round)
    for (int c = -1; c < n; ++c) {
      reset();
      cudaEventRecord(start, stream);
      for (int rep = 0; rep < 2; ++rep) {
        if (c < 0)
          torch_product(scratch, a2, w, key.acc);
        else
          lt_check(lt_product(plan, qualified[static_cast<size_t>(c)], scratch, a2, w, key.acc, stream), "Matmul");
      }
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float t = 0;
      cudaEventElapsedTime(&t, start, stop);
      if (round > 0) ms[static_cast<size_t>(c + 1)].push_back(t / 2);
    }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::string line = "product " + shape_text(key) + ": ";
  if (n == 0) {
    report(line + "torch's choice (no cuBLASLt candidate without workspace gives its values bit for bit, of " +
           std::to_string(count) + ")");
    return plan;
  }
  int best = -1;
  float best_ms = median(ms[0]);
  for (int c = 0; c < n; ++c) {
    const float t = median(ms[static_cast<size_t>(c + 1)]);
    if (t < best_ms) best = c, best_ms = t;
  }
  char text[256];
  const float torch_ms = median(ms[0]);
  if (best < 0) {
    std::snprintf(text, sizeof(text), "torch's choice, %.3f ms (the fastest of it and %d cuBLASLt candidates equal to "
                  "it bit for bit)", torch_ms, n);
  } else {
    plan.torch = false;
    plan.algo = qualified[static_cast<size_t>(best)];
    std::snprintf(text, sizeof(text), "cuBLASLt tile %u (cublasLtMatmulTile_t), cluster %u, %.3f ms against torch's "
                  "choice %.3f ms (%d candidates equal to torch's values bit for bit)",
                  config<uint32_t>(plan.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  static_cast<unsigned>(config<uint16_t>(plan.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)), best_ms,
                  torch_ms, n);
  }
  report(line + text);
  return plan;
}

}  // namespace

bool product(const at::Tensor& out, const at::Tensor& a, const at::Tensor& w, bool accumulate) {
  if (!enabled() || !out.defined() || !a.defined() || !w.defined() || !out.is_cuda()) return false;
  const at::ScalarType t = out.scalar_type();
  if ((t != at::kBFloat16 && t != at::kHalf) || a.scalar_type() != t || w.scalar_type() != t) return false;
  if (a.device() != out.device() || w.device() != out.device() || w.dim() != 2 || a.dim() < 1 || out.dim() < 1)
    return false;
  if (!out.is_contiguous() || !a.is_contiguous() || !w.is_contiguous()) return false;
  const int64_t K = w.size(1), N = w.size(0);
  if (K == 0 || N == 0 || a.size(-1) != K || out.size(-1) != N) return false;
  const int64_t M = a.numel() / K;
  if (M == 0 || out.numel() / N != M || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return false;
  const c10::cuda::CUDAGuard guard(out.device());
  const Key key{out.device().index(), M, K, N, static_cast<int>(t), accumulate, alignment(a.data_ptr()),
                alignment(w.data_ptr()), alignment(out.data_ptr())};
  const at::Tensor out2 = out.view({M, N}), a2 = a.view({M, K});
  Plan plan;
  {
    static std::mutex mu;
    static std::map<Key, Plan> plans;
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it == plans.end()) {
      if (plans.size() >= kMaxShapes) {
        if (plans.size() == kMaxShapes)
          report("product " + shape_text(key) + ": torch's choice, untuned (" + std::to_string(kMaxShapes) +
                 " shapes tuned already; later shapes take torch's choice)");
        it = plans.emplace(key, Plan{}).first;
      } else {
        it = plans.emplace(key, tune(key, out2, a2, w)).first;
      }
    }
    plan = it->second;
  }
  if (plan.torch)
    torch_product(out2, a2, w, accumulate);
  else
    lt_check(lt_product(plan, plan.algo, out2, a2, w, accumulate, c10::cuda::getCurrentCUDAStream().stream()),
             "Matmul");
  return true;
}

#else

bool enabled() { return false; }
bool product(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) { return false; }

#endif

}  // namespace flashdraft::tuned

// AdamW with float32 master weights and moments, reading the gradient in its own dtype
// (engine_ops.cuh: adamw_mixed). ATen's fused AdamW needs the gradient in the master's
// dtype and leaves the 16-bit copy to the caller: for bf16 training that is a cast of
// every gradient to float32 (read 2 + write 4 bytes per value) and a copy of every master
// back (read 4 + write 2) around the update (read 2 + 12, write 12). Here the update reads
// 14 and writes 14 bytes per value, once.
// The arithmetic follows ATen's fused AdamW (ADAMW mode): decoupled decay first, then the
// moments, then the bias-corrected step; bias corrections in double from the device step.
#include "ops_common.cuh"

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kILP = 4;  // values per thread per iteration (16 bytes of each float32 array)

struct Consts {
  float lr, beta1, beta2, eps, decay;  // decay = lr * weight_decay
  float step_size, bc2_sqrt;           // lr / (1 - b1^t), sqrt(1 - b2^t)
  float inv_scale;
};

__device__ __forceinline__ Consts consts(const AdamWArgs a) {
  Consts c;
  const double t = static_cast<double>(*a.step);
  const double bc1 = 1.0 - pow(a.beta1, t), bc2 = 1.0 - pow(a.beta2, t);
  c.lr = static_cast<float>(a.lr);
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.decay = static_cast<float>(a.lr * a.weight_decay);
  c.step_size = static_cast<float>(a.lr / bc1);
  c.bc2_sqrt = static_cast<float>(sqrt(bc2));
  c.inv_scale = a.grad_scale ? 1.f / *a.grad_scale : 1.f;
  return c;
}

__device__ __forceinline__ float update(const Consts& c, float g, float& w, float& m, float& v) {
  g *= c.inv_scale;
  w -= c.decay * w;
  m = c.beta1 * m + (1.f - c.beta1) * g;
  v = c.beta2 * v + (1.f - c.beta2) * g * g;
  const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
  w -= c.step_size * m / denom;
  return w;
}

template <typename T>
__global__ void adamw_kernel(T* __restrict__ param, const T* __restrict__ grad, float* __restrict__ master,
                             float* __restrict__ m, float* __restrict__ v, int64_t n, AdamWArgs args, bool vec) {
  if (args.skip && *args.skip != 0.f) return;
  const Consts c = consts(args);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = vec ? n / kILP : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    float4 w4 = reinterpret_cast<float4*>(master)[i];
    float4 m4 = reinterpret_cast<float4*>(m)[i];
    float4 v4 = reinterpret_cast<float4*>(v)[i];
    float gv[kILP];
    const T* gp = grad + i * kILP;
#pragma unroll
    for (int k = 0; k < kILP; ++k) gv[k] = to_float(gp[k]);
    float* wp = &w4.x;
    float* mp = &m4.x;
    float* vp = &v4.x;
    T out[kILP];
#pragma unroll
    for (int k = 0; k < kILP; ++k) out[k] = from_float<T>(update(c, gv[k], wp[k], mp[k], vp[k]));
    reinterpret_cast<float4*>(master)[i] = w4;
    reinterpret_cast<float4*>(m)[i] = m4;
    reinterpret_cast<float4*>(v)[i] = v4;
    if (static_cast<void*>(param) != static_cast<void*>(master)) {
#pragma unroll
      for (int k = 0; k < kILP; ++k) param[i * kILP + k] = out[k];
    }
  }
  for (int64_t i = nvec * kILP + tid; i < n; i += stride) {
    float w = master[i], mm = m[i], vv = v[i];
    const T out = from_float<T>(update(c, to_float(grad[i]), w, mm, vv));
    master[i] = w;
    m[i] = mm;
    v[i] = vv;
    if (static_cast<void*>(param) != static_cast<void*>(master)) param[i] = out;
  }
}

}  // namespace

void adamw_mixed(DType dtype, void* param, const void* grad, float* master, float* exp_avg, float* exp_avg_sq,
                 int64_t n, const AdamWArgs& args, void* stream) {
  if (n <= 0) return;
  if (!args.step) throw std::runtime_error("adamw_mixed: the step counter is required");
  if (dtype != DType::f32 && param == static_cast<void*>(master))
    throw std::runtime_error("adamw_mixed: a 16-bit parameter cannot be its own float32 master");
  const bool vec = aligned16(master) && aligned16(exp_avg) && aligned16(exp_avg_sq);
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t items = vec ? n / kILP + 1 : n;
    adamw_kernel<T><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(param), static_cast<const T*>(grad), master, exp_avg, exp_avg_sq, n, args, vec);
  });
  check_launch("adamw_mixed");
}

}  // namespace flashdraft::cuda_ops

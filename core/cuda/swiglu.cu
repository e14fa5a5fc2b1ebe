// SwiGLU forward and backward (engine_ops.cuh), one pass each, float32 math per value:
//   forward   y = silu(g) u = g u sig(g)                     reads g, u; writes y
//   backward  du = dy g sig,  dg = dy u sig (1 + g (1 - sig))  reads g, u, dy; writes dg, du
// (ATen's composite takes 2 passes forward and about 9 backward, each a full read and
// write of a [tokens, ffn] tensor.) 16-byte vectors where every pointer allows, values
// one by one otherwise; grid-stride loops.
#include "ops_common.cuh"

namespace flashdraft::cuda_ops {
namespace {

using namespace detail;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + __expf(-g)); }

template <typename T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y, int64_t n,
                                  bool vec) {
  constexpr int E = Vec16<T>::E;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = vec ? n / E : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    const Vec16<T> a = load16(g + i * E), b = load16(u + i * E);
    Vec16<T> o;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float x = to_float(a.v[k]);
      o.v[k] = from_float<T>(x * sigmoid(x) * to_float(b.v[k]));
    }
    store16(y + i * E, o);
  }
  for (int64_t i = nvec * E + tid; i < n; i += stride) {
    const float x = to_float(g[i]);
    y[i] = from_float<T>(x * sigmoid(x) * to_float(u[i]));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dy,
                                  T* __restrict__ dg, T* __restrict__ du, int64_t n, bool vec) {
  constexpr int E = Vec16<T>::E;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = vec ? n / E : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    const Vec16<T> a = load16(g + i * E), b = load16(u + i * E), c = load16(dy + i * E);
    Vec16<T> og, ou;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float x = to_float(a.v[k]), up = to_float(b.v[k]), d = to_float(c.v[k]);
      const float s = sigmoid(x);
      ou.v[k] = from_float<T>(d * x * s);
      og.v[k] = from_float<T>(d * up * s * (1.f + x * (1.f - s)));
    }
    store16(dg + i * E, og);
    store16(du + i * E, ou);
  }
  for (int64_t i = nvec * E + tid; i < n; i += stride) {
    const float x = to_float(g[i]), up = to_float(u[i]), d = to_float(dy[i]);
    const float s = sigmoid(x);
    du[i] = from_float<T>(d * x * s);
    dg[i] = from_float<T>(d * up * s * (1.f + x * (1.f - s)));
  }
}

}  // namespace

void swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n, void* stream) {
  if (n <= 0) return;
  const bool vec = aligned16(gate) && aligned16(up) && aligned16(out);
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t items = vec ? n / Vec16<T>::E + 1 : n;
    swiglu_fwd_kernel<T><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n, vec);
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(DType dtype, const void* gate, const void* up, const void* dy, void* d_gate, void* d_up, int64_t n,
                     void* stream) {
  if (n <= 0) return;
  const bool vec = aligned16(gate) && aligned16(up) && aligned16(dy) && aligned16(d_gate) && aligned16(d_up);
  with_type(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t items = vec ? n / Vec16<T>::E + 1 : n;
    swiglu_bwd_kernel<T><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dy), static_cast<T*>(d_gate),
        static_cast<T*>(d_up), n, vec);
  });
  check_launch("swiglu_backward");
}

}  // namespace flashdraft::cuda_ops

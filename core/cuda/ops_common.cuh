// Device helpers shared by the engine's CUDA kernels (engine_ops.cuh): 16-bit <-> float
// conversion, 16-byte vector access, launch checks.
#pragma once

#include "engine_ops.cuh"

#include <flashdraft/launch.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace flashdraft::cuda_ops::detail {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// E = 16 / sizeof(T) values of T in one 16-byte load or store.
template <typename T>
struct Vec16 {
  static constexpr int E = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[E];
  };
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
  Vec16<T> r;
  r.raw = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& r) {
  *reinterpret_cast<uint4*>(p) = r.raw;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("flashdraft CUDA kernel ") + kernel +
                             " failed to launch: " + cudaGetErrorString(e));
}

// Programmatic dependent launch: flashdraft/launch.cuh (pdl_wait, pdl_trigger, pdl_on,
// launch_dependent), shared with the kernel plugins.
using launch::launch_dependent;
using launch::pdl_on;
using launch::pdl_trigger;
using launch::pdl_wait;

// Calls f with a null pointer of the element type of `dtype` (the kernels' template argument).
template <typename F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(static_cast<float*>(nullptr)); return;
    case DType::bf16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    case DType::f16: f(static_cast<__half*>(nullptr)); return;
  }
  throw std::runtime_error("flashdraft CUDA kernels: unknown dtype");
}

// Blocks for a grid-stride loop over `items` with `threads` per block: enough to fill
// every SM several times over, never more than the work.
inline unsigned grid_for(int64_t items, int threads) {
  const int64_t want = (items + threads - 1) / threads;
  return static_cast<unsigned>(want < 1 ? 1 : want > 8192 ? 8192 : want);
}

// p[a] += sum_{c < n} A[(row0 + a) a_stride + c] B[c kCols + lane] for a < 8: eight rows of A in shared memory (four
// values at a time, the same for the whole warp: broadcast) times column `lane` of B [n][kCols] (n a multiple of 4):
// the recurrent rules' chunk products (gated_delta.cu, ssd.cu), float32 FMA.
template <int kCols>
__device__ __forceinline__ void rows_times(const float* A, int a_stride, const float* B, int n, int row0, int lane,
                                           float (&p)[8]) {
#pragma unroll 2
  for (int c = 0; c < n; c += 4) {
    const float b0 = B[c * kCols + lane], b1 = B[(c + 1) * kCols + lane], b2 = B[(c + 2) * kCols + lane],
                b3 = B[(c + 3) * kCols + lane];
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      const float4 w = *reinterpret_cast<const float4*>(A + (row0 + a) * a_stride + c);
      p[a] = fmaf(w.x, b0, fmaf(w.y, b1, fmaf(w.z, b2, fmaf(w.w, b3, p[a]))));
    }
  }
}

// acc[r] = sum_{j < n} K[j k_stride + row0 + r] (V[j kCols + lane] scale[j]) for r < 16 (kScaled false: no scale):
// sixteen rows of K^T V at column `lane`, K and V in shared memory (the recurrent rules' state updates), float32 FMA.
template <int kCols, bool kScaled>
__device__ __forceinline__ void cols_times(const float* K, int k_stride, const float* V, const float* scale, int n,
                                           int row0, int lane, float (&acc)[16]) {
#pragma unroll
  for (int r = 0; r < 16; ++r) acc[r] = 0.f;
#pragma unroll 4
  for (int j = 0; j < n; ++j) {
    const float vj = kScaled ? V[j * kCols + lane] * scale[j] : V[j * kCols + lane];
#pragma unroll
    for (int r4 = 0; r4 < 4; ++r4) {
      const float4 t = *reinterpret_cast<const float4*>(K + j * k_stride + row0 + 4 * r4);
      acc[4 * r4] = fmaf(t.x, vj, acc[4 * r4]);
      acc[4 * r4 + 1] = fmaf(t.y, vj, acc[4 * r4 + 1]);
      acc[4 * r4 + 2] = fmaf(t.z, vj, acc[4 * r4 + 2]);
      acc[4 * r4 + 3] = fmaf(t.w, vj, acc[4 * r4 + 3]);
    }
  }
}

}  // namespace flashdraft::cuda_ops::detail

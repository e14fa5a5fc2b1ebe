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

}  // namespace flashdraft::cuda_ops::detail

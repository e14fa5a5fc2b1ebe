// Device helpers shared by the engine's CUDA kernels (engine_ops.cuh): 16-bit <-> float
// conversion, 16-byte vector access, launch checks.
#pragma once

#include "engine_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// Programmatic dependent launch (sm_90 and later): a kernel launched with launch_dependent()
// may be scheduled while the kernel before it in the stream is still finishing (its last wave,
// its memory flush), and waits in pdl_wait() until that kernel has completed and its writes are
// visible, so it must call pdl_wait() before reading or writing anything another kernel writes.
// pdl_trigger() lets the next kernel, if it was launched so, be scheduled once every block of
// this one has started or exited. On older devices, or with FLASHDRAFT_PDL=0 in the
// environment, launch_dependent() is a plain launch and both calls do nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on device `dev` use it: compute capability 9.0 or later (read once per
// device), unless FLASHDRAFT_PDL=0; pdl_here(): on the current device.
inline bool pdl_on(int dev) {
  static const bool off = [] {
    const char* e = std::getenv("FLASHDRAFT_PDL");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  constexpr int kDevices = 64;
  if (off || dev < 0 || dev >= kDevices) return false;
  static std::atomic<int> known[kDevices];  // 0 not read yet, 1 no, 2 yes
  int v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();  // (no device: not a launch error to report later)
      major = 0;
    }
    v = major >= 9 ? 2 : 1;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

inline bool pdl_here() {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess && pdl_on(dev);
}

// kernel<<<grid, block, 0, stream>>>(args...) with programmatic dependent launch where pdl_here().
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (pdl_here()) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

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

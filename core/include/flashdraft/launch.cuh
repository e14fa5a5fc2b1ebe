// Programmatic dependent launch (compute capability 9.0 and later) for CUDA kernels: the
// engine's (core/cuda) and kernel plugins' (kernels/flash_cuda), header-only, CUDA runtime only.
//
// A kernel launched with launch_dependent() may be scheduled while the kernel before it in the
// stream is still finishing (its last wave, its memory flush); it waits in pdl_wait() until that
// kernel has completed and its writes are visible, so it must call pdl_wait() before it reads
// or writes anything another kernel may touch (in practice: first). pdl_trigger() lets the next
// kernel, if it was launched so, be scheduled once every block of this one has started or
// exited. On older devices, or with FLASHDRAFT_PDL=0 in the environment, launch_dependent() is
// a plain launch and both device calls do nothing.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace flashdraft::launch {

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

// major * 10 + minor of CUDA device `dev` (0 where there is no such device; that error is cleared,
// not left as a launch error to report later).
inline int compute_capability(int dev) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

// Whether launches on device `dev` use it: compute capability 9.0 or later (read once per
// device), unless FLASHDRAFT_PDL=0.
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
    v = compute_capability(dev) >= 90 ? 2 : 1;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch where the
// current device has it (pdl_on). Returns the launch's error, which cudaGetLastError() also reports.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && pdl_on(dev)) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace flashdraft::launch

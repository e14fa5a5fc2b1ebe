// flash_cuda forward launcher: instantiates flash_fwd_kernel for every
// (dtype, head dim, configuration) and launches the one asked for.
#include <stdexcept>

#include "flash_kernels.cuh"

namespace flashdraft::flash_cuda {
namespace {

using namespace detail;

template <class T, int D, int STAGES>
void launch_fwd(const FlashParams& p) {
  constexpr int smem = FwdSmem<D, STAGES>::bytes;
  auto kernel = flash_fwd_kernel<T, D, STAGES>;
  static bool attr_set = false;  // per instantiation; idempotent if raced
  if (!attr_set) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("flash_cuda forward: cannot allow ") + std::to_string(smem) +
                               " bytes of shared memory: " + cudaGetErrorString(e));
    attr_set = true;
  }
  const dim3 grid((p.Lq + BQ - 1) / BQ, p.Hq, p.B);
  kernel<<<grid, kFwdWarps * 32, smem, p.stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("flash_cuda forward launch: ") + cudaGetErrorString(e));
}

template <class T, int D>
void launch_fwd_cfg(const FlashParams& p, Config c) {
  // 4 warps x 32 rows; 2 K/V stages (96 KB at d128) lets two CTAs share an H200 SM;
  // the sm90 configuration uses the same forward
  // (3 stages, 128 KB, one CTA per SM: measured 248 vs 304 TFLOP/s causal, v2 notes)
  (void)c;
  launch_fwd<T, D, 2>(p);
}

}  // namespace

std::string flash_forward(const FlashParams& p, Config config) {
  const std::string why = flash_check(p, false);
  if (!why.empty()) throw std::runtime_error("flash_cuda forward: " + why);
  int device = 0;
  cudaGetDevice(&device);
  const Config c = flash_resolve_config(config, device);
  if (c == Config::sm90a) {
    flash_forward_sm90a(p);
    return flash_variant(false, c, p.dtype, p.D);
  }
  if (p.dtype == DType::bf16) {
    if (p.D == 64) launch_fwd_cfg<__nv_bfloat16, 64>(p, c);
    else launch_fwd_cfg<__nv_bfloat16, 128>(p, c);
  } else {
    if (p.D == 64) launch_fwd_cfg<__half, 64>(p, c);
    else launch_fwd_cfg<__half, 128>(p, c);
  }
  return flash_variant(false, c, p.dtype, p.D);
}

}  // namespace flashdraft::flash_cuda

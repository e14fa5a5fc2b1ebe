// flash_cuda backward launcher: preprocess (delta, lse in base 2), dK/dV over the
// transposed lists, dQ over the forward lists; all on p.stream, in that order.
#include <stdexcept>

#include "flash_kernels.cuh"

namespace flashdraft::flash_cuda {
namespace {

using namespace detail;

template <class K>
void allow_smem(K kernel, int smem, bool& done, const char* what) {
  if (done) return;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("flash_cuda ") + what + ": cannot allow " + std::to_string(smem) +
                             " bytes of shared memory: " + cudaGetErrorString(e));
  done = true;
}
void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("flash_cuda ") + what + " launch: " + cudaGetErrorString(e));
}

template <class T, int D, int KV_STAGES, int DQ_STAGES, int DQ_MT, bool DQ_ATOMIC>
void launch_bwd(const FlashParams& p) {
  const int lq_pad = (p.Lq + BQ - 1) / BQ * BQ;
  const size_t rows = size_t(p.B) * p.Hq * lq_pad;
  float* ws_lse2 = static_cast<float*>(p.workspace);
  float* ws_delta = ws_lse2 + rows;
  float* dq_acc = ws_delta + rows;  // DQ_ATOMIC only: [B*Hq][Lq_pad][D] fp32
  {
    constexpr int rpb = 256 / (D / 8);
    const dim3 grid(lq_pad / rpb, p.B * p.Hq);
    flash_bwd_pre_kernel<T, D><<<grid, 256, 0, p.stream>>>(p, ws_lse2, ws_delta, lq_pad);
    check_launch("backward preprocess");
  }
  if (DQ_ATOMIC) {
    const cudaError_t e = cudaMemsetAsync(dq_acc, 0, rows * D * sizeof(float), p.stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("flash_cuda backward: memset: ") + cudaGetErrorString(e));
  }
  {
    constexpr int smem = DQ_ATOMIC ? KvSmem<D, KV_STAGES>::bytes_atomic : KvSmem<D, KV_STAGES>::bytes;
    auto kernel = flash_bwd_dkdv_kernel<T, D, KV_STAGES, DQ_ATOMIC>;
    static bool done = false;
    allow_smem(kernel, smem, done, "backward dK/dV");
    const dim3 grid((p.Lkv + BKV - 1) / BKV, p.Hkv, p.B);
    kernel<<<grid, 128, smem, p.stream>>>(p, ws_lse2, ws_delta, lq_pad, DQ_ATOMIC ? dq_acc : nullptr);
    check_launch("backward dK/dV");
  }
  if (DQ_ATOMIC) {
    const dim3 grid((lq_pad * (D / 8) + 255) / 256, p.B * p.Hq);
    flash_bwd_dq_convert_kernel<T, D><<<grid, 256, 0, p.stream>>>(p, dq_acc, lq_pad);
    check_launch("backward dQ convert");
  } else {
    constexpr int smem = DqSmem<D, DQ_STAGES>::bytes;
    auto kernel = flash_bwd_dq_kernel<T, D, DQ_STAGES, DQ_MT>;
    static bool done = false;
    allow_smem(kernel, smem, done, "backward dQ");
    const dim3 grid((p.Lq + BQ - 1) / BQ, p.Hq, p.B);
    kernel<<<grid, 256 / DQ_MT, smem, p.stream>>>(p, ws_lse2, ws_delta, lq_pad);
    check_launch("backward dQ");
  }
}

template <class T, int D>
void launch_bwd_cfg(const FlashParams& p, Config c) {
  // dK/dV: 2 Q/dO stages in both (98 KB at d128: two CTAs per H200 SM; 3 stages measured
  // slower, NOTES.md v1). dQ as a separate pass:
  //   sm120: 4 warps x 32 rows, one K/V stage (96 KB at d128);
  //   sm90 : 8 warps x 16 rows, two K/V stages (128 KB) -- measured fastest on the H200.
  // The dQ-by-atomics path (launch_bwd<..., true>) is kept for measurement only: on the
  // H200 it was no faster (NOTES.md v3) and needs an fp32 [B*Hq][Lq][D] buffer.
  if (c == Config::sm90) launch_bwd<T, D, 2, 2, 1, false>(p);
  else launch_bwd<T, D, 2, 1, 2, false>(p);
}

}  // namespace

std::string flash_backward(const FlashParams& p, Config config) {
  const std::string why = flash_check(p, true);
  if (!why.empty()) throw std::runtime_error("flash_cuda backward: " + why);
  int device = 0;
  cudaGetDevice(&device);
  const Config c = flash_resolve_config(config, device);
  if (c == Config::sm90a) {
    flash_backward_sm90a(p);
    return flash_variant(true, c, p.dtype, p.D);
  }
  if (p.dtype == DType::bf16) {
    if (p.D == 64) launch_bwd_cfg<__nv_bfloat16, 64>(p, c);
    else launch_bwd_cfg<__nv_bfloat16, 128>(p, c);
  } else {
    if (p.D == 64) launch_bwd_cfg<__half, 64>(p, c);
    else launch_bwd_cfg<__half, 128>(p, c);
  }
  return flash_variant(true, c, p.dtype, p.D);
}

}  // namespace flashdraft::flash_cuda

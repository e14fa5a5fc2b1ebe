// flash_cuda backward launcher: preprocess (delta, lse in base 2), dK/dV over the
// transposed lists, dQ over the forward lists; all on p.stream, in that order.
#include "flash_kernels.cuh"

namespace flashdraft::flash_cuda {
namespace {

using namespace detail;

// dK/dV: 2 Q/dO stages in both configurations (98 KB at d128: two CTAs per H200 SM; 3
// stages measured slower, NOTES.md v1). dQ as a separate pass (flash_attention.cuh says why
// not atomics), DQ_MT m-tiles of 16 rows per warp and DQ_STAGES K/V stages:
//   sm120: 4 warps x 32 rows, one K/V stage (96 KB at d128);
//   sm90 : 8 warps x 16 rows, two K/V stages (128 KB) -- measured fastest on the H200.
template <class T, int D, int DQ_STAGES, int DQ_MT>
void launch_bwd(const FlashParams& p) {
  constexpr int KV_STAGES = 2;
  const BwdWorkspace ws = launch_bwd_preprocess<T, D>(p, 1, false, "backward preprocess");
  {
    constexpr int smem = KvSmem<D, KV_STAGES>::bytes;
    auto kernel = flash_bwd_dkdv_kernel<T, D, KV_STAGES, false>;
    static const bool allowed = allow_smem(kernel, smem, "backward dK/dV");
    (void)allowed;
    kernel<<<key_items(p, 1), 128, smem, p.stream>>>(p, ws.lse2, ws.delta, ws.lq_pad, ws.kv_order, nullptr);
    check_launch("backward dK/dV");
  }
  {
    constexpr int smem = DqSmem<D, DQ_STAGES>::bytes;
    auto kernel = flash_bwd_dq_kernel<T, D, DQ_STAGES, DQ_MT>;
    static const bool allowed = allow_smem(kernel, smem, "backward dQ");
    (void)allowed;
    kernel<<<query_items(p), 256 / DQ_MT, smem, p.stream>>>(p, ws.lse2, ws.delta, ws.lq_pad, ws.q_order);
    check_launch("backward dQ");
  }
}

}  // namespace

std::string flash_backward(const FlashParams& p, Config config) {
  const Config c = launch_config(p, true, config);
  if (c == Config::sm90a) {
    flash_backward_sm90a(p);
  } else {
    for_instance(p, [&](auto i) {
      using T = typename decltype(i)::T;
      if (c == Config::sm90)
        launch_bwd<T, decltype(i)::D, 2, 1>(p);
      else
        launch_bwd<T, decltype(i)::D, 1, 2>(p);
    });
  }
  return flash_variant(true, c, p.dtype, p.D);
}

}  // namespace flashdraft::flash_cuda

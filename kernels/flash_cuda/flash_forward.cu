// flash_cuda forward launcher: instantiates flash_fwd_kernel for every (dtype, head dim)
// and launches the one asked for; sm90a goes to flash_sm90a.cu (heads up to 128).
#include "flash_kernels.cuh"

namespace flashdraft::flash_cuda {
namespace {

using namespace detail;

// Heads up to 128: 4 warps x 32 rows; 2 K/V stages (96 KB at d128) let two CTAs share an H200
// SM. sm90 and sm120 run this same forward (3 stages, 128 KB, hence one CTA per SM, measured
// slower: 248 vs 304 TFLOP/s causal, NOTES.md v2). Heads of 192 / 256: 8 warps x 16 rows, the
// stages flash_forward_stages() gives the configuration's shared memory.
template <class T, int D, int STAGES>
void launch_fwd(const FlashParams& p) {
  constexpr int smem = FwdSmem<D, STAGES>::bytes;
  auto kernel = flash_fwd_kernel<T, D, STAGES>;
  static const bool allowed = allow_smem(kernel, smem, "forward");
  (void)allowed;
  int* order = static_cast<int*>(p.workspace);  // flash_forward_workspace_bytes()
  if (!p.order_ready) launch_schedule(p, order, nullptr, 1, false);
  kernel<<<query_items(p), FwdShape<D>::kWarps * 32, smem, p.stream>>>(p, order);
  check_launch("forward");
}

}  // namespace

std::string flash_forward(const FlashParams& p, Config config) {
  const Config c = launch_config(p, false, config);
  if (c == Config::sm90a && p.D <= 128) {
    flash_forward_sm90a(p);
  } else if (p.D <= 128) {
    for_instance(p, [&](auto i) { launch_fwd<typename decltype(i)::T, decltype(i)::D, 2>(p); });
  } else {
    int device = 0;
    cudaGetDevice(&device);
    const Config f = flash_forward_config(c, p.D);
    const DeviceLimits limits = flash_device_limits(device);
    const std::string unfit = flash_forward_unfit(p.D, f, limits);
    if (!unfit.empty()) throw std::runtime_error("flash_cuda forward: " + unfit);
    const int stages = flash_forward_stages(p.D, f, limits);
    for_forward_instance(p, [&](auto i) {
      using T = typename decltype(i)::T;
      constexpr int D = decltype(i)::D;
      if constexpr (D > 128) {
        if (stages == 2)
          launch_fwd<T, D, 2>(p);
        else
          launch_fwd<T, D, 1>(p);
      }
    });
  }
  return flash_variant(false, c, p.dtype, p.D);
}

}  // namespace flashdraft::flash_cuda

// The online target's gate / up product with SwiGLU in its epilogue, on Hopper (sm_90a):
//   out[M, I] = round(round(silu(round(x Wg^T))) * round(x Wu^T)),  W = [Wg; Wu]  [2 I, K]
// bf16, float32 accumulation; the same roundings as swiglu_packed after the product (the
// product's own summation order is the one difference from cuBLAS's). The [M, 2 I] product is
// never written: one pass of 2 x M x I x 2 bytes less per layer. frozen::linear_swiglu takes it
// only with FLASHDRAFT_GEMM_SWIGLU=1: on an H100 at Qwen3-8B's shape it is level with cuBLAS's
// product and the pass at best (1.01-1.04x their time in two calls, bench/RESULTS.md
// "target_forward v6" and "v7"), not faster, and 68.2 against 66.1 / 66.9 ms in the step (v7).
// Tried on top of it and measured (v7; the code is in commit 8fede8a): the epilogue in pieces
// under the next tile's products, 5-7% slower than here at the tile's end; the last partial round
// split along K, level. Neither kept.
//
// Persistent CTAs (as many as fit at once), three warpgroups each: warpgroup 2 (one thread) is
// the producer, which walks the CTA's tiles and fills a ring of STAGES stages by TMA (x's
// 128 x 64 box, and Wg's and Wu's 128 x 64 boxes for the same 128 output columns: 48 KB a stage,
// 128-byte swizzle); the consumers, warpgroups 0 and 1 (64 rows each), run m64n256k16 products
// from shared memory (B = the 128 gate rows then the 128 up rows), so a thread holds each output
// column's gate and up accumulators side by side: the epilogue is local, rounds them as
// swiglu_packed does and stores bf16 pairs. With FLASHDRAFT_GEMM_CLUSTER=2 CTAs run in clusters of
// two: the pair takes row blocks 2 i, 2 i + 1 of one column block and each CTA loads half of the W
// tile into both (TMA multicast), so W is read from L2 once per pair (measured 2.1x slower on an
// H100 at Qwen3-8B's shape, bench/RESULTS.md: not the default). Tiles are taken in
// groups of FLASHDRAFT_GEMM_GROUP_M (12) row blocks, column-block major inside a group, so the
// tiles running at once share x and W in L2. The producer runs ahead into the next tile while the
// consumers store.
#include "ops_common.cuh"

#include <flashdraft/wgmma.cuh>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

namespace flashdraft::cuda_ops {
namespace {

using detail::check_launch;

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4;
constexpr int kTileA = BM * BK * 2, kTileB = 2 * BN * BK * 2, kStage = kTileA + kTileB;
constexpr int kSmem = 1024 + STAGES * kStage + 64;  // alignment slack, stages, barriers

struct GemmShape {
  int M, K, I, tiles_m, tiles_n, group_m;
  __nv_bfloat16* out;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void tile_of(const GemmShape& s, int t, int& mb, int& nb) {
  const int per_group = s.group_m * s.tiles_n, group = t / per_group, first = group * s.group_m;
  const int gm = min(s.group_m, s.tiles_m - first), r = t - group * per_group;
  mb = first + r % gm;
  nb = r / gm;
}

__device__ __forceinline__ float silu_times(float g, float u) {
  const float a = __bfloat162float(__float2bfloat16_rn(g / (1.f + expf(-g))));
  return __fmul_rn(a, u);
}

// CL CTAs a cluster (1 or 2): with 2, the pair takes row blocks 2 i and 2 i + 1 of the same
// column block, and each CTA loads one half of the W tile (rank 0 the gate rows, rank 1 the up
// rows) into both CTAs' shared memory (TMA multicast): W is read from L2 once per pair. A stage
// is then free when the consumers of both CTAs have released it (the `empty` barrier counts
// 8 x CL warps; each consumer warp arrives on its own CTA's and on its peer's).
template <int CL>
__global__ void __launch_bounds__(384, 1)
    gate_up_swiglu_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                          const GemmShape s) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // (the same offset in every CTA of a cluster: multicast copies and remote arrivals use it)
  const uint32_t s0 = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = s0 + STAGES * kStage;
  auto full = [&](int st) { return bars + 8 * st; };
  auto empty = [&](int st) { return bars + 8 * (STAGES + st); };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rank = CL == 1 ? 0 : int(wg::cluster_rank());
  const int cluster = blockIdx.x / CL, clusters = gridDim.x / CL;
  // tiles of CL row blocks (row block CL i + rank is this CTA's part of tile i)
  GemmShape sc = s;
  sc.tiles_m = (s.tiles_m + CL - 1) / CL;
  sc.group_m = max(1, s.group_m / CL);
  const int tiles = sc.tiles_m * sc.tiles_n, kb_n = s.K / BK;
  // The CTA's walk, the same in both roles: stage(mb, nb, kb, it) for k block kb of each of its
  // tiles (row block mb, column block nb; `it` counts every stage so far), then tile_end(mb, nb, it).
  auto walk = [&](auto&& stage, auto&& tile_end) {
    int it = 0;
    for (int t = cluster; t < tiles; t += clusters) {
      int mb, nb;
      tile_of(sc, t, mb, nb);
      mb = mb * CL + rank;
      for (int kb = 0; kb < kb_n; ++kb, ++it) stage(mb, nb, kb, it);
      tile_end(mb, nb, it);
    }
  };
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st) {
      wg::mbar_init(full(st), 1);
      wg::mbar_init(empty(st), 8 * CL);
    }
    wg::mbar_init_fence();
    wg::tma_prefetch_map(&map_x);
    wg::tma_prefetch_map(&map_w);
  }
  if constexpr (CL > 1)
    wg::cluster_sync();  // the peer's barriers exist before anything is sent to them
  else
    __syncthreads();
  // x may be the previous kernel's output, and `out` memory it still reads
  launch::pdl_wait();

  if (warp >= 8) {  // ---- producer warpgroup: one thread issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid != 256) return;
    walk(
        [&](int mb, int nb, int kb, int it) {
          const int st = it % STAGES;
          if (it >= STAGES) wg::mbar_wait(empty(st), ((it / STAGES) - 1) & 1);
          const uint32_t a = s0 + st * kStage, b = a + kTileA;
          wg::mbar_arrive_expect_tx(full(st), kStage);
          wg::tma_load_2d(a, &map_x, kb * BK, mb * BM, full(st));
          if constexpr (CL == 1) {
            wg::tma_load_2d(b, &map_w, kb * BK, nb * BN, full(st));
            wg::tma_load_2d(b + kTileB / 2, &map_w, kb * BK, s.I + nb * BN, full(st));
          } else {
            wg::tma_load_2d_multicast(b + rank * (kTileB / 2), &map_w, kb * BK, rank * s.I + nb * BN, full(st),
                                      (1 << CL) - 1);
          }
        },
        [](int, int, int) {});
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  // ---- consumers: warpgroup w owns rows 64 w .. 64 w + 63 of each tile
  const int w = warp / 4, wq = warp % 4, g = lane / 4, t4 = lane % 4;
  auto release = [&](int st) {
    __syncwarp();
    if (lane == 0) {
      if constexpr (CL == 1)
        wg::mbar_arrive(empty(st));
      else
        for (int c = 0; c < CL; ++c) wg::mbar_arrive_cluster(empty(st), c);
    }
  };
  float d[128];
  walk(
      [&](int, int, int kb, int it) {
        const int st = it % STAGES;
        wg::mbar_wait(full(st), (it / STAGES) & 1);
        const uint32_t a = s0 + st * kStage, b = a + kTileA;
        const uint64_t da = wg::desc_k<BM>(a, 64 * w, 0), db = wg::desc_k<2 * BN>(b, 0, 0);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          wg::Mma<__nv_bfloat16>::ss256(d, wg::desc_add(da, kk * 32), wg::desc_add(db, kk * 32), kb > 0 || kk > 0);
        wg::commit();
        wg::wait<1>();  // the previous stage's products have ended: release it
        if (kb > 0) release((it - 1) % STAGES);
      },
      [&](int mb, int nb, int it) {
        wg::wait<0>();
        wg::pin(d);
        release((it - 1) % STAGES);
        // epilogue: gate column c is d[4 j ..] (j < 16), its up column d[4 (j + 16) ..]
        const int row = mb * BM + 64 * w + 16 * wq + g;
        __nv_bfloat16* o = s.out + (int64_t)row * s.I + nb * BN + 2 * t4;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float g0 = __bfloat162float(__float2bfloat16_rn(d[4 * j + 2 * h]));
            const float g1 = __bfloat162float(__float2bfloat16_rn(d[4 * j + 2 * h + 1]));
            const float u0 = __bfloat162float(__float2bfloat16_rn(d[4 * (j + 16) + 2 * h]));
            const float u1 = __bfloat162float(__float2bfloat16_rn(d[4 * (j + 16) + 2 * h + 1]));
            if (row + 8 * h < s.M)
              *reinterpret_cast<__nv_bfloat162*>(o + (int64_t)8 * h * s.I + 8 * j) =
                  __floats2bfloat162_rn(silu_times(g0, u0), silu_times(g1, u1));
          }
      });
  // the peer may still arrive on this CTA's barriers (and this one on its): both stay until both are done
  if constexpr (CL > 1) wg::cluster_sync();
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link to libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    cudaGetLastError();
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A row-major [rows, cols] bf16 matrix as 128-row x 64-column boxes, 128-byte swizzle, rows
// past the end read as zeros.
bool tile_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols) {
  const EncodeTiled enc = encode_tiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {BK, 128}, elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int env_int(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : fallback;
}

}  // namespace

bool gate_up_swiglu_device(int device) { return launch::compute_capability(device) == 90 && encode_tiled() != nullptr; }

bool gate_up_swiglu_applies(DType dtype, int64_t M, int64_t K, int64_t I, int device) {
  constexpr int64_t kInt = int64_t(1) << 31;
  return dtype == DType::bf16 && M > 0 && M < kInt && K > 0 && K % BK == 0 && K < kInt && I > 0 && I % BN == 0 &&
         2 * I < kInt && ((M + BM - 1) / BM) * (I / BN) < kInt && gate_up_swiglu_device(device);
}

void gate_up_swiglu(const void* x, const void* w, void* out, int64_t M, int64_t K, int64_t I, void* stream) {
  CUtensorMap mx, mw;
  if (!tile_map(&mx, x, M, K) || !tile_map(&mw, w, 2 * I, K))
    throw std::runtime_error("gate_up_swiglu: cuTensorMapEncodeTiled refused x [" + std::to_string(M) + ", " +
                             std::to_string(K) + "] or W [" + std::to_string(2 * I) + ", " + std::to_string(K) +
                             "] (16-byte aligned bases and rows are required)");
  static const int cl = env_int("FLASHDRAFT_GEMM_CLUSTER", 1) == 2 ? 2 : 1;
  auto kernel = cl == 1 ? gate_up_swiglu_kernel<1> : gate_up_swiglu_kernel<2>;
  static std::once_flag attr;
  std::call_once(attr, [&] { cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem); });
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  // (tuning knobs for bench_gemm_swiglu, read once: row blocks per group, CTAs at most)
  static const int group_m = std::max(1, env_int("FLASHDRAFT_GEMM_GROUP_M", 12));
  static const int ctas = std::max(1, env_int("FLASHDRAFT_GEMM_CTAS", 1 << 20));
  static const bool persistent = env_int("FLASHDRAFT_GEMM_PERSISTENT", 1) != 0;  // 0: a CTA (cluster) a tile
  const GemmShape s{
      int(M), int(K), int(I), int((M + BM - 1) / BM), int(I / BN), group_m, static_cast<__nv_bfloat16*>(out)};
  const int tiles = ((s.tiles_m + cl - 1) / cl) * s.tiles_n;  // of cl row blocks
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(384);
  config.dynamicSmemBytes = kSmem;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = cl;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attrs;
  config.numAttrs = 1;
  // as many clusters as can run at once (persistent: a cluster started late would add a whole share of
  // tiles to the end); the SMs of a GPC need not pair up, so this may be fewer than sms / cl
  static int resident = 0;  // (read on the first call's device: the engine runs one device a process)
  if (resident == 0) {
    config.gridDim = dim3(sms - sms % cl);
    int n = 0;
    const cudaError_t rc = cudaOccupancyMaxActiveClusters(&n, kernel, &config);
    resident = rc == cudaSuccess && n > 0 ? n : sms / cl;
    cudaGetLastError();
    if (env_int("FLASHDRAFT_GEMM_INFO", 0))
      std::fprintf(stderr, "gate_up_swiglu: clusters of %d, %d at once (occupancy query: %s, %d), %s\n", cl, resident,
                   cudaGetErrorString(rc), n, persistent ? "persistent" : "a CTA a tile");
  }
  const int grid = cl * std::min({tiles, persistent ? resident : tiles, std::max(1, ctas / cl)});
  config.gridDim = dim3(grid);
  config.numAttrs = launch::pdl_on(dev) ? 2 : 1;
  cudaLaunchKernelEx(&config, kernel, mx, mw, s);
  check_launch("gate_up_swiglu");
}

}  // namespace flashdraft::cuda_ops

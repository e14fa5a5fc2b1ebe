// The online target's gate / up product with SwiGLU in its epilogue, on Hopper (sm_90a):
//   out[M, I] = round(round(silu(round(x Wg^T))) * round(x Wu^T)),  W = [Wg; Wu]  [2 I, K]
// bf16, float32 accumulation; the same roundings as swiglu_packed after the product (the
// product's own summation order is the one difference from cuBLAS's). The [M, 2 I] product is
// never written: one pass of 2 x M x I x 2 bytes less per layer. frozen::linear_swiglu takes it
// only with FLASHDRAFT_GEMM_SWIGLU=1: on an H100 at Qwen3-8B's shape it is level with cuBLAS's
// product and the pass (1.01x), not faster (bench/RESULTS.md "target_forward v6").
//
// Persistent CTAs (as many as fit at once), two consumer warpgroups (232 registers a thread) and a
// producer warpgroup (40) each. The producer (one thread) walks the CTA's tiles and fills a
// ring of STAGES stages by TMA (x's 128 x 64 box, and Wg's and Wu's 128 x 64 boxes for the same 128
// output columns: 48 KB a stage, 128-byte swizzle); the consumers, warpgroups 0 and 1 (64 rows
// each), run m64n256k16 products from shared memory (B = the 128 gate rows then the 128 up rows),
// so a thread holds each output column's gate and up accumulators side by side: the epilogue is
// local. With FLASHDRAFT_GEMM_EPI_STEP=n > 0 (the default 1) a tile's accumulators are rounded to
// bf16 pairs in registers at its end and the SwiGLU and the stores run in eight pieces, n after
// each of the next tile's first k blocks, under its products; with 0, at the tile's end while the
// tensor cores wait. Measured on an H100 (bench/RESULTS.md "target_forward v7"): the pieces under
// the products are 5-7% slower than the epilogue at the tile's end. A last round of tiles that
// would leave more than half the CTAs idle is split along K: two CTAs a tile, the second handing its float32
// sums through global scratch (FLASHDRAFT_GEMM_SPLIT_TAIL=0: not split). With
// FLASHDRAFT_GEMM_CLUSTER=2 CTAs run in clusters of two: the pair takes row blocks 2 i, 2 i + 1 of
// one column block and each CTA loads half of the W tile into both (TMA multicast), so W is read
// from L2 once per pair (measured 2.1x slower on an H100 at Qwen3-8B's shape, bench/RESULTS.md: not
// the default). Tiles are taken in groups of FLASHDRAFT_GEMM_GROUP_M (12) row blocks, column-block
// major inside a group, so the tiles running at once share x and W in L2. The producer runs ahead
// into the next tile while the consumers store.
#include "ops_common.cuh"

#include <flashdraft/wgmma.cuh>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace flashdraft::cuda_ops {
namespace {

using detail::check_launch;

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4;
constexpr int kTileA = BM * BK * 2, kTileB = 2 * BN * BK * 2, kStage = kTileA + kTileB;
constexpr int kSmem = 1024 + STAGES * kStage + 64;  // alignment slack, stages, barriers
// two consumer warpgroups and a producer warpgroup (registers are handed out by warpgroups): the
// producer gives up all but 40 registers a thread, the consumers take 232 (setmaxnreg), room for the
// accumulators and the pending tile's bf16 pairs
constexpr int kThreads = 384;

struct GemmShape {
  int M, K, I, tiles_m, tiles_n, group_m;
  __nv_bfloat16* out;
  // The last, partial round of tiles split in two along K (split_items > 0): tiles split_from ..
  // split_from + split_items - 1, tile i's halves taken by CTAs 2 i (the first half of K; it adds
  // the second's partial sums and stores) and 2 i + 1 (the second half: its float32 partial sums to
  // partial[i], then flags[i] = 1). The finishing CTA sets the flag back to 0.
  int split_from, split_items;
  float* partial;
  unsigned* flags;
  // epilogue pieces run after each k block of the next tile (0: all at the tile's end, as the
  // product's own epilogue)
  int epi_step;
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
template <int CL, bool OV>
__global__ void __launch_bounds__(kThreads, 1)
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
  // With a split tail, the tiles from split_from on are done in halves of K (`half` 0 or 1;
  // -1: the whole K), CTA 2 i + half taking half `half` of tile split_from + i; `first` marks a
  // tile's first k block.
  auto walk = [&](auto&& stage, auto&& tile_end) {
    int it = 0;
    auto run = [&](int t, int k0, int k1, int half) {
      int mb, nb;
      tile_of(sc, t, mb, nb);
      mb = mb * CL + rank;
      for (int kb = k0; kb < k1; ++kb, ++it) stage(mb, nb, kb, it, kb == k0);
      tile_end(mb, nb, it, half);
    };
    for (int t = cluster; t < min(tiles, s.split_from); t += clusters) run(t, 0, kb_n, -1);
    if (cluster < 2 * s.split_items) {
      const int half = cluster % 2;
      run(s.split_from + cluster / 2, half * (kb_n / 2), half ? kb_n : kb_n / 2, half);
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
        [&](int mb, int nb, int kb, int it, bool) {
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
        [](int, int, int, int) {});
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
  // The epilogue of a tile runs under the next tile's first products: at the tile's end its
  // accumulators are rounded to bf16 pairs (p: gate pair, up pair, for each of the thread's 32
  // row / column-pair places) so that d is free for the next tile, and the SwiGLU and the stores
  // follow in kEpiChunks pieces, one after each of the next tile's first k blocks is issued.
  constexpr int kEpiChunks = 8, kPlaces = 32, kPerChunk = kPlaces / kEpiChunks;
  uint32_t p[2 * kPlaces];
  __nv_bfloat16* po = nullptr;       // the pending tile's first output of this thread's row
  int prow = 0, pdone = kEpiChunks;  // its row; chunks of it already stored (kEpiChunks: none pending)
  auto epilogue_chunk = [&](int c) {
#pragma unroll
    for (int cc = 0; cc < kEpiChunks; ++cc)
      if (cc == c)
#pragma unroll
        for (int q = 0; q < kPerChunk; ++q) {
          const int place = cc * kPerChunk + q, j = place / 2, h = place % 2;
          const uint32_t gp = p[2 * place], up = p[2 * place + 1];
          if (prow + 8 * h < s.M)
            *reinterpret_cast<__nv_bfloat162*>(po + (int64_t)8 * h * s.I + 8 * j) =
                __floats2bfloat162_rn(silu_times(__uint_as_float(gp << 16), __uint_as_float(up << 16)),
                                      silu_times(__uint_as_float(gp & 0xffff0000u), __uint_as_float(up & 0xffff0000u)));
        }
  };
  auto finish_pending = [&] {
    if constexpr (OV)
      for (; pdone < kEpiChunks; ++pdone) epilogue_chunk(pdone);
  };
  walk(
      [&](int, int, int, int it, bool first) {
        const int st = it % STAGES;
        wg::mbar_wait(full(st), (it / STAGES) & 1);
        const uint32_t a = s0 + st * kStage, b = a + kTileA;
        const uint64_t da = wg::desc_k<BM>(a, 64 * w, 0), db = wg::desc_k<2 * BN>(b, 0, 0);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          wg::Mma<__nv_bfloat16>::ss256(d, wg::desc_add(da, kk * 32), wg::desc_add(db, kk * 32), !first || kk > 0);
        wg::commit();
        wg::wait<1>();  // the previous stage's products have ended: release it
        if (!first) release((it - 1) % STAGES);
        if constexpr (OV)
          for (int c = 0; c < s.epi_step && pdone < kEpiChunks; ++c) epilogue_chunk(pdone++);  // under the products
      },
      [&](int mb, int nb, int it, int half) {
        finish_pending();  // (K shorter than kEpiChunks blocks)
        wg::wait<0>();
        wg::pin(d);
        release((it - 1) % STAGES);
        if (half >= 0) {  // a split tile: hand the second half's sums to the first's CTA
          const int item = cluster / 2;
          float4* part = reinterpret_cast<float4*>(s.partial) + (int64_t)item * 32 * 256 + tid;
          unsigned* flag = s.flags + item;
          if (half == 1) {
#pragma unroll
            for (int r = 0; r < 32; ++r)
              __stcg(part + r * 256, make_float4(d[4 * r], d[4 * r + 1], d[4 * r + 2], d[4 * r + 3]));
            __threadfence();
            wg::named_barrier(1, 256);
            if (tid == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
            return;
          }
          if (tid == 0) {
            unsigned v = 0;
            for (;;) {
              asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
              if (v) break;
              __nanosleep(64);
            }
            *flag = 0;  // for the next launch
          }
          wg::named_barrier(1, 256);
#pragma unroll
          for (int r = 0; r < 32; ++r) {
            const float4 q = __ldcg(part + r * 256);
            d[4 * r] += q.x;
            d[4 * r + 1] += q.y;
            d[4 * r + 2] += q.z;
            d[4 * r + 3] += q.w;
          }
        }
        // gate column pair j of place (j, h) is d[4 j + 2 h ..], its up pair d[4 (j + 16) + 2 h ..]
        prow = mb * BM + 64 * w + 16 * wq + g;
        po = s.out + (int64_t)prow * s.I + nb * BN + 2 * t4;
        if constexpr (OV) {
#pragma unroll
          for (int place = 0; place < kPlaces; ++place) {
            const int j = place / 2, h = place % 2;
            const __nv_bfloat162 gg = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            const __nv_bfloat162 uu = __floats2bfloat162_rn(d[4 * (j + 16) + 2 * h], d[4 * (j + 16) + 2 * h + 1]);
            p[2 * place] = *reinterpret_cast<const uint32_t*>(&gg);
            p[2 * place + 1] = *reinterpret_cast<const uint32_t*>(&uu);
          }
          pdone = 0;
        } else {  // the epilogue here, the tensor cores waiting
#pragma unroll
          for (int place = 0; place < kPlaces; ++place) {
            const int j = place / 2, h = place % 2;
            const float g0 = __bfloat162float(__float2bfloat16_rn(d[4 * j + 2 * h]));
            const float g1 = __bfloat162float(__float2bfloat16_rn(d[4 * j + 2 * h + 1]));
            const float u0 = __bfloat162float(__float2bfloat16_rn(d[4 * (j + 16) + 2 * h]));
            const float u1 = __bfloat162float(__float2bfloat16_rn(d[4 * (j + 16) + 2 * h + 1]));
            if (prow + 8 * h < s.M)
              *reinterpret_cast<__nv_bfloat162*>(po + (int64_t)8 * h * s.I + 8 * j) =
                  __floats2bfloat162_rn(silu_times(g0, u0), silu_times(g1, u1));
          }
        }
      });
  finish_pending();
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

// The split tail's scratch: a flag per split tile (at most 1024 of them), then its float32
// partial sums (the 256 consumer threads' 128 accumulators).
constexpr int64_t kFlagBytes = 4096, kPartialBytes = 256 * 128 * 4;

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

int64_t gate_up_swiglu_scratch_bytes(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return kFlagBytes + int64_t(sms / 2) * kPartialBytes;
}

namespace {

// How a call runs: the launch settings (read once, tuning knobs for bench_gemm_swiglu), the grid
// and the split last round.
struct Plan {
  int cl, tiles, grid, split_items;
  bool persistent;
};

Plan plan_for(int64_t M, int64_t K, int64_t I) {
  static const int cl = env_int("FLASHDRAFT_GEMM_CLUSTER", 1) == 2 ? 2 : 1;
  static const int ctas = std::max(1, env_int("FLASHDRAFT_GEMM_CTAS", 1 << 20));  // CTAs at most
  static const bool persistent = env_int("FLASHDRAFT_GEMM_PERSISTENT", 1) != 0;   // 0: a CTA (cluster) a tile
  static const bool split = env_int("FLASHDRAFT_GEMM_SPLIT_TAIL", 1) != 0;
  // as many clusters as can run at once (persistent: a cluster started late would add a whole share of
  // tiles to the end); the SMs of a GPC need not pair up, so this may be fewer than sms / cl
  static const int resident = [] {
    for (auto k : {gate_up_swiglu_kernel<1, false>, gate_up_swiglu_kernel<1, true>, gate_up_swiglu_kernel<2, false>,
                   gate_up_swiglu_kernel<2, true>})
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    auto kernel = cl == 1 ? gate_up_swiglu_kernel<1, true> : gate_up_swiglu_kernel<2, true>;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cl;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.gridDim = dim3(sms - sms % cl);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmem;
    config.attrs = &attr;
    config.numAttrs = 1;
    int n = 0;
    const cudaError_t rc = cudaOccupancyMaxActiveClusters(&n, kernel, &config);
    cudaGetLastError();
    const int r = rc == cudaSuccess && n > 0 ? n : sms / cl;
    if (env_int("FLASHDRAFT_GEMM_INFO", 0))
      std::fprintf(stderr, "gate_up_swiglu: clusters of %d, %d at once (occupancy query: %s, %d), %s\n", cl, r,
                   cudaGetErrorString(rc), n, persistent ? "persistent" : "a CTA a tile");
    return r;
  }();  // (the first call's device: the engine runs one device a process)
  Plan p{cl, int(((M + BM - 1) / BM + cl - 1) / cl * (I / BN)), 0, 0, persistent};  // tiles of cl row blocks
  const int clusters = std::min({p.tiles, persistent ? resident : p.tiles, std::max(1, ctas / cl)});
  p.grid = cl * clusters;
  // A last round that would leave more than half the CTAs idle is split along K: its tiles' halves
  // on twice as many CTAs (every CTA of a persistent grid is running, so the one that waits for its
  // partner's sums always gets them). Clusters of one and K of two or more blocks.
  const int rem = p.tiles % clusters;
  if (split && cl == 1 && persistent && rem > 0 && 2 * rem <= clusters && K / BK >= 2 && rem * 4 <= kFlagBytes)
    p.split_items = rem;
  return p;
}

}  // namespace

int gate_up_swiglu_split_tiles(int64_t M, int64_t K, int64_t I) { return plan_for(M, K, I).split_items; }

void gate_up_swiglu(const void* x, const void* w, void* out, int64_t M, int64_t K, int64_t I, void* scratch,
                    int64_t scratch_bytes, void* stream) {
  CUtensorMap mx, mw;
  if (!tile_map(&mx, x, M, K) || !tile_map(&mw, w, 2 * I, K))
    throw std::runtime_error("gate_up_swiglu: cuTensorMapEncodeTiled refused x [" + std::to_string(M) + ", " +
                             std::to_string(K) + "] or W [" + std::to_string(2 * I) + ", " + std::to_string(K) +
                             "] (16-byte aligned bases and rows are required)");
  static const int group_m = std::max(1, env_int("FLASHDRAFT_GEMM_GROUP_M", 12));  // row blocks a group
  static const int epi_step = std::max(0, env_int("FLASHDRAFT_GEMM_EPI_STEP", 1));
  const Plan p = plan_for(M, K, I);
  GemmShape s{int(M),
              int(K),
              int(I),
              int((M + BM - 1) / BM),
              int(I / BN),
              group_m,
              static_cast<__nv_bfloat16*>(out),
              p.tiles,
              0,
              nullptr,
              nullptr,
              epi_step};
  if (p.split_items > 0) {
    if (!scratch || scratch_bytes < kFlagBytes + p.split_items * kPartialBytes)
      throw std::runtime_error("gate_up_swiglu: " + std::to_string(scratch_bytes) + " bytes of scratch for " +
                               std::to_string(p.split_items) + " split tiles; gate_up_swiglu_scratch_bytes gives " +
                               "what a call needs");
    s.split_from = p.tiles - p.split_items;
    s.split_items = p.split_items;
    s.flags = static_cast<unsigned*>(scratch);
    s.partial = reinterpret_cast<float*>(static_cast<char*>(scratch) + kFlagBytes);
  }
  static bool told = false;
  if (!told && env_int("FLASHDRAFT_GEMM_INFO", 0)) {
    told = true;
    std::fprintf(stderr, "gate_up_swiglu: M %d: %d tiles on %d CTAs, %d of them split along K\n", s.M, p.tiles, p.grid,
                 s.split_items);
  }
  int dev = 0;
  cudaGetDevice(&dev);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = p.cl;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attrs;
  config.numAttrs = launch::pdl_on(dev) ? 2 : 1;
  cudaLaunchKernelEx(&config,
                     epi_step > 0 ? (p.cl == 1 ? gate_up_swiglu_kernel<1, true> : gate_up_swiglu_kernel<2, true>)
                                  : (p.cl == 1 ? gate_up_swiglu_kernel<1, false> : gate_up_swiglu_kernel<2, false>),
                     mx, mw, s);
  check_launch("gate_up_swiglu");
}

}  // namespace flashdraft::cuda_ops

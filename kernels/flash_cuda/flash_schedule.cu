// flash_cuda work order: before a kernel is launched, flash_schedule_kernel writes the
// order in which its CTAs take their work items, longest first (the LPT rule: the GPU hands
// out CTAs in launch order as SMs free up, so sorting the items by cost, longest first,
// leaves the short ones for the last wave). The cost of an item is read from the
// BlockMask's own lists, so the order follows any mask: DFlash rows whose lengths differ
// 25-fold, causal, per-head random masks.
// Sorted in groups of heads, not globally: the items are cut into groups of (batch, kv
// head) units, the groups keep their order and each is sorted longest first within itself.
// A global sort runs the same tile of every head at once, so the SMs read the K/V (or Q/dO)
// of all heads together and the L2 no longer holds them: measured on the H200 (NOTES.md
// v10), the sm90a forward ran 0.745 ms sorted globally against 0.732 in grid order,
// although its SM idle time fell from 5.4% to 1.7%. For the sm90a kernels a group's
// operands are sized to a share of the L2 (flash_schedule_groups(), flash_config.hpp), and
// a group's tail is filled by the next group's longest items. The mma.sync kernels (sm80 /
// sm90 / sm120 configurations) sort the whole problem as one group: at half the wgmma rate
// their operand traffic stays below what the memory delivers, and one sort measured 7-10%
// faster than the grid order there (DFlash 4.699 vs 5.204 ms on the H200).
//   query items (forward, dQ): item = (b * Hq + h) * q_blocks + qb; cost = 4 x full tiles
//     + 5 x partial tiles of the row's list (a partial tile also reads its bitmap);
//   key items (dK/dV): item = (b * Hkv + hk) * n_cols + c, where c is one 64-key column
//     (sm80 / sm90 / sm120 kernels) or a pair of them (sm90a); cost = the q heads of the
//     GQA group's transposed list lengths (of a pair: the longer column, since the two
//     columns' warpgroups work side by side).
// One CTA per group: a counting sort on 1024 buckets (cost scaled by the group's largest
// cost): a histogram, a scan in descending order, a scatter. Items of equal bucket land in
// any order; the kernels' outputs do not depend on the order (each output is written by
// exactly one CTA).
// Schedule::grid writes the launch grid's own order instead (query tiles of a head from
// the last to the first; key items in index order).
#include "flash_kernels.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace flashdraft::flash_cuda::detail {
namespace {

constexpr int kSortThreads = 1024, kBuckets = 1024;

struct QueryCost {
  FlashMask m;
  int Hq, q_blocks;
  __device__ int operator()(int item) const {
    const int qb = item % q_blocks, bh = item / q_blocks, h = bh % Hq, b = bh / Hq;
    const int mb = m.batch == 1 ? 0 : b, mh = m.heads == 1 ? 0 : h;
    const int row = (mb * m.heads + mh) * q_blocks + qb;
    return 4 * (m.full_offset[row + 1] - m.full_offset[row]) + 5 * (m.part_offset[row + 1] - m.part_offset[row]);
  }
};

struct KeyCost {
  FlashMask m;
  int Hq, Hkv, kv_blocks, per_item, n_cols;  // per_item: 64-key columns per item (1 or 2)
  __device__ int column(int mh_row, int c) const {
    const int col = mh_row * kv_blocks + c;
    return (m.t_full_offset[col + 1] - m.t_full_offset[col]) + (m.t_part_offset[col + 1] - m.t_part_offset[col]);
  }
  __device__ int operator()(int item) const {
    const int c = item % n_cols, bh = item / n_cols, hk = bh % Hkv, b = bh / Hkv;
    const int group = Hq / Hkv, mb = m.batch == 1 ? 0 : b;
    int cost = 0;
    for (int g = 0; g < group; ++g) {
      const int h = hk * group + g, mh = m.heads == 1 ? 0 : h;
      int longest = 0;
      for (int k = 0; k < per_item; ++k)
        if (c * per_item + k < kv_blocks) longest = max(longest, column(mb * m.heads + mh, c * per_item + k));
      cost += longest;
    }
    return cost;
  }
};

__device__ int block_max(int v, int* scratch) {
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? scratch[threadIdx.x] : 0;
    for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) scratch[0] = v;
  }
  __syncthreads();
  v = scratch[0];
  __syncthreads();
  return v;
}

// out[i0 .. i1) = the items i0 .. i1 - 1, longest first. One CTA of kSortThreads threads.
template <class Cost>
__device__ void longest_first(int i0, int i1, const Cost& cost, int* out) {
  __shared__ int count[kBuckets];
  __shared__ int scratch[32];
  const int tid = threadIdx.x;
  int top = 0;
  for (int i = i0 + tid; i < i1; i += kSortThreads) top = max(top, cost(i));
  top = block_max(top, scratch);
  auto bucket = [&](int c) {  // 0 = longest
    return top == 0 ? 0 : kBuckets - 1 - int((long long)c * (kBuckets - 1) / top);
  };
  for (int i = tid; i < kBuckets; i += kSortThreads) count[i] = 0;
  __syncthreads();
  for (int i = i0 + tid; i < i1; i += kSortThreads) atomicAdd(&count[bucket(cost(i))], 1);
  __syncthreads();
  // exclusive scan of count[] (kBuckets == kSortThreads: one bucket per thread)
  const int mine = count[tid];
  int incl = mine;
  for (int o = 1; o < 32; o *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, incl, o);
    if (tid % 32 >= o) incl += x;
  }
  if (tid % 32 == 31) scratch[tid / 32] = incl;
  __syncthreads();
  if (tid < 32) {
    int w = scratch[tid];
    for (int o = 1; o < 32; o *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, w, o);
      if (tid >= o) w += x;
    }
    scratch[tid] = w;  // inclusive over warps
  }
  __syncthreads();
  count[tid] = i0 + incl - mine + (tid >= 32 ? scratch[tid / 32 - 1] : 0);
  __syncthreads();
  for (int i = i0 + tid; i < i1; i += kSortThreads) out[atomicAdd(&count[bucket(cost(i))], 1)] = i;
}

// Groups: CTAs 0 .. q_groups - 1 order the query items (q_order), the rest the key items
// (kv_order, when not null); a group is q_units / kv_units (batch, kv head) units.
// Schedule::grid: CTA 0 and CTA q_groups write the grid order of all the items.
__global__ void __launch_bounds__(kSortThreads)
    flash_schedule_kernel(const FlashParams p, int* q_order, int* kv_order, int per_item, int q_units, int kv_units,
                          int q_groups) {
  const int q_blocks = (p.Lq + BQ - 1) / BQ, kv_blocks = (p.Lkv + BKV - 1) / BKV;
  const int n_cols = (kv_blocks + per_item - 1) / per_item;
  const bool grid = p.schedule == Schedule::grid;
  const int g = blockIdx.x;
  if (g < q_groups) {
    const int n = p.B * p.Hq * q_blocks, per_group = q_units * (p.Hq / p.Hkv) * q_blocks;
    if (grid) {
      if (g == 0)
        for (int i = threadIdx.x; i < n; i += kSortThreads)
          q_order[i] = i - i % q_blocks + (q_blocks - 1 - i % q_blocks);
    } else {
      longest_first(g * per_group, min(n, (g + 1) * per_group), QueryCost{p.mask, p.Hq, q_blocks}, q_order);
    }
  } else if (kv_order != nullptr) {
    const int n = p.B * p.Hkv * n_cols, per_group = kv_units * n_cols, k = g - q_groups;
    if (grid) {
      if (k == 0)
        for (int i = threadIdx.x; i < n; i += kSortThreads) kv_order[i] = i;
    } else {
      longest_first(k * per_group, min(n, (k + 1) * per_group),
                    KeyCost{p.mask, p.Hq, p.Hkv, kv_blocks, per_item, n_cols}, kv_order);
    }
  }
}

// L2 bytes of the current device, read once per device.
size_t l2_bytes() {
  static std::mutex mu;
  static std::map<int, size_t> known;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess || bytes <= 0) {
    cudaGetLastError();
    bytes = 4 << 20;  // unknown: small groups keep the L2 behaviour of the grid order
  }
  return known[device] = size_t(bytes);
}

}  // namespace

void launch_schedule(const FlashParams& p, int* q_order, int* kv_order, int kv_per_item, bool l2_groups) {
  const int units = p.B * p.Hkv;
  const ScheduleGroups sg = flash_schedule_groups(p.B, p.Hq, p.Hkv, p.Lq, p.Lkv, p.D, 2, l2_bytes(), l2_groups);
  int q_units = sg.q_units, kv_units = sg.kv_units;
  if (const char* env = std::getenv("FLASHDRAFT_FLASH_CUDA_GROUP_HEADS")) {  // "q,kv" (benchmarks)
    int a = 0, b = 0;
    if (std::sscanf(env, "%d,%d", &a, &b) != 2 || a < 1 || b < 1)
      throw std::runtime_error(std::string("flash_cuda: FLASHDRAFT_FLASH_CUDA_GROUP_HEADS is '") + env +
                               "'; expected two positive numbers of kv heads per group, \"q,kv\" (e.g. 3,4)");
    q_units = std::min(a, units), kv_units = std::min(b, units);
  }
  const bool grid = p.schedule == Schedule::grid;
  const int q_groups = grid ? 1 : (units + q_units - 1) / q_units;
  const int kv_groups = kv_order == nullptr ? 0 : grid ? 1 : (units + kv_units - 1) / kv_units;
  flash_schedule_kernel<<<q_groups + kv_groups, kSortThreads, 0, p.stream>>>(p, q_order, kv_order, kv_per_item, q_units,
                                                                             kv_units, q_groups);
  check_launch("work order");
}

}  // namespace flashdraft::flash_cuda::detail

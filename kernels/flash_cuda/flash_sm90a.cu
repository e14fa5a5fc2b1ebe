// flash_cuda for Hopper (configuration "sm90a"): the same algorithm, lists and workspace
// as flash_kernels.cuh's forward, dK/dV and dQ kernels, with every product on the
// warpgroup MMA (wgmma, sm_90a) instead of mma.sync:
//   fwd  : one CTA = two consumer warpgroups (64 query rows each) and a producer
//          warpgroup per (128-query mask tile, q head, batch); two list entries (128 keys)
//          per step: S = Q K^T (Q from registers, K from smem, m64n128), online softmax,
//          O += P V (P from registers, V read MN-major); 2-stage ring of 128-key K/V tiles
//          filled by the producer with cp.async, mbarrier handshakes; 162 KB, 1 CTA/SM.
//   dK/dV: one CTA = two consumer warpgroups (one 64-key mask column each) and a producer
//          warpgroup per (pair of key columns, kv head, batch); the producer merges the two
//          columns' transposed lists and loads each 64-query step of Q / dO once for both,
//          into a 2-stage ring (mbarriers); per step and column S^T = K Q^T and
//          dP^T = V dO^T (A and B from shared memory, K-major), then dV += P^T dO (issued
//          as soon as P exists, running while dS is computed) and dK += dS^T Q (A = P^T /
//          dS^T from registers, B = dO / Q read MN-major from the same tiles). 134 KB,
//          1 CTA/SM.
//   dQ   : one CTA = two consumer warpgroups (64 query rows each) and a producer
//          warpgroup per (128-query tile, q head, batch), walking the forward lists with
//          a 3-stage K/V ring (mbarriers, like the forward); per KV tile
//          S = Q K^T, dP = dO V^T (smem x smem), dQ += dS K (registers x smem, MN-major),
//          the dQ product left running while the next tile's S and dP are issued.
//   dK/dV and dQ run concurrently, dK/dV on a second stream of the greatest priority
//   (fork / join events on the caller's stream; its CTAs are handed out first and the dQ
//   CTAs fill its tail); dQ is still a separate pass: no atomics, deterministic.
// This file is compiled for sm_90a only (CMakeLists.txt); the host launchers below are
// called by flash_forward() / flash_backward() when the resolved configuration is sm90a, which
// flash_resolve_config() allows only on compute capability 9.0 devices.
#include <climits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <flashdraft/launch.cuh>
#include <flashdraft/wgmma.cuh>
#include "flash_kernels.cuh"

namespace flashdraft::flash_cuda {
namespace detail {
namespace {

// Copies rows [row0, row0 + ROWS) of a [L][D] matrix into a sw128 tile (wgmma.cuh) of
// TROWS rows, at its rows trow0 .. trow0 + ROWS - 1 (trow0 a multiple of 8); rows >= L are
// zero-filled. Thread tid copies 16-byte piece tid % C of rows tid / C + k * (NT / C);
// NT / C is a multiple of 8, so (row % 8) is fixed per thread.
template <int D, int ROWS, int NT, int TROWS = ROWS>
__device__ __forceinline__ void load_sw128(uint32_t dst, const uint16_t* base, int64_t row_stride, int row0, int L,
                                           int tid, int trow0 = 0) {
  constexpr int C = D / 8, RPP = NT / C;
  static_assert(RPP % 8 == 0 && ROWS % RPP == 0 && ROWS <= TROWS, "tile copy shape");
  const int r0 = tid / C, c = tid % C;
  const uint32_t d0 = dst + (c / 8) * (TROWS * 128) + (trow0 + r0) * 128 + (((c % 8) ^ (r0 & 7)) << 4);
  const uint16_t* src = base + (int64_t)(row0 + r0) * row_stride + c * 8;
#pragma unroll
  for (int k = 0; k < ROWS / RPP; ++k) {
    const bool ok = row0 + r0 + k * RPP < L;
    cp_async16(d0 + k * RPP * 128, ok ? src + (int64_t)k * RPP * row_stride : base, ok);
  }
}

// Packs an N-column fp32 accumulator fragment (wgmma.cuh layout, N / 2 floats) into
// N / 16 A k-steps.
template <class T, int NF>
__device__ __forceinline__ void pack_a_flat(uint32_t (&pa)[NF / 8][4], const float (&p)[NF]) {
#pragma unroll
  for (int kk = 0; kk < NF / 8; ++kk) {
    pa[kk][0] = Ops<T>::pack(p[8 * kk + 0], p[8 * kk + 1]);
    pa[kk][1] = Ops<T>::pack(p[8 * kk + 2], p[8 * kk + 3]);
    pa[kk][2] = Ops<T>::pack(p[8 * kk + 4], p[8 * kk + 5]);
    pa[kk][3] = Ops<T>::pack(p[8 * kk + 6], p[8 * kk + 7]);
  }
}

// Loads a warp's 16 rows (row0 .. row0 + 15 of a ROWS-row sw128 tile) as wgmma A
// fragments, one per 16-column k-step (ldmatrix: lanes 0-15 address the rows at k, lanes
// 16-31 the same rows at k + 8, so the four matrices are a0..a3 of the A layout).
template <int D, int ROWS>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[D / 16][4], uint32_t tile, int row0, int lane) {
  const int r = row0 + (lane % 16);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int k = 16 * kk + (lane / 16) * 8;
    const uint32_t addr = tile + (k / 64) * (ROWS * 128) + r * 128 + ((((k % 64) / 8) ^ (r & 7)) << 4);
    // the memory clobber keeps the read after the mbarrier wait that makes the tile valid
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[kk][0]), "=r"(a[kk][1]), "=r"(a[kk][2]), "=r"(a[kk][3])
                 : "r"(addr)
                 : "memory");
  }
}

// Stores a warp's 16 rows of a 64 x D fp32 accumulator (flat wgmma layout) to a tile in
// flash_kernels.cuh's [rows][D] layout (tile_off), for smem_to_global.
template <class T, int D>
__device__ __forceinline__ void acc_flat_to_smem(unsigned char* tile, int row0, const float (&acc)[D / 2], int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<uint32_t*>(tile + tile_off<D>(row0 + g, j) + t * 4) = Ops<T>::pack(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<uint32_t*>(tile + tile_off<D>(row0 + g + 8, j) + t * 4) =
        Ops<T>::pack(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// Masks a 64-column score fragment (wgmma.cuh layout; this thread's rows qrow, qrow + 8 of
// the 128-row mask tile) with the bitmap words tile_mask read (flash_kernels.cuh), called
// before the wait for the S product so that their latency runs under it (NOTES.md v14).
// The flat [32] and mma.sync's [8][4] fragments are the same registers in the same order.
__device__ __forceinline__ void mask_scores(float (&s)[32], const FlashParams& p, const TileMask& tm, int t) {
  apply_tile_mask(reinterpret_cast<float(&)[8][4]>(s), tm, p.Lkv, t);
}

__device__ __forceinline__ uint32_t align1024(uint32_t a) { return (a + 1023u) & ~1023u; }

// mbarriers (shared::cta, wgmma.cuh): the producer warp fills a ring of K/V stages with
// cp.async and signals each stage's `full` barrier when its copies land (one arrival per
// producer thread, counted when that thread's earlier copies complete); each consumer warp
// arrives on the stage's `empty` barrier once its products read it.
using wg::mbar_arrive;
using wg::mbar_arrive_on_copies;
using wg::mbar_init;
using wg::mbar_wait;
using wg::named_barrier;

// The mbarriers at the start of a CTA's shared memory (`base`): full[STAGES] and empty[STAGES]
// of the ring of stages the producer fills, then `once`, the barrier of the tiles loaded once
// (Q, or K and V; one arrival per producer thread). init(): thread 0 sets them up (a stage is
// full after `fill` arrivals and empty after the 8 consumer warps'), then every thread waits.
template <int STAGES>
struct Barriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full(int st) const { return base + 8 * st; }
  __device__ __forceinline__ uint32_t empty(int st) const { return base + 8 * (STAGES + st); }
  __device__ __forceinline__ uint32_t once() const { return base + 8 * (2 * STAGES); }
  __device__ __forceinline__ void init(int tid, int fill) const {
    if (tid == 0) {
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(full(st), fill);
        mbar_init(empty(st), 8);
      }
      mbar_init(once(), 128);
    }
    __syncthreads();
  }
};
// The producer warpgroup keeps REGS registers per thread and gives the rest back for the
// consumers' setmaxnreg.inc.
template <int REGS>
__device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS) : "memory");
}

// ---------------------------------------------------------------- dK / dV, warp-specialised
// One CTA per (pair of 64-key mask columns 2x, 2x + 1, kv head, batch): warpgroups 0 and 1
// own one column each (its K, V tiles and its dK, dV accumulators), warpgroup 2 is the
// producer. The producer merges the two columns' transposed lists (each sorted by query
// tile, full and partial disjoint) into one walk, so a 64-query step of Q and dO is loaded
// once for both columns; it stages with each step the rows' lse2 / delta, each column's
// bitmap rows and a kind per column (kNone: the column does not see this step, kFull,
// kPart), and ends the walk with a step of kind kEnd. The consumers wait on the stage's
// `full` mbarrier and release it on `empty`; there is no CTA-wide barrier in the loop, so
// one warpgroup's softmax runs under the other's products.
enum : int { kNone = 0, kFull = 1, kPart = 2, kEnd = 3 };
template <int D, int STAGES>
struct WsKvSmem {
  static constexpr int kKV = BKV * D * 2;     // one K or V tile, 64 rows
  static constexpr int kQ = BQ_STEP * D * 2;  // Q or dO tile, 64 rows
  static constexpr int kBars = 1024;
  // meta: lse2[64] +0, delta[64] +256, bits of column 0 [64][2] +512, column 1 +1024,
  // kind[2] +1536
  static constexpr int kMeta = 2048;
  static constexpr int kStage = 2 * kQ + kMeta;
  static constexpr int bytes = 1024 + kBars + 4 * kKV + STAGES * kStage;
};

template <class T, int D, int STAGES>
__global__ void __launch_bounds__(384, 1)
    ws_bwd_dkdv_kernel(const FlashParams p, const float* ws_lse2, const float* ws_delta, int Lq_pad, const int* order) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WsKvSmem<D, STAGES>;
  const uint32_t s0 = align1024(smem_addr(smem_raw));
  unsigned char* smem = smem_raw + (s0 - smem_addr(smem_raw));
  const int kv_blocks = (p.Lkv + BKV - 1) / BKV;
  const KeyItem item = key_item(p, order, (kv_blocks + 1) / 2);
  const int hk = item.hk, b = item.b;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const int kvb0 = 2 * item.c;
  trace_begin(p, 0, item.item);

  const Barriers<STAGES> bar{s0};
  const uint32_t kvbar = bar.once();
  const uint32_t tiles = s0 + S::kBars;
  auto sK = [&](int w) { return tiles + w * 2 * S::kKV; };
  auto sV = [&](int w) { return sK(w) + S::kKV; };
  auto stage = [&](int st) { return S::kBars + 4 * S::kKV + st * S::kStage; };  // byte offset from s0
  bar.init(tid, 129);  // a stage: 128 copy arrivals + thread 0's, after it wrote the kinds

  if (warp >= 8) {  // ---- producer warpgroup
    // 24: the CTA is launched with 168 x 384 registers and setmaxnreg.inc only takes what
    // the producer gives back: 256 x 240 + 128 x 24 = 168 x 384 (with 32 the consumers'
    // increase waits for ever: measured, a hang)
    producer_registers<24>();
    const int pt = tid - 256;
    const uint16_t* K = head_of(p.k, p.k_strides, b, hk);
    const uint16_t* V = head_of(p.v, p.v_strides, b, hk);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      load_sw128<D, BKV, 128>(sK(w), K, p.k_strides.row, (kvb0 + w) * BKV, p.Lkv, pt);
      load_sw128<D, BKV, 128>(sV(w), V, p.v_strides.row, (kvb0 + w) * BKV, p.Lkv, pt);
    }
    mbar_arrive_on_copies(kvbar);
    const FlashMask& m = p.mask;
    const int group = p.Hq / p.Hkv, mb = m.batch == 1 ? 0 : b;
    int it = 0;
    auto put = [&](int h, int q0, const int(&ent)[2], int half, int kind_end) {
      const int st = it % STAGES;
      if (it >= STAGES) mbar_wait(bar.empty(st), ((it / STAGES) - 1) & 1);
      const int off = stage(st);
      unsigned char* meta = smem + off + 2 * S::kQ;
      if (!kind_end) {
        const uint16_t* Q = head_of(p.q, p.q_strides, b, h);
        const uint16_t* dO = head_of(p.dout, p.dout_strides, b, h);
        load_sw128<D, BQ_STEP, 128>(s0 + off, Q, p.q_strides.row, q0, p.Lq, pt);
        load_sw128<D, BQ_STEP, 128>(s0 + off + S::kQ, dO, p.dout_strides.row, q0, p.Lq, pt);
        const int64_t row = ((int64_t)b * p.Hq + h) * Lq_pad + q0;
        const uint32_t sm = s0 + off + 2 * S::kQ;
        if (pt < 16)
          cp_async16(sm + pt * 16, ws_lse2 + row + pt * 4, true);
        else if (pt < 32)
          cp_async16(sm + 256 + (pt - 16) * 16, ws_delta + row + (pt - 16) * 4, true);
        else if (pt < 96) {
          const int c = (pt - 32) / 32, i = (pt - 32) % 32;
          if (ent[c] >= 0)
            cp_async16(sm + 512 + c * 512 + i * 16, m.bits + (int64_t)ent[c] * (BQ * 2) + half * (BQ_STEP * 2) + i * 4,
                       true);
        }
      }
      if (pt == 0) {
        int* kind = reinterpret_cast<int*>(meta + 1536);
        kind[0] = kind_end ? kEnd : ent[0] == -2 ? kNone : ent[0] == -1 ? kFull : kPart;
        kind[1] = kind_end ? kEnd : ent[1] == -2 ? kNone : ent[1] == -1 ? kFull : kPart;
      }
      mbar_arrive_on_copies(bar.full(st));
      if (pt == 0) mbar_arrive(bar.full(st));
      ++it;
    };
    for (int gi = 0; gi < group; ++gi) {
      const int h = hk * group + gi;
      const int col = (mb * m.heads + (m.heads == 1 ? 0 : h)) * kv_blocks + kvb0;
      // positions in (and ends of) each column's full and partial lists
      int f[2], fe[2], q[2], qe[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool in = kvb0 + c < kv_blocks;
        f[c] = in ? m.t_full_offset[col + c] : 0;
        fe[c] = in ? m.t_full_offset[col + c + 1] : 0;
        q[c] = in ? m.t_part_offset[col + c] : 0;
        qe[c] = in ? m.t_part_offset[col + c + 1] : 0;
      }
      for (;;) {
        int qb = INT_MAX;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (f[c] < fe[c]) qb = min(qb, m.t_full_index[f[c]]);
          if (q[c] < qe[c]) qb = min(qb, m.t_part_index[q[c]]);
        }
        if (qb == INT_MAX) break;
        int ent[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (f[c] < fe[c] && m.t_full_index[f[c]] == qb) {
            ent[c] = -1;
            ++f[c];
          } else if (q[c] < qe[c] && m.t_part_index[q[c]] == qb) {
            ent[c] = m.t_part_entry[q[c]];
            ++q[c];
          } else {
            ent[c] = -2;
          }
        }
        for (int half = 0; half < 2 && qb * BQ + half * BQ_STEP < p.Lq; ++half)
          put(h, qb * BQ + half * BQ_STEP, ent, half, 0);
      }
    }
    const int none[2] = {-2, -2};
    put(0, 0, none, 0, 1);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

  // ---- consumers: warpgroup w owns keys kvb0 + w's 64 rows
  const int w = warp / 4, wq = warp % 4;
  const int kv0 = (kvb0 + w) * BKV;
  const float sl2 = p.scale * kLog2e;
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const int krow = wq * 16 + g;  // this thread's keys: krow, krow + 8 (within the column)
  const int word = wq / 2;       // keys 16 wq .. 16 wq + 15 sit in word (16 wq) / 32 of a bitmap row
  const uint32_t key0 = 1u << (krow % 32), key1 = 1u << ((krow + 8) % 32);  // their bits in it
  auto release = [&](int st) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar.empty(st));
  };
  mbar_wait(kvbar, 0);
  for (int it = 0;; ++it) {
    const int st = it % STAGES;
    mbar_wait(bar.full(st), (it / STAGES) & 1);
    const int off = stage(st);
    const float* sL = reinterpret_cast<const float*>(smem + off + 2 * S::kQ);
    const int kind = reinterpret_cast<const int*>(sL + 384)[w];
    if (kind == kEnd) break;
    if (kind == kNone) {
      release(st);
      continue;
    }
    // The step of a partial column and that of a full one are separate copies of the
    // body (`partial` known at compile time), so a full step runs no bitmap code.
    auto body = [&](auto partial_tag) {
      constexpr bool partial = decltype(partial_tag)::value;
      wg::fence_async_smem();
      const uint32_t sQ = s0 + off, sdO = s0 + off + S::kQ;
      const float* sDelta = sL + 64;
      const uint32_t* sBits = reinterpret_cast<const uint32_t*>(sL + 128 + 128 * w);

      // S^T = K Q^T, dP^T = V dO^T: 64 keys x 64 queries, two commit groups
      float s[32], dp[32];
      wg::fence();
      const uint64_t descK = wg::desc_k<BKV>(sK(w), 0, 0), descQ = wg::desc_k<BQ_STEP>(sQ, 0, 0);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wg::Mma<T>::ss64(s, wg::desc_add(descK, (kk / 4) * (BKV * 128) + (kk % 4) * 32),
                         wg::desc_add(descQ, (kk / 4) * (BQ_STEP * 128) + (kk % 4) * 32), kk > 0);
      wg::commit();
      const uint64_t descV = wg::desc_k<BKV>(sV(w), 0, 0), descdO = wg::desc_k<BQ_STEP>(sdO, 0, 0);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wg::Mma<T>::ss64(dp, wg::desc_add(descV, (kk / 4) * (BKV * 128) + (kk % 4) * 32),
                         wg::desc_add(descdO, (kk / 4) * (BQ_STEP * 128) + (kk % 4) * 32), kk > 0);
      wg::commit();
      // lse2 of this thread's 16 query columns, read while the products run: read after the
      // wait, each load stood between a score and its exp (NOTES.md v13: short-scoreboard stalls)
      float2 l2v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) l2v[j] = *reinterpret_cast<const float2*>(sL + 8 * j + 2 * t);
      wg::wait<1>();
      wg::pin(s);
      // P^T = exp2(s * sl2 - lse2[q]) (0 where masked)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // the bitmap rows of query columns c = 8 j + 2 t and c + 1, both words of each,
        // in one 16-byte read; this warp's keys sit in word `word`
        uint4 bits = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (partial) bits = *reinterpret_cast<const uint4*>(sBits + 2 * (8 * j + 2 * t));
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float l2 = x ? l2v[j].y : l2v[j].x;
          float p0 = fast_exp2(fmaf(s[4 * j + x], sl2, -l2));
          float p1 = fast_exp2(fmaf(s[4 * j + 2 + x], sl2, -l2));
          if constexpr (partial) {
            const uint32_t bw = x ? (word ? bits.w : bits.z) : (word ? bits.y : bits.x);
            if (!(bw & key0)) p0 = 0.f;
            if (!(bw & key1)) p1 = 0.f;
          }
          s[4 * j + x] = p0;
          s[4 * j + 2 + x] = p1;
        }
      }
      uint32_t pa[4][4], pb[4][4];
      pack_a_flat<T>(pa, s);
      // dV += P^T dO runs while dS is computed
      wg::pin(pa);
      wg::fence();
      const uint64_t descdOmn = wg::desc_mn<BQ_STEP>(sdO, 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg::Mma<T>::template rs<D>(dv, pa[kk], wg::desc_add(descdOmn, kk * 2048));
      wg::commit();
      float2 dev[8];  // delta of the same columns, likewise before the wait
#pragma unroll
      for (int j = 0; j < 8; ++j) dev[j] = *reinterpret_cast<const float2*>(sDelta + 8 * j + 2 * t);
      wg::wait<1>();  // dP (the dV product may still run)
      wg::pin(dp);
      // dS^T = P^T (dP^T - delta[q])
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const float de = x ? dev[j].y : dev[j].x;
          dp[4 * j + x] = s[4 * j + x] * (dp[4 * j + x] - de);
          dp[4 * j + 2 + x] = s[4 * j + 2 + x] * (dp[4 * j + 2 + x] - de);
        }
      pack_a_flat<T>(pb, dp);
      // dK += dS^T Q (Q read MN-major)
      wg::pin(pb);
      wg::fence();
      const uint64_t descQmn = wg::desc_mn<BQ_STEP>(sQ, 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg::Mma<T>::template rs<D>(dk, pb[kk], wg::desc_add(descQmn, kk * 2048));
      wg::commit();
      wg::wait<0>();
      wg::pin(dv);
      wg::pin(dk);
      release(st);
    };
    if (kind == kPart)
      body(std::true_type{});
    else
      body(std::false_type{});
  }

#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] *= p.scale;
  // Stage through the warpgroup's own K and V tiles (only its products read them, and
  // they have ended), in the [rows][D] layout smem_to_global reads.
  unsigned char* tdk = smem + (sK(w) - s0);
  unsigned char* tdv = smem + (sV(w) - s0);
  named_barrier(1 + w, 128);
  acc_flat_to_smem<T, D>(tdk, wq * 16, dk, lane);
  acc_flat_to_smem<T, D>(tdv, wq * 16, dv, lane);
  named_barrier(1 + w, 128);
  uint16_t* dK = head_of(p.dk, p.dk_strides, b, hk);
  uint16_t* dV = head_of(p.dv, p.dv_strides, b, hk);
  smem_to_global<D>(dK, p.dk_strides.row, tdk, 0, BKV, kv0, p.Lkv, tid % 128, 128);
  smem_to_global<D>(dV, p.dv_strides.row, tdv, 0, BKV, kv0, p.Lkv, tid % 128, 128);
  trace_end(p, 0);
}

// ---------------------------------------------------------------- dQ
// One CTA per (128-row mask tile, q head, batch), warp-specialised like the forward:
// warpgroup 2 copies Q and dO once and the K/V tiles into a STAGES-deep ring; warpgroups
// 0 and 1 (64 rows each, K/V loaded once for both) wait on the stage's mbarrier instead of
// a CTA barrier, and release a stage once the dQ product that reads its K tile has ended
// (that product runs on under the next tile's S and dP). 3 stages: 161 KB, 1 CTA/SM.
// Measured against the v6 dQ (two warpgroups in lockstep, 2 stages) and 2 stages: NOTES.md v8.
template <int D, int STAGES>
struct WgDqSmem {
  static constexpr int kQ = BQ * D * 2;
  static constexpr int kKV = BKV * D * 2;
  static constexpr int kBars = 1024;
  static constexpr int bytes = 1024 + kBars + 2 * kQ + STAGES * 2 * kKV;
};

template <class T, int D, int STAGES>
__global__ void __launch_bounds__(384, 1)
    wg_bwd_dq_kernel(const FlashParams p, const float* ws_lse2, const float* ws_delta, int Lq_pad, const int* order) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WgDqSmem<D, STAGES>;
  const uint32_t s0 = align1024(smem_addr(smem_raw));
  unsigned char* smem = smem_raw + (s0 - smem_addr(smem_raw));
  const QueryWork work = query_work(p, order, dq_trace_first(p));
  const int h = work.h, b = work.b, q0 = work.q0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const uint16_t *Q = work.q, *K = work.k, *V = work.v, *dO = work.dout;
  uint16_t* dQ = head_of(p.dq, p.dq_strides, b, h);
  const RowList rl = work.rl;
  if (rl.n == 0) {
    zero_rows<D>(dQ, p.dq_strides.row, q0, BQ, p.Lq, tid, 384);
    trace_end(p, dq_trace_first(p));
    return;
  }
  const Barriers<STAGES> bar{s0};
  const uint32_t qbar = bar.once();
  const uint32_t sQ = s0 + S::kBars, sdO = sQ + S::kQ;
  auto sK = [&](int st) { return sQ + 2 * S::kQ + st * 2 * S::kKV; };
  auto sV = [&](int st) { return sK(st) + S::kKV; };
  bar.init(tid, 128);

  if (warp >= 8) {  // ---- producer warpgroup
    producer_registers<40>();
    const int pt = tid - 256;
    load_sw128<D, BQ, 128>(sQ, Q, p.q_strides.row, q0, p.Lq, pt);
    load_sw128<D, BQ, 128>(sdO, dO, p.dout_strides.row, q0, p.Lq, pt);
    mbar_arrive_on_copies(qbar);
    for (int it = 0; it < rl.n; ++it) {
      const int st = it % STAGES;
      if (it >= STAGES) mbar_wait(bar.empty(st), ((it / STAGES) - 1) & 1);
      int kvb, entry;
      rl.at(p.mask, it, kvb, entry);
      load_sw128<D, BKV, 128>(sK(st), K, p.k_strides.row, kvb * BKV, p.Lkv, pt);
      load_sw128<D, BKV, 128>(sV(st), V, p.v_strides.row, kvb * BKV, p.Lkv, pt);
      mbar_arrive_on_copies(bar.full(st));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  const int wgi = warp / 4;
  const int qrow = warp * 16 + g;  // rows qrow, qrow + 8 of the 128-row mask tile
  float l2[2], de[2];
  {
    const int64_t wrow = ((int64_t)b * p.Hq + h) * Lq_pad + q0 + qrow;  // padded: in range
    l2[0] = ws_lse2[wrow], l2[1] = ws_lse2[wrow + 8];
    de[0] = ws_delta[wrow], de[1] = ws_delta[wrow + 8];
  }
  const float sl2 = p.scale * kLog2e;
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  auto release = [&](int st) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar.empty(st));
  };
  mbar_wait(qbar, 0);
  for (int it = 0; it < rl.n; ++it) {
    const int st = it % STAGES;
    int kvb, entry;
    rl.at(p.mask, it, kvb, entry);
    // the tile's bitmap words, read before the waits: their latency runs under the wait and the products
    const TileMask tm = tile_mask(p.mask, kvb, entry, qrow);
    mbar_wait(bar.full(st), (it / STAGES) & 1);
    wg::fence_async_smem();
    float s[32], dp[32];
    wg::fence();
    // each product's descriptor is the first k-step's plus a constant (wg::desc_add)
    const uint64_t descQ = wg::desc_k<BQ>(sQ, 64 * wgi, 0), descK = wg::desc_k<BKV>(sK(st), 0, 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg::Mma<T>::ss64(s, wg::desc_add(descQ, (kk / 4) * (BQ * 128) + (kk % 4) * 32),
                       wg::desc_add(descK, (kk / 4) * (BKV * 128) + (kk % 4) * 32), kk > 0);
    wg::commit();
    const uint64_t descdO = wg::desc_k<BQ>(sdO, 64 * wgi, 0), descV = wg::desc_k<BKV>(sV(st), 0, 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg::Mma<T>::ss64(dp, wg::desc_add(descdO, (kk / 4) * (BQ * 128) + (kk % 4) * 32),
                       wg::desc_add(descV, (kk / 4) * (BKV * 128) + (kk % 4) * 32), kk > 0);
    wg::commit();
    wg::wait<2>();  // the previous tile's dQ product has ended: its stage is free
    wg::pin(dq);
    if (it > 0) release((it - 1) % STAGES);
    wg::wait<1>();
    wg::pin(s);
    mask_scores(s, p, tm, t);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) s[4 * j + x] = fast_exp2(fmaf(s[4 * j + x], sl2, -l2[x / 2]));
    wg::wait<0>();
    wg::pin(dp);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) dp[4 * j + x] = s[4 * j + x] * (dp[4 * j + x] - de[x / 2]);
    uint32_t pb[4][4];
    pack_a_flat<T>(pb, dp);
    wg::pin(pb);
    wg::fence();
    const uint64_t descKmn = wg::desc_mn<BKV>(sK(st), 0);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg::Mma<T>::template rs<D>(dq, pb[kk], wg::desc_add(descKmn, kk * 2048));
    wg::commit();
  }
  wg::wait<0>();
  wg::pin(dq);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] *= p.scale;
  // both consumer warpgroups are past their last S before the Q tile is overwritten
  named_barrier(1, 256);
  acc_flat_to_smem<T, D>(smem + S::kBars, warp * 16, dq, lane);
  __syncwarp();
  smem_to_global<D>(dQ, p.dq_strides.row, smem + S::kBars, warp * 16, 16, q0 + warp * 16, p.Lq, lane, 32);
  trace_end(p, dq_trace_first(p));
}

// ---------------------------------------------------------------- forward
// The forward's softmax for the step's KVT key tiles (64 columns each, already masked)
// without touching O: updates m and l, packs P into pa and returns in alpha the factor O
// must be rescaled by.
template <class T, int KVT>
__device__ __forceinline__ void fwd_softmax_p(float (&s)[32 * KVT], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                              uint32_t (&pa)[4 * KVT][4], float sl2) {
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int j = 0; j < 8 * KVT; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    base[r] = mx[r] == -INFINITY ? 0.f : mx[r] * sl2;
    alpha[r] = fast_exp2(m[r] * sl2 - base[r]);  // m = -inf -> 0
    m[r] = mx[r];
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int j = 0; j < 8 * KVT; ++j)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      s[4 * j + x] = fast_exp2(fmaf(s[4 * j + x], sl2, -base[x / 2]));
      l[x / 2] += s[4 * j + x];
    }
  pack_a_flat<T>(pa, s);
}

// One CTA per (128-row mask tile, q head, batch), three warpgroups. Warpgroup 2 is the
// producer: it gives most of its registers to the consumers (setmaxnreg), copies Q once
// and then the K/V tiles of the row's list into a STAGES-deep ring, two list entries per
// stage (stacked into one tile of 128 rows; a missing last entry is zero-filled).
// Warpgroups 0 and 1 are the consumers, 64 query rows each, sharing every K/V tile (half
// the K/V traffic of one CTA per 64 rows). They are not in lockstep: one's softmax runs
// while the other's products hold the tensor cores. Per step a consumer runs S = Q K^T as
// m64n128 products, one softmax over the 128 columns and one rescale of O: the per-step
// costs (barrier waits, row reductions, the rescale of O) are paid once per two mask
// tiles. Q is read from shared memory once, into registers (wgmma A fragments), so S
// reads only K from shared memory. Measured against the v6 forward (one warpgroup per 64
// rows, two CTAs per SM), 3 stages and in-warpgroup pipelining: NOTES.md, v8; the step
// of two tiles against one: v11; Q in registers against Q in shared memory: v12.
constexpr int kFwdKVT = 2;  // mask-list entries (64-key tiles) per forward step: S is m64n128
template <int D, int STAGES>
struct WgFwdSmem {
  static constexpr int kQ = BQ_STEP * D * 2;         // one warpgroup's 64 rows
  static constexpr int kKV = kFwdKVT * BKV * D * 2;  // a stage's K (or V) tile, 128 rows
  static constexpr int kBars = 1024;                 // mbarriers, then 1024-aligned tiles
  static constexpr int bytes = 1024 + kBars + 2 * kQ + STAGES * 2 * kKV;
};
constexpr int kWsFwdThreads = 384;  // consumer warpgroups 0, 1; producer warpgroup 2

template <class T, int D, int STAGES>
__global__ void __launch_bounds__(kWsFwdThreads, 1) wg_fwd_kernel(const FlashParams p, const int* order) {
  constexpr int KVT = kFwdKVT, KR = KVT * BKV;  // list entries and key rows of a stage
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WgFwdSmem<D, STAGES>;
  const uint32_t s0 = align1024(smem_addr(smem_raw));
  unsigned char* smem = smem_raw + (s0 - smem_addr(smem_raw));
  // Launched with programmatic dependent launch (launch_fwd): wait until the kernel before it
  // (the q|k|v RoPE, the work order) has completed and its writes are visible, before reading
  // or writing anything. Without the launch attribute this returns at once.
  launch::pdl_wait();
  const QueryWork work = query_work(p, order, 0);
  const int qb = work.qb, h = work.h, b = work.b;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const uint16_t *Q = work.q, *K = work.k, *V = work.v;
  uint16_t* O = head_of(p.out, p.out_strides, b, h);
  float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.Lq;
  const RowList rl = work.rl;
  if (rl.n == 0) {  // no visible key in the whole tile
    zero_rows<D>(O, p.out_strides.row, qb * BQ, BQ, p.Lq, tid, kWsFwdThreads);
    if (tid < BQ && qb * BQ + tid < p.Lq) lse[qb * BQ + tid] = -INFINITY;
    trace_end(p, 0);
    return;
  }
  const int steps = (rl.n + KVT - 1) / KVT;
  const Barriers<STAGES> bar{s0};
  const uint32_t qbar = bar.once();
  const uint32_t sQ = s0 + S::kBars;
  auto sK = [&](int st) { return sQ + 2 * S::kQ + st * 2 * S::kKV; };
  auto sV = [&](int st) { return sK(st) + S::kKV; };
  bar.init(tid, 128);

  if (warp >= 8) {  // ---- producer warpgroup: hands its registers to the consumers
    producer_registers<40>();
    const int pt = tid - 256;
    load_sw128<D, BQ_STEP, 128>(sQ, Q, p.q_strides.row, qb * BQ, p.Lq, pt);
    load_sw128<D, BQ_STEP, 128>(sQ + S::kQ, Q, p.q_strides.row, qb * BQ + BQ_STEP, p.Lq, pt);
    mbar_arrive_on_copies(qbar);
    for (int it = 0; it < steps; ++it) {
      const int st = it % STAGES;
      if (it >= STAGES) mbar_wait(bar.empty(st), ((it / STAGES) - 1) & 1);
#pragma unroll
      for (int e = 0; e < KVT; ++e) {
        int kvb = 0, entry;
        const bool there = KVT * it + e < rl.n;
        if (there) rl.at(p.mask, KVT * it + e, kvb, entry);
        // a missing entry: rows past any L, so the copies zero-fill (no stale NaN reaches P V)
        const int L = there ? p.Lkv : 0;
        load_sw128<D, BKV, 128, KR>(sK(st), K, p.k_strides.row, kvb * BKV, L, pt, e * BKV);
        load_sw128<D, BKV, 128, KR>(sV(st), V, p.v_strides.row, kvb * BKV, L, pt, e * BKV);
      }
      mbar_arrive_on_copies(bar.full(st));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  // ---- consumers: warpgroup w = rows 64 w .. 64 w + 63 of the tile
  const int w = warp / 4, wq = warp % 4;
  const int q0 = qb * BQ + w * BQ_STEP;
  const bool active = q0 < p.Lq;  // an empty half still releases every stage
  const int qrow = w * BQ_STEP + wq * 16 + g;
  const uint32_t sQw = sQ + w * S::kQ;
  const float sl2 = p.scale * kLog2e;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
  uint32_t pa[4 * KVT][4];
  auto release = [&](int st) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar.empty(st));
  };
  uint32_t qa[D / 16][4];  // this warp's 16 Q rows as A fragments, read from the tile once
  auto issue_s = [&](float(&s)[32 * KVT], int st) {
    const uint64_t d0 = wg::desc_k<KR>(sK(st), 0, 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg::Mma<T>::rsk128(s, qa[kk], wg::desc_add(d0, (kk / 4) * (KR * 128) + (kk % 4) * 32), kk > 0);
  };
  auto issue_pv = [&](int st) {
    const uint64_t d0 = wg::desc_mn<KR>(sV(st), 0);
#pragma unroll
    for (int kk = 0; kk < 4 * KVT; ++kk) wg::Mma<T>::template rs<D>(o, pa[kk], wg::desc_add(d0, kk * 2048));
  };
  auto rescale = [&]() {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) o[4 * j + x] *= alpha[x / 2];
  };

  if (!active) {
    for (int it = 0; it < steps; ++it) {
      mbar_wait(bar.full(it % STAGES), (it / STAGES) & 1);
      release(it % STAGES);
    }
    trace_end(p, 0);
    return;
  }
  mbar_wait(qbar, 0);
  load_a_frags<D, BQ_STEP>(qa, sQw, wq * 16, lane);
  const uint32_t zero = static_cast<uint32_t>(p.Lq) >> 31;  // Lq < 2^31; ptxas cannot know it
  // One step (KVT list entries). MASKED: the step holds a partial tile, a tile at the kv
  // edge or a missing last entry; the other steps run a copy of the step without any
  // masking code (the partial entries come first in the list, so the masked steps are the
  // first ones and, where Lkv is not a multiple of 64, the step of the edge tile).
  auto step = [&](int it, auto masked_tag) {
    constexpr bool MASKED = decltype(masked_tag)::value;
    const int st = it % STAGES;
    // the step's list entries and bitmap words, read before the waits (they do not
    // depend on the stage), so their global latency runs under the wait and S
    TileMask tm[KVT];
    if constexpr (MASKED) {
#pragma unroll
      for (int e = 0; e < KVT; ++e) {
        int kvb = 0, entry = -1;
        if (KVT * it + e < rl.n) rl.at(p.mask, KVT * it + e, kvb, entry);
        tm[e] = tile_mask(p.mask, kvb, entry, qrow);
      }
    }
    mbar_wait(bar.full(st), (it / STAGES) & 1);
    wg::fence_async_smem();
    float s[32 * KVT];
    wg::fence();
    issue_s(s, st);
    wg::commit();
    wg::wait<0>();
    wg::pin(s);
    if constexpr (MASKED) {
#pragma unroll
      for (int e = 0; e < KVT; ++e) {
        float(&se)[32] = *reinterpret_cast<float(*)[32]>(s + 32 * e);
        if (KVT * it + e < rl.n) {
          mask_scores(se, p, tm[e], t);
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) se[i] = -INFINITY;
        }
      }
    }
    fwd_softmax_p<T, KVT>(s, m, l, alpha, pa, sl2);
    rescale();
    wg::pin(pa);
    wg::pin(o);
    wg::fence();
    issue_pv(st);
    wg::commit();
    wg::wait<0>();
    wg::pin(o);
    wg::carry(qa, zero);  // no product is in flight here
    release(st);
  };
  const int mstep = (rl.np + KVT - 1) / KVT;  // the steps that hold a partial entry
  const bool ragged = p.Lkv % BKV != 0;
  for (int it = 0; it < steps; ++it) {
    bool masked = it < mstep || KVT * it + KVT > rl.n;
    if (!masked && ragged) {
#pragma unroll
      for (int e = 0; e < KVT; ++e) {
        int kvb, entry;
        rl.at(p.mask, KVT * it + e, kvb, entry);
        masked = masked || kvb * BKV + BKV > p.Lkv;
      }
    }
    if (masked)
      step(it, std::true_type{});
    else
      step(it, std::false_type{});
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv[2] = {l[0] > 0.f ? 1.f / l[0] : 0.f, l[1] > 0.f ? 1.f / l[1] : 0.f};
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int x = 0; x < 4; ++x) o[4 * j + x] *= inv[x / 2];
  // the warpgroup's own Q tile is free once all four warps are past their last S
  named_barrier(1 + w, 128);
  unsigned char* tile = smem + S::kBars + w * S::kQ;
  acc_flat_to_smem<T, D>(tile, wq * 16, o, lane);
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = q0 + wq * 16 + g + 8 * r;
      if (q < p.Lq) lse[q] = l[r] > 0.f ? (m[r] * sl2 + __log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
  __syncwarp();
  smem_to_global<D>(O, p.out_strides.row, tile, wq * 16, 16, q0 + wq * 16, p.Lq, lane, 32);
  trace_end(p, 0);
}

// A second stream per device for the dK/dV pass (independent of dQ once the preprocess
// ran), at the device's greatest stream priority, with the fork / join events; created on
// first use, kept for the process.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
SideStream& side_stream(int device) {
  static std::mutex mu;
  static std::map<int, SideStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  SideStream& s = streams[device];
  if (s.stream == nullptr) {
    int least = 0, greatest = 0;
    if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
        cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming) != cudaSuccess)
      throw std::runtime_error("flash_cuda backward (sm90a): cannot create the dK/dV stream: " +
                               std::string(cudaGetErrorString(cudaGetLastError())));
  }
  return s;
}

template <class T, int D>
void launch_dkdv(const FlashParams& p, const float* ws_lse2, const float* ws_delta, int lq_pad, const int* order,
                 cudaStream_t stream) {
  constexpr int smem = WsKvSmem<D, 2>::bytes;
  auto kernel = ws_bwd_dkdv_kernel<T, D, 2>;
  static const bool allowed = allow_smem(kernel, smem, "backward dK/dV (sm90a)");
  (void)allowed;
  kernel<<<key_items(p, 2), 384, smem, stream>>>(p, ws_lse2, ws_delta, lq_pad, order);
  check_launch("backward dK/dV (sm90a)");
}
template <class T, int D>
void launch_dq(const FlashParams& p, const float* ws_lse2, const float* ws_delta, int lq_pad, const int* order) {
  constexpr int smem = WgDqSmem<D, 3>::bytes;
  auto kernel = wg_bwd_dq_kernel<T, D, 3>;
  static const bool allowed = allow_smem(kernel, smem, "backward dQ (sm90a)");
  (void)allowed;
  kernel<<<query_items(p), 384, smem, p.stream>>>(p, ws_lse2, ws_delta, lq_pad, order);
  check_launch("backward dQ (sm90a)");
}

template <class T, int D>
void launch_bwd(const FlashParams& p) {
  const BwdWorkspace ws = launch_bwd_preprocess<T, D>(p, 2, true, "backward preprocess (sm90a)");
  // dK/dV on a second stream of the greatest priority, concurrent with dQ on the caller's
  // stream: both only read what the preprocess wrote (measured on the H200, NOTES.md v6:
  // 5% faster on the DFlash mask than the two passes in sequence). The priority makes the
  // block scheduler hand out every dK/dV CTA (the long ones first) before any dQ CTA, so
  // the short dQ CTAs fill the SMs the dK/dV tail leaves idle; with dQ launched first the
  // dK/dV CTAs of the last L2 group started late and ran on alone (NOTES.md v14: SM idle
  // 9.0% -> 2.0% on the DFlash mask).
  int device = 0;
  cudaGetDevice(&device);
  SideStream& side = side_stream(device);
  cudaEventRecord(side.fork, p.stream);
  cudaStreamWaitEvent(side.stream, side.fork, 0);
  launch_dkdv<T, D>(p, ws.lse2, ws.delta, ws.lq_pad, ws.kv_order, side.stream);
  launch_dq<T, D>(p, ws.lse2, ws.delta, ws.lq_pad, ws.q_order);
  cudaEventRecord(side.join, side.stream);
  cudaStreamWaitEvent(p.stream, side.join, 0);
  check_launch("backward (sm90a) stream join");
}

template <class T, int D>
void launch_fwd(const FlashParams& p) {
  constexpr int smem = WgFwdSmem<D, 2>::bytes;
  auto kernel = wg_fwd_kernel<T, D, 2>;
  static const bool allowed = allow_smem(kernel, smem, "forward (sm90a)");
  (void)allowed;
  int* order = static_cast<int*>(p.workspace);  // flash_forward_workspace_bytes()
  if (!p.order_ready) launch_schedule(p, order, nullptr, 2, true);
  // Programmatic dependent launch (flashdraft/launch.cuh): the CTAs are scheduled while the
  // kernel before finishes and wait in the kernel for it (FLASHDRAFT_PDL=0: a plain launch).
  launch::launch_dependent(kernel, dim3(query_items(p)), dim3(kWsFwdThreads), smem, p.stream, p,
                           static_cast<const int*>(order));
  check_launch("forward (sm90a)");
}

}  // namespace
}  // namespace detail

// Called by flash_forward() (flash_forward.cu) after flash_check() and with the
// configuration resolved to sm90a.
void flash_forward_sm90a(const FlashParams& p) {
  using namespace detail;
  for_instance(p, [&](auto i) { launch_fwd<typename decltype(i)::T, decltype(i)::D>(p); });
}

// Called by flash_backward() (flash_backward.cu) after flash_check() and with the
// configuration resolved to sm90a.
void flash_backward_sm90a(const FlashParams& p) {
  using namespace detail;
  for_instance(p, [&](auto i) { launch_bwd<typename decltype(i)::T, decltype(i)::D>(p); });
}

}  // namespace flashdraft::flash_cuda

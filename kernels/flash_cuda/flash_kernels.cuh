// flash_cuda device code: primitives and the four kernel templates (forward, backward
// preprocess, dK/dV, dQ), plus the host helpers their launchers share. Included by the
// launchers (flash_forward.cu, flash_backward.cu, flash_sm90a.cu) and check_flash_cuda.cu.
//
// Fragment conventions (mma.sync m16n8k16, row.col, g = lane / 4, t = lane % 4):
//   A 16x16 : a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  : b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8  : c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
// so an accumulator tile pair (n-tiles 2kk, 2kk+1) repacks directly into the A operand of
// the next product (P -> P.V), as in FlashAttention-2.
// Shared-memory tiles are [rows][D] of 16-bit values in 16-byte chunks with the chunk
// index XORed by (row & 7): the 8 row addresses of every ldmatrix phase hit 8 distinct
// bank groups, for both the plain and the transposed loads.
// Softmax runs in base 2: scores are multiplied by scale*log2(e) inside the exp2, the
// running max m is kept in raw score units, and lse = (m*scale*log2e + log2 l) * ln 2.
// A row whose max is still -inf uses 0 as the subtracted max, so exp2(-inf - 0) = 0 and
// no -inf - -inf NaN can appear; such a row ends with l = 0: out 0, lse -inf.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash_attention.cuh"

namespace flashdraft::flash_cuda::detail {

constexpr int BQ = kTileQ;    // 128
constexpr int BKV = kTileKV;  // 64
constexpr int BQ_STEP = 64;   // query rows per dK/dV step (half a mask tile)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------- primitives
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy; bytes beyond src_bytes (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The 16-bit type's conversions and its m16n8k16 product (T: __nv_bfloat16 or __half).
#define FD_MMA_M16N8K16(TY)                              \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY \
      ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "              \
      "{%8,%9}, {%0,%1,%2,%3};\n"                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <class T>
struct Ops {
  static constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  static_assert(kBf16 || std::is_same<T, __half>::value, "flash_cuda runs bf16 and fp16");
  using Pair = typename std::conditional<kBf16, __nv_bfloat162, __half2>::type;
  __device__ static __forceinline__ uint32_t pack(float a, float b) {
    Pair v;
    if constexpr (kBf16)
      v = __floats2bfloat162_rn(a, b);
    else
      v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static __forceinline__ float2 unpack(uint32_t u) {
    if constexpr (kBf16)
      return __bfloat1622float2(*reinterpret_cast<Pair*>(&u));
    else
      return __half22float2(*reinterpret_cast<Pair*>(&u));
  }
  __device__ static __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16)
      FD_MMA_M16N8K16("bf16");
    else
      FD_MMA_M16N8K16("f16");
  }
};
#undef FD_MMA_M16N8K16

// Zeroes a warp's fragments of A x B accumulator tiles (4 fp32 each).
template <int A, int B>
__device__ __forceinline__ void zero_acc(float (&x)[A][B][4]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) x[i][j][0] = x[i][j][1] = x[i][j][2] = x[i][j][3] = 0.f;
}

// Swizzled [rows][D] tile: byte offset of 16-byte chunk `chunk` of row `row`.
template <int D>
__device__ __forceinline__ uint32_t tile_off(int row, int chunk) {
  return static_cast<uint32_t>((row * (D / 8) + (chunk ^ (row & 7))) * 16);
}

// Copies rows [row0, row0 + ROWS) of a [L][D] matrix (row stride in elements) into a
// swizzled tile; rows >= L are zero-filled (so masked-out garbage can never be NaN).
// Thread tid always copies chunk tid % C of rows tid / C + k * (NT / C); NT / C is a
// multiple of 8, so the swizzle key (row & 7) is the same for every k: one destination
// base per thread instead of ROWS * C / NT live addresses.
// Where NT threads do not split into whole groups of 8 rows (heads of 192: 24 chunks a row), each
// thread takes every NT-th chunk of the tile instead, with its own address per chunk.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(uint32_t dst, const uint16_t* base, int64_t row_stride, int row0, int L,
                                          int tid) {
  constexpr int C = D / 8, RPP = NT / C;
  if constexpr (NT % C != 0 || RPP % 8 != 0 || ROWS % RPP != 0) {
    for (int i = tid; i < ROWS * C; i += NT) {
      const int r = i / C, c = i % C;
      const bool ok = row0 + r < L;
      cp_async16(dst + tile_off<D>(r, c), ok ? base + (int64_t)(row0 + r) * row_stride + c * 8 : base, ok);
    }
    return;
  }
  const int r0 = tid / C, c = tid % C;
  const uint32_t d0 = dst + r0 * (D * 2) + ((c ^ (r0 & 7)) << 4);
  const uint16_t* src = base + (int64_t)(row0 + r0) * row_stride + c * 8;
#pragma unroll
  for (int k = 0; k < ROWS / RPP; ++k) {
    const bool ok = row0 + r0 + k * RPP < L;
    cp_async16(d0 + k * RPP * (D * 2), ok ? src + (int64_t)k * RPP * row_stride : base, ok);
  }
}

// Stores a warp's 16 x D fp32 accumulator rows (already scaled) to a swizzled tile.
template <class T, int D>
__device__ __forceinline__ void acc_to_smem(unsigned char* tile, int row0, const float (&acc)[D / 8][4], int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<uint32_t*>(tile + tile_off<D>(row0 + g, j) + t * 4) = Ops<T>::pack(acc[j][0], acc[j][1]);
    *reinterpret_cast<uint32_t*>(tile + tile_off<D>(row0 + g + 8, j) + t * 4) = Ops<T>::pack(acc[j][2], acc[j][3]);
  }
}
// Copies `rows` rows of a swizzled tile to global memory (16-byte stores), rows >= L skipped.
template <int D>
__device__ __forceinline__ void smem_to_global(uint16_t* base, int64_t row_stride, const unsigned char* tile,
                                               int tile_row0, int rows, int grow0, int L, int tid, int nt) {
  constexpr int C = D / 8;
  for (int i = tid; i < rows * C; i += nt) {
    const int r = i / C, c = i % C;
    if (grow0 + r < L)
      *reinterpret_cast<uint4*>(base + (int64_t)(grow0 + r) * row_stride + c * 8) =
          *reinterpret_cast<const uint4*>(tile + tile_off<D>(tile_row0 + r, c));
  }
}

// Writes zeros to rows [row0, row0 + rows) of a [L][D] matrix (rows >= L skipped), 16 bytes
// per store: the output of a tile that sees no key.
template <int D>
__device__ __forceinline__ void zero_rows(uint16_t* base, int64_t row_stride, int row0, int rows, int L, int tid,
                                          int nt) {
  constexpr int C = D / 8;
  for (int i = tid; i < rows * C; i += nt) {
    const int r = i / C, c = i % C;
    if (row0 + r < L)
      *reinterpret_cast<uint4*>(base + (int64_t)(row0 + r) * row_stride + c * 8) = make_uint4(0, 0, 0, 0);
  }
}

// ldmatrix addressing. In all three patterns below the 8 rows a lane group addresses are
// consecutive and start at a multiple of 8, so (row & 7) == (lane & 7) and the swizzled
// chunk is (2 * step) ^ key(lane): one per-lane base plus a compile-time row offset and
// an XOR with the step; this keeps the compiler from holding dozens of addresses live.
//   A operand, [m][k] tile : row lane % 16,                       chunk 2kk + lane / 16
//   B operand, [n][k] tile : row (lane / 16) * 8 + lane % 8,      chunk 2kk + (lane / 8) % 2
//   B operand, [k][n] tile (.trans): row ((lane / 8) % 2) * 8 + lane % 8, chunk 2dp + lane / 16
template <int D>
struct LaneAddr {
  static constexpr int RB = D * 2;  // bytes per row
  uint32_t a_row, b_row, t_row;     // byte offsets of this lane's row
  uint32_t a_key, b_key;            // XOR keys (the .trans pattern uses a_key)
  __device__ __forceinline__ explicit LaneAddr(int lane) {
    a_row = (lane % 16) * RB;
    b_row = ((lane / 16) * 8 + lane % 8) * RB;
    t_row = (((lane / 8) % 2) * 8 + lane % 8) * RB;
    a_key = (lane / 16) ^ (lane & 7);
    b_key = ((lane / 8) % 2) ^ (lane & 7);
  }
  __device__ __forceinline__ static uint32_t chunk(int step2, uint32_t key) { return ((step2 ^ key) << 4); }
};

// S[mt](16 x 64) += A(rows arow0 + 16 mt .., D) * B(64 rows, D)^T. A warp owns MT m-tiles
// of 16 rows and every B fragment read from shared memory feeds MT products
// (FlashAttention-2's 32 rows per warp halve the shared-memory reads per FLOP vs 16).
// J0, NJ: only B rows [16 J0, 16 (J0 + NJ)) (s holds 2 NJ n-tiles of 8).
template <class T, int D, int MT, int J0 = 0, int NJ = 4>
__device__ __forceinline__ void gemm_abt_mt(float (&s)[MT][2 * NJ][4], uint32_t sA, int arow0, uint32_t sB,
                                            const LaneAddr<D>& la) {
  constexpr int RB = LaneAddr<D>::RB;
  const uint32_t abase = sA + arow0 * RB + la.a_row, bbase = sB + la.b_row;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[MT][4];
    const uint32_t ac = LaneAddr<D>::chunk(2 * kk, la.a_key), bc = LaneAddr<D>::chunk(2 * kk, la.b_key);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], abase + mt * 16 * RB + ac);
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj) {
      uint32_t b[4];
      ldsm_x4(b, bbase + (J0 + jj) * 16 * RB + bc);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Ops<T>::mma(s[mt][2 * jj], a[mt], b[0], b[1]);
        Ops<T>::mma(s[mt][2 * jj + 1], a[mt], b[2], b[3]);
      }
    }
  }
}
// Packs a 16 x 64 fp32 accumulator into the A fragments of 4 k-steps of 16.
template <class T>
__device__ __forceinline__ void pack_a(uint32_t (&pa)[4][4], const float (&p)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = Ops<T>::pack(p[2 * kk][0], p[2 * kk][1]);
    pa[kk][1] = Ops<T>::pack(p[2 * kk][2], p[2 * kk][3]);
    pa[kk][2] = Ops<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    pa[kk][3] = Ops<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
}
// O[mt](16 x D) += PA[mt](16 x 64, packed A fragments) * V(64 rows of sV, D).
template <class T, int D, int MT>
__device__ __forceinline__ void gemm_pv_mt(float (&o)[MT][D / 8][4], const uint32_t (&pa)[MT][4][4], uint32_t sV,
                                           const LaneAddr<D>& la) {
  constexpr int RB = LaneAddr<D>::RB;
  const uint32_t vbase = sV + la.t_row;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_t(b, vbase + kk * 16 * RB + LaneAddr<D>::chunk(2 * dp, la.a_key));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Ops<T>::mma(o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
        Ops<T>::mma(o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
      }
    }
}

// The KV tile of list position `it` of a query tile's row: partial tiles first.
struct RowList {
  int po, np, fo, n;
  __device__ __forceinline__ void at(const FlashMask& m, int it, int& kvb, int& entry) const {
    if (it < np) {
      kvb = m.part_index[po + it];
      entry = po + it;
    } else {
      kvb = m.full_index[fo + it - np];
      entry = -1;
    }
  }
};
// ---------------------------------------------------------------- work items and traces
// A CTA's work item, read from the order the schedule kernel wrote (flash_schedule.cu):
// query item = (b * Hq + h) * q_blocks + qb, key item = (b * Hkv + hk) * n_cols + c.
struct QueryItem {
  int qb, h, b, item;
};
__device__ __forceinline__ QueryItem query_item(const FlashParams& p, const int* order, int q_blocks) {
  const int item = order[blockIdx.x], bh = item / q_blocks;
  return QueryItem{item % q_blocks, bh % p.Hq, bh / p.Hq, item};
}
struct KeyItem {
  int c, hk, b, item;
};
__device__ __forceinline__ KeyItem key_item(const FlashParams& p, const int* order, int n_cols) {
  const int item = order[blockIdx.x], bh = item / n_cols;
  return KeyItem{item % n_cols, bh % p.Hkv, bh / p.Hkv, item};
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// p.trace (flash_attention.cuh): entry first + blockIdx.x gets the CTA's start, SM and item
// from thread 0, and its end as the latest exit of its warps (trace_end in every warp
// that returns).
__device__ __forceinline__ void trace_begin(const FlashParams& p, int first, int item) {
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned long long* e = p.trace + 4 * ((size_t)first + blockIdx.x);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    e[0] = global_ns();
    e[2] = smid;
    e[3] = (unsigned)item;
  }
}
__device__ __forceinline__ void trace_end(const FlashParams& p, int first) {
  if (p.trace != nullptr && threadIdx.x % 32 == 0)
    atomicMax(p.trace + 4 * ((size_t)first + blockIdx.x) + 1, global_ns());
}
// The first trace entry of the dQ kernel (flash_trace_dq_first()).
__device__ __forceinline__ int dq_trace_first(const FlashParams& p) { return p.B * p.Hkv * ((p.Lkv + BKV - 1) / BKV); }

__device__ __forceinline__ RowList row_list(const FlashMask& m, int b, int h, int qb, int q_blocks) {
  const int mb = m.batch == 1 ? 0 : b, mh = m.heads == 1 ? 0 : h;
  const int row = (mb * m.heads + mh) * q_blocks + qb;
  RowList r;
  r.po = m.part_offset[row];
  r.np = m.part_offset[row + 1] - r.po;
  r.fo = m.full_offset[row];
  r.n = r.np + (m.full_offset[row + 1] - r.fo);
  return r;
}

// The first element of head h of batch row b of a [B, H, L, D] tensor of `p`.
__device__ __forceinline__ const uint16_t* head_of(const void* t, const Strides& s, int b, int h) {
  return static_cast<const uint16_t*>(t) + b * s.batch + h * s.head;
}
__device__ __forceinline__ uint16_t* head_of(void* t, const Strides& s, int b, int h) {
  return static_cast<uint16_t*>(t) + b * s.batch + h * s.head;
}
// The K and V tiles of entry `it` of a query tile's list of key tiles, into sk and sv.
template <int D, int NT>
__device__ __forceinline__ void load_kv_tiles(uint32_t sk, uint32_t sv, const uint16_t* K, const uint16_t* V,
                                              const FlashParams& p, const RowList& rl, int it, int tid) {
  int kvb, entry;
  rl.at(p.mask, it, kvb, entry);
  load_tile<D, BKV, NT>(sk, K, p.k_strides.row, kvb * BKV, p.Lkv, tid);
  load_tile<D, BKV, NT>(sv, V, p.v_strides.row, kvb * BKV, p.Lkv, tid);
}
// Step `it` of a cp.async pipeline of STAGES stages over n entries: issues the loads of entry
// it + STAGES - 1 (load(entry, stage)), then waits until entry it's stage has landed, in every
// thread. Returns that stage.
template <int STAGES, class Load>
__device__ __forceinline__ int pipeline_step(int it, int n, Load&& load) {
  {
    const int nx = it + STAGES - 1;
    if (nx < n) load(nx, nx % STAGES);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();
  __syncthreads();
  return it % STAGES;
}
// The start of a query work item, the same in the forward and the dQ kernels: tile qb of
// query head h (key head hk) of batch row b (rows q0 ..), the heads of Q, dO, K and V it reads
// and its list of key tiles (rl.n = 0: it sees no key). `trace` is the kernel's first
// trace entry.
struct QueryWork {
  int qb, h, b, hk, q0;
  const uint16_t *q, *dout, *k, *v;  // dout: the dQ kernels' (unused by the forward's)
  RowList rl;
};
__device__ __forceinline__ QueryWork query_work(const FlashParams& p, const int* order, int trace) {
  const int q_blocks = (p.Lq + BQ - 1) / BQ;
  const QueryItem item = query_item(p, order, q_blocks);
  trace_begin(p, trace, item.item);
  QueryWork work;
  work.qb = item.qb;
  work.h = item.h;
  work.b = item.b;
  work.hk = work.h / (p.Hq / p.Hkv);
  work.q0 = work.qb * BQ;
  work.q = head_of(p.q, p.q_strides, work.b, work.h);
  work.dout = head_of(p.dout, p.dout_strides, work.b, work.h);
  work.k = head_of(p.k, p.k_strides, work.b, work.hk);
  work.v = head_of(p.v, p.v_strides, work.b, work.hk);
  work.rl = row_list(p.mask, work.b, work.h, work.qb, q_blocks);
  return work;
}

// Masks a warp's 16 x 64 score tile (rows qrow, qrow + 8 of the 128-row mask tile):
// partial tiles read their bitmap (2 words per row), a full tile only cuts the ragged
// kv edge (its out-of-range columns are not part of the mask). mask_by_bits and
// mask_kv_edge are the two cases; apply_mask reads the words and applies them at once,
// tile_mask / apply_tile_mask in two halves, for the sm90a kernels, which read the words
// before they wait for the scores (flash_sm90a.cu, NOTES.md v14).
// The words are shifted by the thread's 2 t once, so that each score's test is an and
// with a constant (one instruction) instead of a shift by a register and an and.
__device__ __forceinline__ void mask_by_bits(float (&s)[8][4], const uint32_t (&w0)[2], const uint32_t (&w1)[2],
                                             int t) {
  const uint32_t a[2] = {w0[0] >> (2 * t), w0[1] >> (2 * t)}, b[2] = {w1[0] >> (2 * t), w1[1] >> (2 * t)};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const uint32_t bit = 1u << ((j % 4) * 8 + x);
      if (!(a[j / 4] & bit)) s[j][x] = -INFINITY;
      if (!(b[j / 4] & bit)) s[j][2 + x] = -INFINITY;
    }
}
__device__ __forceinline__ void mask_kv_edge(float (&s)[8][4], int kv0, int Lkv, int t) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int x = 0; x < 2; ++x)
      if (kv0 + 8 * j + 2 * t + x >= Lkv) {
        s[j][x] = -INFINITY;
        s[j][2 + x] = -INFINITY;
      }
}
__device__ __forceinline__ void apply_mask(float (&s)[8][4], const FlashMask& m, int entry, int kv0, int Lkv, int qrow,
                                           int t) {
  if (entry >= 0) {
    const uint32_t* w = m.bits + (int64_t)entry * (BQ * 2);
    const uint32_t w0[2] = {__ldg(w + qrow * 2), __ldg(w + qrow * 2 + 1)};
    const uint32_t w1[2] = {__ldg(w + (qrow + 8) * 2), __ldg(w + (qrow + 8) * 2 + 1)};
    mask_by_bits(s, w0, w1, t);
  } else if (kv0 + BKV > Lkv) {
    mask_kv_edge(s, kv0, Lkv, t);
  }
}
struct TileMask {
  uint32_t w0[2], w1[2];  // rows qrow and qrow + 8; read for a partial tile only
  int kvb, entry;         // the key tile (64 keys from kvb * BKV) and apply_mask's entry
};
__device__ __forceinline__ TileMask tile_mask(const FlashMask& m, int kvb, int entry, int qrow) {
  TileMask tm;
  tm.kvb = kvb, tm.entry = entry;
  if (entry >= 0) {
    const uint32_t* w = m.bits + (int64_t)entry * (BQ * 2);
    tm.w0[0] = __ldg(w + qrow * 2), tm.w0[1] = __ldg(w + qrow * 2 + 1);
    tm.w1[0] = __ldg(w + (qrow + 8) * 2), tm.w1[1] = __ldg(w + (qrow + 8) * 2 + 1);
  } else {
    tm.w0[0] = tm.w0[1] = tm.w1[0] = tm.w1[1] = ~0u;
  }
  return tm;
}
__device__ __forceinline__ void apply_tile_mask(float (&s)[8][4], const TileMask& tm, int Lkv, int t) {
  if (tm.entry >= 0)
    mask_by_bits(s, tm.w0, tm.w1, t);
  else if (tm.kvb * BKV + BKV > Lkv)
    mask_kv_edge(s, tm.kvb * BKV, Lkv, t);
}

// ---------------------------------------------------------------- forward
template <int D, int STAGES>
struct FwdSmem {
  static constexpr int kQ = BQ * D * 2;
  static constexpr int kKV = BKV * D * 2;
  static constexpr int bytes = kQ + STAGES * 2 * kKV;
  static_assert(bytes == flash_forward_smem(D, STAGES), "flash_config.hpp's count");
};
// The forward's 128 query rows: heads up to 128 wide as 4 warps x 2 m-tiles of 16 rows (each key
// fragment read feeds two products; two CTAs an SM); wider heads (192, 256) as 8 warps x 1 m-tile,
// so that a thread's output accumulator (MT x D / 8 x 4 floats: 128 at 256) stays in registers.
template <int D>
struct FwdShape {
  static constexpr int kWarps = D <= 128 ? 4 : 8, kMT = D <= 128 ? 2 : 1, kCtas = D <= 128 ? 2 : 1;
  static_assert(kWarps * kMT * 16 == BQ, "the forward's rows");
};

template <class T, int D, int STAGES>
__global__ void __launch_bounds__(FwdShape<D>::kWarps * 32, FwdShape<D>::kCtas)
    flash_fwd_kernel(const FlashParams p, const int* order) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = FwdSmem<D, STAGES>;
  constexpr int MT = FwdShape<D>::kMT, NT = FwdShape<D>::kWarps * 32, WR = MT * 16;  // rows per warp
  const int q_blocks = (p.Lq + BQ - 1) / BQ;
  const QueryItem item = query_item(p, order, q_blocks);
  const int qb = item.qb, h = item.h, b = item.b;
  trace_begin(p, 0, item.item);
  const int hk = h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const LaneAddr<D> la(lane);
  const int q0 = qb * BQ;

  const uint16_t* Q = head_of(p.q, p.q_strides, b, h);
  const uint16_t* K = head_of(p.k, p.k_strides, b, hk);
  const uint16_t* V = head_of(p.v, p.v_strides, b, hk);
  uint16_t* O = head_of(p.out, p.out_strides, b, h);
  float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.Lq;

  const RowList rl = row_list(p.mask, b, h, qb, q_blocks);
  if (rl.n == 0) {  // no visible key in the whole tile
    zero_rows<D>(O, p.out_strides.row, q0, BQ, p.Lq, tid, NT);
    if (tid < BQ && q0 + tid < p.Lq) lse[q0 + tid] = -INFINITY;
    trace_end(p, 0);
    return;
  }
  const uint32_t sQ = smem_addr(smem);
  auto sK = [&](int st) { return sQ + S::kQ + st * 2 * S::kKV; };
  auto sV = [&](int st) { return sQ + S::kQ + st * 2 * S::kKV + S::kKV; };
  auto load_kv = [&](int it, int st) { load_kv_tiles<D, NT>(sK(st), sV(st), K, V, p, rl, it, tid); };

  load_tile<D, BQ, NT>(sQ, Q, p.q_strides.row, q0, p.Lq, tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < rl.n) load_kv(s, s);
    cp_async_commit();
  }

  const float sl2 = p.scale * kLog2e;
  float o[MT][D / 8][4];
  zero_acc(o);
  // row r of m-tile mt: tile row warp*WR + mt*16 + g + 8r
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  for (int it = 0; it < rl.n; ++it) {
    const int st = pipeline_step<STAGES>(it, rl.n, load_kv);
    int kvb, entry;
    rl.at(p.mask, it, kvb, entry);

    float s[MT][8][4];
    zero_acc(s);
    gemm_abt_mt<T, D, MT>(s, sQ, warp * WR, sK(st), la);

    uint32_t pa[MT][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      apply_mask(s[mt], p.mask, entry, kvb * BKV, p.Lkv, warp * WR + mt * 16 + g, t);
      // online softmax, two rows per thread, reduced over the 4 lanes of a quad
      float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[mt][j][0], s[mt][j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[mt][j][2], s[mt][j][3]));
      }
      float base[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        base[r] = mx[r] == -INFINITY ? 0.f : mx[r] * sl2;
        alpha[r] = fast_exp2(m[mt][r] * sl2 - base[r]);  // m = -inf -> 0
        m[mt][r] = mx[r];
        l[mt][r] *= alpha[r];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[mt][j][0] = fast_exp2(fmaf(s[mt][j][0], sl2, -base[0]));
        s[mt][j][1] = fast_exp2(fmaf(s[mt][j][1], sl2, -base[0]));
        s[mt][j][2] = fast_exp2(fmaf(s[mt][j][2], sl2, -base[1]));
        s[mt][j][3] = fast_exp2(fmaf(s[mt][j][3], sl2, -base[1]));
        l[mt][0] += s[mt][j][0] + s[mt][j][1];
        l[mt][1] += s[mt][j][2] + s[mt][j][3];
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[mt][j][0] *= alpha[0];
        o[mt][j][1] *= alpha[0];
        o[mt][j][2] *= alpha[1];
        o[mt][j][3] *= alpha[1];
      }
      pack_a<T>(pa[mt], s[mt]);
    }
    gemm_pv_mt<T, D, MT>(o, pa, sV(st), la);
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
    }
    const float inv0 = l[mt][0] > 0.f ? 1.f / l[mt][0] : 0.f, inv1 = l[mt][1] > 0.f ? 1.f / l[mt][1] : 0.f;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[mt][j][0] *= inv0;
      o[mt][j][1] *= inv0;
      o[mt][j][2] *= inv1;
      o[mt][j][3] *= inv1;
    }
    // Each warp reuses its own rows of the Q tile for staging: no block barrier needed.
    acc_to_smem<T, D>(smem, warp * WR + mt * 16, o[mt], lane);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = q0 + warp * WR + mt * 16 + g + 8 * r;
        if (q < p.Lq) lse[q] = l[mt][r] > 0.f ? (m[mt][r] * sl2 + __log2f(l[mt][r])) * kLn2 : -INFINITY;
      }
    }
  }
  __syncwarp();
  smem_to_global<D>(O, p.out_strides.row, smem, warp * WR, WR, q0 + warp * WR, p.Lq, lane, 32);
  trace_end(p, 0);
}

// ---------------------------------------------------------------- backward preprocess
// ws_lse2[row][q] = lse * log2(e) (+inf where lse = -inf or q >= Lq: such rows give P = 0)
// ws_delta[row][q] = sum_d dO * O (0 for q >= Lq); row = b * Hq + h, q < Lq_pad.
template <class T, int D>
__global__ void __launch_bounds__(256)
    flash_bwd_pre_kernel(const FlashParams p, float* ws_lse2, float* ws_delta, int Lq_pad) {
  constexpr int TPR = D / 8;  // threads per row, 8 elements each
  constexpr int RPB = 256 / TPR;
  const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
  const int q = blockIdx.x * RPB + threadIdx.x / TPR, c = threadIdx.x % TPR;
  if (q >= Lq_pad) return;
  float acc = 0.f;
  if (q < p.Lq) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.out) + b * p.out_strides.batch +
                                                    h * p.out_strides.head + q * p.out_strides.row + c * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.dout) + b * p.dout_strides.batch +
                                                    h * p.dout_strides.head + q * p.dout_strides.row + c * 8);
    const uint32_t ou[4] = {o.x, o.y, o.z, o.w}, du[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = Ops<T>::unpack(ou[i]), e = Ops<T>::unpack(du[i]);
      acc += a.x * e.x + a.y * e.y;
    }
  }
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (c == 0) {
    float l2 = INFINITY;
    if (q < p.Lq) {
      const float v = p.lse[(int64_t)bh * p.Lq + q];
      l2 = v == -INFINITY ? INFINITY : v * kLog2e;
    }
    ws_lse2[(int64_t)bh * Lq_pad + q] = l2;
    ws_delta[(int64_t)bh * Lq_pad + q] = q < p.Lq ? acc : 0.f;
  }
}

// ---------------------------------------------------------------- backward dK / dV
template <int D, int STAGES>
struct KvSmem {
  static constexpr int kKV = BKV * D * 2;
  static constexpr int kQ = BQ_STEP * D * 2;
  // stage: Q tile, dO tile, lse2[64], delta[64], bits[64 rows x 2 words], flag
  static constexpr int kStage = 2 * kQ + 64 * 4 * 2 + 128 * 4 + 16;
  static constexpr int kDS = BKV * BQ_STEP * 2;  // dS^T tile [64 keys][64 queries] (dQ by atomics)
  static constexpr int bytes = 2 * kKV + STAGES * kStage;
  static constexpr int bytes_atomic = bytes + kDS;
};

// One step of the dK/dV walk: 64 query rows of head h starting at q0; entry = partial
// entry of the 128x64 mask tile (-1: full), half = which 64-row half of that tile.
struct KvStep {
  int h, q0, entry, half;
};
// Walks (q head of the GQA group, transposed list position, half) in order; settle()
// skips halves beyond Lq and heads with empty lists.
struct KvCursor {
  int g = 0, idx = 0, half = 0;
  __device__ __forceinline__ bool settle(const FlashParams& p, int b, int hk, int kvb, int kv_blocks, KvStep& s) {
    const int group = p.Hq / p.Hkv;
    const FlashMask& m = p.mask;
    const int mb = m.batch == 1 ? 0 : b;
    while (g < group) {
      const int h = hk * group + g;
      const int mh = m.heads == 1 ? 0 : h;
      const int col = (mb * m.heads + mh) * kv_blocks + kvb;
      const int po = m.t_part_offset[col], np = m.t_part_offset[col + 1] - po;
      const int fo = m.t_full_offset[col], nf = m.t_full_offset[col + 1] - fo;
      if (idx >= np + nf) {
        ++g;
        idx = 0;
        half = 0;
        continue;
      }
      const int qb = idx < np ? m.t_part_index[po + idx] : m.t_full_index[fo + idx - np];
      const int q0 = qb * BQ + half * BQ_STEP;
      if (q0 >= p.Lq) {
        ++idx;
        half = 0;
        continue;
      }
      s.h = h;
      s.q0 = q0;
      s.entry = idx < np ? m.t_part_entry[po + idx] : -1;
      s.half = half;
      return true;
    }
    return false;
  }
  __device__ __forceinline__ void advance() {
    if (++half == 2) {
      half = 0;
      ++idx;
    }
  }
};

// Stages the per-row data of a dK/dV step behind its Q and dO tiles (the layout both
// dK/dV kernels read): lse2[64] at +0, delta[64] at +256, the step's 64 bitmap rows
// (2 words each) of a partial tile at +512, the int flag "partial" at +1024 and the
// step's q head and first row at +1028 / +1032 (read only by the atomic-dQ variant).
// sl / meta: the same place as a shared-memory address and as a pointer; row: the
// step's first row in the padded workspace. Threads 0..63 issue the copies.
__device__ __forceinline__ void load_step_meta(uint32_t sl, unsigned char* meta, const KvStep& s, const FlashParams& p,
                                               const float* ws_lse2, const float* ws_delta, int64_t row, int tid) {
  if (tid < 16)
    cp_async16(sl + tid * 16, ws_lse2 + row + tid * 4, true);
  else if (tid < 32)
    cp_async16(sl + 256 + (tid - 16) * 16, ws_delta + row + (tid - 16) * 4, true);
  else if (s.entry >= 0 && tid < 64)  // 64 rows x 2 words of this half of the tile
    cp_async16(sl + 512 + (tid - 32) * 16,
               p.mask.bits + (int64_t)s.entry * (BQ * 2) + s.half * (BQ_STEP * 2) + (tid - 32) * 4, true);
  if (tid == 0) {
    int* flags = reinterpret_cast<int*>(meta + 1024);
    flags[0] = s.entry >= 0 ? 1 : 0;
    flags[1] = s.h;
    flags[2] = s.q0;
  }
}

// DQ_ATOMIC: also dQ += dS K for the step (dS^T through shared memory, keys contracted
// across the 4 warps) added into the fp32 buffer dq_acc [B*Hq][Lq_pad][D] with
// red.global.add (v2 on sm_90+); flash_bwd_dq_convert_kernel then scales and converts.
// No configuration launches it (no faster, NOTES.md v3): only check_flash_cuda's per-phase
// timing does, to keep that measurement repeatable.
template <class T, int D, int STAGES, bool DQ_ATOMIC>
__global__ void __launch_bounds__(128, 2)
    flash_bwd_dkdv_kernel(const FlashParams p, const float* ws_lse2, const float* ws_delta, int Lq_pad,
                          const int* order, float* dq_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = KvSmem<D, STAGES>;
  const int kv_blocks = (p.Lkv + BKV - 1) / BKV;
  const KeyItem item = key_item(p, order, kv_blocks);
  const int kvb = item.c, hk = item.hk, b = item.b;
  trace_begin(p, 0, item.item);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const LaneAddr<D> la(lane);
  const int kv0 = kvb * BKV;

  const uint16_t* K = head_of(p.k, p.k_strides, b, hk);
  const uint16_t* V = head_of(p.v, p.v_strides, b, hk);
  const uint32_t sK = smem_addr(smem), sV = sK + S::kKV;
  auto stage = [&](int st) { return 2 * S::kKV + st * S::kStage; };  // byte offset
  auto load_step = [&](const KvStep& s, int st) {
    const int off = stage(st);
    const uint16_t* Q = head_of(p.q, p.q_strides, b, s.h);
    const uint16_t* dO = head_of(p.dout, p.dout_strides, b, s.h);
    load_tile<D, BQ_STEP, 128>(sK + off, Q, p.q_strides.row, s.q0, p.Lq, tid);
    load_tile<D, BQ_STEP, 128>(sK + off + S::kQ, dO, p.dout_strides.row, s.q0, p.Lq, tid);
    load_step_meta(sK + off + 2 * S::kQ, smem + off + 2 * S::kQ, s, p, ws_lse2, ws_delta,
                   ((int64_t)b * p.Hq + s.h) * Lq_pad + s.q0, tid);
  };

  load_tile<D, BKV, 128>(sK, K, p.k_strides.row, kv0, p.Lkv, tid);
  load_tile<D, BKV, 128>(sV, V, p.v_strides.row, kv0, p.Lkv, tid);
  // One cursor: the loads walk the transposed lists STAGES - 1 steps ahead and count the
  // steps they issue; step `it` exists iff it < issued (the loads end only at the list's end).
  KvCursor lc;
  KvStep ls;
  int issued = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (lc.settle(p, b, hk, kvb, kv_blocks, ls)) {
      load_step(ls, s);
      lc.advance();
      ++issued;
    }
    cp_async_commit();
  }

  const float sl2 = p.scale * kLog2e;
  float dk[1][D / 8][4], dv[1][D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int x = 0; x < 4; ++x) dk[0][j][x] = dv[0][j][x] = 0.f;
  const int krow = warp * 16 + g;  // this thread's keys: krow, krow + 8 (within the tile)

  for (int it = 0; it < issued; ++it) {
    {
      if (lc.settle(p, b, hk, kvb, kv_blocks, ls)) {
        load_step(ls, (it + STAGES - 1) % STAGES);
        lc.advance();
        ++issued;
      }
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const int off = stage(it % STAGES);
    const uint32_t sQ = sK + off, sdO = sK + off + S::kQ;
    const float* sL = reinterpret_cast<const float*>(smem + off + 2 * S::kQ);
    const float* sDelta = sL + 64;
    const uint32_t* sBits = reinterpret_cast<const uint32_t*>(sL + 128);
    const int* sFlags = reinterpret_cast<const int*>(sL + 256);
    const bool partial = sFlags[0] != 0;

    // S^T = K Q^T: this warp's 16 keys x 64 queries; P^T = exp2(s * sl2 - lse2[q]) (0
    // where masked), rounded to T at once (as the dQ pass does), so that S and dP^T are
    // never live together: dV += P^T dO runs before dP^T = V dO^T.
    uint32_t pa[1][4][4];
    {
      float s[1][8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int x = 0; x < 4; ++x) s[0][j][x] = 0.f;
      gemm_abt_mt<T, D, 1>(s, sK, warp * 16, sQ, la);
      const int word = warp / 2;  // keys 16w..16w+15 all sit in word (16w)/32 of a row
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = 8 * j + 2 * t;  // the thread's two query columns within the step
        const float2 l2 = *reinterpret_cast<const float2*>(sL + c);
        uint32_t w0 = 0, w1 = 0;
        if (partial) w0 = sBits[c * 2 + word], w1 = sBits[c * 2 + 2 + word];
#pragma unroll
        for (int hx = 0; hx < 2; ++hx) {  // keys krow (hx 0) and krow + 8 (hx 1)
          float e0 = fast_exp2(fmaf(s[0][j][2 * hx], sl2, -l2.x));
          float e1 = fast_exp2(fmaf(s[0][j][2 * hx + 1], sl2, -l2.y));
          if (partial) {
            const int bit = (krow + 8 * hx) % 32;
            if (!((w0 >> bit) & 1u)) e0 = 0.f;
            if (!((w1 >> bit) & 1u)) e1 = 0.f;
          }
          pa[0][j / 2][(j % 2) * 2 + hx] = Ops<T>::pack(e0, e1);
        }
      }
    }
    gemm_pv_mt<T, D, 1>(dv, pa, sdO, la);
    // dP^T = V dO^T, then dS^T = P^T (dP^T - delta[q]) in place over P^T's fragments
    {
      float dp[1][8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int x = 0; x < 4; ++x) dp[0][j][x] = 0.f;
      gemm_abt_mt<T, D, 1>(dp, sV, warp * 16, sdO, la);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 de = *reinterpret_cast<const float2*>(sDelta + 8 * j + 2 * t);
#pragma unroll
        for (int hx = 0; hx < 2; ++hx) {
          uint32_t& w = pa[0][j / 2][(j % 2) * 2 + hx];
          const float2 pr = Ops<T>::unpack(w);
          w = Ops<T>::pack(pr.x * (dp[0][j][2 * hx] - de.x), pr.y * (dp[0][j][2 * hx + 1] - de.y));
        }
      }
    }
    // dK += dS^T Q (contraction over the 64 queries)
    {
      gemm_pv_mt<T, D, 1>(dk, pa, sQ, la);
      if constexpr (DQ_ATOMIC) {
        // this warp's dS^T rows (keys 16w + g, +8) into the [key][query] tile
        unsigned char* tds = smem + 2 * S::kKV + STAGES * S::kStage;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          *reinterpret_cast<uint32_t*>(tds + tile_off<64>(krow, 2 * kk) + t * 4) = pa[0][kk][0];
          *reinterpret_cast<uint32_t*>(tds + tile_off<64>(krow + 8, 2 * kk) + t * 4) = pa[0][kk][1];
          *reinterpret_cast<uint32_t*>(tds + tile_off<64>(krow, 2 * kk + 1) + t * 4) = pa[0][kk][2];
          *reinterpret_cast<uint32_t*>(tds + tile_off<64>(krow + 8, 2 * kk + 1) + t * 4) = pa[0][kk][3];
        }
        __syncthreads();
        // dQ rows 16w .. 16w + 15 of the step: A = dS (query x key) read transposed
        const uint32_t sds = smem_addr(tds);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ldsm_x4_t(pa[0][kk], sds + tile_off<64>(kk * 16 + (lane / 16) * 8 + lane % 8, 2 * warp + (lane / 8) % 2));
        float acc[1][D / 8][4];
        zero_acc(acc);
        gemm_pv_mt<T, D, 1>(acc, pa, sK, la);
        float* dst = dq_acc + (((int64_t)b * p.Hq + sFlags[1]) * Lq_pad + sFlags[2] + warp * 16 + g) * D + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
#if __CUDA_ARCH__ >= 900
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst + 8 * j), "f"(acc[0][j][0]), "f"(acc[0][j][1])
                       : "memory");
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst + 8 * D + 8 * j), "f"(acc[0][j][2]),
                       "f"(acc[0][j][3])
                       : "memory");
#else
          atomicAdd(dst + 8 * j, acc[0][j][0]);
          atomicAdd(dst + 8 * j + 1, acc[0][j][1]);
          atomicAdd(dst + 8 * D + 8 * j, acc[0][j][2]);
          atomicAdd(dst + 8 * D + 8 * j + 1, acc[0][j][3]);
#endif
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  __syncthreads();

#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int x = 0; x < 4; ++x) dk[0][j][x] *= p.scale;
  // Stage through the first stage's Q and dO tiles (64 rows each, free after the loop).
  unsigned char* tdk = smem + stage(0);
  unsigned char* tdv = smem + stage(0) + S::kQ;
  acc_to_smem<T, D>(tdk, warp * 16, dk[0], lane);
  acc_to_smem<T, D>(tdv, warp * 16, dv[0], lane);
  __syncthreads();
  uint16_t* dK = head_of(p.dk, p.dk_strides, b, hk);
  uint16_t* dV = head_of(p.dv, p.dv_strides, b, hk);
  smem_to_global<D>(dK, p.dk_strides.row, tdk, 0, BKV, kv0, p.Lkv, tid, 128);
  smem_to_global<D>(dV, p.dv_strides.row, tdv, 0, BKV, kv0, p.Lkv, tid, 128);
  trace_end(p, 0);
}

// ---------------------------------------------------------------- backward dQ
template <int D, int STAGES>
struct DqSmem {
  static constexpr int kQ = BQ * D * 2;
  static constexpr int kKV = BKV * D * 2;
  static constexpr int bytes = 2 * kQ + STAGES * 2 * kKV;
};

// P is rounded to the input type right after the exp (its A-fragment form), which keeps
// S and dP from being live at once (32 rows x (dq 128 + P 32 + dP 64) registers).
// MT m-tiles of 16 rows per warp, 8 / MT warps (128 rows per CTA).
template <class T, int D, int STAGES, int MT>
__global__ void __launch_bounds__(256 / MT, MT)
    flash_bwd_dq_kernel(const FlashParams p, const float* ws_lse2, const float* ws_delta, int Lq_pad,
                        const int* order) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = DqSmem<D, STAGES>;
  constexpr int NT = 256 / MT, WR = MT * 16;
  // dP in parts of 16 keys at 32 rows per warp (spill 324 -> 236 bytes on sm_120, backward
  // 2% faster on the H200), of 32 keys at 16 rows per warp (no spill either way)
  constexpr int DP_PARTS = MT == 2 ? 4 : 2;
  const int q_blocks = (p.Lq + BQ - 1) / BQ;
  const QueryItem item = query_item(p, order, q_blocks);
  const int qb = item.qb, h = item.h, b = item.b;
  trace_begin(p, dq_trace_first(p), item.item);
  const int hk = h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, t = lane % 4, g = lane / 4;
  const LaneAddr<D> la(lane);
  const int q0 = qb * BQ;

  const uint16_t* Q = head_of(p.q, p.q_strides, b, h);
  const uint16_t* dO = head_of(p.dout, p.dout_strides, b, h);
  const uint16_t* K = head_of(p.k, p.k_strides, b, hk);
  const uint16_t* V = head_of(p.v, p.v_strides, b, hk);
  uint16_t* dQ = head_of(p.dq, p.dq_strides, b, h);

  const RowList rl = row_list(p.mask, b, h, qb, q_blocks);
  if (rl.n == 0) {
    zero_rows<D>(dQ, p.dq_strides.row, q0, BQ, p.Lq, tid, NT);
    trace_end(p, dq_trace_first(p));
    return;
  }
  const uint32_t sQ = smem_addr(smem), sdO = sQ + S::kQ;
  auto sK = [&](int st) { return sQ + 2 * S::kQ + st * 2 * S::kKV; };
  auto sV = [&](int st) { return sQ + 2 * S::kQ + st * 2 * S::kKV + S::kKV; };
  auto load_kv = [&](int it, int st) { load_kv_tiles<D, NT>(sK(st), sV(st), K, V, p, rl, it, tid); };
  load_tile<D, BQ, NT>(sQ, Q, p.q_strides.row, q0, p.Lq, tid);
  load_tile<D, BQ, NT>(sdO, dO, p.dout_strides.row, q0, p.Lq, tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < rl.n) load_kv(s, s);
    cp_async_commit();
  }
  float l2[MT][2], de[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t wrow = ((int64_t)b * p.Hq + h) * Lq_pad + q0 + warp * WR + mt * 16 + g;  // padded: in range
    l2[mt][0] = ws_lse2[wrow], l2[mt][1] = ws_lse2[wrow + 8];
    de[mt][0] = ws_delta[wrow], de[mt][1] = ws_delta[wrow + 8];
  }
  const float sl2 = p.scale * kLog2e;
  float dq[MT][D / 8][4];
  zero_acc(dq);

  for (int it = 0; it < rl.n; ++it) {
    const int st = pipeline_step<STAGES>(it, rl.n, load_kv);
    int kvb, entry;
    rl.at(p.mask, it, kvb, entry);
    uint32_t pa[MT][4][4];
    // P of the step; MASKED: a partial tile or a tile at the kv edge. At 32 rows per warp
    // (sm120) a full tile runs a copy without masking code (backward 5% faster on the H200);
    // at 16 rows per warp (sm90) the copy measured 1-2% slower, so every tile runs the
    // masked code there, whose apply_mask skips the mask of a full tile at run time.
    auto scores = [&](auto masked_tag) {
      float s[MT][8][4];
      zero_acc(s);
      gemm_abt_mt<T, D, MT>(s, sQ, warp * WR, sK(st), la);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (decltype(masked_tag)::value)
          apply_mask(s[mt], p.mask, entry, kvb * BKV, p.Lkv, warp * WR + mt * 16 + g, t);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hx = 0; hx < 2; ++hx)
            pa[mt][j / 2][(j % 2) * 2 + hx] = Ops<T>::pack(fast_exp2(fmaf(s[mt][j][2 * hx], sl2, -l2[mt][hx])),
                                                           fast_exp2(fmaf(s[mt][j][2 * hx + 1], sl2, -l2[mt][hx])));
      }
    };
    if constexpr (MT == 1)
      scores(std::true_type{});
    else if (entry >= 0 || kvb * BKV + BKV > p.Lkv)
      scores(std::true_type{});
    else
      scores(std::false_type{});
    // dP = dO V^T in DP_PARTS parts of 64 / DP_PARTS keys (fewer live registers), then
    // dS = P (dP - delta) in place over P's fragments (same layout as pack_a)
    constexpr int NJ = 4 / DP_PARTS;
#pragma unroll
    for (int part = 0; part < DP_PARTS; ++part) {
      float dp[MT][2 * NJ][4];
      zero_acc(dp);
      gemm_abt_mt<T, D, MT, 0, NJ>(dp, sdO, warp * WR, sV(st) + part * NJ * 16 * (D * 2), la);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int jl = 0; jl < 2 * NJ; ++jl)
#pragma unroll
          for (int hx = 0; hx < 2; ++hx) {
            const int j = 2 * NJ * part + jl;
            uint32_t& w = pa[mt][j / 2][(j % 2) * 2 + hx];
            const float2 pr = Ops<T>::unpack(w);
            w = Ops<T>::pack(pr.x * (dp[mt][jl][2 * hx] - de[mt][hx]), pr.y * (dp[mt][jl][2 * hx + 1] - de[mt][hx]));
          }
    }
    // dQ += dS K: B operand = K tile read transposed (k = key, n = head dim)
    gemm_pv_mt<T, D, MT>(dq, pa, sK(st), la);
    __syncthreads();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) dq[mt][j][x] *= p.scale;
    // each warp stages its own rows through its rows of the Q tile
    acc_to_smem<T, D>(smem, warp * WR + mt * 16, dq[mt], lane);
  }
  __syncwarp();
  smem_to_global<D>(dQ, p.dq_strides.row, smem, warp * WR, WR, q0 + warp * WR, p.Lq, lane, 32);
  trace_end(p, dq_trace_first(p));
}

// dq = scale * dq_acc (fp32, padded rows) -> T, rows < Lq; one thread per 8 elements.
template <class T, int D>
__global__ void __launch_bounds__(256)
    flash_bwd_dq_convert_kernel(const FlashParams p, const float* dq_acc, int Lq_pad) {
  constexpr int C = D / 8;
  const int bh = blockIdx.y, b = bh / p.Hq, h = bh % p.Hq;
  const int i = blockIdx.x * 256 + threadIdx.x, q = i / C, c = i % C;
  if (q >= p.Lq) return;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + ((int64_t)bh * Lq_pad + q) * D + c * 8);
  const float4 x = src[0], y = src[1];
  const float s = p.scale;
  uint4 o;
  o.x = Ops<T>::pack(x.x * s, x.y * s);
  o.y = Ops<T>::pack(x.z * s, x.w * s);
  o.z = Ops<T>::pack(y.x * s, y.y * s);
  o.w = Ops<T>::pack(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head +
                            (int64_t)q * p.dq_strides.row + c * 8) = o;
}

// ---------------------------------------------------------------- host side of the launchers
// The (dtype, head dim) pairs the kernels are instantiated for, as a type.
template <class T_, int D_>
struct Instance {
  using T = T_;
  static constexpr int D = D_;
};
// Calls launch(Instance<T, D>{}) for p's dtype and head dim (flash_check() admits 64 and 128).
template <class F>
void for_instance(const FlashParams& p, F&& launch) {
  if (p.dtype == DType::bf16) {
    if (p.D == 64)
      launch(Instance<__nv_bfloat16, 64>{});
    else
      launch(Instance<__nv_bfloat16, 128>{});
  } else {
    if (p.D == 64)
      launch(Instance<__half, 64>{});
    else
      launch(Instance<__half, 128>{});
  }
}

// The same for the forward, whose head dims include 192 and 256 (flash_forward_head_dim()).
template <class F>
void for_forward_instance(const FlashParams& p, F&& launch) {
  const bool bf16 = p.dtype == DType::bf16;
  switch (p.D) {
    case 64: return bf16 ? launch(Instance<__nv_bfloat16, 64>{}) : launch(Instance<__half, 64>{});
    case 128: return bf16 ? launch(Instance<__nv_bfloat16, 128>{}) : launch(Instance<__half, 128>{});
    case 192: return bf16 ? launch(Instance<__nv_bfloat16, 192>{}) : launch(Instance<__half, 192>{});
    default: return bf16 ? launch(Instance<__nv_bfloat16, 256>{}) : launch(Instance<__half, 256>{});
  }
}

// Lets `kernel` use `smem` bytes of dynamic shared memory: above 48 KB a launch needs this
// attribute, set once per kernel (callers keep the result in a function-local static).
template <class K>
bool allow_smem(K kernel, int smem, const char* what) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("flash_cuda ") + what + ": cannot allow " + std::to_string(smem) +
                             " bytes of shared memory: " + cudaGetErrorString(e));
  return true;
}
inline void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("flash_cuda ") + what + " launch: " + cudaGetErrorString(e));
}

// The configuration a launch runs: the problem checked (flash_check()) and `requested`
// resolved on the current device; throws std::runtime_error naming the phase otherwise.
inline Config launch_config(const FlashParams& p, bool backward, Config requested) {
  const std::string why = flash_check(p, backward);
  if (!why.empty())
    throw std::runtime_error(std::string("flash_cuda ") + (backward ? "backward: " : "forward: ") + why);
  int device = 0;
  cudaGetDevice(&device);
  return flash_resolve_config(requested, device);
}

// Writes the CTA orders (flash_schedule.cu) on p.stream: q_order for the query kernels,
// kv_order (when not null) for the dK/dV kernel, whose items are kv_per_item 64-key columns.
// l2_groups: sort within groups of heads whose operands fit the L2 (the sm90a kernels), else
// over the whole problem (the mma.sync kernels): flash_schedule.cu says why.
void launch_schedule(const FlashParams& p, int* q_order, int* kv_order, int kv_per_item, bool l2_groups);
// Items of the query kernels and of a dK/dV kernel of kv_per_item columns per CTA.
inline int query_items(const FlashParams& p) { return p.B * p.Hq * ((p.Lq + BQ - 1) / BQ); }
inline int key_items(const FlashParams& p, int kv_per_item) {
  return p.B * p.Hkv * (((p.Lkv + BKV - 1) / BKV + kv_per_item - 1) / kv_per_item);
}

// The backward workspace (flash_backward_workspace_bytes()): lse*log2(e), then delta, one
// float per query row, rows padded to the 128-row tile; then the query and key orders.
struct BwdWorkspace {
  float* lse2;
  float* delta;
  int lq_pad;
  int* q_order;
  int* kv_order;
};
// Fills the workspace both backward walks read (the orders, then flash_bwd_pre_kernel, on
// p.stream).
template <class T, int D>
BwdWorkspace launch_bwd_preprocess(const FlashParams& p, int kv_per_item, bool l2_groups, const char* what) {
  BwdWorkspace w;
  w.lq_pad = (p.Lq + BQ - 1) / BQ * BQ;
  w.lse2 = static_cast<float*>(p.workspace);
  w.delta = w.lse2 + size_t(p.B) * p.Hq * w.lq_pad;
  w.q_order = reinterpret_cast<int*>(w.delta + size_t(p.B) * p.Hq * w.lq_pad);
  w.kv_order = w.q_order + (query_items(p) + 3) / 4 * 4;
  launch_schedule(p, w.q_order, w.kv_order, kv_per_item, l2_groups);
  constexpr int rows_per_block = 256 / (D / 8);  // D / 8 threads per row
  const dim3 grid(w.lq_pad / rows_per_block, p.B * p.Hq);
  flash_bwd_pre_kernel<T, D><<<grid, 256, 0, p.stream>>>(p, w.lse2, w.delta, w.lq_pad);
  check_launch(what);
  return w;
}

}  // namespace flashdraft::flash_cuda::detail

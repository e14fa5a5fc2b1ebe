// Hopper (sm_90a) building blocks: wgmma.mma_async wrappers, shared-memory matrix
// descriptors and the 128-byte-swizzled tile layout they read, mbarriers, the tensor memory
// accelerator's 2-D tile copy (plain and multicast) and clusters. Header-only device code, included by files compiled
// for sm_90a alone (wgmma exists on no other target): kernels/flash_cuda/flash_sm90a.cu and
// core/cuda/gemm_sm90a.cu. The wrappers below are plain inline PTX, one per shape used:
//   wgmma_ss_n{64,128,256}_* D(64xN) (+)= A(64x16, smem, K-major) * B(16xN, smem, K-major)
//   wgmma_rs_n{64,128}_* D(64xN) (+)= A(64x16, registers) * B(16xN, smem, MN-major)
// Accumulator fragment of m64nN (per warp w of the warpgroup, lane = 4g + t):
//   d[4j + 0..1] = rows 16w + g,     cols 8j + 2t .. 8j + 2t + 1
//   d[4j + 2..3] = rows 16w + g + 8, same cols
// which is mma.sync's m16n8 C layout repeated over N / 8, and the register A fragment
// (a0..a3 of a 16x16 k-step) is mma.sync's A layout: an fp32 accumulator over N = 64
// repacks into four k-steps of A exactly as in FlashAttention-2.
//
// Tile layout ("sw128"): a [ROWS][D] matrix of 16-bit values is stored as D / 64 column
// chunks, each [ROWS][64] (128 bytes per row), chunk c at byte c * ROWS * 128; inside a
// chunk, the 16-byte piece p of row r sits at r * 128 + ((p ^ (r % 8)) * 16). With every
// chunk 1024-byte aligned this is the hardware's 128-byte swizzle, so one layout serves
// both operand orders:
//   K-major (rows = M or N, D = K): start = chunk (k / 64) + row0 * 128 + (k % 64) * 2,
//            stride byte offset 1024 (next 8 rows); leading byte offset unused.
//   MN-major (rows = K, D = N): start = 16-row k-step * 2048, stride byte offset 1024
//            (next 8 rows of K), leading byte offset ROWS * 128 (next 64 columns of N).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashdraft::wg {

__device__ __forceinline__ uint64_t desc(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// K-major operand: 16-element k-step kk of the rows starting at row0 of a ROWS-row tile.
template <int ROWS>
__device__ __forceinline__ uint64_t desc_k(uint32_t tile, int row0, int kk) {
  return desc(tile + (kk / 4) * (ROWS * 128) + row0 * 128 + (kk % 4) * 32, 16, 1024);
}
// MN-major operand: rows 16 kk .. 16 kk + 15 of a ROWS-row tile are the k-step.
template <int ROWS>
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, int kk) {
  return desc(tile + kk * 2048, ROWS * 128, 1024);
}

// The descriptor of the same operand byte_off bytes further on (byte_off a multiple of 16):
// the start address is the low 14 bits of the low word, and no tile of a CTA's shared
// memory (< 256 KB) carries out of them, so a 32-bit add of the low word is enough (one
// instruction per product instead of rebuilding the descriptor).
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t byte_off) {
  const uint32_t lo = uint32_t(d) + (byte_off >> 4), hi = uint32_t(d >> 32);
  return (uint64_t(hi) << 32) | lo;
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers at this point of the program: the compiler sees the
// wgmma asm as producing its outputs at once, so reads must not move above the wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}
// Register-A fragments that stay the same across a loop (the forward's Q, held for every
// step): ptxas (CUDA 13.0) otherwise reuses their registers inside the loop for other
// values, and the next step's S reads those (seen in the SASS; kernels/flash_cuda/NOTES.md v12). A real
// redefinition in the loop, an xor with a zero ptxas cannot see through, keeps them live.
// Call it where no product that reads them is in flight.
template <int N>
__device__ __forceinline__ void carry(uint32_t (&d)[N][4], uint32_t zero) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("xor.b32 %0, %0, %1;\n" : "+r"(d[i][j]) : "r"(zero));
}
// Shared memory written by the generic proxy (cp.async, st.shared) and read next by
// wgmma (the async proxy): each writing thread fences before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- the products: one inline-PTX asm per operand form and shape, written once for both
// 16-bit types by the macros below (TY: bf16 or f16). The operands are numbered in order:
// the N / 2 accumulators (%0 ..), then A (smem descriptor, or four registers), B, and `acc`
// (0 overwrites D: scale-d false).
#define FD_WG_REGS_64                                                                                                \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%" \
  "30,%31}"
#define FD_WG_REGS_128                                                                                               \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%" \
  "30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%" \
  "58,%59,%60,%61,%62,%63}"
#define FD_WG_ACC_64(d)                                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FD_WG_ACC_128(d)                                                                                      \
  FD_WG_ACC_64(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
      "+f"(d[63])
// clang-format off
#define FD_WG_REGS_256 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define FD_WG_ACC_256(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
// clang-format on
// D(64xN) (+)= A(smem, K-major) * B(smem, K-major); A, B, acc are %IA, %IA + 1, %IA + 2.
#define FD_WG_SS(N, TY, IA, IB, IP)                                                                         \
  __device__ __forceinline__ void wgmma_ss_n##N##_##TY(float(&d)[N / 2], uint64_t a, uint64_t b, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP                                                   \
                 ", 0;\n"                                                                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " FD_WG_REGS_##N           \
                 ", %" #IA ", %" #IB ", p, 1, 1, 0, 0;\n}\n"                                                \
                 : FD_WG_ACC_##N(d)                                                                         \
                 : "l"(a), "l"(b), "r"(acc));                                                               \
  }
// D(64xN) (+)= A(registers) * B(smem); TB = 1: B is MN-major (NAME rs), 0: K-major (rsk).
#define FD_WG_RS(NAME, N, TY, A4, IB, IP, TB)                                                                     \
  __device__ __forceinline__ void wgmma_##NAME##_n##N##_##TY(float(&d)[N / 2], const uint32_t(&a)[4], uint64_t b, \
                                                             int acc) {                                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP                                                         \
                 ", 0;\n"                                                                                         \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " FD_WG_REGS_##N                 \
                 ", " A4 ", %" #IB ", p, 1, 1, " #TB ";\n}\n"                                                     \
                 : FD_WG_ACC_##N(d)                                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));                                 \
  }
// Every product of one type, and Mma<T>: the kernels' names for them.
#define FD_WG_PRODUCTS(T, TY)                                                                                    \
  FD_WG_SS(64, TY, 32, 33, 34)                                                                                   \
  FD_WG_SS(128, TY, 64, 65, 66)                                                                                  \
  FD_WG_SS(256, TY, 128, 129, 130)                                                                               \
  FD_WG_RS(rs, 64, TY, "{%32, %33, %34, %35}", 36, 37, 1)                                                        \
  FD_WG_RS(rs, 128, TY, "{%64, %65, %66, %67}", 68, 69, 1)                                                       \
  FD_WG_RS(rsk, 128, TY, "{%64, %65, %66, %67}", 68, 69, 0)                                                      \
  template <>                                                                                                    \
  struct Mma<T> {                                                                                                \
    __device__ static __forceinline__ void ss64(float (&d)[32], uint64_t a, uint64_t b, int acc) {               \
      wgmma_ss_n64_##TY(d, a, b, acc);                                                                           \
    }                                                                                                            \
    __device__ static __forceinline__ void ss128(float (&d)[64], uint64_t a, uint64_t b, int acc) {              \
      wgmma_ss_n128_##TY(d, a, b, acc);                                                                          \
    }                                                                                                            \
    __device__ static __forceinline__ void ss256(float (&d)[128], uint64_t a, uint64_t b, int acc) {             \
      wgmma_ss_n256_##TY(d, a, b, acc);                                                                          \
    }                                                                                                            \
    __device__ static __forceinline__ void rsk128(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int acc) { \
      wgmma_rsk_n128_##TY(d, a, b, acc);                                                                         \
    }                                                                                                            \
    template <int N>                                                                                             \
    __device__ static __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {           \
      if constexpr (N == 64)                                                                                     \
        wgmma_rs_n64_##TY(d, a, b, 1);                                                                           \
      else                                                                                                       \
        wgmma_rs_n128_##TY(d, a, b, 1);                                                                          \
    }                                                                                                            \
  };

template <class T>
struct Mma;
FD_WG_PRODUCTS(__nv_bfloat16, bf16)
FD_WG_PRODUCTS(__half, f16)

#undef FD_WG_PRODUCTS
#undef FD_WG_RS
#undef FD_WG_SS
#undef FD_WG_ACC_256
#undef FD_WG_ACC_128
#undef FD_WG_ACC_64
#undef FD_WG_REGS_256
#undef FD_WG_REGS_128
#undef FD_WG_REGS_64

// ---- mbarriers (shared::cta) and the tensor memory accelerator (TMA) ----------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// After thread 0's inits, before the CTA barrier: makes them visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival counted when this thread's earlier cp.async copies complete.
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// One arrival, and `bytes` more to come from TMA copies that complete_tx on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The box at element coordinates (x innermost, y) of the tensor map `map` (a __grid_constant__
// kernel parameter's address) into shared memory at dst, its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// The same box into shared memory at dst in every CTA of the cluster in cta_mask (the same
// offset in each), its bytes counted on each one's barrier at offset `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* map, int x, int y, uint32_t bar,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
      : "memory");
}
// ---- clusters
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every (not exited) thread of the cluster, with release / acquire of shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// An arrival on the barrier at offset `bar` of the cluster's CTA `cta` (this one included).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, int cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace flashdraft::wg

// flash_cuda: fused block-sparse attention (FlashAttention-2 style), forward and
// backward, over flashdraft's BlockMask, for sm_80 / sm_90 / sm_120, bf16 and fp16,
// head dims 64 and 128, GQA. This header is the host API; it is plain C++ (no LibTorch,
// no device code) so the plugin (flash_cuda_plugin.cpp) can include it from a .cpp.
//
// What it computes, per (batch b, query head h, query row i):
//   s_ij  = scale * q_i . k_j           (k, v of kv head h / (Hq / Hkv): GQA)
//   out_i = sum_j softmax_j(s_ij) v_j   over the keys j visible in the BlockMask
//   lse_i = log sum_j exp(s_ij)         natural log; -inf (and out_i = 0) for a row
//                                       with no visible key; its gradients are 0.
// Backward gives dq, dk, dv in the input dtype (accumulated in fp32 registers).
//
// Algorithm (see flash_kernels.cuh for the device code and its invariants):
//   forward : one CTA per (128-query tile, q head, batch); 4 warps x 32 rows (two m16
//             tiles per warp, as FlashAttention-2: every K/V fragment read from shared
//             memory feeds two MMAs); walks the tile's partial then full KV tiles (64 keys)
//             from the CSR lists; mma.sync m16n8k16 (fp32 accumulate), ldmatrix with an
//             XOR swizzle, cp.async 2-stage K/V pipeline, online softmax in base 2; full
//             tiles never read a bitmap (only the ragged last KV tile is cut by column).
//   backward: (1) preprocess: delta = rowsum(dO * O) and lse*log2(e) into the workspace
//             (rows padded to the tile; pad rows and empty rows get lse = +inf: P = 0);
//             (2) dK/dV: one CTA per (64-key tile, kv head, batch), 4 warps x 16 keys,
//             walking the transposed lists (all q heads of the GQA group) in 64-row
//             query steps, 2-stage Q/dO pipeline; dK, dV stay in fp32 registers and are
//             written once (no atomics, no zeroing);
//             (3) dQ: one CTA per (128-query tile, q head, batch) walking the forward
//             lists, recomputing P and dP; dQ accumulated in fp32 registers.
//   dQ is a SEPARATE PASS, not atomics: every dq element is written exactly once by one
//   CTA (deterministic, no fp32 dq buffer to zero and convert: workspace 2 MB instead of
//   +134 MB at B=1,H=32,L=8192). The price is recomputing S and dP (7 instead of 5 GEMMs).
//   The atomic alternative (dQ += dS K inside the dK/dV kernel, red.global.add.v2.f32)
//   was measured on the H200: no faster (DFlash 3.91+0.05 ms vs 2.35+1.65 ms, NOTES.md
//   v3), so no configuration uses it; its kernel code in flash_kernels.cuh is reached only
//   by check_flash_cuda's per-phase timing (`check_flash_cuda bench`).
//
// Work order: each launch is preceded by a small kernel (flash_schedule.cu) that writes, into
// the workspace, the order in which the CTAs take their tiles: longest mask list first
// (Schedule::longest_first), or the grid's fixed order (Schedule::grid).
// Tiles: the BlockMask must be built at block_q = 128, block_kv = 64 (flash_tile_size()).
// Configurations (same tiles; they differ in the backward kernels):
//   sm120: every kernel fits 99 KB of shared memory per block (RTX 50xx / RTX PRO 6000):
//          forward 96 KB, dK/dV 98 KB, dQ 4 warps x 32 rows with one K/V stage (96 KB).
//   sm90 : for parts with >= 160 KB per block (H100/H200, A100): dQ 8 warps x 16 rows
//          with two K/V stages (128 KB).
//   sm90a: Hopper (compute capability 9.0) only: every product on the warpgroup MMA
//          (wgmma, flash_sm90a.cu: forward 162 KB, two mask tiles = 128 keys per step, Q
//          in registers; dK/dV 134 KB, dQ 162 KB); dK/dV runs on a second stream of the
//          greatest priority, concurrently with the dQ pass.
//   Config::automatic picks sm90a on compute capability 9.0, else sm90 where the device
//   allows >= 160 KB per block, else sm120 (flash_config.hpp). The launchers run the
//   Config they are given; the plugin takes it from the experiment's
//   [kernels.flash_cuda].config, or from FLASHDRAFT_FLASH_CUDA_CONFIG, which overrides it
//   (flash_choose_config()), and reports the variant string the launcher returns.
// Variant names: flash_cuda/{fwd,bwd}/{sm120,sm90,sm90a}/{bf16,fp16}/d{64,128,192,256}/m128n64.
// Heads of 192 and 256 (DeepSeek-V3's latent attention with its values padded, Qwen3.5's, Gemma's)
// run forward only, on the mma.sync forward with 8 warps of 16 rows under every configuration
// (reported as sm90 under sm90a) and 2 key/value stages where the configuration's shared memory
// holds them, else 1 (flash_forward_stages(): 256 does not fit sm120's 99 KB).
//
// Requirements checked by flash_check(): D in {64, 128} (forward: also 192, 256); last dim contiguous and every
// row start 16-byte aligned (row/head/batch strides multiples of 8 elements, pointers
// 16-byte aligned); Hq % Hkv == 0; mask tile 128x64; mask batch in {1, B}, heads in
// {1, Hq}; lse contiguous [B, Hq, Lq]. Errors throw std::runtime_error with a sentence.
//
// Build and check (standalone, no LibTorch): kernels/flash_cuda/build.sh build-flash
// compiles the .cu files and check_flash_cuda.cu with nvcc (sm_80, sm_90, sm_120 SASS +
// compute_120 PTX; flash_sm90a.cu for sm_90a) into build-flash/check_flash_cuda; on the
// device, kernels/flash_cuda/run_device.sh build-flash runs `check_flash_cuda check` and
// `check_flash_cuda bench`.
#pragma once

#include "flash_config.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace flashdraft::flash_cuda {

enum class DType : int { bf16 = 0, fp16 = 1 };

constexpr int kTileQ = 128;  // query rows per mask tile (BlockMask::block_q)
constexpr int kTileKV = 64;  // keys per mask tile (BlockMask::block_kv)

// Strides in elements; the last (head-dim) stride must be 1.
struct Strides {
  int64_t batch = 0, head = 0, row = 0;
};

// The BlockMask lists on the device (see flashdraft/block_mask.hpp for their meaning).
struct FlashMask {
  const int32_t* full_offset = nullptr;
  const int32_t* full_index = nullptr;
  const int32_t* part_offset = nullptr;
  const int32_t* part_index = nullptr;
  const uint32_t* bits = nullptr;
  const int32_t* t_full_offset = nullptr;
  const int32_t* t_full_index = nullptr;
  const int32_t* t_part_offset = nullptr;
  const int32_t* t_part_index = nullptr;
  const int32_t* t_part_entry = nullptr;
  int batch = 1, heads = 1;  // 1 = shared across batch / heads
  int block_q = kTileQ, block_kv = kTileKV;
};

// The order in which a kernel's CTAs take their work items (query tiles, key columns or
// pairs of them). longest_first: a small kernel (flash_cuda_schedule.cu) sorts the items
// by the length of their mask lists, longest first, before each launch, so the short
// items fill the last wave (LPT); grid: the fixed order of the launch grid (each head's
// query tiles from the last to the first, key columns in order) -- kept to measure the
// difference ([kernels.flash_cuda].schedule).
enum class Schedule : int { longest_first = 0, grid = 1 };

struct FlashParams {
  DType dtype = DType::bf16;
  int B = 0, Hq = 0, Hkv = 0, Lq = 0, Lkv = 0, D = 0;
  float scale = 0.f;
  // forward inputs: q [B,Hq,Lq,D], k, v [B,Hkv,Lkv,D]
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  Strides q_strides, k_strides, v_strides;
  // forward output / backward input: out [B,Hq,Lq,D], lse [B,Hq,Lq] float32 contiguous
  void* out = nullptr;
  Strides out_strides;
  float* lse = nullptr;
  // backward: dout like out; dq like q; dk, dv like k
  const void* dout = nullptr;
  Strides dout_strides;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides dq_strides, dk_strides, dv_strides;
  // forward: flash_forward_workspace_bytes(params), backward: flash_backward_workspace_bytes(
  // params); device memory, 16-byte aligned, contents need not be initialised.
  void* workspace = nullptr;
  // forward: the workspace already holds the CTA order that an earlier forward computed with
  // this mask, these sizes and this configuration on this stream: no work-order launch.
  bool order_ready = false;
  FlashMask mask;
  cudaStream_t stream = nullptr;
  Schedule schedule = Schedule::longest_first;
  // Optional (benchmarks): 4 x uint64 per CTA of the main kernels -- start and end
  // (%globaltimer, ns), SM id, work item -- zero-filled by the caller. Forward: one entry
  // per slot of flash_trace_slots(params, false); backward: the dK/dV kernel's CTAs from
  // entry 0, the dQ kernel's from entry flash_trace_dq_first(params). Unused slots stay 0.
  unsigned long long* trace = nullptr;
};

struct TileSize {
  int q = kTileQ, kv = kTileKV;
};

// The tile the BlockMask must be built at (the same for every head dim and config).
TileSize flash_tile_size(int head_dim);
// Head dims the kernel supports, as text for a refusal reason: "64, 128; 192, 256 forward only";
// flash_supports_head_dim() answers for the forward (flash_config.hpp's flash_backward_head_dim()
// for the backward).
const char* flash_supported_head_dims();
bool flash_supports_head_dim(int head_dim);
// The compute capability and shared memory per block of CUDA device `device`; throws
// std::runtime_error when they cannot be read.
DeviceLimits flash_device_limits(int device);
// automatic -> flash_auto_config() of the device; any other -> itself when the device can
// run it, else throws std::runtime_error with flash_config_unfit()'s reason.
Config flash_resolve_config(Config requested, int device);
// "" when the problem is runnable, else a sentence with the found and accepted values.
std::string flash_check(const FlashParams& p, bool backward);
// The variant string a call with these arguments reports.
std::string flash_variant(bool backward, Config resolved, DType dtype, int head_dim);

// Launches on p.stream (asynchronous); returns the variant that ran.
std::string flash_forward(const FlashParams& p, Config config = Config::automatic);
// Bytes of p.workspace flash_forward() needs: the CTA order, one int per (query tile, q
// head, batch) (8 KB for B=1, H=32, L=8192). p needs B, Hq, Lq set.
size_t flash_forward_workspace_bytes(const FlashParams& p);
// Bytes of p.workspace flash_backward() needs, the same for every configuration: 2 floats
// (lse*log2(e) and delta) per query row, rows padded to 128 (2 MB for B=1, H=32, L=8192),
// then the two CTA orders (query tiles; key columns). p needs B, Hq, Hkv, Lq, Lkv set.
size_t flash_backward_workspace_bytes(const FlashParams& p);
// p.trace sizes (entries of 4 x uint64): forward CTAs, or backward dK/dV + dQ CTAs; and
// the first dQ entry of a backward trace.
size_t flash_trace_slots(const FlashParams& p, bool backward);
size_t flash_trace_dq_first(const FlashParams& p);
std::string flash_backward(const FlashParams& p, Config config = Config::automatic);
// The sm90a kernels (flash_sm90a.cu, wgmma); flash_forward() / flash_backward() call them
// for Config::sm90a.
void flash_forward_sm90a(const FlashParams& p);
void flash_backward_sm90a(const FlashParams& p);

}  // namespace flashdraft::flash_cuda

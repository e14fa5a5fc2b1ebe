// flash_cuda host side shared by forward and backward: configuration choice, problem
// checks, variant names. See flash_attention.cuh for the API and the algorithm.
#include "flash_attention.cuh"

#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

namespace flashdraft::flash_cuda {

TileSize flash_tile_size(int /*head_dim*/) { return TileSize{kTileQ, kTileKV}; }

const char* flash_supported_head_dims() { return kHeadDimsText; }
bool flash_supports_head_dim(int d) { return flash_forward_head_dim(d); }

namespace {
std::string strides_ok(const char* name, const void* ptr, const Strides& s) {
  if (ptr == nullptr) return std::string(name) + " is a null pointer";
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    return std::string(name) + " is not 16-byte aligned (flash_cuda loads rows in 16-byte pieces)";
  if (s.batch % 8 != 0 || s.head % 8 != 0 || s.row % 8 != 0)
    return std::string(name) + " has strides (batch " + std::to_string(s.batch) + ", head " + std::to_string(s.head) +
           ", row " + std::to_string(s.row) + ") that are not multiples of 8 elements; make it contiguous";
  return "";
}
// Work items (CTAs) of the query kernels and key columns of the dK/dV kernels.
size_t q_items(const FlashParams& p) { return size_t(p.B) * p.Hq * ((size_t(p.Lq) + kTileQ - 1) / kTileQ); }
size_t kv_columns(const FlashParams& p) { return size_t(p.B) * p.Hkv * ((size_t(p.Lkv) + kTileKV - 1) / kTileKV); }
size_t ints16(size_t n) { return (n + 3) / 4 * 4 * sizeof(int32_t); }  // n ints, 16-byte multiple
}  // namespace

DeviceLimits flash_device_limits(int device) {
  DeviceLimits d;
  if (cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    throw std::runtime_error("flash_cuda: cannot read the compute capability and shared memory of CUDA device " +
                             std::to_string(device) + ": " + cudaGetErrorString(e));
  }
  return d;
}

Config flash_resolve_config(Config requested, int device) {
  const DeviceLimits d = flash_device_limits(device);
  if (requested == Config::automatic) {
    std::string why;
    return flash_auto_config(d, &why);
  }
  const std::string unfit = flash_config_unfit(requested, d);
  if (!unfit.empty()) throw std::runtime_error("flash_cuda: on CUDA device " + std::to_string(device) + ", " + unfit);
  return requested;
}

std::string flash_check(const FlashParams& p, bool backward) {
  if (!flash_supports_head_dim(p.D))
    return "head_dim " + std::to_string(p.D) + " unsupported (supported: " + flash_supported_head_dims() + ")";
  if (backward && !flash_backward_head_dim(p.D))
    return "head_dim " + std::to_string(p.D) + " runs forward only (the backward's head dims: 64, 128)";
  if (p.B < 1 || p.Hq < 1 || p.Hkv < 1 || p.Lq < 1 || p.Lkv < 1)
    return "empty problem (B " + std::to_string(p.B) + ", Hq " + std::to_string(p.Hq) + ", Hkv " +
           std::to_string(p.Hkv) + ", Lq " + std::to_string(p.Lq) + ", Lkv " + std::to_string(p.Lkv) + ")";
  if (p.Hq % p.Hkv != 0)
    return "query heads " + std::to_string(p.Hq) + " are not a multiple of kv heads " + std::to_string(p.Hkv);
  if (p.B > 65535 || p.Hq > 65535) return "batch or heads above 65535";
  if (q_items(p) > size_t(INT_MAX) || kv_columns(p) > size_t(INT_MAX))
    return "batch x heads x tiles above 2^31 - 1 (" + std::to_string(q_items(p)) + " query tiles, " +
           std::to_string(kv_columns(p)) + " key columns)";
  if (p.mask.block_q != kTileQ || p.mask.block_kv != kTileKV)
    return "mask tile " + std::to_string(p.mask.block_q) + "x" + std::to_string(p.mask.block_kv) +
           " but flash_cuda needs " + std::to_string(kTileQ) + "x" + std::to_string(kTileKV) +
           " (build the mask at flash_tile_size())";
  if (!(p.mask.batch == 1 || p.mask.batch == p.B))
    return "mask batch " + std::to_string(p.mask.batch) + ", expected 1 or " + std::to_string(p.B);
  if (!(p.mask.heads == 1 || p.mask.heads == p.Hq))
    return "mask heads " + std::to_string(p.mask.heads) + ", expected 1 or " + std::to_string(p.Hq);
  if (!p.mask.full_offset || !p.mask.full_index || !p.mask.part_offset || !p.mask.part_index || !p.mask.bits)
    return "mask lists missing (null pointer)";
  if (p.lse == nullptr) return "lse is a null pointer";
  std::string r;
  if (!(r = strides_ok("q", p.q, p.q_strides)).empty()) return r;
  if (!(r = strides_ok("k", p.k, p.k_strides)).empty()) return r;
  if (!(r = strides_ok("v", p.v, p.v_strides)).empty()) return r;
  if (!(r = strides_ok("out", p.out, p.out_strides)).empty()) return r;
  if (backward) {
    if (!p.mask.t_full_offset || !p.mask.t_full_index || !p.mask.t_part_offset || !p.mask.t_part_index ||
        !p.mask.t_part_entry)
      return "transposed mask lists missing (null pointer)";
    if (!(r = strides_ok("dout", p.dout, p.dout_strides)).empty()) return r;
    if (!(r = strides_ok("dq", p.dq, p.dq_strides)).empty()) return r;
    if (!(r = strides_ok("dk", p.dk, p.dk_strides)).empty()) return r;
    if (!(r = strides_ok("dv", p.dv, p.dv_strides)).empty()) return r;
  }
  if (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0)
    return std::string("workspace missing or not 16-byte aligned (the ") + (backward ? "backward" : "forward") +
           " needs " + std::to_string(backward ? flash_backward_workspace_bytes(p) : flash_forward_workspace_bytes(p)) +
           " bytes)";
  if (p.schedule != Schedule::longest_first && p.schedule != Schedule::grid)
    return "schedule " + std::to_string(static_cast<int>(p.schedule)) + " is not a Schedule";
  return "";
}

std::string flash_variant(bool backward, Config c, DType dtype, int d) {
  if (!backward) c = flash_forward_config(c, d);
  return std::string("flash_cuda/") + (backward ? "bwd/" : "fwd/") + flash_config_name(c) + "/" +
         (dtype == DType::bf16 ? "bf16/" : "fp16/") + "d" + std::to_string(d) + "/m" + std::to_string(kTileQ) + "n" +
         std::to_string(kTileKV);
}

size_t flash_forward_workspace_bytes(const FlashParams& p) { return ints16(q_items(p)); }

size_t flash_backward_workspace_bytes(const FlashParams& p) {
  const size_t lq_pad = (size_t(p.Lq) + kTileQ - 1) / kTileQ * kTileQ;
  const size_t rows = size_t(p.B) * size_t(p.Hq) * lq_pad;
  // lse*log2(e) and delta per padded row; the query order; the key order (one item per
  // column at most: the sm90a dK/dV kernel takes pairs)
  return 2 * rows * sizeof(float) + ints16(q_items(p)) + ints16(kv_columns(p));
}

size_t flash_trace_slots(const FlashParams& p, bool backward) {
  return backward ? kv_columns(p) + q_items(p) : q_items(p);
}
size_t flash_trace_dq_first(const FlashParams& p) { return kv_columns(p); }

}  // namespace flashdraft::flash_cuda

// flash_cuda plugin: the thin LibTorch layer over the plain C++ launchers of
// flash_attention.cuh. It checks the problem (supports()), allocates every output and
// the backward workspace with LibTorch (so the caching allocator and the engine's
// memory tracker see them), and passes raw pointers, element strides, the BlockMask
// lists already on the device and the current CUDA stream of the inputs' device.
//
// The configuration (sm120 | sm90 | auto) is read from FLASHDRAFT_FLASH_CUDA_CONFIG on
// every call, never cached, so a test or a run can switch it between calls; the variant
// the launcher returns (flash_cuda/{fwd,bwd}/{sm120,sm90}/{bf16,fp16}/d{64,128}/m128n64)
// is what this plugin reports.
//
// Edge cases handled here rather than in the kernels: Lq = 0 or B*H = 0 (empty outputs),
// Lkv = 0 (no key at all: out 0, lse -inf, gradients 0, as the header's contract says),
// and empty mask lists (a zero-length list has no storage; the kernels never read an
// entry of it, but flash_check() wants a non-null pointer).
#include "flash_attention.cuh"

#include <flashdraft/attention.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace {

namespace fc = flashdraft::flash_cuda;
using flashdraft::AttentionBackward;
using flashdraft::AttentionForward;
using flashdraft::AttentionProblem;
using flashdraft::BlockMaskTensors;
using flashdraft::BlockSize;
using flashdraft::Support;

// Compute capability of a CUDA device as major*10+minor, or a reason why it is unknown.
int compute_capability(int device, std::string* why) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    *why = "CUDA device " + std::to_string(device) + " is not available (" +
           (e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::to_string(count) + " devices found") + ")";
    return 0;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    *why = "cannot read the compute capability of CUDA device " + std::to_string(device);
    return 0;
  }
  return major * 10 + minor;
}

fc::DType to_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return fc::DType::bf16;
  if (t == at::kHalf) return fc::DType::fp16;
  throw std::invalid_argument(std::string("flash_cuda: dtype ") + c10::toString(t) +
                              " unsupported (supported: BFloat16, Half)");
}

fc::Strides strides_of(const at::Tensor& t) {
  fc::Strides s;
  s.batch = t.stride(0), s.head = t.stride(1), s.row = t.stride(2);
  return s;
}

// A tensor the kernels can read: on `device`, last dim contiguous, rows 16-byte aligned.
// Contiguous tensors of D in {64, 128} always are; anything else is copied once.
at::Tensor kernel_ready(const at::Tensor& t) {
  const bool ok = t.stride(-1) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

// Throws std::invalid_argument naming the first input that does not fit the contract.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMaskTensors& mask) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    throw std::invalid_argument("flash_cuda: q, k, v must be 4-D [B, H, L, D]; found q " + c10::str(q.sizes()) + ", k " +
                                c10::str(k.sizes()) + ", v " + c10::str(v.sizes()));
  if (k.sizes() != v.sizes() || k.size(0) != q.size(0) || k.size(3) != q.size(3) || k.size(1) < 1 ||
      q.size(1) % k.size(1) != 0)
    throw std::invalid_argument("flash_cuda: shapes do not fit q [B, Hq, Lq, D], k = v [B, Hkv, Lkv, D] with Hq "
                                "a multiple of Hkv; found q " + c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) + ", v " + c10::str(v.sizes()));
  if (!q.is_cuda() || k.device() != q.device() || v.device() != q.device())
    throw std::invalid_argument("flash_cuda: q, k, v must be on one CUDA device; found " + q.device().str() + ", " +
                                k.device().str() + ", " + v.device().str());
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    throw std::invalid_argument(std::string("flash_cuda: q, k, v must share one dtype; found ") +
                                c10::toString(q.scalar_type()) + ", " + c10::toString(k.scalar_type()) + ", " +
                                c10::toString(v.scalar_type()));
  to_dtype(q.scalar_type());
  if (!fc::flash_supports_head_dim(static_cast<int>(q.size(3))))
    throw std::invalid_argument("flash_cuda: head_dim " + std::to_string(q.size(3)) + " unsupported (supported: " +
                                fc::flash_supported_head_dims() + ")");
  if (mask.host == nullptr) throw std::invalid_argument("flash_cuda: the BlockMaskTensors carry no host mask");
  const flashdraft::BlockMask& m = *mask.host;
  if (m.q_len != q.size(2) || m.kv_len != k.size(2) || (m.batch != 1 && m.batch != q.size(0)) ||
      (m.heads != 1 && m.heads != q.size(1)))
    throw std::invalid_argument("flash_cuda: the mask (batch " + std::to_string(m.batch) + ", heads " +
                                std::to_string(m.heads) + ", " + std::to_string(m.q_len) + " x " +
                                std::to_string(m.kv_len) + ") does not fit q " + c10::str(q.sizes()) + " and k " + c10::str(k.sizes()) +
                                " (mask batch and heads must be 1 or equal to B and Hq)");
  const fc::TileSize tile = fc::flash_tile_size(static_cast<int>(q.size(3)));
  if (m.block_q != tile.q || m.block_kv != tile.kv)
    throw std::invalid_argument("flash_cuda: the mask is built at tiles " + std::to_string(m.block_q) + " x " +
                                std::to_string(m.block_kv) + " but flash_cuda needs " + std::to_string(tile.q) +
                                " x " + std::to_string(tile.kv) + " (block_size())");
}

// The device lists of the mask, moved to `device` if they are elsewhere; empty lists
// point at `dummy` (never read: the offsets say there are no entries).
struct DeviceMask {
  at::Tensor keep[10];
  at::Tensor dummy;
  fc::FlashMask lists;
};

DeviceMask device_mask(const BlockMaskTensors& m, const c10::Device& device) {
  DeviceMask d;
  d.dummy = at::zeros({4}, at::TensorOptions().dtype(at::kInt).device(device));
  const at::Tensor* src[10] = {&m.full_offset, &m.full_index, &m.part_offset, &m.part_index, &m.bits,
                               &m.t_full_offset, &m.t_full_index, &m.t_part_offset, &m.t_part_index,
                               &m.t_part_entry};
  const char* names[10] = {"full_offset", "full_index", "part_offset", "part_index", "bits",
                           "t_full_offset", "t_full_index", "t_part_offset", "t_part_index", "t_part_entry"};
  const int32_t* ptr[10];
  for (int i = 0; i < 10; ++i) {
    if (!src[i]->defined())
      throw std::invalid_argument(std::string("flash_cuda: the mask list ") + names[i] + " is missing");
    if (src[i]->scalar_type() != at::kInt)
      throw std::invalid_argument(std::string("flash_cuda: the mask list ") + names[i] + " is " +
                                  c10::toString(src[i]->scalar_type()) + "; int32 expected");
    d.keep[i] = src[i]->to(device).contiguous();
    ptr[i] = d.keep[i].numel() ? d.keep[i].data_ptr<int32_t>() : d.dummy.data_ptr<int32_t>();
  }
  fc::FlashMask& f = d.lists;
  f.full_offset = ptr[0], f.full_index = ptr[1], f.part_offset = ptr[2], f.part_index = ptr[3];
  f.bits = reinterpret_cast<const uint32_t*>(ptr[4]);  // int32 storage of the uint32 words
  f.t_full_offset = ptr[5], f.t_full_index = ptr[6], f.t_part_offset = ptr[7], f.t_part_index = ptr[8];
  f.t_part_entry = ptr[9];
  f.batch = static_cast<int>(m.host->batch), f.heads = static_cast<int>(m.host->heads);
  f.block_q = static_cast<int>(m.host->block_q), f.block_kv = static_cast<int>(m.host->block_kv);
  return d;
}

// Sizes, scale, dtype and stream shared by forward and backward.
fc::FlashParams base_params(const at::Tensor& q, const at::Tensor& k, double scale) {
  fc::FlashParams p;
  p.dtype = to_dtype(q.scalar_type());
  p.B = static_cast<int>(q.size(0)), p.Hq = static_cast<int>(q.size(1)), p.Hkv = static_cast<int>(k.size(1));
  p.Lq = static_cast<int>(q.size(2)), p.Lkv = static_cast<int>(k.size(2)), p.D = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(scale);
  p.stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  return p;
}

class FlashCuda : public flashdraft::AttentionKernel {
 public:
  explicit FlashCuda(const flashdraft::Config&) {}
  static void declare(flashdraft::Schema&) {}

  Support supports(const AttentionProblem& p) const override {
    std::string why;
    auto add = [&](const std::string& reason) { why += (why.empty() ? "" : "; ") + reason; };
    if (!p.device.is_cuda()) add("device " + p.device.str() + " unsupported (supported: cuda)");
    if (p.dtype != at::kBFloat16 && p.dtype != at::kHalf)
      add(std::string("dtype ") + c10::toString(p.dtype) + " unsupported (supported: BFloat16, Half)");
    if (!fc::flash_supports_head_dim(static_cast<int>(p.head_dim)))
      add("head_dim " + std::to_string(p.head_dim) + " unsupported (supported: " + fc::flash_supported_head_dims() +
          ")");
    if (p.heads_q < 1 || p.heads_kv < 1 || p.heads_q % p.heads_kv != 0)
      add("heads_q " + std::to_string(p.heads_q) + " is not a multiple of heads_kv " + std::to_string(p.heads_kv) +
          " (supported: GQA with Hq % Hkv == 0)");
    if (p.device.is_cuda()) {
      std::string cc_why;
      const int index = p.device.has_index() ? p.device.index() : 0;
      const int cc = compute_capability(index, &cc_why);
      if (cc == 0) {
        add(cc_why);
      } else if (cc < 80) {
        add("compute capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10) + " of " +
            p.device.str() + " unsupported (supported: 8.0 and above; SASS for 8.0, 9.0, 12.0)");
      } else {
        // The configuration named in the environment must be valid and fit the device.
        try {
          fc::flash_resolve_config(fc::flash_config_from_env(), index);
        } catch (const std::exception& e) {
          add(e.what());
        }
      }
    }
    return why.empty() ? Support::yes() : Support::no("flash_cuda: " + why);
  }

  BlockSize block_size(const AttentionProblem& p) const override {
    const fc::TileSize t = fc::flash_tile_size(static_cast<int>(p.head_dim));
    return {t.q, t.kv};
  }

  AttentionForward forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const BlockMaskTensors& mask, double scale) override {
    check_inputs(q_in, k_in, v_in, mask);
    const c10::cuda::CUDAGuard guard(q_in.device());
    const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const fc::Config config = fc::flash_config_from_env();  // per call: tests switch it
    const int device = q.device().index();
    const std::string variant = fc::flash_variant(false, fc::flash_resolve_config(config, device),
                                                  to_dtype(q.scalar_type()), static_cast<int>(q.size(3)));
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    if (q.numel() == 0) return {out, lse, variant};
    if (k.size(2) == 0) {  // no keys: every row is empty
      out.zero_();
      lse.fill_(-std::numeric_limits<float>::infinity());
      return {out, lse, variant};
    }
    const DeviceMask dm = device_mask(mask, q.device());
    fc::FlashParams p = base_params(q, k, scale);
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.q_strides = strides_of(q), p.k_strides = strides_of(k), p.v_strides = strides_of(v);
    p.out = out.data_ptr(), p.out_strides = strides_of(out);
    p.lse = lse.data_ptr<float>();
    p.mask = dm.lists;
    return {out, lse, fc::flash_forward(p, config)};
  }

  AttentionBackward backward(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
                             const BlockMaskTensors& mask, double scale) override {
    check_inputs(q_in, k_in, v_in, mask);
    if (dout_in.sizes() != q_in.sizes() || out_in.sizes() != q_in.sizes() ||
        dout_in.scalar_type() != q_in.scalar_type() || out_in.scalar_type() != q_in.scalar_type())
      throw std::invalid_argument("flash_cuda backward: dout " + c10::str(dout_in.sizes()) + " and out " + c10::str(out_in.sizes()) +
                                  " must have q's shape " + c10::str(q_in.sizes()) + " and dtype");
    if (lse_in.dim() != 3 || lse_in.size(0) != q_in.size(0) || lse_in.size(1) != q_in.size(1) ||
        lse_in.size(2) != q_in.size(2) || lse_in.scalar_type() != at::kFloat)
      throw std::invalid_argument("flash_cuda backward: lse must be float32 [B, Hq, Lq] = [" +
                                  std::to_string(q_in.size(0)) + ", " + std::to_string(q_in.size(1)) + ", " +
                                  std::to_string(q_in.size(2)) + "]; found " + c10::str(lse_in.sizes()) + " " +
                                  c10::toString(lse_in.scalar_type()));
    const c10::cuda::CUDAGuard guard(q_in.device());
    const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const at::Tensor dout = kernel_ready(dout_in.to(q.device())), out = kernel_ready(out_in.to(q.device()));
    const at::Tensor lse = lse_in.to(q.device()).contiguous();
    const fc::Config config = fc::flash_config_from_env();
    const int device = q.device().index();
    const std::string variant = fc::flash_variant(true, fc::flash_resolve_config(config, device),
                                                  to_dtype(q.scalar_type()), static_cast<int>(q.size(3)));
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (k.size(2) == 0 || q.numel() == 0) {  // nothing visible: every gradient is 0
      dq.zero_(), dk.zero_(), dv.zero_();
      return {dq, dk, dv, variant};
    }
    const DeviceMask dm = device_mask(mask, q.device());
    fc::FlashParams p = base_params(q, k, scale);
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.q_strides = strides_of(q), p.k_strides = strides_of(k), p.v_strides = strides_of(v);
    p.out = const_cast<void*>(out.data_ptr()), p.out_strides = strides_of(out);
    p.lse = const_cast<float*>(lse.data_ptr<float>());
    p.dout = dout.data_ptr(), p.dout_strides = strides_of(dout);
    p.dq = dq.data_ptr(), p.dq_strides = strides_of(dq);
    p.dk = dk.data_ptr(), p.dk_strides = strides_of(dk);
    p.dv = dv.data_ptr(), p.dv_strides = strides_of(dv);
    p.mask = dm.lists;
    // The workspace (delta and lse in base 2 per padded row) through the caching
    // allocator; its blocks are 512-byte aligned, more than the 16 bytes needed.
    const size_t bytes = fc::flash_backward_workspace_bytes(p, config);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    const std::string ran = fc::flash_backward(p, config);
    // workspace is freed here; the caching allocator only reuses the block for work
    // queued later on this stream, so freeing before the kernels finish is safe.
    return {dq, dk, dv, ran};
  }
};

}  // namespace

FLASHDRAFT_PLUGIN(kernel, "flash_cuda", "0.1.0",
                  "fused block-sparse attention on CUDA (mma.sync, 128x64 tiles), forward and backward",
                  FlashCuda)

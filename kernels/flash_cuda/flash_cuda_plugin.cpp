// flash_cuda plugin: the thin LibTorch layer over the plain C++ launchers of
// flash_attention.cuh. It checks the problem (supports()), allocates every output and
// the backward workspace with LibTorch (so the caching allocator and the engine's
// memory tracker see them), and passes raw pointers, element strides, the BlockMask
// lists already on the device and the current CUDA stream of the inputs' device.
//
// The configuration (auto | sm90a | sm90 | sm120) is the experiment's
// [kernels.flash_cuda].config; FLASHDRAFT_FLASH_CUDA_CONFIG, when set, overrides it. The
// variable is read on every call, never cached, so a test or a benchmark can switch it
// between calls. supports() answers with the choice as a note ("config sm90a (auto:
// compute capability 9.0)", printed in the selection report), or refuses a configuration the
// device cannot run; the variant the launcher returns
// (flash_cuda/{fwd,bwd}/{sm90a,sm90,sm120}/{bf16,fp16}/d{64,128,192,256}/m128n64) is what a call
// reports. Heads of 192 and 256 run forward only (the online target's attention): supports()
// refuses them for a problem that needs a backward, and where the configuration's shared memory
// cannot hold their forward (256 under sm120's 99 KB).
//
// Edge cases handled here rather than in the kernels: Lq = 0 or B*H = 0 (empty outputs),
// Lkv = 0 (no key at all: out 0, lse -inf, gradients 0, as the header's contract says),
// and empty mask lists (a zero-length list has no storage; the kernels never read an
// entry of it, but flash_check() wants a non-null pointer).
#include "flash_attention.cuh"

#include "common/attention_inputs.hpp"

#include <flashdraft/attention.hpp>
#include <flashdraft/plugin.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashdraft {
namespace {

namespace fc = flash_cuda;

// What flash_cuda accepts beyond the contract; supports() and the calls' checks both read it.
const kernel_inputs::Accepted kAccepted{"flash_cuda",
                                        c10::DeviceType::CUDA,
                                        {at::kBFloat16, at::kHalf},
                                        [](int64_t d) { return fc::flash_supports_head_dim(static_cast<int>(d)); },
                                        fc::flash_supported_head_dims()};

// The compute capability and shared memory of CUDA device `device`, or false with the
// reason they are unknown in *why.
bool device_limits(int device, fc::DeviceLimits* limits, std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    *why = "CUDA device " + std::to_string(device) + " is not available (" +
           (e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::to_string(count) + " devices found") + ")";
    return false;
  }
  try {
    *limits = fc::flash_device_limits(device);
  } catch (const std::exception& x) {
    *why = x.what();
    return false;
  }
  return true;
}

// After check_inputs(): the dtype is BFloat16 or Half.
fc::DType to_dtype(at::ScalarType t) { return t == at::kBFloat16 ? fc::DType::bf16 : fc::DType::fp16; }

fc::Strides strides_of(const at::Tensor& t) {
  fc::Strides s;
  s.batch = t.stride(0), s.head = t.stride(1), s.row = t.stride(2);
  return s;
}

// A tensor the kernels can read: on `device`, last dim contiguous, rows 16-byte aligned.
// Contiguous tensors of any accepted D (a multiple of 64) always are; anything else is copied once.
at::Tensor kernel_ready(const at::Tensor& t) {
  const bool ok = t.stride(-1) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

// Throws std::invalid_argument naming the first input that does not fit: the shared checks,
// then the tile the kernels need.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockMaskTensors& mask) {
  kernel_inputs::check_inputs(kAccepted, q, k, v, mask);
  const flashdraft::BlockMask& m = *mask.host;
  const fc::TileSize tile = fc::flash_tile_size(static_cast<int>(q.size(3)));
  if (m.block_q != tile.q || m.block_kv != tile.kv)
    throw std::invalid_argument("flash_cuda: the mask is built at tiles " + std::to_string(m.block_q) + " x " +
                                std::to_string(m.block_kv) + " but flash_cuda needs " + std::to_string(tile.q) + " x " +
                                std::to_string(tile.kv) + " (block_size())");
}

// The device lists of the mask, moved to `device` if they are elsewhere; empty lists
// point at `dummy` (never read: the offsets say there are no entries).
struct DeviceMask {
  at::Tensor keep[10];
  at::Tensor dummy;
  fc::FlashMask lists;
};

DeviceMask device_mask(const BlockMaskTensors& m, const c10::Device& device, const at::Tensor& dummy) {
  DeviceMask d;
  d.dummy = dummy;
  const at::Tensor* src[10] = {&m.full_offset,   &m.full_index,   &m.part_offset,   &m.part_index,   &m.bits,
                               &m.t_full_offset, &m.t_full_index, &m.t_part_offset, &m.t_part_index, &m.t_part_entry};
  const char* names[10] = {"full_offset",   "full_index",   "part_offset",   "part_index",   "bits",
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

// What the forward's CTA order depends on: the mask's list offsets (the tensors themselves,
// held, so that their storage cannot be reused while the order is kept, and their version
// counters: an in-place change is a new mask), the sizes, the configuration, the schedule,
// the device and the stream. The hf target's layers, and a drafter's, all attend under one
// mask per step: one order serves them all.
struct OrderKey {
  at::Tensor full_offset, part_offset;
  int64_t full_version = 0, part_version = 0;
  int B = 0, Hq = 0, Hkv = 0, Lq = 0, Lkv = 0, D = 0, device = -1;
  fc::Config config = fc::Config::automatic;
  fc::Schedule schedule = fc::Schedule::longest_first;
  cudaStream_t stream = nullptr;

  bool same(const OrderKey& o) const {
    return full_offset.defined() && o.full_offset.defined() && full_offset.is_same(o.full_offset) &&
           part_offset.is_same(o.part_offset) && full_version == o.full_version && part_version == o.part_version &&
           B == o.B && Hq == o.Hq && Hkv == o.Hkv && Lq == o.Lq && Lkv == o.Lkv && D == o.D && device == o.device &&
           config == o.config && schedule == o.schedule && stream == o.stream;
  }
};

// A tensor's version counter; -1 for an inference tensor (made under c10::InferenceMode, as
// served validation's masks are), which has none.
int64_t version_of(const at::Tensor& t) { return t.is_inference() ? -1 : static_cast<int64_t>(t._version()); }

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
  explicit FlashCuda(const flashdraft::Config& c) {
    key_.key_value = c.string("config");
    if (c.given("config")) key_.key_where = c.where("config").str();
    fc::Config parsed;
    if (!fc::flash_parse_config(key_.key_value, &parsed))  // the engine's schema check already refuses it
      c.fail("config", "\"" + key_.key_value + "\" is not a configuration; accepted: " + fc::flash_config_names(true));
    const std::string schedule = c.string("schedule");
    if (schedule == "grid")
      schedule_ = fc::Schedule::grid;
    else if (schedule != "longest-first")  // the schema check already refuses it
      c.fail("schedule", "\"" + schedule + "\" is not a schedule; accepted: \"longest-first\", \"grid\"");
  }
  static void declare(flashdraft::Schema& s) {
    s.string("config",
             "kernel configuration: \"auto\" picks sm90a on compute capability 9.0, else sm90 where a block may "
             "use 160 KB of shared memory, else sm120; the environment variable FLASHDRAFT_FLASH_CUDA_CONFIG "
             "overrides it")
        .def(std::string("auto"))
        .one_of({"auto", "sm90a", "sm90", "sm120"});
    s.string("schedule",
             "order in which the kernels' CTAs take their query tiles and key columns: \"longest-first\" sorts "
             "them by the length of their mask lists before each launch (short ones fill the last wave); "
             "\"grid\" keeps the launch grid's fixed order (for comparison)")
        .def(std::string("longest-first"))
        .one_of({"longest-first", "grid"});
  }

  Support supports(const AttentionProblem& p) const override {
    kernel_inputs::Refusals why = kernel_inputs::problem_refusals(kAccepted, p);
    const fc::ConfigRequest request = config_request();
    const std::string bad_request = fc::flash_config_request_error(request);  // needs no device
    why.add(bad_request);
    const int head_dim = static_cast<int>(p.head_dim);
    if (p.needs_backward && fc::flash_forward_head_dim(head_dim) && !fc::flash_backward_head_dim(head_dim))
      why.add("head_dim " + std::to_string(head_dim) +
              " runs forward only (the backward's head dims: 64, 128), and this problem needs a backward");
    std::string note;
    if (p.device.is_cuda()) {
      const int index = p.device.has_index() ? p.device.index() : 0;
      const std::string device = "cuda:" + std::to_string(index);
      fc::DeviceLimits limits;
      std::string unknown;
      if (!device_limits(index, &limits, &unknown)) {
        why.add(unknown);
      } else if (limits.major < 8) {
        why.add("compute capability " + std::to_string(limits.major) + "." + std::to_string(limits.minor) + " of " +
                device + " unsupported (supported: 8.0 and above; SASS for 8.0, 9.0, 12.0)");
      } else if (bad_request.empty()) {
        const fc::ConfigChoice choice = fc::flash_choose_config(request, limits, device);
        why.add(choice.refusal);
        if (choice.refusal.empty() && fc::flash_forward_head_dim(head_dim))
          why.add(fc::flash_forward_unfit(head_dim, fc::flash_forward_config(choice.config, head_dim), limits));
        note = choice.note;
      }
    }
    return why.support(note);
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
    const fc::Config config = configuration(q.device());  // per call: tests switch the variable
    const std::string variant =
        fc::flash_variant(false, config, to_dtype(q.scalar_type()), static_cast<int>(q.size(3)));
    // out [B, Hq, Lq, D] laid out as [B, Lq, Hq, D] in memory (the kernels take its strides): the
    // caller's head merge before the output projection (transpose(1, 2).reshape) is then a view,
    // not a copy of the whole output.
    const int64_t Hq = q.size(1), Lq = q.size(2), D = q.size(3);
    at::Tensor out = at::empty_strided(q.sizes(), {Lq * Hq * D, D, Hq * D, 1}, q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    if (q.numel() == 0) return {out, lse, variant};
    if (k.size(2) == 0) {  // no keys: every row is empty
      out.zero_();
      lse.fill_(-std::numeric_limits<float>::infinity());
      return {out, lse, variant};
    }
    const DeviceMask dm = device_mask(mask, q.device(), dummy(q.device()));
    fc::FlashParams p = base_params(q, k, scale);
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.q_strides = strides_of(q), p.k_strides = strides_of(k), p.v_strides = strides_of(v);
    p.out = out.data_ptr(), p.out_strides = strides_of(out);
    p.lse = lse.data_ptr<float>();
    p.mask = dm.lists;
    p.schedule = schedule_;
    // The CTA order (a few KB): kept from the last forward when this call's key is the same
    // (one work-order launch per mask instead of one per layer), else made here and kept.
    // The variable that regroups the heads (benchmarks) is read at each launch: no keeping.
    OrderKey key;
    key.full_offset = mask.full_offset, key.part_offset = mask.part_offset;
    key.full_version = version_of(mask.full_offset), key.part_version = version_of(mask.part_offset);
    key.B = p.B, key.Hq = p.Hq, key.Hkv = p.Hkv, key.Lq = p.Lq, key.Lkv = p.Lkv, key.D = p.D;
    key.device = q.device().index(), key.config = config, key.schedule = schedule_, key.stream = p.stream;
    const char* regroup = std::getenv("FLASHDRAFT_FLASH_CUDA_GROUP_HEADS");
    const bool keep = regroup == nullptr || *regroup == '\0';
    at::Tensor workspace;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (keep && order_key_.same(key)) workspace = order_, p.order_ready = true;
    }
    if (!p.order_ready)
      workspace = at::empty({static_cast<int64_t>(fc::flash_forward_workspace_bytes(p))}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    const std::string ran = fc::flash_forward(p, config);
    if (keep && !p.order_ready) {
      const std::lock_guard<std::mutex> lock(mutex_);
      order_key_ = std::move(key), order_ = std::move(workspace);
    }
    return {out, lse, ran};
  }

  AttentionBackward backward(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
                             const BlockMaskTensors& mask, double scale) override {
    check_inputs(q_in, k_in, v_in, mask);
    kernel_inputs::check_backward_inputs(kAccepted, dout_in, out_in, lse_in, q_in);
    const c10::cuda::CUDAGuard guard(q_in.device());
    const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const at::Tensor dout = kernel_ready(dout_in), out = kernel_ready(out_in);
    const at::Tensor lse = lse_in.contiguous();
    const fc::Config config = configuration(q.device());
    const std::string variant = fc::flash_variant(true, config, to_dtype(q.scalar_type()), static_cast<int>(q.size(3)));
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (k.size(2) == 0 || q.numel() == 0) {  // nothing visible: every gradient is 0
      dq.zero_(), dk.zero_(), dv.zero_();
      return {dq, dk, dv, variant};
    }
    const DeviceMask dm = device_mask(mask, q.device(), dummy(q.device()));
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
    p.schedule = schedule_;
    // The workspace (delta and lse in base 2 per padded row, the CTA orders) through the caching
    // allocator; its blocks are 512-byte aligned, more than the 16 bytes needed.
    const size_t bytes = fc::flash_backward_workspace_bytes(p);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    const std::string ran = fc::flash_backward(p, config);
    // workspace is freed here; the caching allocator only reuses the block for work
    // queued later on this stream, so freeing before the kernels finish is safe.
    return {dq, dk, dv, ran};
  }

 private:
  // Four int32 on `device` that empty mask lists point at (never read), made once per device.
  at::Tensor dummy(const c10::Device& device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const size_t i = static_cast<size_t>(device.index());
    if (dummies_.size() <= i) dummies_.resize(i + 1);
    if (!dummies_[i].defined()) dummies_[i] = at::zeros({4}, at::TensorOptions().dtype(at::kInt).device(device));
    return dummies_[i];
  }

  // The configuration asked for: the experiment key, and the environment variable read now.
  fc::ConfigRequest config_request() const {
    fc::ConfigRequest r = key_;
    const char* env = std::getenv(fc::kConfigEnv);
    if (env != nullptr && *env != '\0') r.env = env;
    return r;
  }
  // The configuration a call on `device` runs; throws std::invalid_argument with the
  // refusal supports() would give.
  fc::Config configuration(const c10::Device& device) const {
    fc::DeviceLimits limits;
    std::string unknown;
    if (!device_limits(device.index(), &limits, &unknown)) throw std::invalid_argument("flash_cuda: " + unknown);
    const fc::ConfigChoice choice = fc::flash_choose_config(config_request(), limits, device.str());
    if (!choice.refusal.empty()) throw std::invalid_argument("flash_cuda: " + choice.refusal);
    return choice.config;
  }

  fc::ConfigRequest key_;                                // [kernels.flash_cuda].config and where it was given
  fc::Schedule schedule_ = fc::Schedule::longest_first;  // [kernels.flash_cuda].schedule
  std::mutex mutex_;                                     // guards what follows
  std::vector<at::Tensor> dummies_;                      // per device index
  OrderKey order_key_;                                   // the last forward's CTA order and its key
  at::Tensor order_;
};

}  // namespace
}  // namespace flashdraft

FLASHDRAFT_PLUGIN(
    kernel, "flash_cuda", "0.1.0",
    "fused block-sparse attention on CUDA (mma.sync; wgmma on Hopper; 128x64 tiles), forward and backward",
    flashdraft::FlashCuda)

// flash_cuda configurations and how one is chosen: plain C++17 (no CUDA, no LibTorch), so
// the kernel library, the plugin and the tests share one set of rules and sentences.
//
// The configurations differ in their backward kernels (flash_attention.cuh):
//   sm90a: the warpgroup MMA (wgmma), compute capability 9.0 only;
//   sm90 : mma.sync with a dQ pass that needs 160 KB of shared memory per block;
//   sm120: mma.sync with every kernel within 99 KB per block (any compute capability >= 8.0).
// "auto" picks sm90a on compute capability 9.0, else sm90 where a block may use 160 KB,
// else sm120.
//
// Who asks: the experiment's [kernels.flash_cuda].config (default "auto"), unless the
// environment variable FLASHDRAFT_FLASH_CUDA_CONFIG is set and non-empty: it wins over the
// file (tests and benchmarks switch it between calls). flash_choose_config() turns the
// request and the device into the configuration that runs plus a note that says who chose
// it and why, or into a refusal that names the value, where it came from and what the
// device accepts.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace flashdraft::flash_cuda {

enum class Config : int { automatic = 0, sm120 = 1, sm90 = 2, sm90a = 3 };

constexpr const char* kConfigEnv = "FLASHDRAFT_FLASH_CUDA_CONFIG";
constexpr const char* kConfigKey = "[kernels.flash_cuda].config";
constexpr int kSm90MinSmem = 160 * 1024;  // the sm90 dQ pass takes up to 131 KB per block

// What a device offers the configurations.
struct DeviceLimits {
  int major = 0, minor = 0;  // compute capability
  int smem_per_block = 0;    // opt-in shared memory per block, bytes
};

// "auto", "sm120", "sm90", "sm90a": the names the key and the environment variable take.
inline const char* flash_config_name(Config c) {
  switch (c) {
    case Config::automatic: return "auto";
    case Config::sm120: return "sm120";
    case Config::sm90: return "sm90";
    case Config::sm90a: return "sm90a";
  }
  return "?";
}

// Every name, in the order the documentation lists them; `quoted` as a TOML file writes them.
inline std::string flash_config_names(bool quoted) {
  std::string s;
  for (Config c : {Config::automatic, Config::sm90a, Config::sm90, Config::sm120}) {
    const std::string n = flash_config_name(c);
    s += (s.empty() ? "" : ", ") + (quoted ? "\"" + n + "\"" : n);
  }
  return s;
}

// False for anything but one of the names above.
inline bool flash_parse_config(const std::string& name, Config* out) {
  for (Config c : {Config::automatic, Config::sm90a, Config::sm90, Config::sm120})
    if (name == flash_config_name(c)) {
      *out = c;
      return true;
    }
  return false;
}

// "" when configuration `c` (not automatic) runs on a device with these limits, else why not.
inline std::string flash_config_unfit(Config c, const DeviceLimits& d) {
  if (c == Config::sm90a && !(d.major == 9 && d.minor == 0))
    return "sm90a needs compute capability 9.0 (wgmma), the device has " + std::to_string(d.major) + "." +
           std::to_string(d.minor);
  if (c == Config::sm90 && d.smem_per_block < kSm90MinSmem)
    return "sm90 needs " + std::to_string(kSm90MinSmem / 1024) + " KB of shared memory per block, the device allows " +
           std::to_string(d.smem_per_block / 1024) + " KB";
  return "";
}

// Head dims: 64 and 128 forward and backward; 192 and 256 (DeepSeek-V3's and Qwen3.5's / Gemma's
// attention) forward only -- the online target's attention, which takes no gradient.
inline bool flash_forward_head_dim(int d) { return d == 64 || d == 128 || d == 192 || d == 256; }
inline bool flash_backward_head_dim(int d) { return d == 64 || d == 128; }
constexpr const char* kHeadDimsText = "64, 128; 192, 256 forward only";
constexpr int kSm120Smem = 99 * 1024;  // what the sm120 configuration keeps every kernel within

// The mma.sync forward's shared memory: the 128-row query tile and `stages` pairs of 64-row key and
// value tiles, 16-bit values.
constexpr int flash_forward_smem(int head_dim, int stages) { return 256 * head_dim * (1 + stages); }
// The shared memory per block a configuration's kernels may take on a device: sm120 stays within
// 99 KB whatever the device allows (it is the configuration of the parts that allow no more).
inline int flash_config_smem(Config c, const DeviceLimits& d) {
  return c == Config::sm120 && d.smem_per_block > kSm120Smem ? kSm120Smem : d.smem_per_block;
}
// The stages of the mma.sync forward's key/value pipeline under configuration `c` (not automatic) on
// a device with these limits: 2 for heads up to 128 (96 KB at 128); wider heads 2 where they fit
// (192 KB at 256, 144 KB at 192), else 1 (128 KB, 96 KB), else 0: the head dim cannot run there.
inline int flash_forward_stages(int head_dim, Config c, const DeviceLimits& d) {
  if (head_dim <= 128) return 2;
  const int smem = flash_config_smem(c, d);
  return flash_forward_smem(head_dim, 2) <= smem ? 2 : flash_forward_smem(head_dim, 1) <= smem ? 1 : 0;
}
// "" when configuration `c` (not automatic) runs the forward of head_dim on the device, else why not.
inline std::string flash_forward_unfit(int head_dim, Config c, const DeviceLimits& d) {
  if (flash_forward_stages(head_dim, c, d) > 0) return "";
  return "head_dim " + std::to_string(head_dim) + "'s forward needs " +
         std::to_string(flash_forward_smem(head_dim, 1) / 1024) + " KB of shared memory per block, config " +
         flash_config_name(c) + " allows " + std::to_string(flash_config_smem(c, d) / 1024) + " KB on this device";
}
// The configuration whose forward kernel runs: heads wider than 128 take the mma.sync forward in
// every configuration (under sm90a, as sm90 runs it: the device's whole shared memory).
inline Config flash_forward_config(Config c, int head_dim) {
  return c == Config::sm90a && head_dim > 128 ? Config::sm90 : c;
}

// The configuration "auto" picks on a device with these limits; *why says what decided it.
inline Config flash_auto_config(const DeviceLimits& d, std::string* why) {
  const std::string cc = "compute capability " + std::to_string(d.major) + "." + std::to_string(d.minor);
  if (d.major == 9 && d.minor == 0) {
    *why = cc;
    return Config::sm90a;
  }
  *why = cc + ", " + std::to_string(d.smem_per_block / 1024) + " KB of shared memory per block";
  if (d.smem_per_block >= kSm90MinSmem) return Config::sm90;
  *why += ", below the " + std::to_string(kSm90MinSmem / 1024) + " KB sm90 needs";
  return Config::sm120;
}

// The configuration asked for: the experiment key and the environment override.
struct ConfigRequest {
  std::string key_value = "auto";  // [kernels.flash_cuda].config, given or defaulted
  std::string key_where;           // "experiments/x.toml:22:10" when given in a file, else ""
  std::optional<std::string> env;  // FLASHDRAFT_FLASH_CUDA_CONFIG when set and non-empty
};

// "" when the request names configurations, else a sentence naming the bad value, where it
// came from and the accepted names. Needs no device.
inline std::string flash_config_request_error(const ConfigRequest& r) {
  Config c = Config::automatic;
  if (r.env && !flash_parse_config(*r.env, &c))
    return std::string(kConfigEnv) + " is '" + *r.env +
           "', not a configuration; accepted values: " + flash_config_names(false) + " (or unset it to use " +
           kConfigKey + " = \"" + r.key_value + "\")";
  if (!flash_parse_config(r.key_value, &c))
    return std::string(kConfigKey) + " is \"" + r.key_value + "\"" + (r.key_where.empty() ? "" : " at " + r.key_where) +
           ", not a configuration; accepted values: " + flash_config_names(true);
  return "";
}

struct ConfigChoice {
  Config config = Config::automatic;  // what runs; never automatic when refusal is empty
  std::string note;                   // "config sm90a (auto: compute capability 9.0)"
  std::string refusal;                // non-empty: nothing runs, and this sentence says why
};

// The configuration a call on `device` (named so in messages: "cuda:0") runs.
inline ConfigChoice flash_choose_config(const ConfigRequest& r, const DeviceLimits& d, const std::string& device) {
  ConfigChoice out;
  out.refusal = flash_config_request_error(r);
  if (!out.refusal.empty()) return out;
  const std::string key = kConfigKey;
  std::string over;  // how the environment variable, when set, relates to the key
  if (r.env) over = *r.env == r.key_value ? "as " + key : "overriding " + key + " = \"" + r.key_value + "\"";
  Config requested = Config::automatic;
  flash_parse_config(r.env ? *r.env : r.key_value, &requested);
  if (requested == Config::automatic) {
    std::string why;
    out.config = flash_auto_config(d, &why);
    out.note = std::string("config ") + flash_config_name(out.config) + " (auto: " + why +
               (r.env ? std::string("; ") + kConfigEnv + "=auto, " + over : "") + ")";
    return out;
  }
  const std::string unfit = flash_config_unfit(requested, d);
  if (!unfit.empty()) {
    std::string accepted;
    for (Config c : {Config::automatic, Config::sm90a, Config::sm90, Config::sm120})
      if (flash_config_unfit(c, d).empty()) {
        const std::string n = flash_config_name(c);
        accepted += (accepted.empty() ? "" : ", ") + (r.env ? n : "\"" + n + "\"");
      }
    const std::string asked =
        r.env ? std::string(kConfigEnv) + "=" + *r.env + " (" + over + ")"
              : key + " = \"" + r.key_value + "\"" + (r.key_where.empty() ? "" : " (" + r.key_where + ")");
    out.refusal = asked + " cannot run on " + device + ": " + unfit + "; accepted on " + device + ": " + accepted;
    return out;
  }
  out.config = requested;
  out.note = std::string("config ") + flash_config_name(requested) + " (forced by " +
             (r.env ? std::string(kConfigEnv) + "=" + *r.env + ", " + over : key) + ")";
  return out;
}

// The work order's groups (flash_schedule.cu): how many (batch, kv head) units each sorted
// group of the query kernels' and of the dK/dV kernel's items spans. The sm90a kernels
// (l2_groups) sort within groups whose operands fit a share of the L2 -- query kernels read
// their kv head's K and V (40%), the dK/dV kernel the Q and dO of the kv head's q heads (70%);
// the shares are the best of the sizes measured on the H200, NOTES.md v10 -- at least one unit
// a group. The mma.sync kernels sort the whole problem as one group.
struct ScheduleGroups {
  int q_units = 1, kv_units = 1;
};
inline ScheduleGroups flash_schedule_groups(int B, int Hq, int Hkv, int Lq, int Lkv, int D, int elem_bytes,
                                            size_t l2_bytes, bool l2_groups) {
  const int units = B * Hkv;
  ScheduleGroups g{units, units};
  if (!l2_groups || units < 1) return g;
  auto fit = [&](size_t unit_bytes, int percent) {
    const size_t n = l2_bytes * size_t(percent) / 100 / (unit_bytes > 0 ? unit_bytes : 1);
    return n < 1 ? 1 : n > size_t(units) ? units : int(n);
  };
  g.q_units = fit(2 * size_t(Lkv) * size_t(D) * size_t(elem_bytes), 40);
  g.kv_units = fit(2 * size_t(Hq / Hkv) * size_t(Lq) * size_t(D) * size_t(elem_bytes), 70);
  return g;
}

}  // namespace flashdraft::flash_cuda

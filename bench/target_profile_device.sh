#!/usr/bin/env bash
# On the GPU machine, in one call: where the online target's forward spends its time inside the
# training step, at the shapes of bench/qwen3_8b_hf_target.toml (Qwen3-8B-shaped random
# checkpoint, 34 of 36 layers run, S = 3072, B = 1, 1-layer drafter, flash_cuda in both).
#   device run: command `bash bench/target_profile_device.sh`, carry [".deps", "build-device"] after
#   scripts/stage-device-build here, timeout_s 600.
# 1. the engine's run, 16 steps, steps 10-12 under --profile: its table of device time by part of
#    the step (the target's forward, the drafter's forward, the backward, the optimizer: each part's
#    kernels, its span on the device and its longest kernels), the SM clock and power while it runs,
#    and the median /steps/target_time_s over steps 13-16;
# 2. the target's products two ways: each shape alone (median of 20, as target_forward_device.sh's
#    floor), and all 34 layers' products back to back with each layer's own weights (median of 10),
#    to tell whether the products run slower in sequence than alone; the target's causal attention
#    through torch's SDPA (cuDNN, flash), for the attention's share.
set -uo pipefail
OUT=${OUT:-/tmp/target-profile-device}
mkdir -p "$OUT"
rm -rf /tmp/target-runs  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
exec > >(tee "$OUT/target-profile-device.log") 2>&1
CKPT=/tmp/qwen3-8b-random
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset qwen3-8b --out $CKPT --device cuda > /tmp/checkpoint.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins

echo "=== the target's products: alone and in sequence"
python3 - <<'PY'
import torch, statistics
S, H, I, q, kv, L = 3072, 4096, 12288, 32 * 128, 8 * 128, 34
shapes = {"qkv": (S, H, q + 2 * kv), "o": (S, q, H), "gate_up": (S, H, 2 * I), "down": (S, I, H)}
from bench.device_common import timed
acts = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (m, k, n) in shapes.items()}
weights = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for name, (m, k, n) in shapes.items()}
           for _ in range(L)]
alone = 0.0
for name in shapes:
    ms = timed(lambda: torch.nn.functional.linear(acts[name], weights[0][name]), 20, 5)
    alone += ms
    print(f"{name}: alone {ms:.3f} ms")
def chain():
    for w in weights:
        for name in shapes: torch.nn.functional.linear(acts[name], w[name])
seq = timed(chain, 10)
flop = 2 * L * sum(m * k * n for m, k, n in shapes.values())
from torch.nn.attention import SDPBackend, sdpa_kernel
qa = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
ka, va = (torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
    try:
        with sdpa_kernel(b):
            ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True), 20)
        print(f"causal attention [1, 32 / 8, {S}, 128], SDPA {b.name}: {ms:.3f} ms, x 34 = {34 * ms:.2f} ms "
              f"({4 * S * S / 2 * 32 * 128 / ms / 1e9:.0f} TFLOP/s)")
    except Exception as e:
        print(f"SDPA {b.name}: {type(e).__name__}: {str(e)[:120]}")
print(f"34 layers' products: alone, summed {L * alone:.2f} ms ({flop / (L * alone) / 1e9:.0f} TFLOP/s); "
      f"back to back, each layer its own weights {seq:.2f} ms ({flop / seq / 1e9:.0f} TFLOP/s)")
PY

wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 /tmp/checkpoint.log
sed -e "s/^name = .*/name = \"target_profile\"/" -e "s|^path = \"/tmp/qwen3-8b-random\"|path = \"$CKPT\"|" \
  -e "s/^steps = 20/steps = 16/" -e "s/^target_layer_ids = \(.*\)/target_layer_ids = \1\nlabels = \"data\"/" \
  bench/qwen3_8b_hf_target.toml > /tmp/target_profile.toml
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > /tmp/clocks.txt &
smi=$!
timeout -k 5 200 "$BUILD/bin/flashdraft" run /tmp/target_profile.toml --out /tmp/target-runs --profile 10:13 \
  > /tmp/run_profile.log 2>&1
echo "=== run: rc $?"
kill $smi 2>/dev/null
grep -E "^target|^error|^step +16/" /tmp/run_profile.log | head -5
sed -n '/^profile/,/^step/p' /tmp/run_profile.log | grep -v "^step" | head -120
python3 - <<'PY'
import statistics, h5py
f = h5py.File("/tmp/target-runs/target_profile.h5", "r", swmr=True)
t, s = f["steps/target_time_s"][:], f["steps/step_time_s"][:]
print(f"steps 13-16: target forward median {1e3 * statistics.median(t[12:]):.1f} ms, step {1e3 * statistics.median(s[12:]):.1f} ms; "
      f"profiled steps 11-13: target {' '.join(f'{1e3 * x:.1f}' for x in t[10:13])} ms")
rows = [l.split(",") for l in open("/tmp/clocks.txt") if l.count(",") == 1]
clk = [float(a) for a, b in rows if a.strip().replace(".", "").isdigit()]
pw = [float(b) for a, b in rows if b.strip().replace(".", "").isdigit()]
busy = [c for c, p in zip(clk, pw) if p > 250]
if busy:
    print(f"SM clock while drawing > 250 W: median {statistics.median(busy):.0f} MHz, min {min(busy):.0f}, max {max(busy):.0f} "
          f"({len(busy)} samples); power median {statistics.median([p for p in pw if p > 250]):.0f} W, max {max(pw):.0f} W")
PY

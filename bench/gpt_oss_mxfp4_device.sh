#!/usr/bin/env bash
# On the GPU machine, in one call: gpt-oss's experts as published (MXFP4), held two ways by the hf
# target — [target] mxfp4 = "dequantize" (bf16 at load) and "keep" (MXFP4 on the device, a layer's
# experts dequantized in each forward) — and whether gpt-oss-120b fits one GPU with "keep".
#   device run: command `bash bench/gpt_oss_mxfp4_device.sh`, carry [".deps", "build-device"] after
#   `scripts/stage-device-build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops` here,
#   timeout_s 600.
# 1. test_cuda_ops' MXFP4 case (the dequantization kernel against ATen's ops) and the norm cases;
# 2. gpt-oss-20b's shapes, 4 of its 24 layers, --mxfp4 (scripts/make-random-checkpoint): the states
#    of layers 1 and 2 on 3072 random tokens, "keep" against "dequantize" (equal: the same kernel
#    dequantizes both), then bench/gpt_oss_20b_hf_target.toml's step, 24 steps each way: median
#    target forward ms (steps 14-24), step ms, peak GiB;
# 3. gpt-oss-120b's shapes, the first G120 (default 24) of its 36 layers (the disk: ~1.6 GiB a layer in
#    MXFP4), "keep", the drafter reading layers 1, G120 / 2 and G120 - 1 (every layer runs): 12 steps,
#    target forward ms, peak GiB; the 36 layers' memory by arithmetic from the measured per-layer bytes
#    (G120=0: not run).
set -uo pipefail
G120=${G120:-24}
OUT=${OUT:-/tmp/gpt-oss-mxfp4-device}/mxfp4
mkdir -p "$OUT"
exec > >(tee "$OUT/gpt-oss-mxfp4-device.log") 2>&1
rm -rf /tmp/oss-runs /tmp/gpt-oss-20b-mxfp4 /tmp/gpt-oss-120b-mxfp4
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h /tmp | tail -1
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset gpt-oss-20b --layers 4 --mxfp4 --out /tmp/gpt-oss-20b-mxfp4 \
  --device cuda > /tmp/ckpt20.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops
echo "=== test_cuda_ops ($(( $(date +%s) - t0 )) s)"
"$BUILD/bin/test_cuda_ops" --gtest_filter='*Mxfp4*:*FrozenDecoderOps*:*ClampedGlu*' > /tmp/test_cuda_ops.log 2>&1
echo "rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" /tmp/test_cuda_ops.log | head -20
grep -E "groups: equal|float32 weight|^BFloat16 I .*clamped_glu" /tmp/test_cuda_ops.log | grep -vE "Float H|Half H" | head -24
wait $ckpt; echo "=== gpt-oss-20b checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 /tmp/ckpt20.log

echo "=== states, keep against dequantize"
timeout -k 5 200 python3 - "$BUILD" <<'PY' | tee "$OUT/states.txt"
import subprocess, sys, torch
from safetensors.torch import save_file, load_file
build = sys.argv[1]
torch.manual_seed(0)
save_file({"tokens": torch.randint(0, 201088, (1, 3072)), "lengths": torch.tensor([3072])}, "/tmp/oss_in.safetensors")
out = {}
for mode in ("dequantize", "keep"):
    p = subprocess.run([f"{build}/bin/target_states", "hf", "/tmp/gpt-oss-20b-mxfp4", "/tmp/oss_in.safetensors",
                        f"/tmp/oss_{mode}.safetensors", "1,2", "flash_cuda", "bfloat16", "cuda", "engine",
                        f"mxfp4={mode}"], capture_output=True, text=True)
    print(mode, "rc", p.returncode, p.stdout.strip().splitlines()[-2:] if p.returncode == 0 else p.stderr.strip()[-300:])
    out[mode] = load_file(f"/tmp/oss_{mode}.safetensors")["hidden"]
print("keep equal to dequantize:", torch.equal(out["keep"], out["dequantize"]),
      "; mean |state|", out["keep"].float().abs().mean().item())
PY

run_ours() {  # name ckpt toml mxfp4 steps layers
  local name=$1 ckpt=$2 toml=$3 mode=$4 steps=$5 layers=$6
  sed -e "s|^path = .*|path = \"$ckpt\"\nmxfp4 = \"$mode\"|" -e "s/^name = .*/name = \"$name\"/" \
    -e "s/^steps = .*/steps = $steps/" -e "s/^target_layer_ids = .*/target_layer_ids = [$layers]/" "$toml" \
    > /tmp/$name.toml
  timeout -k 5 240 "$BUILD/bin/flashdraft" run /tmp/$name.toml --out /tmp/oss-runs > /tmp/run_$name.log 2>&1
  echo "=== ours, $name (mxfp4 = $mode): rc $? ($(( $(date +%s) - t0 )) s)"
  grep -E "^target:|^error|out of memory" /tmp/run_$name.log | head -4
  python3 - /tmp/oss-runs/$name.h5 $name $steps <<'PY' | tee -a "$OUT/ours.txt"
import statistics, sys, h5py
f = h5py.File(sys.argv[1], "r")
t, s = f["steps/target_time_s"][:], f["steps/step_time_s"][:]
first = max(2, int(sys.argv[3]) * 13 // 24)
print(f"ours {sys.argv[2]}: target forward median {1e3 * statistics.median(t[first:]):.1f} ms (steps {first + 1}-"
      f"{len(t)}), step {1e3 * statistics.median(s[first:]):.1f} ms, peak {f['memory/step'][:].max() / 2**30:.2f} GiB, "
      f"loss {f['steps/loss'][0]:.3f} -> {f['steps/loss'][-1]:.3f}")
PY
}
run_ours oss20_dequantize /tmp/gpt-oss-20b-mxfp4 bench/gpt_oss_20b_hf_target.toml dequantize 24 "1, 2"
run_ours oss20_keep /tmp/gpt-oss-20b-mxfp4 bench/gpt_oss_20b_hf_target.toml keep 24 "1, 2"
rm -rf /tmp/gpt-oss-20b-mxfp4

[ "$G120" -gt 0 ] || { echo "done ($(( $(date +%s) - t0 )) s)"; exit 0; }
echo "=== gpt-oss-120b checkpoint, $G120 of 36 layers ($(( $(date +%s) - t0 )) s)"
timeout -k 5 240 python3 scripts/make-random-checkpoint --preset gpt-oss-120b --layers $G120 --mxfp4 \
  --out /tmp/gpt-oss-120b-mxfp4 --device cuda > /tmp/ckpt120.log 2>&1
echo "rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 /tmp/ckpt120.log; df -h /tmp | tail -1
run_ours oss120_keep /tmp/gpt-oss-120b-mxfp4 bench/gpt_oss_20b_hf_target.toml keep 12 "1, $((G120 / 2)), $((G120 - 1))"
python3 - /tmp/gpt-oss-120b-mxfp4 $G120 <<'PY' | tee -a "$OUT/ours.txt"
import json, os, sys
folder, n = sys.argv[1], int(sys.argv[2])
index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
per_layer = (index["metadata"]["total_size"] - 2 * 201088 * 2880 * 2) / n
print(f"gpt-oss-120b: {n} layers on disk {index['metadata']['total_size'] / 2**30:.2f} GiB, {per_layer / 2**30:.3f} GiB "
      f"a layer; the other {36 - n} layers add {(36 - n) * per_layer / 2**30:.2f} GiB to the peak above")
PY
rm -rf /tmp/gpt-oss-120b-mxfp4
echo "done ($(( $(date +%s) - t0 )) s)"

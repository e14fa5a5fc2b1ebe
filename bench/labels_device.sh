#!/usr/bin/env bash
# On the GPU machine, in one call: build the engine, the plugins and the GPU tests of the loss
# op and the attention kernel against that machine's torch (carry .deps); run them (labels
# from a target through the fused LM-head kernels against their float64 definition; flash_cuda
# against dense_ref on packed DFlash masks, served decoding's masks); then the cost of labels
# from the target at Qwen3-8B shapes: bench/qwen3_8b_hf_target.toml (random Qwen3-8B-shaped
# checkpoint made here, S = 3072, 512 anchors x 16, a 1-layer drafter) for 20 steps with
# [drafter] labels = "data", "target_argmax" and "target_kl", median step time of steps 3-20.
set -uo pipefail
OUT=${OUT:-/tmp/labels-device}
mkdir -p "$OUT"
rm -rf /tmp/labels-runs  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
exec > >(tee "$OUT/labels-device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset qwen3-8b --out /tmp/qwen3-8b-random --device cuda \
  > "$OUT/checkpoint.log" 2>&1 &
ckpt=$!
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=ON -DFLASHDRAFT_BUILD_BENCH=ON \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" > "$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
# KERNEL_TESTS=0 skips building and running the attention kernel's tests (the loss op's run).
KERNEL_TESTS=${KERNEL_TESTS:-1}
targets="flashdraft_cli flashdraft_all_plugins test_lm_head_loss"
[ "$KERNEL_TESTS" = 1 ] && targets="$targets test_flash_cuda test_cuda_ops"
cmake --build "$BUILD" -j16 --target $targets > "$OUT/build.log" 2>&1
rc=$?
echo "=== build: rc $rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$OUT/build.log" | head -50; exit 1; }
echo "=== test_lm_head_loss"
"$BUILD/bin/test_lm_head_loss" 2>&1 | grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[ +OK|Failure|Expected|Which is" | head -40
if [ "$KERNEL_TESTS" = 1 ]; then
  echo "=== test_cuda_ops"
  "$BUILD/bin/test_cuda_ops" 2>&1 | tail -3
  echo "=== test_flash_cuda (generator cases)"
  "$BUILD/bin/test_flash_cuda" --gtest_filter='*EveryMaskGenerator*:*Generator*' 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |Failure|dflash_packed|dflash_served|causal_decode" | head -20
fi
wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 "$OUT/checkpoint.log"
for labels in data target_argmax target_kl; do
  sed "s/^target_layer_ids = \(.*\)$/target_layer_ids = \1\nlabels = \"$labels\"/" bench/qwen3_8b_hf_target.toml \
    > "/tmp/labels_$labels.toml"
  sed -i "s/^name = .*/name = \"labels_$labels\"/" "/tmp/labels_$labels.toml"
  "$BUILD/bin/flashdraft" run "/tmp/labels_$labels.toml" --out /tmp/labels-runs > "$OUT/run_$labels.log" 2>&1
  echo "=== labels = $labels: rc $?"
  grep -E "^target:|^loss:|error" "$OUT/run_$labels.log" | head -5
done
"$BUILD/bin/flashdraft" inspect /tmp/labels-runs/labels_data.h5 > /dev/null 2>&1
python3 - <<'PY'
import statistics, subprocess, sys
rows = []
for labels in ("data", "target_argmax", "target_kl"):
    path = f"/tmp/labels-runs/labels_{labels}.h5"
    try:
        import h5py
        f = h5py.File(path, "r", swmr=True)
        s, t, loss = f["steps/step_time_s"][:], f["steps/target_time_s"][:], f["steps/loss"][:]
        m = f["memory/step"][:]
    except Exception as e:  # no h5py: read what inspect prints
        print(labels, "unreadable:", e); continue
    rows.append((labels, 1e3 * statistics.median(s[2:]), 1e3 * statistics.median(t[2:]),
                 1e3 * statistics.median((s - t)[2:]), m.max() / 2**30, loss[0], loss[-1]))
base = rows[0][1] if rows else 1
print("| labels | step ms (median, steps 3-20) | target forward ms | drafter ms | peak GiB | loss first / last | step / data |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.3f} / {r[6]:.3f} | {r[1] / base:.3f}x |")
PY
echo "=== total $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# On the GPU machine, in one call: the DFlash-2 drafter step (plugins/dflash2) next to the
# DFlash step at Qwen3-8B shapes (bench/dflash_step_{1,5}.toml: hidden 4096, 32/8 heads,
# SwiGLU 12288, vocabulary 151936, S = 3072, 512 anchors x 16, batch 1, bf16, flash_cuda;
# the synthetic "random" target), DFlash-2 at speculators' defaults (conv_kernel_size 2,
# conv_group_size 16, selector_rank 256, selector_top_k 16).
#   device run: command `bash bench/dflash2_device.sh`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600.
# 1. build the engine, the plugins and test_dflash2 against that machine's torch;
# 2. test_dflash2 (the selector's hand-written backward against autograd, float32 and bf16 on
#    the GPU) and test_lm_head_loss's top-k cases (the candidates from the LM-head op's logits);
# 3. 30 steps each of DFlash and DFlash-2, 1 and 5 layers, one process each, nothing else
#    running; DFlash-2's steps 26-28 under --profile (its per-family GPU time);
# 4. the table: median step ms over steps 6-25, peak GiB (allocator peak of the step), ratio.
set -uo pipefail
OUT=${OUT:-/tmp/dflash2-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/dflash2-device.log") 2>&1
RUNS=/tmp/dflash2-runs
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins test_dflash2 test_lm_head_loss
echo "=== test_dflash2"
"$BUILD/bin/test_dflash2" 2>&1 | grep -E "rel err|^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" | head -20
echo "=== test_lm_head_loss (the op's top-k, which DFlash-2's selector takes its candidates from)"
"$BUILD/bin/test_lm_head_loss" --gtest_filter='*TopK*' 2>&1 | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" | head -20
rm -rf "$RUNS"
for L in 1 5; do
  sed -e "s/^name = .*/name = \"dflash2_step_$L\"/" -e '0,/^plugin = "dflash"$/s//plugin = "dflash2"/' \
    "bench/dflash_step_$L.toml" > "/tmp/dflash2_step_$L.toml"
  grep -q 'plugin = "dflash2"' "/tmp/dflash2_step_$L.toml" || { echo "no dflash2 in /tmp/dflash2_step_$L.toml"; exit 1; }
  for cfg in "bench/dflash_step_$L.toml" "/tmp/dflash2_step_$L.toml"; do
    prof=""
    case "$cfg" in *dflash2*) prof="--profile 25:28" ;; esac
    log="$OUT/$(basename "$cfg" .toml).log"
    timeout -k 5 150 "$BUILD/bin/flashdraft" run "$cfg" --out "$RUNS" $prof > "$log" 2>&1
    echo "=== $cfg: rc $?"
    grep -E "^error|^step +30/|profile|^ +[a-z_]+ +[0-9.]+ ms" "$log" | head -30
  done
done
python3 - "$RUNS" <<'PY' | tee "$OUT/results.md"
import statistics, sys
import h5py
runs = sys.argv[1]
print("| drafter | layers | median step ms | peak GiB | loss step 1 -> 30 | kernels | DFlash-2 / DFlash time | memory |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
base = {}
for L in (1, 5):
    for name in (f"dflash_step_{L}", f"dflash2_step_{L}"):
        try:
            f = h5py.File(f"{runs}/{name}.h5", "r", swmr=True)
        except OSError as e:
            print(f"| {name} | {L} | no log ({e}) | | | | | |")
            continue
        st = f["steps/step_time_s"][:25]
        med = 1e3 * statistics.median(st[5:])
        peak = max(f["memory/step"][5:25]) / 2**30
        loss = f["steps/loss"][:]
        names = sorted({n.decode() if isinstance(n, bytes) else str(n) for n in f["kernels/names"][:]})
        drafter = "DFlash-2" if name.startswith("dflash2") else "DFlash"
        ratio = mem = ""
        if drafter == "DFlash":
            base[L] = (med, peak)
        elif L in base:
            ratio, mem = f"{med / base[L][0]:.3f}", f"{peak / base[L][1]:.3f}"
        print(f"| {drafter} | {L} | {med:.1f} | {peak:.2f} | {loss[0]:.3f} -> {loss[-1]:.3f} | {', '.join(names)} | "
              f"{ratio} | {mem} |")
PY
echo "=== done in $(( $(date +%s) - t0 )) s"

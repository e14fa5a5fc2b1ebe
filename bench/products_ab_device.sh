#!/usr/bin/env bash
# On the GPU machine, in one call: the online target's forward with its products tuned (each shape
# on the fastest cuBLASLt algorithm equal to torch's values, the default) against torch's choice
# for every product (FLASHDRAFT_TUNE_PRODUCTS=0), alternating run by run (ROUNDS pairs, default 3),
# at the shapes of bench/target_forward_device.sh (Qwen3-8B-shaped random checkpoint, 34 of 36
# layers, S = 3072, B = 1, 1-layer drafter, flash_cuda in both; 24 steps a run). Each run: median
# target forward ms over steps 14-24 and the card's median SM clock while it ran; then the median
# of each variant's runs and their ratio. The card's clock moves run to run (its power limit): only
# runs alternated in one call compare.
#   device run: command `bash bench/products_ab_device.sh`, carry [".deps", "build-device"] after
#   scripts/stage-device-build here, timeout_s 600.
set -uo pipefail
OUT=${OUT:-/tmp/products-ab-device}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
exec > >(tee "$OUT/products-ab-device.log") 2>&1
CKPT=/tmp/qwen3-8b-random
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset qwen3-8b --out $CKPT --device cuda > /tmp/checkpoint.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins
wait $ckpt || { echo "checkpoint failed"; tail -5 /tmp/checkpoint.log; exit 1; }
echo "=== checkpoint ($(( $(date +%s) - t0 )) s)"
sed -e "s|^path = \"/tmp/qwen3-8b-random\"|path = \"$CKPT\"\nkernels = \"engine\"|" -e "s/^steps = 20/steps = 24/" \
  -e "s/^target_layer_ids = \(.*\)/target_layer_ids = \1\nlabels = \"data\"/" bench/qwen3_8b_hf_target.toml \
  > /tmp/products_ab.toml
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 |
  while IFS= read -r line; do echo "$(date +%s.%N) $line"; done > /tmp/ab_clocks.txt 2>/dev/null &
sampler=$!
: > /tmp/ab_runs.txt
for r in $(seq 1 "$ROUNDS"); do
  for v in tuned torch; do
    tune=1; [ $v = torch ] && tune=0
    name="ab_${v}_$r"
    start=$(date +%s.%N)
    sed -e "s/^name = .*/name = \"$name\"/" /tmp/products_ab.toml > "/tmp/$name.toml"
    FLASHDRAFT_TUNE_PRODUCTS=$tune timeout -k 5 150 "$BUILD/bin/flashdraft" run "/tmp/$name.toml" --out /tmp/ab-runs \
      > "/tmp/$name.log" 2>&1
    rc=$?
    echo "$v $r $rc $start $(date +%s.%N)" >> /tmp/ab_runs.txt
    echo "=== $name: rc $rc"
    [ $rc -eq 0 ] || tail -5 "/tmp/$name.log"
  done
done
kill $sampler 2>/dev/null
python3 - <<'PY' | tee "$OUT/results.md"
import statistics
import h5py
clocks = []
for line in open("/tmp/ab_clocks.txt"):
    p = line.replace(",", " ").split()
    try:
        clocks.append((float(p[0]), float(p[1]), float(p[2])))
    except (ValueError, IndexError):
        pass
runs = {"tuned": [], "torch": []}
print("| round | products | target forward ms (steps 14-24) | SM MHz (median, drawing > 200 W) |")
print("| --- | --- | --- | --- |")
for line in open("/tmp/ab_runs.txt"):
    v, r, rc, start, end = line.split()
    if rc != "0":
        print(f"| {r} | {v} | failed (rc {rc}) | |"); continue
    with h5py.File(f"/tmp/ab-runs/ab_{v}_{r}.h5", "r") as f:
        ms = 1e3 * statistics.median(f["steps/target_time_s"][13:])
    mhz = [c[1] for c in clocks if float(start) <= c[0] < float(end) and c[2] > 200]
    runs[v].append(ms)
    print(f"| {r} | {v} | {ms:.2f} | {statistics.median(mhz) if mhz else float('nan'):.0f} |")
if runs["tuned"] and runs["torch"]:
    a, b = statistics.median(runs["tuned"]), statistics.median(runs["torch"])
    print(f"\nmedian of the runs: tuned {a:.2f} ms, torch's choice {b:.2f} ms: tuned / torch's {a / b:.4f}")
PY
grep -h "^target: product" /tmp/ab_tuned_*.log | sort | uniq -c
echo "=== done in $(( $(date +%s) - t0 )) s"

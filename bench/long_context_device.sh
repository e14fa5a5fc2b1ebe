#!/usr/bin/env bash
# On the GPU machine, in ONE device call: the whole online step at long context on one H200
# (bench/long_context.toml: the Qwen3-8B-shaped target with YaRN factor 4, 34 of its 36
# layers run; a 5-layer DFlash drafter, 512 anchors per 3072 tokens, its steps in parts of
# 1820 blocks; B = 1; flash_cuda in the drafter and in the target).
#   device run: command `bash bench/long_context_device.sh [S ...]`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600
#   (default lengths: 32768 65536 131072; STEPS=n sets the steps per length, default 4;
#   ANCHORS=n the same n anchors at every length instead of S / 6, e.g. 512 for the issue's first
#   long-context table).
# 1. build the engine and the plugins; meanwhile the random checkpoint (--yarn 4; one already in
#    /tmp/qwen3-8b-yarn4 is used as it is) and one shard
#    of random-token conversations of the longest length;
# 2. per length, one process: `flashdraft run` for STEPS steps;
# 3. the table: median step ms over the steps after the first, target forward ms, peak GiB,
#    loss first -> last (finite), the kernels of the drafter's and the target's attention.
# Files under $OUT: long-context-device.log (this output), build.log, S<length>.log, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/long-context-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/long-context-device.log") 2>&1
LENGTHS=${*:-32768 65536 131072}
STEPS=${STEPS:-4}
RUNS=/tmp/long-context-runs
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
longest=$(echo $LENGTHS | tr ' ' '\n' | sort -n | tail -1)
# A checkpoint already on this machine (a warm machine after another long-context call, or a
# link to runs/long-context/checkpoint) is used as it is: it is the same preset.
ckpt=""
if [ ! -f /tmp/qwen3-8b-yarn4/config.json ]; then
  python3 scripts/make-random-checkpoint --preset qwen3-8b --yarn 4 --out /tmp/qwen3-8b-yarn4 --device cuda \
    > "$OUT/checkpoint.log" 2>&1 &
  ckpt=$!
else
  echo "=== using the checkpoint already in /tmp/qwen3-8b-yarn4 ($(readlink -f /tmp/qwen3-8b-yarn4))"
fi
python3 bench/long_tokens.py "$longest" /tmp/long-tokens > "$OUT/tokens.log" 2>&1 &
toks=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins
[ -z "$ckpt" ] || wait $ckpt || { tail -20 "$OUT/checkpoint.log"; exit 1; }
wait $toks || { tail -20 "$OUT/tokens.log"; exit 1; }
echo "=== checkpoint and tokens ready at $(( $(date +%s) - t0 )) s"
rm -rf "$RUNS"
for S in $LENGTHS; do
  want=${ANCHORS:-$(( S / 6 ))}
  parts=$(( (want + 1819) / 1820 ))
  anchors=$(( want / parts * parts ))
  sed -e "s/^name = .*/name = \"long_$S\"/" -e "s/^steps = .*/steps = $STEPS/" -e "s/^seq_len = .*/seq_len = $S/" \
    -e "s/^anchors = .*/anchors = $anchors/" -e "s/^anchor_parts = .*/anchor_parts = $parts/" \
    bench/long_context.toml > "/tmp/long_$S.toml"
  echo "=== S $S: $anchors anchors in $parts parts (at $(( $(date +%s) - t0 )) s)"
  timeout -k 5 400 "$BUILD/bin/flashdraft" run "/tmp/long_$S.toml" --out "$RUNS" > "$OUT/S$S.log" 2>&1
  echo "rc $?"
  grep -E "^error|^step +[0-9]+/|out of memory|CUDA" "$OUT/S$S.log" | cut -c1-260 | head -12
done
python3 - "$RUNS" $LENGTHS <<'PY' | tee "$OUT/results.md"
import statistics, sys, math
import h5py
runs, lengths = sys.argv[1], [int(s) for s in sys.argv[2:]]
print("| S | anchors (parts) | steps | median step ms | target forward ms | drafter ms | peak GiB | loss first -> last | drafter attention | target attention |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for S in lengths:
    try:
        f = h5py.File(f"{runs}/long_{S}.h5", "r", swmr=True)
    except OSError as e:
        print(f"| {S} | | 0 | no log ({e.__class__.__name__}) | | | | | | |")
        continue
    st = f["steps/step_time_s"][:]
    if len(st) == 0:
        print(f"| {S} | | 0 | no step | | | | | | |")
        continue
    tail = st[1:] if len(st) > 1 else st
    med = 1e3 * statistics.median(tail)
    tgt = f["steps/target_time_s"][:] if "steps/target_time_s" in f else []
    tmed = 1e3 * statistics.median(tgt[1:] if len(tgt) > 1 else tgt) if len(tgt) else float("nan")
    peak = max(f["memory/step"][:]) / 2**30
    loss = f["steps/loss"][:]
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["kernels/names"][:]]
    fwd = f["kernels/forward"][:]
    d = sorted({names[i] for i in fwd[-1, :5] if i >= 0})
    t = sorted({names[i] for i in fwd[-1, 5:] if i >= 0})
    exp = f.attrs["experiment"]
    exp = exp.decode() if isinstance(exp, bytes) else exp
    a = [l for l in exp.splitlines() if l.startswith(("anchors", "anchor_parts"))]
    finite = all(math.isfinite(x) for x in loss)
    print(f"| {S} | {a[0].split('=')[1].strip()} ({a[1].split('=')[1].strip()}) | {len(st)} | {med:.0f} | {tmed:.0f} | "
          f"{med - tmed:.0f} | {peak:.1f} | {loss[0]:.3f} -> {loss[-1]:.3f}{'' if finite else ' NOT FINITE'} | "
          f"{', '.join(d)} | {', '.join(t)} |")
PY
echo "=== done at $(( $(date +%s) - t0 )) s"

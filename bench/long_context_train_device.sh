#!/usr/bin/env bash
# On the GPU machine: S = 131072 trained for 20 steps (bench/long_context.toml: the
# Qwen3-8B-shaped target with YaRN factor 4, a 5-layer DFlash drafter, 21840 anchors in 13
# parts, B = 1, flash_cuda in both), over as many back-to-back device calls as it takes. A
# step there is 31.2 s (measured; 27-41 s by the arithmetic of bench/RESULTS.md "long_context"), so 20 of them do
# not fit in one 10-minute call. Everything lives under runs/long-context/ (ignored by git),
# which a machine keeps between calls while it stays warm (30 s after a call): make the next
# call at once. Two ways across the calls:
#   MODE=detach (the default): the run is started in a session of its own (setsid), which the
#     machine lets outlive the call; each call follows its log until the run ends or the call's
#     limit is near, and a later call finds the run still going and follows it on. One process,
#     no checkpoint: ~12 minutes of device time for the 20 steps (~100 s to make the checkpoint
#     and the tokens and load them, then 20 x 31.2 s), where the other way spends two
#     14 GB checkpoint writes and loads on top. If the machine went back between calls, the run
#     is gone (as a checkpoint would be) and the next call starts over.
#   MODE=checkpoint: each call trains until its deadline, then SIGTERM makes the run finish the
#     step in flight and write its checkpoint, and the next call resumes it (`--resume latest`,
#     the same log). A call that finds a log but no checkpoint, or none of it, says so.
#   device run: command `bash bench/long_context_train_device.sh`, carry [".deps", "build-device"]
#   after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600; again
#   until it prints "20 of 20 steps".
#   S (default 131072), STEPS (20), FRESH=1 starts over; MODE=checkpoint only: DEADLINE (seconds
#   after the start at which the run is told to stop; default 380: the step in flight, 31 s at
#   131072, and the drafter's checkpoint, 14 GB, take the rest: in the first call, 2026-12-05,
#   with 500 the checkpoint was still being written when the call's 590 s ran out, over 60 s
#   after the last step; a resumed run whose remaining steps fit in the call is not stopped
#   early), MIN_LEFT (default 60 s), LOAD_S (the seconds a resumed call allows for loading the
#   checkpoint, default 90). For a smoke test elsewhere: CKPT (a checkpoint folder to use, not
#   made here), EDIT (sed expressions applied to the experiment file last), LIMIT (the call's
#   seconds, default 590).
# Files under $OUT: long-context-train.log (this output), run.log, results.md (at the end).
set -uo pipefail
OUT=${OUT:-/tmp/long-context-train}
mkdir -p "$OUT"
exec > >(tee "$OUT/long-context-train.log") 2>&1
MODE=${MODE:-detach}
S=${S:-131072}
STEPS=${STEPS:-20}
deadline_given=${DEADLINE:-}
DEADLINE=${DEADLINE:-380}
LIMIT=${LIMIT:-590}
[ "$DEADLINE" -le $(( LIMIT - 20 )) ] || DEADLINE=$(( LIMIT - 20 ))  # the call's end comes first
case "$MODE" in detach | checkpoint) ;; *) echo "MODE=$MODE: give detach or checkpoint"; exit 2 ;; esac
HERE=$(pwd)/runs/long-context
RUNS=$HERE/runs
NAME=long_$S
t0=$(date +%s)
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# The table of the run so far, from its log (results.md).
table() {
python3 - "$RUNS/$NAME.h5" "$STEPS" "$HERE/segments.txt" "$S" <<'PY' | tee "$OUT/results.md"
import math, statistics, sys
import h5py
path, steps, seg, S = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
try:
    f = h5py.File(path, "r", swmr=True)
except OSError as e:
    sys.exit(f"no table: the run's log {path} cannot be read ({e}); run.log says why")
st, loss = f["steps/step_time_s"][:], f["steps/loss"][:]
tgt = f["steps/target_time_s"][:] if "steps/target_time_s" in f else []
starts = sorted({int(x) for x in open(seg).read().split()})  # each call's first step (warm-up)
warm = [i for i in range(len(st)) if i not in starts]
med = 1e3 * statistics.median(st[warm]) if warm else float("nan")
tmed = 1e3 * statistics.median(tgt[warm]) if warm and len(tgt) else float("nan")
peak = max(f["memory/step"][:]) / 2**30
names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["kernels/names"][:]]
fwd = f["kernels/forward"][:]
used = sorted({names[i] for row in fwd for i in row if i >= 0})
finite = all(math.isfinite(x) for x in loss)
print(f"{len(st)} of {steps} steps in {len(starts)} call(s) (each call's first step at {starts})")
print("| S | steps | median step ms | target forward ms | peak GiB | loss first -> last | finite | attention kernels |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
print(f"| {S} | {len(st)} | {med:.0f} | {tmed:.0f} | {peak:.1f} | "
      f"{loss[0]:.3f} -> {loss[-1]:.3f} | {finite} | {', '.join(used)} |")
print("per-step loss:", " ".join(f"{x:.3f}" for x in loss))
PY
}

# Follows the detached run's log until the run ends or the call's limit is near.
follow() {
  local pid=$1 seen=0 n
  while kill -0 "$pid" 2> /dev/null; do
    if [ $(( $(date +%s) - t0 )) -ge $(( LIMIT - 15 )) ]; then
      echo "=== the call's end is near at $(( $(date +%s) - t0 )) s: the run (pid $pid) goes on; call again at once"
      cp "$HERE/$NAME.log" "$OUT/run.log"
      exit 0
    fi
    sleep 5
    n=$(grep -c "^step " "$HERE/$NAME.log")
    [ "$n" -le "$seen" ] || { grep "^step " "$HERE/$NAME.log" | tail -n $(( n - seen )) | cut -c1-200; seen=$n; }
  done
  wait "$pid" 2> /dev/null
  cp "$HERE/$NAME.log" "$OUT/run.log"
  echo "=== the run has ended, at $(( $(date +%s) - t0 )) s of this call"
  grep -E "^error|interrupted|out of memory|CUDA error|^done:" "$HERE/$NAME.log" | cut -c1-240 | tail -10
}

if [ "$MODE" = detach ] && [ "${FRESH:-0}" != 1 ] && [ -f "$HERE/$NAME.pid" ]; then
  pid=$(cat "$HERE/$NAME.pid")
  if kill -0 "$pid" 2> /dev/null; then
    echo "=== $NAME still training (pid $pid, started by an earlier call): following it"
    follow "$pid"
  else
    echo "=== $NAME ran in an earlier call and is no longer running"
    cp "$HERE/$NAME.log" "$OUT/run.log"
  fi
  table
  echo "=== done at $(( $(date +%s) - t0 )) s"
  exit 0
fi

if [ "${FRESH:-0}" = 1 ]; then  # a detached run still going is stopped at once (SIGTERM would finish its step first)
  [ ! -f "$HERE/$NAME.pid" ] || { kill -KILL "$(cat "$HERE/$NAME.pid")" 2> /dev/null && sleep 2; }
  rm -rf "$HERE"
fi
# The other device scripts' 16 GB checkpoints and runs, left on a warm machine, would leave too
# little of its 64 GB disk for this one's checkpoint (16 GB), the drafter's (~13 GB, two while
# the next is written) and the build.
rm -rf /tmp/qwen3-8b-random /tmp/qwen3-8b-yarn4 /tmp/long-context-runs /tmp/pipeline-runs
df -h . | tail -1
mkdir -p "$HERE"
[ "$MODE" = checkpoint ] || rm -rf "$RUNS" "$HERE/$NAME.pid"  # a detached run starts over (its tokens and checkpoint stay)
resume=""
if [ -f "$RUNS/$NAME.h5" ]; then
  if ! ls -d "$RUNS"/checkpoints/step_* > /dev/null 2>&1; then
    echo "runs/long-context has the log of $NAME but no checkpoint to resume from; FRESH=1 starts over"
    exit 1
  fi
  resume="--resume latest"
  echo "=== resuming $NAME from $(ls -d "$RUNS"/checkpoints/step_* | sort -V | tail -1)"
elif [ -d "$HERE/checkpoint" ] || [ -d "$HERE/tokens" ]; then
  echo "=== no log of $NAME yet: a fresh run on the kept checkpoint and tokens"
else
  echo "=== nothing kept in runs/long-context (a fresh machine): a fresh run"
fi
ckpt=""
if [ -n "${CKPT:-}" ]; then
  rm -rf "$HERE/checkpoint" && ln -s "$(cd "$CKPT" && pwd)" "$HERE/checkpoint"
elif [ ! -f "$HERE/checkpoint/config.json" ]; then
  python3 scripts/make-random-checkpoint --preset qwen3-8b --yarn 4 --out "$HERE/checkpoint" --device cuda \
    > "$OUT/checkpoint.log" 2>&1 &
  ckpt=$!
fi
if [ ! -f "$HERE/tokens/shard-00000.h5" ]; then
  python3 bench/long_tokens.py "$S" "$HERE/tokens" > "$OUT/tokens.log" 2>&1 || { tail -5 "$OUT/tokens.log"; exit 1; }
fi
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins
[ -z "$ckpt" ] || wait $ckpt || { tail -20 "$OUT/checkpoint.log"; exit 1; }
echo "=== checkpoint and tokens ready at $(( $(date +%s) - t0 )) s"
parts=$(( (S / 6 + 1819) / 1820 ))
anchors=$(( S / 6 / parts * parts ))
# The same experiment file in every call (a resumed run continues this one).
sed -e "s/^name = .*/name = \"$NAME\"/" -e "s/^steps = .*/steps = $STEPS/" -e "s/^seq_len = .*/seq_len = $S/" \
  -e "s/^anchors = .*/anchors = $anchors/" -e "s/^anchor_parts = .*/anchor_parts = $parts/" \
  -e "s|^path = \"/tmp/qwen3-8b-yarn4\"|path = \"$HERE/checkpoint\"|" -e "s|^path = \"/tmp/long-tokens\"|path = \"$HERE/tokens\"|" \
  -e "${EDIT:-}" bench/long_context.toml > "$HERE/$NAME.toml"
if [ "$MODE" = detach ]; then  # one process to the end: every step is in the log, no checkpoint
  echo 0 > "$HERE/segments.txt"
  echo "=== $NAME: $anchors anchors in $parts parts; $STEPS steps in a session of its own"
  setsid "$BUILD/bin/flashdraft" run "$HERE/$NAME.toml" --out "$RUNS" > "$HERE/$NAME.log" 2>&1 < /dev/null &
  echo $! > "$HERE/$NAME.pid"
  follow "$(cat "$HERE/$NAME.pid")"
  table
  echo "=== done at $(( $(date +%s) - t0 )) s"
  exit 0
fi
printf '\n[checkpoint]\nenabled = true\nevery = 0\nkeep = 1\n' >> "$HERE/$NAME.toml"
before=0  # the step this call starts at (a resumed run's log is cut back to its checkpoint's)
[ -z "$resume" ] || before=$(ls -d "$RUNS"/checkpoints/step_* | sed 's/.*step_//' | sort -n | tail -1)
if [ "$before" -ge "$STEPS" ]; then
  echo "=== $NAME has trained its $STEPS steps already (FRESH=1 starts over)"
  table
  exit 0
fi
# A resumed run whose remaining steps fit in this call (at the log's median step time, with
# 90 s for loading the checkpoint) is not told to stop: it finishes, and a final checkpoint cut
# off by the call's end loses nothing (every step is in the log).
if [ -n "$resume" ] && [ -z "$deadline_given" ]; then
  step_s=$(python3 - "$RUNS/$NAME.h5" "$before" <<'PY'
import statistics, sys
import h5py
st = h5py.File(sys.argv[1], "r", swmr=True)["steps/step_time_s"][1:int(sys.argv[2])]
print(int(statistics.median(st)) + 1 if len(st) else 0)
PY
)
  need=$(( (STEPS - before) * step_s + ${LOAD_S:-90} ))
  if [ "$step_s" -gt 0 ] && [ $(( $(date +%s) - t0 + need )) -lt $(( LIMIT - 20 )) ]; then
    DEADLINE=$(( LIMIT - 20 ))
    echo "=== the $(( STEPS - before )) steps left fit in this call (${step_s} s each, ${need} s with the load): no early stop"
  fi
fi
left=$(( DEADLINE - ($(date +%s) - t0) ))
echo "=== $NAME: $anchors anchors in $parts parts; from step $before; training until SIGTERM in $left s"
[ $left -gt "${MIN_LEFT:-60}" ] || { echo "too little time left in this call"; exit 1; }
timeout -s TERM -k $(( LIMIT - DEADLINE )) $left "$BUILD/bin/flashdraft" run "$HERE/$NAME.toml" --out "$RUNS" $resume \
  >> "$OUT/run.log" 2>&1
echo "rc $? at $(( $(date +%s) - t0 )) s"
grep -E "^error|^step +[0-9]+/|interrupted|resume|out of memory|CUDA|checkpoint" "$OUT/run.log" | cut -c1-240 | tail -30
echo "$before" >> "$HERE/segments.txt"
table
echo "=== done at $(( $(date +%s) - t0 )) s"

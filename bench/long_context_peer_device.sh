#!/usr/bin/env bash
# On the GPU machine, in ONE device call: the co-located PyTorch pipeline at long context,
# S = 8192, 16384, 32768, 65536, 131072 until it no longer fits, next to bench/long_context_device.sh's
# run of ours: transformers' model for the target (the Qwen3-8B-shaped random checkpoint with
# YaRN factor 4, bf16, SDPA, output_hidden_states, cut after layer 33, no gradient) feeding the
# compiled DFlash step of bench/dflash_peer.py (5 layers, flex_attention, 512 anchors per 3072
# tokens, B = 1). Each length in its own process (a fresh allocator; compilation included in
# the first step, not in the median).
#   device run: command `bash bench/long_context_peer_device.sh [S ...]`, carry [".deps"], timeout_s 600
#   TARGET_MODE=eager|compiled (default compiled), STEPS (default 3), CKPT (default: made here).
# The table: per S, the peer's step ms (the better of its synchronised median and back-to-back
# mean), peak GiB, first step s, loss finite; "out of memory" where the process ran out of
# device memory; the largest S that ran.
# Files under $OUT: long-context-peer.log (this output), checkpoint.log, S<length>.log, peer.jsonl, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/long-context-peer}
mkdir -p "$OUT"
exec > >(tee "$OUT/long-context-peer.log") 2>&1
LENGTHS=${*:-8192 16384 32768 65536 131072}
STEPS=${STEPS:-3}
TARGET_MODE=${TARGET_MODE:-compiled}
CKPT=${CKPT:-/tmp/qwen3-8b-yarn4}
DEVICE=${DEVICE:-cuda}
PEER_SHAPE=${PEER_SHAPE:-}  # extra dflash_peer.py flags (the CPU smoke test's tiny shapes)
date -u
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
t0=$(date +%s)
if [ ! -f "$CKPT/config.json" ]; then
  python3 scripts/make-random-checkpoint --preset qwen3-8b --yarn 4 --out "$CKPT" --device "$DEVICE" \
    > "$OUT/checkpoint.log" 2>&1 || { tail -20 "$OUT/checkpoint.log"; exit 1; }
  echo "=== checkpoint ready at $(( $(date +%s) - t0 )) s"
fi
rm -f "$OUT/peer.jsonl"
for S in $LENGTHS; do
  anchors=$(( S / 6 ))
  echo "=== S $S: $anchors anchors (at $(( $(date +%s) - t0 )) s)"
  timeout -k 5 280 python3 bench/dflash_peer.py --device "$DEVICE" --variant compiled --layers 5 --seq "$S" \
    --anchors "$anchors" --target "$CKPT" --target-mode "$TARGET_MODE" --steps "$STEPS" --warmup 1 $PEER_SHAPE \
    --json-out "$OUT/peer.jsonl" > "$OUT/S$S.log" 2>&1
  rc=$?
  echo "rc $rc"
  if [ $rc -ne 0 ]; then
    if grep -qE "OutOfMemoryError|out of memory" "$OUT/S$S.log"; then
      echo "S $S: out of memory" | tee -a "$OUT/oom.txt"
    else
      grep -vE "^W[0-9]|Warning" "$OUT/S$S.log" | tail -5
    fi
    break  # a longer S needs more memory still
  fi
  grep -E "layers 5: median" "$OUT/S$S.log" | cut -c1-200
done
python3 - "$OUT" $LENGTHS <<'PY' | tee "$OUT/results.md"
import json, os, sys
out, lengths = sys.argv[1], [int(s) for s in sys.argv[2:]]
runs = {}
if os.path.exists(f"{out}/peer.jsonl"):
    for line in open(f"{out}/peer.jsonl"):
        r = json.loads(line)
        runs[r["shape"]["seq"]] = r
oom = open(f"{out}/oom.txt").read() if os.path.exists(f"{out}/oom.txt") else ""
print("| S | anchors | peer step ms | peak GiB | first step s | loss finite | impl |")
print("| --- | --- | --- | --- | --- | --- | --- |")
largest = None
for S in lengths:
    r = runs.get(S)
    if r:
        largest = S
        print(f"| {S} | {r['shape']['anchors']} | {r['median_ms']:.1f} | {r['peak_gib']} | {r['first_step_s']:.1f} | "
              f"{r['finite']} | {r['impl']} |")
    elif f"S {S}: out of memory" in oom:
        print(f"| {S} | {S // 6} | out of memory | | | | |")
    else:
        print(f"| {S} | {S // 6} | not run | | | | |")
print(f"\nThe peer's largest S that ran: {largest if largest else 'none'}")
PY
echo "=== done at $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# On the GPU machine, in ONE device call: the whole online step with batches > 1 and uneven
# lengths at Qwen3-8B shapes: conversations of random tokens with lengths drawn uniformly in
# 256..3072 (a prompt of the first tenth, the rest carrying loss), rows of 3072 tokens, one
# conversation per row padded (pack = false) or whole conversations packed (pack = true, a
# block sees only its own conversation), B = 1, 2, 4, 512 anchors per row; the
# Qwen3-8B-shaped random checkpoint as the online target (34 layers run), a 1-layer DFlash
# drafter learning the data's tokens, flash_cuda in both.
#   device run: command `bash bench/batch_rows_device.sh`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600.
# Table: median step ms over steps 4..STEPS (STEPS=16 unless set), real input tokens/s (padding not counted), labelled
# positions/s, peak GiB, per B and row layout.
# Files under $OUT: batch-rows-device.log (this output), build.log, <layout>_<B>.log, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/batch-rows-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/batch-rows-device.log") 2>&1
RUNS=${RUNS:-/tmp/batch-rows-runs}  # the run folders hold more files than a device call brings back (8):
# the tables are printed in this output and written to $OUT/results.md
STEPS=${STEPS:-16}
CKPT=/tmp/qwen3-8b-random
DATA=/tmp/uneven-tokens
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
if [ -f $CKPT/config.json ]; then  # made whole (config.json is written last) by an earlier script of this call or machine
  echo "=== using the checkpoint already in $CKPT"; ckpt=
else
  python3 scripts/make-random-checkpoint --preset qwen3-8b --out $CKPT --device cuda > "$OUT/checkpoint.log" 2>&1 &
  ckpt=$!
fi
python3 - "$DATA" <<'PY' > "$OUT/tokens.log" 2>&1
import os, sys
import h5py, numpy as np
out, n = sys.argv[1], 400
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
lengths = rng.integers(256, 3073, size=n)
tokens = rng.integers(0, 151643, size=int(lengths.sum()), dtype=np.int32)
mask = np.ones(len(tokens), dtype=np.uint8)
offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
for i in range(n):
    mask[offsets[i]: offsets[i] + lengths[i] // 10] = 0  # the prompt
with h5py.File(os.path.join(out, "shard-00000.h5"), "w") as f:
    f.create_dataset("tokens", data=tokens)
    f.create_dataset("loss_mask", data=mask)
    f.create_dataset("offsets", data=offsets)
    f.create_dataset("lines", data=np.arange(1, n + 1, dtype=np.int64))
    f.attrs.update(format="flashdraft-tokens-v1", vocab_size=151936, tokenizer="random ids",
                   source="bench/batch_rows_device.sh")
print(f"{n} conversations, {int(lengths.sum())} tokens, lengths {lengths.min()}..{lengths.max()}")
PY
cat "$OUT/tokens.log"
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins
[ -z "$ckpt" ] || wait $ckpt || { tail -20 "$OUT/checkpoint.log"; exit 1; }
echo "=== checkpoint ready at $(( $(date +%s) - t0 )) s"
rm -rf "$RUNS"
for B in 1 2 4; do  # B by B, padded then packed: a call cut short still compares the layouts
  for pack in false true; do
    name=$([ $pack = true ] && echo packed || echo padded)_$B
    sed -e "s/^name = .*/name = \"$name\"/" -e "s/^steps = .*/steps = $STEPS/" -e "s|^path = .*|path = \"$CKPT\"|" \
      -e 's/^\[drafter\]$/[drafter]\nlabels = "data"/' -e '/^\[dataset\]$/,$d' bench/qwen3_8b_hf_target.toml > "/tmp/$name.toml"
    printf '[dataset]\nplugin = "tokens"\npath = "%s"\nseq_len = 3072\nbatch_size = %s\npack = %s\neval_sequences = 0\n\n[mask]\nplugin = "dflash"\n' \
      "$DATA" "$B" "$pack" >> "/tmp/$name.toml"
    timeout -k 5 120 "$BUILD/bin/flashdraft" run "/tmp/$name.toml" --out "$RUNS" > "$OUT/$name.log" 2>&1
    echo "=== $name: rc $? at $(( $(date +%s) - t0 )) s"
    grep -E "^error|^step +$STEPS/" "$OUT/$name.log" | cut -c1-200
  done
done
python3 - "$RUNS" <<'PY' | tee "$OUT/results.md"
import statistics, sys
import h5py
runs = sys.argv[1]
print("| rows | B | median step ms | input tokens/s (real) | labelled positions/s | peak GiB | input tokens/s / B=1's |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for layout in ("padded", "packed"):
    base = None
    for B in (1, 2, 4):
        try:
            f = h5py.File(f"{runs}/{layout}_{B}.h5", "r", swmr=True)
            st = f["steps/step_time_s"][3:]
            med = 1e3 * statistics.median(st)
            itps = statistics.median(f["steps/input_tokens_per_s"][3:])
            ltps = statistics.median(f["steps/tokens_per_s"][3:])
            peak = max(f["memory/step"][3:]) / 2**30
        except (OSError, KeyError, ValueError, statistics.StatisticsError) as e:
            print(f"| {layout} | {B} | no run ({e.__class__.__name__}) | | | | |")
            continue
        base = base or itps
        print(f"| {layout} | {B} | {med:.1f} | {itps:.0f} | {ltps:.0f} | {peak:.2f} | {itps / base:.2f} |")
PY
echo "=== done at $(( $(date +%s) - t0 )) s"

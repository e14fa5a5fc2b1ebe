#!/usr/bin/env bash
# On the GPU machine, in ONE device call: the whole online step against the co-located
# PyTorch pipeline a careful user builds today, side by side at Qwen3-8B shapes (S = 3072,
# 512 anchors x 16, B = 1, bf16): the Qwen3-8B-shaped random checkpoint (made here by
# scripts/make-random-checkpoint) as the target, the layers 1, 9, 17, 25, 33 feeding a 1- and
# a 5-layer DFlash drafter that learns the data's tokens.
#   ours  `flashdraft run` of bench/qwen3_8b_hf_target.toml (labels = "data"; layers 1 and 5),
#         flash_cuda in the drafter and in the target, 24 steps each;
#   peer  bench/dflash_peer.py --target: transformers' model (bf16, SDPA, output_hidden_states,
#         cut after layer 33, no gradient, under torch.compile) feeding the compiled DFlash step
#         (flex_attention); TARGET_MODE="eager compiled" adds the eager target.
#   device run: command `bash bench/pipeline_device.sh`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600.
# Table: median step ms (ours over steps 6-24; the peer's better of synchronised median and
# back-to-back mean), tokens/s (labelled positions), peak GiB, ours / peer.
# Before the runs: test_lm_head_loss and test_cuda_ops on the GPU. Ours profiles steps 3-4 (not in
# the median): device time per op family, and the device's idle gaps with the host ops behind them.
# Files under $OUT: pipeline-device.log (this output), build.log, ours_<L>.log, peer.jsonl, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/pipeline-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/pipeline-device.log") 2>&1
TARGET_MODE=${TARGET_MODE:-compiled}
RUNS=${RUNS:-/tmp/pipeline-runs}  # the run folders hold more files than a device call brings back (8):
# the tables are printed in this output and written to $OUT/results.md
CKPT=/tmp/qwen3-8b-random
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
t0=$(date +%s)
if [ -f $CKPT/config.json ]; then  # made whole (config.json is written last) by an earlier script of this call or machine
  echo "=== using the checkpoint already in $CKPT"; ckpt=
else
  python3 scripts/make-random-checkpoint --preset qwen3-8b --out $CKPT --device cuda > "$OUT/checkpoint.log" 2>&1 &
  ckpt=$!
fi
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins test_lm_head_loss test_cuda_ops
for t in test_lm_head_loss test_cuda_ops; do  # the engine's CUDA kernels against their definitions on this GPU
  echo "=== $t"
  "$BUILD/bin/$t" 2>&1 | grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" | head -20
done
[ -z "$ckpt" ] || wait $ckpt || { tail -20 "$OUT/checkpoint.log"; exit 1; }
echo "=== checkpoint ready at $(( $(date +%s) - t0 )) s"
rm -rf "$RUNS" "$OUT/peer.jsonl"
for L in 1 5; do
  sed -e "s/^name = .*/name = \"ours_$L\"/" -e "s/^steps = .*/steps = 24/" -e "s/^layers = .*/layers = $L/" \
    -e 's/^\[drafter\]$/[drafter]\nlabels = "data"/' -e "s|^path = .*|path = \"$CKPT\"|" \
    bench/qwen3_8b_hf_target.toml > "/tmp/ours_$L.toml"
  timeout -k 5 150 "$BUILD/bin/flashdraft" run "/tmp/ours_$L.toml" --out "$RUNS" --profile 3:5 > "$OUT/ours_$L.log" 2>&1
  echo "=== ours, $L drafter layers: rc $? at $(( $(date +%s) - t0 )) s"
  grep -E "^error|^step +24/" "$OUT/ours_$L.log" | cut -c1-200
  # steps 3-4 under the profiler (outside the median): device time by family and its idle gaps
  grep -E "^profile:|^  (matrix|attention|elementwise|copies|RMSNorm|other)" "$OUT/ours_$L.log"
  sed -n '/device idle between/,/^step/p' "$OUT/ours_$L.log" | grep -v "^step" | head -13
done
timeout -k 5 360 python3 bench/dflash_peer.py --variant compiled --layers 1 5 --target $CKPT \
  --target-mode $TARGET_MODE --steps 10 --warmup 3 --json-out "$OUT/peer.jsonl" 2>&1 | grep -vE "^W[0-9]|Warning" | tail -8
echo "=== peer: done at $(( $(date +%s) - t0 )) s"
python3 - "$RUNS" "$OUT/peer.jsonl" <<'PY' | tee "$OUT/results.md"
import json, statistics, sys
import h5py
runs, peer_path = sys.argv[1:3]
peer = {}
try:
    for line in open(peer_path):
        r = json.loads(line)
        if r["layers"] not in peer or r["median_ms"] < peer[r["layers"]]["median_ms"]:
            peer[r["layers"]] = r
except OSError:
    pass
print("| drafter layers | ours step ms | ours tokens/s | ours peak GiB | peer step ms | peer tokens/s | peer peak GiB | ours / peer |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for L in (1, 5):
    try:
        f = h5py.File(f"{runs}/ours_{L}.h5", "r", swmr=True)
        st = f["steps/step_time_s"][:]
        med = 1e3 * statistics.median(st[5:])
        tps = statistics.median(f["steps/tokens_per_s"][5:])
        peak = max(f["memory/step"][5:]) / 2**30
        ours = f"| {L} | {med:.1f} | {tps:.0f} | {peak:.2f} "
    except (OSError, KeyError, ValueError) as e:
        med, ours = None, f"| {L} | no run ({e.__class__.__name__}) | | "
    p = peer.get(L)
    if p:
        ratio = f"{med / p['median_ms']:.3f}" if med else ""
        print(ours + f"| {p['median_ms']:.1f} ({p['impl']}) | {p['tokens_per_s']:.0f} | {p['peak_gib']} | {ratio} |")
    else:
        print(ours + "| no run | | | |")
PY
echo "=== done at $(( $(date +%s) - t0 )) s"

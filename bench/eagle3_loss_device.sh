#!/usr/bin/env bash
# On the GPU machine, in ONE device call: EAGLE-3's loss through the engine's LM-head op at
# Llama-3.1-8B's shapes (bench/eagle3_llama8b.toml: hidden 4096, draft vocabulary 32000 over a
# trained draft head, target vocabulary 128256, ttt_steps 7, S = 2048, batch 1, bf16, flash_cuda;
# the synthetic "random" target), one run per [loss] variant, side by side:
#   reference  the plain definition: the draft logits, float32 log-softmax, -sum p log q by
#              autograd (the ATen ops EAGLE-3 ran as its own loss before the op took soft labels)
#   chunked    rows in chunks, gradients (rows and head) computed in the forward in ATen
#   fused      one GEMM, the soft-label row kernel (core/cuda/lm_head_ce.cu prob_rows) writing
#              the gradient over the bf16 logits, the two gradient GEMMs
#   device run: command `bash bench/eagle3_loss_device.sh`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600.
# 1. build the engine, the plugins, test_lm_head_loss and test_eagle3 against the machine's torch;
# 2. test_lm_head_loss (every CUDA case: soft labels and the trained head's gradient against the
#    float64 definition, fp32 and bf16) and test_eagle3;
# 3. 30 steps per variant, one process each, nothing else running;
# 4. the table: median step ms over steps 6..30, peak GiB, step-1 loss and its relative
#    difference from reference's, the loss at step 30, the variant each step's loss ran.
# Files under $OUT: eagle3-loss-device.log (this output), build.log, <variant>.log, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/eagle3-loss-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/eagle3-loss-device.log") 2>&1
RUNS=/tmp/eagle3-loss-runs
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins test_lm_head_loss test_eagle3
for t in test_lm_head_loss test_eagle3; do
  echo "=== $t"
  timeout -k 5 120 "$BUILD/bin/$t" 2>&1 |
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|Failure|Expected|Which is|rel" | head -30
done
rm -rf "$RUNS"
for v in reference chunked fused; do
  sed -e "s/^name = .*/name = \"eagle3_loss_$v\"/" bench/eagle3_llama8b.toml > "/tmp/eagle3_loss_$v.toml"
  printf '\n[loss]\nkernels = ["%s"]\n' "$v" >> "/tmp/eagle3_loss_$v.toml"
  timeout -k 5 150 "$BUILD/bin/flashdraft" run "/tmp/eagle3_loss_$v.toml" --out "$RUNS" > "$OUT/$v.log" 2>&1
  echo "=== $v: rc $?"
  grep -E "^error|^loss:|^  [a-z]+: selected|^step +(1|30)/" "$OUT/$v.log" | cut -c1-220 | head -8
done
python3 - "$RUNS" <<'PY' | tee "$OUT/results.md"
import statistics, sys
import h5py
runs = sys.argv[1]
rows, base = [], None
for v in ("reference", "chunked", "fused"):
    try:
        f = h5py.File(f"{runs}/eagle3_loss_{v}.h5", "r", swmr=True)
    except OSError as e:
        print(f"| {v} | no log ({e}) |")
        continue
    st = f["steps/step_time_s"][:]
    if len(st) < 10:
        print(f"| {v} | only {len(st)} steps |")
        continue
    med = 1e3 * statistics.median(st[5:])
    peak = max(f["memory/step"][5:]) / 2**30
    loss = f["steps/loss"][:]
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["kernels/names"][:]]
    ran = sorted({names[i] for i in f["kernels/loss"][:].ravel() if i >= 0})
    if base is None:
        base = (med, peak, loss[0])
    rel = abs(loss[0] - base[2]) / abs(base[2])
    rows.append(f"| {v} | {med:.1f} | {med / base[0]:.3f} | {peak:.2f} | {peak / base[1]:.3f} | {loss[0]:.6f} | "
                f"{rel:.1e} | {loss[-1]:.4f} | {', '.join(ran)} |")
print("| [loss] kernels | median step ms | time / reference | peak GiB | memory / reference | loss step 1 | "
      "rel. diff. from reference | loss step 30 | /kernels/loss |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
print("\n".join(rows))
PY
echo "=== done in $(( $(date +%s) - t0 )) s"

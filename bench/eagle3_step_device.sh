#!/usr/bin/env bash
# On the GPU machine, in ONE device call: the EAGLE-3 drafter step at Llama-3.1-8B's shapes
# (bench/eagle3_llama8b.toml: hidden 4096, 32/8 heads of 128, SwiGLU 14336, target vocabulary
# 128256, draft vocabulary 32000, ttt_steps 7, S = 2048, batch 1, bf16, flash_cuda; synthetic
# "random" target), and its figures as a table for bench/RESULTS.md.
#   device run: command `bash bench/eagle3_step_device.sh`, carry [".deps"], timeout_s 600
#   (.deps: TOML++ unpacked by ../shared/device/fetch-deps.sh; see /work/shared/device/README.md).
#   1. build the engine and plugins against that machine's torch (tests and benchmarks off, -j16);
#   2. `flashdraft validate` (the kernel choice for all 7 unroll calls: 7 distinct problems,
#      Lkv = 2048 .. 14336), then `flashdraft run` for 30 steps;
#   3. one table: median step ms over steps 6..30, tokens/s (step-0 positions that carry loss
#      per second), peak GiB (allocator peak of the measured steps, and by phase), first-step s,
#      the kernel variants each unroll call ran (forward and backward), loss first -> last.
# Files under $OUT: eagle3-step-device.log (this output), build.log, engine.log, results.md.
set -uo pipefail
OUT=${OUT:-/tmp/eagle3-step-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/eagle3-step-device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
RUNS=/tmp/eagle3-runs
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')

# --- 1. build -----------------------------------------------------------------------------------
{
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=OFF -DFLASHDRAFT_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" && cmake --build "$BUILD" -j16
} > "$OUT/build.log" 2>&1
rc=$?
echo "=== build: rc $rc at $(elapsed) s"
if [ $rc -ne 0 ]; then
  grep -B2 -A10 -E "error|Error" "$OUT/build.log" | head -60
  exit 1
fi

# --- 2. validate, then run ----------------------------------------------------------------------
rm -rf "$RUNS"
echo "=== flashdraft validate bench/eagle3_llama8b.toml (at $(elapsed) s)"
timeout -k 5 120 "$BUILD/bin/flashdraft" validate bench/eagle3_llama8b.toml --out "$RUNS" 2>&1 | tee "$OUT/engine.log"
echo "=== flashdraft run bench/eagle3_llama8b.toml (at $(elapsed) s)"
timeout -k 5 400 "$BUILD/bin/flashdraft" run bench/eagle3_llama8b.toml --out "$RUNS" >> "$OUT/engine.log" 2>&1
echo "run rc $? at $(elapsed) s"
grep -vE "^data: generated" "$OUT/engine.log" | tail -40

# --- 3. the table -------------------------------------------------------------------------------
python3 - "$OUT" "$RUNS" "$BUILD" <<'PY'
import os, statistics, subprocess, sys
out, runs, build = sys.argv[1:4]
path = os.path.join(runs, "eagle3_llama8b.h5")
if not os.path.exists(path):
    sys.exit("no run log at " + path + " (see engine.log)")
try:
    import h5py
except ImportError:
    print(subprocess.run([os.path.join(build, "bin", "flashdraft"), "inspect", path], capture_output=True, text=True).stdout)
    sys.exit("h5py absent: the inspect output above has the figures")
f = h5py.File(path, "r", swmr=True)
st = f["steps/step_time_s"][:]
if len(st) == 0:
    sys.exit("no step in the run log")
tps = f["steps/tokens_per_s"][:]
tok = [a * b for a, b in zip(tps, st)]
skip = 5 if len(st) > 7 else 1
med = statistics.median(st[skip:])
mem = {k: f["memory/" + k][:] for k in ("step", "forward", "backward", "optimizer")}
names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["kernels/names"][:]]
fwd, bwd = f["kernels/forward"][:], f["kernels/backward"][:]
acc = f["steps/position_accuracy"][:]
gib = lambda v: float(v) / 2**30
rows = [
    "| case | median step ms | tokens/s | peak GiB | first step s |",
    "| --- | --- | --- | --- | --- |",
    f"| EAGLE-3, Llama-3.1-8B shapes (H 4096, draft vocab 32000, ttt 7, S 2048, B 1, bf16, flash_cuda) | "
    f"{1e3 * med:.1f} | {statistics.median(tok[skip:]) / med:.0f} | {gib(max(mem['step'][skip:])):.2f} | {st[0]:.2f} |",
]
text = "\n".join(rows) + "\n\n"
text += (f"median over steps {skip + 1}..{len(st)} (min {1e3 * min(st[skip:]):.1f} ms); peaks by phase (GiB): "
         + ", ".join(f"{k} {gib(max(v[skip:])):.2f}" for k, v in mem.items() if k != "step")
         + f"; tokens = step-0 positions carrying loss ({statistics.median(tok[skip:]):.0f} per step)\n")
text += f"loss {f['steps/loss'][0]:.4f} -> {f['steps/loss'][-1]:.4f}; per-step accuracy at the last step: " + \
        " ".join(f"{a:.3f}" for a in acc[-1]) + "\n"
text += "kernel variants per unroll call (forward | backward), last step:\n"
for c in range(fwd.shape[1]):
    fn = names[fwd[-1, c]] if fwd[-1, c] >= 0 else "none"
    bn = names[bwd[-1, c]] if bwd[-1, c] >= 0 else "none"
    text += f"  call {c}: {fn} | {bn}\n"
open(os.path.join(out, "results.md"), "w").write(text)
print(text)
PY
echo "=== done at $(elapsed) s"

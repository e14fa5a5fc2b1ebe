#!/usr/bin/env bash
# On the GPU machine, in one call: build the engine and plugins against that machine's
# torch (carry .deps: TOML++ and nlohmann-json unpacked from Debian), make a
# Qwen3-8B-shaped checkpoint with random bf16 weights there (scripts/make-random-checkpoint,
# in parallel with the build), train bench/qwen3_8b_hf_target.toml for 20 steps, and print
# the target's forward time, the drafter's step time and the memory peaks.
set -uo pipefail
OUT=${OUT:-/tmp/hf-target-device}
mkdir -p "$OUT"
rm -rf /tmp/hf-runs  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
exec > >(tee "$OUT/hf-target-device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
for m in transformers safetensors h5py; do python3 -c "import $m; print('$m', $m.__version__)" 2>/dev/null || echo "$m: absent"; done
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset qwen3-8b --out /tmp/qwen3-8b-random --device cuda \
  > "$OUT/checkpoint.log" 2>&1 &
ckpt=$!
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=OFF -DFLASHDRAFT_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" > "$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
cmake --build "$BUILD" -j16 > "$OUT/build.log" 2>&1
rc=$?
echo "=== build: rc $rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$OUT/build.log" | head -50; exit 1; }
wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 "$OUT/checkpoint.log"
echo "=== flashdraft run bench/qwen3_8b_hf_target.toml"
"$BUILD/bin/flashdraft" run bench/qwen3_8b_hf_target.toml --out /tmp/hf-runs > "$OUT/run.log" 2>&1
echo "rc $?"
grep -E "attention|selected|refused|^target|^step +(1|2|10|20)/|^done|error" "$OUT/run.log" | head -30
python3 - /tmp/hf-runs/qwen3_8b_hf_target.h5 <<'PY' || "$BUILD/bin/flashdraft" inspect /tmp/hf-runs/qwen3_8b_hf_target.h5
import sys, statistics
try:
    import h5py
except ImportError:
    raise SystemExit(1)
f = h5py.File(sys.argv[1], "r", swmr=True)
t = f["steps/target_time_s"][:]; s = f["steps/step_time_s"][:]; m = f["memory/step"][:]
print(f"target forward: median {1e3 * statistics.median(t[2:]):.1f} ms (steps 3-20), first {1e3 * t[0]:.1f} ms")
print(f"step (target + drafter fwd/bwd + optimizer): median {1e3 * statistics.median(s[2:]):.1f} ms, first {s[0]:.2f} s")
print(f"drafter step without the target: median {1e3 * statistics.median((s - t)[2:]):.1f} ms")
for ph in ("forward", "backward", "optimizer", "step"):
    print(f"peak {ph}: {f['memory/' + ph][:].max() / 2**30:.2f} GiB")
names = [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]
print("kernels:", sorted(set(names)))
print("loss:", " ".join(f"{x:.3f}" for x in f["steps/loss"][:]))
PY

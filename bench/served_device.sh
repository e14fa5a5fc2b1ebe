#!/usr/bin/env bash
# On the GPU machine, in one call: build the engine, plugins and bench_served against that
# machine's torch (carry .deps), make a Qwen3-8B-shaped checkpoint with random bf16 weights
# there (in parallel with the build), then time one served validation of 64 responses of
# 512 tokens after 512-token prompts with a 5-layer DFlash drafter, against its floor: the
# target's forwards of that validation alone (bench/served.cpp). Greedy, then temperature 1.
set -uo pipefail
OUT=${OUT:-/tmp/served-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/served-device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset qwen3-8b --out /tmp/qwen3-8b-random --device cuda \
  > "$OUT/checkpoint.log" 2>&1 &
ckpt=$!
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=OFF -DFLASHDRAFT_BUILD_BENCH=ON \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" > "$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
cmake --build "$BUILD" -j16 --target flashdraft_cli flashdraft_all_plugins bench_served > "$OUT/build.log" 2>&1
rc=$?
echo "=== build: rc $rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$OUT/build.log" | head -50; exit 1; }
wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 "$OUT/checkpoint.log"
echo "=== greedy"
"$BUILD/bin/bench_served" bench/served_qwen3_8b.toml --responses 64 --prompt 512 --response 512 --warmup 8 2>&1 |
  grep -v "^data:" | tee "$OUT/greedy.md"
echo "=== temperature 1"
sed 's/^served_batch = 64/served_batch = 64\ntemperature = 1.0/' bench/served_qwen3_8b.toml > /tmp/served_t1.toml
"$BUILD/bin/bench_served" /tmp/served_t1.toml --responses 64 --prompt 512 --response 512 --warmup 8 2>&1 |
  grep -E "^\||kernels|target forwards|error" | tee "$OUT/sampled.md"
echo "=== total $(( $(date +%s) - t0 )) s"

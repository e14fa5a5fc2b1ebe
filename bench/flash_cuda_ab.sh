#!/bin/bash
# flash_cuda kernel variants side by side, in ONE device call: builds the tree, checks
# every variant against dense_ref (test_flash_cuda), times each with bench_flash_cuda
# (sm90a configuration), then FlexAttention compiled (default, and as it runs on sm_120
# cards) and SDPA in the same call. Prints one table last.
#
# Device call (project root, carry [".deps"]):
#   AB_ENV=SOME_VARIABLE VARIANTS="a b c" bash bench/flash_cuda_ab.sh
# TEST_TIMEOUT / BENCH_TIMEOUT (s, default 240 / 120) bound each variant's run, so one
# variant that hangs does not take the whole call.
# AB_CONFIGS (default sm90a): the configurations each variant is timed in, e.g. sm90a,sm120;
# TEST_VARIANTS (default VARIANTS): the variants test_flash_cuda runs under.
# TAIL=1 also builds check_flash_cuda and prints its tail table (SM idle per kernel, for
# each CTA order) into $OUT/tail.md.
# Each variant runs with AB_ENV set to it (a switch the kernel code under study reads);
# without AB_ENV, one variant "main": the code as it is.
set -uo pipefail
OUT=${OUT:-/tmp/flash_cuda_ab}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
X=/tmp/flash_cuda_ab_xchg
rm -rf "$X"; mkdir -p "$X"
export PYTHONUNBUFFERED=1
AB_ENV=${AB_ENV:-FLASHDRAFT_AB_UNUSED}
VARIANTS=${VARIANTS:-main}
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
step "configure + build"
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" \
  > "$X/configure.log" 2>&1 || { tail -40 "$X/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
cmake --build "$BUILD" -j16 -- -k > "$X/build.log" 2>&1 || {
  grep -B3 -A12 -E "error" "$X/build.log" | head -60; echo "BUILD FAILED"; }
tail -2 "$X/build.log"

export FLASHDRAFT_EXPECT_SM90A=1
for v in ${TEST_VARIANTS:-$VARIANTS}; do
  step "test_flash_cuda, $AB_ENV=$v"
  ( cd "$BUILD" && env "$AB_ENV=$v" timeout ${TEST_TIMEOUT:-240} ./bin/test_flash_cuda ) > "$X/test_$v.log" 2>&1
  echo "rc $?"
  grep -E "^\[ *(FAILED|PASSED) *\]|Failure" "$X/test_$v.log" | head -8
done
ROWS=$X/rows.md
: > "$ROWS"
for v in $VARIANTS; do
  step "bench_flash_cuda ${AB_CONFIGS:-sm90a}, $AB_ENV=$v"
  env "$AB_ENV=$v" FLASHDRAFT_BENCH_CONFIGS=${AB_CONFIGS:-sm90a} timeout ${BENCH_TIMEOUT:-120} "$BUILD/bin/bench_flash_cuda" table "$X/r_$v.md" "$X" \
    > "$X/bench_$v.log" 2>&1 || tail -5 "$X/bench_$v.log"
  sed "s/| flash_cuda \(sm[0-9a]*\) /| flash_cuda \1 [$v] /" "$X/r_$v.md" >> "$ROWS"
done
if [ "${TAIL:-0}" = 1 ]; then
  step "check_flash_cuda tail: SM occupancy per kernel, CTA orders grid / longest-first"
  cmake --build "$BUILD" --target check_flash_cuda -j16 > "$X/build_check.log" 2>&1 || tail -20 "$X/build_check.log"
  timeout ${TAIL_TIMEOUT:-150} "$BUILD/bin/check_flash_cuda" tail 2>&1 | tee "$OUT/tail.md"
fi
case ",${AB_CONFIGS:-sm90a}," in
  *,sm120,*) ;;  # already timed per variant
  *) step "bench_flash_cuda sm120 configuration"
     FLASHDRAFT_BENCH_CONFIGS=sm120 "$BUILD/bin/bench_flash_cuda" table "$ROWS" "$X" > "$X/bench_sm120.log" 2>&1 || tail -5 "$X/bench_sm120.log" ;;
esac
if [ "${SKIP_FLEX:-0}" != 1 ]; then
  step "flex_attention compiled, SDPA"
  timeout 200 python3 bench/flex_reference.py bench "$X" "$ROWS" 2>&1 | grep -v -i warn
  step "flex_attention as on sm_120"
  timeout 200 python3 bench/flex_reference.py bench-sm120 "$X" "$ROWS" 2>&1 | grep -v -i warn
fi
step "table"
{
  echo "| case | implementation | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | peak GiB |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
  sort -s -t'|' -k2,2 "$ROWS"
} | tee "$OUT/table.md"

#!/bin/bash
# One device call: (build if no binary was carried), list the ELF targets, run the
# correctness check and the benchmark; logs under $OUT. Usage from the repo root:
#   kernels/flash_cuda/run_device.sh [build-dir]      (default build-flash)
set -o pipefail
B=${1:-build-flash}
OUT=${OUT:-/tmp/flash_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
if [ ! -x "$B/check_flash_cuda" ]; then
  kernels/flash_cuda/build.sh "$B" || exit 1
  cp "$B/ptxas.log" "$OUT/ptxas.log"
fi
cuobjdump --list-elf "$B/check_flash_cuda" | grep -c flash_ | sed 's/^/elf images: /'
cuobjdump --list-elf "$B/check_flash_cuda" | sed 's/.*\.\(sm_[0-9]*\)\..*/\1/' | sort | uniq -c
timeout 240 "$B/check_flash_cuda" check > "$OUT/check.log" 2>&1; echo "check rc=$?"
grep -E "FAIL|PASSED|FAILED|device|seed|negative" "$OUT/check.log" | head -60
timeout 200 "$B/check_flash_cuda" bench > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
cat "$OUT/bench.log"

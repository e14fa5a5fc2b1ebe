#!/bin/bash
# Builds check_flash_cuda (SASS for sm_80, sm_90, sm_120 + compute_120 PTX; flash_sm90a.cu for sm_90a) into $1 (default build-flash,
# relative to the caller's directory).
# The ptxas resource report goes to $1/ptxas.log; its table (ptxas_report.py) is printed last.
set -e
OUTDIR=${1:-build-flash}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)   # absolute, before changing directory
cd "$(dirname "$0")"
# FLASH_ARCH replaces the list (e.g. "-gencode arch=compute_90,code=sm_90" for a quick H200-only A/B build).
ARCH=${FLASH_ARCH:-"-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_120,code=sm_120 -gencode arch=compute_120,code=compute_120"}
FLAGS="-O3 -std=c++17 -lineinfo $ARCH -Xptxas -v"
pids=()
for f in flash_attention flash_forward flash_backward flash_schedule check_flash_cuda; do
  nvcc $FLAGS -c $f.cu -o "$OUTDIR/$f.o" > "$OUTDIR/$f.ptxas.log" 2>&1 &
  pids+=($!)
done
# the Hopper (wgmma) backward: sm_90a only
nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90a,code=sm_90a -Xptxas -v -c flash_sm90a.cu \
  -o "$OUTDIR/flash_sm90a.o" > "$OUTDIR/flash_sm90a.ptxas.log" 2>&1 &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait $p || rc=1; done
cat "$OUTDIR"/*.ptxas.log > "$OUTDIR/ptxas.log"
if [ $rc -ne 0 ]; then grep -B2 -A5 -i error "$OUTDIR/ptxas.log" | head -50; exit 1; fi
nvcc $ARCH -gencode arch=compute_90a,code=sm_90a "$OUTDIR"/flash_attention.o "$OUTDIR"/flash_forward.o \
  "$OUTDIR"/flash_backward.o "$OUTDIR"/flash_schedule.o "$OUTDIR"/flash_sm90a.o "$OUTDIR"/check_flash_cuda.o -o "$OUTDIR/check_flash_cuda"
echo "built $OUTDIR/check_flash_cuda"
# registers and spills of the attention kernels, the ones that spill first
python3 ptxas_report.py "$OUTDIR/ptxas.log" flash_ ws_ wg_ | head -24 || true

#!/usr/bin/env bash
# Data-parallel scaling on the GPU machine (2 GPUs, NCCL), in one call: build the engine and
# plugins against that machine's torch (carry .deps: TOML++ and nlohmann-json unpacked from
# Debian), then train bench/distributed_qwen3_8b.toml (DFlash drafter of Qwen3-8B, synthetic
# target) on 1 GPU and on 2 GPUs (torchrun), and print
#   - tokens/s per GPU for 1 and 2 GPUs and the scaling efficiency against linear,
#   - that the weights are identical on both ranks after every step (ranks/weights_* columns),
#   - the kernel variants (flash_cuda) each rank ran, from ranks/kernels_*.
# NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes ask.
set -uo pipefail
OUT=${OUT:-/tmp/distributed-device}
mkdir -p "$OUT"
rm -rf /tmp/dp-1gpu /tmp/dp-2gpu  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
exec > >(tee "$OUT/distributed-device.log") 2>&1
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
EXP=bench/distributed_qwen3_8b.toml
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version(), "GPUs", torch.cuda.device_count())'
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
t0=$(date +%s)
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=OFF -DFLASHDRAFT_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$ROOT/.deps/usr" > "$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
grep -E "NCCL|nccl" "$OUT/configure.log"
cmake --build "$BUILD" -j16 > "$OUT/build.log" 2>&1
rc=$?
echo "=== build: rc $rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$OUT/build.log" | head -50; exit 1; }

echo "=== 1 GPU"
"$BUILD/bin/flashdraft" run $EXP --out /tmp/dp-1gpu > "$OUT/run-1gpu.log" 2>&1
echo "rc $?"; grep -E "selected|refused|^step +(1|20)/|^done|error" "$OUT/run-1gpu.log" | head -12
echo "=== 2 GPUs (torchrun)"
python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29533 --no-python \
  "$BUILD/bin/flashdraft" run $EXP --out /tmp/dp-2gpu > "$OUT/run-2gpu.log" 2>&1
echo "rc $?"; grep -E "distributed:|weights:|selected|refused|^step +(1|20)/|^done|error" "$OUT/run-2gpu.log" | head -16

python3 - /tmp/dp-1gpu/distributed_qwen3_8b.h5 /tmp/dp-2gpu/distributed_qwen3_8b.h5 <<'PY'
import statistics, sys
import h5py
import numpy as np

def names(f):
    return [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]

rates = {}
for gpus, path in ((1, sys.argv[1]), (2, sys.argv[2])):
    try:
        f = h5py.File(path, "r", swmr=True)
    except OSError as e:
        print(f"{gpus} GPU(s): no log ({e})"); continue
    tps = f["steps/tokens_per_s"][:]  # loss-carrying tokens of every rank per second
    rates[gpus] = statistics.median(tps[2:]) / gpus
    print(f"{gpus} GPU(s): {len(tps)} steps, median step {1e3 * statistics.median(f['steps/step_time_s'][2:]):.1f} ms, "
          f"{rates[gpus]:.0f} tokens/s per GPU (steps 3..), peak {f['memory/step'][:].max() / 2**30:.2f} GiB, "
          f"loss {f['steps/loss'][0]:.3f} -> {f['steps/loss'][-1]:.3f}")
    if "ranks/weights_sum" in f:
        s, q = f["ranks/weights_sum"][:], f["ranks/weights_sumsq"][:]
        same = bool((s == s[:, :1]).all() and (q == q[:, :1]).all())
        print(f"  weights identical on every rank after every step: {same} (last checksum {s[-1].tolist()})")
        n = names(f)
        layers = f["kernels/forward"].shape[1]
        for phase in ("forward", "backward"):
            ids = f[f"ranks/kernels_{phase}"][:].reshape(len(tps), -1, layers + 1)  # + the loss column
            for r in range(ids.shape[1]):
                print(f"  rank {r} {phase}: {sorted({n[i] for i in ids[:, r].ravel() if i >= 0})}")
        print("  per-rank step time (median, ms):", np.round(1e3 * np.median(f["ranks/step_time_s"][2:], 0), 1).tolist())
        print("  per-rank peak (GiB):", np.round(f["ranks/memory_step"][:].max(0) / 2**30, 2).tolist())
        ev = [(int(s), k.decode(), m.decode()[:160]) for s, k, m in
              zip(f["events/step"][:], f["events/kind"][:], f["events/message"][:]) if k.decode() != "checkpoint"]
        print("  events:", ev)
if 1 in rates and 2 in rates:
    print(f"| GPUs | tokens/s per GPU | efficiency vs linear |")
    print("| --- | --- | --- |")
    print(f"| 1 | {rates[1]:.0f} | 100% |")
    print(f"| 2 | {rates[2]:.0f} | {100 * rates[2] / rates[1]:.1f}% |")
PY

#!/usr/bin/env bash
# On the GPU machine, in one call: the tests that need a CUDA device and are not part of `make test` here
# (this machine has no GPU): test_cuda_ops (every fused kernel against ATen's ops or a float64 definition, on
# fresh random inputs) and the bf16 CUDA comparisons of tests/python/test_hf_target.py (ours on flash_cuda and
# transformers' own bf16 forward, each against transformers in fp32), for the families that K selects.
#   device run: command `K="granite or cohere" bash bench/cuda_tests_device.sh`, carry [".deps", "build-device"]
#   after `scripts/stage-device-build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops` here.
# K: a pytest -k expression over the families (default: every family); OPS=0 leaves out test_cuda_ops;
# PYTEST_TIMEOUT: seconds for the pytest run (default 420).
set -uo pipefail
K=${K:-}
OUT=${OUT:-/tmp/cuda-tests-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/cuda-tests-device.log") 2>&1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
t0=$(date +%s)
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops
if [ "${OPS:-1}" != 0 ]; then
  echo "=== test_cuda_ops ($(( $(date +%s) - t0 )) s)"
  "$BUILD/bin/test_cuda_ops" > "$OUT/test_cuda_ops.log" 2>&1
  echo "rc $?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|Failure|Expected|Which is" "$OUT/test_cuda_ops.log" | head -30
fi
filter="cuda"
[ -z "$K" ] || filter="cuda and ($K)"
echo "=== pytest tests/python/test_hf_target.py -k '$filter' ($(( $(date +%s) - t0 )) s)"
if python3 -c 'import pytest' 2>/dev/null; then
  FLASHDRAFT_BINARY_DIR=$BUILD timeout -k 5 "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -s -p no:cacheprovider \
    tests/python/test_hf_target.py -k "$filter" > "$OUT/pytest.log" 2>&1
  echo "rc $?"
  grep -E " row |passed|failed|error|Error|assert|kernels " "$OUT/pytest.log" | head -150
else
  echo "pytest is not installed here: skipped"
fi
echo "=== done ($(( $(date +%s) - t0 )) s)"

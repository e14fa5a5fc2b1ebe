#!/usr/bin/env bash
# On the GPU machine (sm_90), in one call: the engine's gate / up product with SwiGLU in its epilogue
# (core/cuda/gemm_sm90a.cu) against cuBLAS's product and the separate pass, at Qwen3-8B's shape,
# under each launch setting below (bench_gemm_swiglu: the check on random inputs, then the three
# ways alternating); then test_flash_cuda and test_cuda_ops (the kernel's test among them), and the
# target's forward in the training step with the fastest setting (bench/target_forward_device.sh,
# VARIANTS="engine engine_swiglu1": cuBLAS's product and the pass, then the kernel, side by side).
#   device run: command `bash bench/gemm_swiglu_device.sh`, carry [".deps", "build-device"] after
#   scripts/stage-device-build here with bench_gemm_swiglu and test_flash_cuda among the targets.
#   SETTINGS="name|VAR=v VAR=v;..." replaces the settings; STEP=0 leaves out the training step;
#   ROUNDS=n alternating rounds of the bench (10).
set -uo pipefail
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins test_cuda_ops test_flash_cuda bench_gemm_swiglu target_states
nvidia-smi --query-gpu=name --format=csv,noheader
date -u +%H:%M
SETTINGS=${SETTINGS:-"persistent|;groups of 24 row blocks|FLASHDRAFT_GEMM_GROUP_M=24;a CTA a tile|FLASHDRAFT_GEMM_PERSISTENT=0;clusters of 2|FLASHDRAFT_GEMM_CLUSTER=2;clusters of 2, 120 CTAs|FLASHDRAFT_GEMM_CLUSTER=2 FLASHDRAFT_GEMM_CTAS=120;clusters of 2, a cluster a tile|FLASHDRAFT_GEMM_CLUSTER=2 FLASHDRAFT_GEMM_PERSISTENT=0"}
best="" best_us=""
echo "| setting | fused us | cuBLAS + pass us | fused / cuBLAS + pass | cuBLAS product alone us |"
echo "| --- | --- | --- | --- | --- |"
IFS=';' read -ra items <<< "$SETTINGS"
for item in "${items[@]}"; do
  name=${item%%|*} vars=${item#*|}
  env $vars FLASHDRAFT_GEMM_INFO=1 timeout 60 "$BUILD/bin/bench_gemm_swiglu" 3072 4096 12288 "${ROUNDS:-10}" > /tmp/gemm_swiglu.log 2>&1
  rc=$?
  grep -E "^gate_up_swiglu:|FAILED" /tmp/gemm_swiglu.log | head -2 | sed 's/^/    /'
  fused=$(grep "^| fused" /tmp/gemm_swiglu.log | awk -F'|' '{print $3+0}')
  pass=$(grep "^| cuBLAS + swiglu" /tmp/gemm_swiglu.log | awk -F'|' '{print $3+0}')
  alone=$(grep "^| cuBLAS product alone" /tmp/gemm_swiglu.log | awk -F'|' '{print $3+0}')
  if [ $rc -ne 0 ] || [ -z "$fused" ]; then
    echo "| $name | rc $rc | | | |"
    continue
  fi
  echo "| $name | $fused | $pass | $(python3 -c "print(f'{$fused / $pass:.3f}')") | $alone |"
  if [ -z "$best_us" ] || python3 -c "import sys; sys.exit(0 if $fused < $best_us else 1)"; then
    best=$vars best_us=$fused
  fi
done
grep -E "^check" /tmp/gemm_swiglu.log
echo "fastest: \"${best:-the defaults}\" ($best_us us)"
echo "=== test_flash_cuda"
timeout 120 "$BUILD/bin/test_flash_cuda" > /tmp/test_flash_cuda.log 2>&1
echo "rc $?"; grep -E "^\[  (PASSED|FAILED) " /tmp/test_flash_cuda.log
[ "${STEP:-1}" = 0 ] && exit 0
# the training step with the fastest setting (its variables reach every run of the script)
env $best VARIANTS="engine engine_swiglu1" timeout 330 bash bench/target_forward_device.sh 2>&1 |
  grep -E "=== test_cuda_ops|^rc |PASSED|FAILED|linear_swiglu|^layer|^\| |^matmul|^products|^the issue|^  engine|transformers (eager|torch.compile):|^  ours|=== done"
grep -E "linear_swiglu" /tmp/test_cuda_ops.log

#!/usr/bin/env bash
# On the GPU machine, in one call: the online target as a mixture of experts, at Qwen3-30B-A3B's
# shapes (the default; bench/qwen3_30b_a3b_hf_target.toml: 12 of its 48 layers, so that the random
# checkpoint, ~16 GiB, fits the machine's disk; the drafter reads layers 1, 4, 7, 10, so 11 layers
# run; S = 3072) or, with MOE=mixtral-8x7b, at Mixtral-8x7B's (bench/mixtral_8x7b_hf_target.toml: 4
# of its 32 layers, ~11 GiB; the drafter reads layers 0 and 2, so 3 layers run; S = 3072) or, with
# MOE=glm-4.5-air, at GLM-4.5-Air's (bench/glm_4_5_air_hf_target.toml: 4 of its 46 layers, ~14 GiB;
# layers 1 and 2 read, 3 run; S = 3072) or, with MOE=qwen2-57b-a14b, at Qwen2-57B-A14B's
# (bench/qwen2_57b_a14b_hf_target.toml: 4 of its 28 layers, ~17 GiB; layers 0 and 2 read, 3 run) or, with
# MOE=gpt-oss-20b, at gpt-oss-20b's (bench/gpt_oss_20b_hf_target.toml: 4 of its 24 layers, bf16 experts,
# ~9 GiB; layers 1 and 2 read, 3 run; transformers runs gpt-oss with its eager attention, which has the
# sinks, not SDPA, which has none: the reference and the peer use it) or, not a mixture of experts, with
# MOE=qwen3.5-27b at Qwen3.5-27B's (hybrid: bench/qwen3_5_27b_hf_target.toml, 4 of its 64 layers, ~7.6 GiB:
# Gated DeltaNet layers 0-2, attention layer 3 of heads of 256 (flash_cuda's forward-only variant); layers 1 and 3
# read, 4 run; transformers' Gated DeltaNet is its torch path there,
# flash-linear-attention not being installed), or with MOE=gemma-3-27b at Gemma 3 27B's (bench/gemma_3_27b_hf_target.toml:
# 6 of its 62 layers, sliding layers 0-4 and full layer 5; layers 1 and 5 read, 6 run), or with MOE=minimax-m2 at
# MiniMax-M2's (bench/minimax_m2_hf_target.toml: 3 of its 62 layers, ~24 GiB; layers 1 and 2 read, 3 run), or with
# MOE=granite-4.0-h-small at Granite-4.0-H-Small's (hybrid: bench/granite_4_0_h_small_hf_target.toml, 6 of its 40
# layers, ~9 GiB: Mamba-2 layers 0-4, attention layer 5; layers 1 and 5 read, 6 run; transformers' Mamba-2 is its torch
# path there, mamba_ssm and causal_conv1d not being installed), or with MOE=nemotron-3-nano at
# NVIDIA-Nemotron-3-Nano-30B-A3B's (bench/nemotron_3_nano_hf_target.toml, 6 of its 52 blocks, ~6.4 GiB: M E M E M *;
# blocks 1 and 5 read, 6 run).
#   device run: command `bash bench/moe_target_device.sh` (or `MOE=mixtral-8x7b bash ...`), carry
#   [".deps", "build-device"] after
#   `scripts/stage-device-build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops` here,
#   timeout_s 600.
# 1. the checkpoint (scripts/make-random-checkpoint --preset $MOE --layers N) while the build is
#    checked and test_cuda_ops runs (combine_experts against ATen's ops among its cases);
# 2. the bf16 CUDA case of tests/python/test_hf_target.py for the mixture of experts (a tiny
#    random one of the same family, flash_cuda; skipped with a line where pytest is absent);
# 3. the hidden states at the real shape: tests/tools/target_states on 3072 random tokens, the
#    layers the drafter reads, [target] kernels "engine" and "aten", against transformers' own bf16
#    forward (SDPA), next to transformers' eager attention against the same (the noise of bf16
#    itself, routing ties included);
# 4. our training step for 24 steps with [target] kernels = "engine" (steps 10-12 profiled) and "aten":
#    median target forward ms over steps 14-24, step ms, peak GiB; with SSD_AB=1 (the Mamba-2 families) also
#    "engine_ssd_apart": the engine's path with the Mamba-2 rule on ATen's ops (FLASHDRAFT_SSD=0), in the same call;
# 5. transformers' model (bf16, SDPA, output_hidden_states, inference mode, the layers ours runs,
#    its default experts implementation): eager, then torch.compile, median forward ms;
# 6. ours with the engine's kernels once more (after transformers: the spread of one version).
# QUICK=1 leaves out the "aten" run and the second engine run (a call with little device time left); TESTS=0 leaves
# out steps 1's test_cuda_ops and 2; PEER_COMPILE=0 leaves out transformers' torch.compile (its first call takes
# minutes at some shapes).
# ADDS_APART=1 adds a third states comparison: the engine's path with each residual add in the norm after it
# (FLASHDRAFT_GEMM_ADD=0), against transformers, the engine's path and the aten one.
set -uo pipefail
QUICK=${QUICK:-0}
MOE=${MOE:-qwen3-30b-a3b}
case $MOE in
  qwen3-30b-a3b) CKPT_LAYERS=12 LAYERS=1,4,7,10 RUN=11 VOCAB=151936 FAMILY=qwen3_moe \
                 TOML=bench/qwen3_30b_a3b_hf_target.toml ;;
  mixtral-8x7b) CKPT_LAYERS=4 LAYERS=0,2 RUN=3 VOCAB=32000 FAMILY=mixtral TOML=bench/mixtral_8x7b_hf_target.toml ;;
  qwen2-57b-a14b) CKPT_LAYERS=4 LAYERS=0,2 RUN=3 VOCAB=151936 FAMILY=qwen2_moe \
                  TOML=bench/qwen2_57b_a14b_hf_target.toml ;;
  glm-4.5-air) CKPT_LAYERS=4 LAYERS=1,2 RUN=3 VOCAB=151552 FAMILY=glm4_moe TOML=bench/glm_4_5_air_hf_target.toml ;;
  gpt-oss-20b) CKPT_LAYERS=4 LAYERS=1,2 RUN=3 VOCAB=201088 FAMILY=gpt_oss TOML=bench/gpt_oss_20b_hf_target.toml \
               PEER_ATTN=eager ;;
  qwen3.5-27b) CKPT_LAYERS=4 LAYERS=1,3 RUN=4 VOCAB=248320 FAMILY=qwen3_5 TOML=bench/qwen3_5_27b_hf_target.toml ;;
  gemma-3-27b) CKPT_LAYERS=6 LAYERS=1,5 RUN=6 VOCAB=262208 FAMILY=gemma3 TOML=bench/gemma_3_27b_hf_target.toml ;;
  minimax-m2) CKPT_LAYERS=3 LAYERS=1,2 RUN=3 VOCAB=200064 FAMILY=minimax_m2 TOML=bench/minimax_m2_hf_target.toml ;;
  granite-4.0-h-small) CKPT_LAYERS=6 LAYERS=1,5 RUN=6 VOCAB=100352 FAMILY=granite4_h \
                       TOML=bench/granite_4_0_h_small_hf_target.toml ;;
  nemotron-3-nano) CKPT_LAYERS=6 LAYERS=1,5 RUN=6 VOCAB=131072 FAMILY=nemotron_h TOML=bench/nemotron_3_nano_hf_target.toml ;;
  *) echo "MOE=$MOE: accepted qwen3-30b-a3b, qwen2-57b-a14b, mixtral-8x7b, glm-4.5-air, gpt-oss-20b, qwen3.5-27b," \
       "gemma-3-27b, minimax-m2, granite-4.0-h-small or nemotron-3-nano" >&2
     exit 2 ;;
esac
PEER_ATTN=${PEER_ATTN:-sdpa}  # transformers' attention for the reference states and the peer's timing
TKERN=${TKERN:-flash_cuda}    # the kernel of our target's attention in the states comparison
OUT=${OUT:-/tmp/moe-target-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/moe-target-device.log") 2>&1
CKPT=/tmp/$MOE-random
rm -rf /tmp/moe-runs  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
echo "MOE=$MOE: $CKPT_LAYERS layers in the checkpoint, layers $LAYERS read, $RUN run, $TOML"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
t0=$(date +%s)
python3 scripts/make-random-checkpoint --preset $MOE --layers $CKPT_LAYERS --out $CKPT --device cuda \
  > /tmp/checkpoint.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops
if [ "${TESTS:-1}" = 0 ]; then
  echo "=== TESTS=0: test_cuda_ops and the CUDA states test left out"
else
echo "=== test_cuda_ops ($(( $(date +%s) - t0 )) s)"
"$BUILD/bin/test_cuda_ops" > /tmp/test_cuda_ops.log 2>&1
echo "rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" /tmp/test_cuda_ops.log | head -20
grep -E "combine_experts" /tmp/test_cuda_ops.log | head -30
grep -E "float32 weight|qkv_rope R .* q$" /tmp/test_cuda_ops.log | grep -E "BFloat16 H 4096|BFloat16 H 1100" | head -16
grep -E "^BFloat16 I .*clamped_glu" /tmp/test_cuda_ops.log | head -10
echo "=== tests/python/test_hf_target.py -k 'cuda and $FAMILY' ($(( $(date +%s) - t0 )) s)"
if python3 -c 'import pytest' 2>/dev/null; then
  FLASHDRAFT_BINARY_DIR=$BUILD timeout -k 5 150 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_hf_target.py \
    -k "cuda and $FAMILY" > /tmp/pytest.log 2>&1
  echo "rc $?"
  grep -E "passed|failed|error|$FAMILY row|adds in the products|Error|assert" /tmp/pytest.log | head -24
else
  echo "pytest is not installed here: skipped"
fi
fi
wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 /tmp/checkpoint.log

echo "=== hidden states at the real shape against transformers"
timeout -k 5 200 python3 - "$BUILD" "$CKPT" "$LAYERS" "$VOCAB" "$PEER_ATTN" "$TKERN" <<'PY' | tee "$OUT/states.txt"
import subprocess, sys, torch
from safetensors.torch import save_file, load_file
build, ckpt, layer_list, vocab, peer_attn, kernel = sys.argv[1:7]
layers = [int(x) for x in layer_list.split(",")]
torch.manual_seed(0)
tokens = torch.randint(0, int(vocab), (1, 3072))
save_file({"tokens": tokens, "lengths": torch.tensor([3072])}, "/tmp/states_in.safetensors")
ours = {}
import os
# (ADDS_APART=1: the engine's path once more with each residual add in the norm after it, FLASHDRAFT_GEMM_ADD=0)
variants = ("engine", "aten", *(("engine_adds_apart",) if os.environ.get("ADDS_APART") == "1" else ()))
for k in variants:
    env = {**os.environ, "FLASHDRAFT_GEMM_ADD": "0"} if k == "engine_adds_apart" else None
    p = subprocess.run([f"{build}/bin/target_states", "hf", ckpt, "/tmp/states_in.safetensors", f"/tmp/states_{k}.safetensors",
                        layer_list, kernel, "bfloat16", "cuda", k.split("_")[0]], capture_output=True, text=True, env=env)
    print(k, "rc", p.returncode, p.stdout.strip().splitlines()[-2:] if p.returncode == 0 else p.stderr.strip()[-300:])
    ours[k] = load_file(f"/tmp/states_{k}.safetensors")["hidden"]
from bench.device_common import rel, transformers_states
# (the noise of bf16: transformers' eager attention against its SDPA; gpt-oss has only the eager one)
impls = ("sdpa", "eager") if peer_attn == "sdpa" else (peer_attn,)
import json, os
made = json.load(open(os.path.join(ckpt, "config.json")))["num_hidden_layers"]
# (one past the deepest layer read, within the layers made: reading the last, both sides give it after the final norm)
states = transformers_states(ckpt, tokens, layers, min(max(layers) + 2, made), impls=impls)
print(f"relative to transformers ({peer_attn}, bf16): max |diff| / max |ref|, mean |diff| / mean |ref|")
for i, L in enumerate(layers):
    ref = states[peer_attn][i]
    if len(impls) == 1:
        print(f"layer {L}: ours engine {rel(ours['engine'][0, :, i], ref)}; ours aten {rel(ours['aten'][0, :, i], ref)}; "
              f"ours engine against ours aten {rel(ours['engine'][0, :, i], ours['aten'][0, :, i])}")
        continue
    print(f"layer {L}: ours engine {rel(ours['engine'][0, :, i], ref)}; ours aten {rel(ours['aten'][0, :, i], ref)}; "
          f"transformers eager attention {rel(states['eager'][i], ref)}")
for i, L in enumerate(layers):
    if "engine_adds_apart" in ours:
        print(f"layer {L}: ours engine, adds apart {rel(ours['engine_adds_apart'][0, :, i], states[peer_attn][i])}; "
              f"against ours engine {rel(ours['engine_adds_apart'][0, :, i], ours['engine'][0, :, i])}, "
              f"against ours aten {rel(ours['engine_adds_apart'][0, :, i], ours['aten'][0, :, i])}")
PY

# One training run of ours: engine (the engine's kernels; steps 10-12 under --profile: the GPU time
# of the target's forward by kernel), aten (transformers' separate ATen ops for the norms, RoPE,
# SwiGLU and the experts' weighted sum), engine_again after transformers (the spread of one version).
run_ours() {
  local k=$1 kern=aten prof="" ssd=1
  case $k in engine*) kern=engine ;; esac
  [ $k = engine ] && prof="--profile 10:13"
  [ $k = engine_ssd_apart ] && ssd=0  # the Mamba-2 rule on ATen's ops, the rest on the engine's path
  sed -e "s|^path = .*|path = \"$CKPT\"\nkernels = \"$kern\"|" -e "s/^name = .*/name = \"moe_$k\"/" \
    $TOML > /tmp/moe_$k.toml
  FLASHDRAFT_SSD=$ssd timeout -k 5 150 "$BUILD/bin/flashdraft" run /tmp/moe_$k.toml --out /tmp/moe-runs $prof \
    > /tmp/run_$k.log 2>&1
  echo "=== ours, [target] kernels = $k: rc $? ($(( $(date +%s) - t0 )) s)"
  grep -E "^target:|^error|^warning" /tmp/run_$k.log | head -3
  grep -A12 "^ *target_forward " /tmp/run_$k.log | head -13
  python3 - /tmp/moe-runs/moe_$k.h5 $k <<'PY' | tee -a "$OUT/ours.txt"
import statistics, sys, h5py
f = h5py.File(sys.argv[1], "r")
t, s = f["steps/target_time_s"][:], f["steps/step_time_s"][:]
print(f"ours {sys.argv[2]}: target forward median {1e3 * statistics.median(t[13:]):.1f} ms (steps 14-24), step "
      f"{1e3 * statistics.median(s[13:]):.1f} ms, peak {f['memory/step'][:].max() / 2**30:.2f} GiB, loss "
      f"{f['steps/loss'][0]:.3f} -> {f['steps/loss'][-1]:.3f}")
PY
}
run_ours engine
[ "${SSD_AB:-0}" = 1 ] && run_ours engine_ssd_apart  # (the Mamba-2 families: the rule's kernels against ATen's ops)
[ "$QUICK" = 1 ] || run_ours aten

echo "=== transformers' forward ($RUN layers, bf16, $PEER_ATTN, output_hidden_states, inference mode) ($(( $(date +%s) - t0 )) s)"
timeout -k 5 240 python3 - "$CKPT" "$RUN" "$VOCAB" "$PEER_ATTN" "${PEER_COMPILE:-1}" <<'PY' | tee "$OUT/peer.txt"
import sys, time, torch, transformers
from bench.device_common import timed
model = transformers.AutoModel.from_pretrained(sys.argv[1], dtype=torch.bfloat16, attn_implementation=sys.argv[4],
                                               num_hidden_layers=int(sys.argv[2])).cuda().eval()
tokens = torch.randint(0, int(sys.argv[3]), (1, 3072), device="cuda")
with torch.inference_mode():
    f = lambda: model(input_ids=tokens, output_hidden_states=True)
    print(f"transformers eager: {timed(f):.2f} ms (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
    if sys.argv[5] == "0":
        sys.exit(0)
    compiled = torch.compile(model)
    t = time.time()
    g = lambda: compiled(input_ids=tokens, output_hidden_states=True)
    g()
    print(f"torch.compile first call {time.time() - t:.1f} s", flush=True)
    print(f"transformers torch.compile: {timed(g):.2f} ms", flush=True)
PY
echo "peer rc $? ($(( $(date +%s) - t0 )) s)"
[ "$QUICK" = 1 ] || run_ours engine_again

#!/usr/bin/env bash
# On the GPU machine, in one call: the online target's forward against its matmul floor and
# against transformers, at the shapes of bench/qwen3_8b_hf_target.toml (a Qwen3-8B-shaped
# checkpoint with random bf16 weights made here; the 1-layer DFlash drafter reads layers
# 1, 9, 17, 25, 33 and learns the data's tokens (labels = "data"), so 34 of the 36 decoder layers
# run; S = 3072, B = 1).
#   device run: command `bash bench/target_forward_device.sh`, carry [".deps", "build-device"] after scripts/stage-device-build here (or [".deps"]: built there), timeout_s 600.
#   VARIANTS="engine" (ours with the engine's kernels only, then transformers and ours again: ~200 s
#   instead of ~290) leaves out the side-by-side runs of step 4.
# 1. build the engine, the plugins, test_cuda_ops and tests/tools/target_states; make the
#    checkpoint meanwhile;
# 2. test_cuda_ops' frozen-layer case (the fused norm / q-k-v RoPE / SwiGLU kernels against
#    transformers' ATen ops on random inputs) and the other fused-op cases;
# 3. the matmul floor: the four products of one layer at their shapes (bf16, cuBLAS through
#    torch), median of 20, times 34 layers;
# 4. our training step for 24 steps with [target] kernels = "engine", the same without programmatic
#    dependent launch (FLASHDRAFT_PDL=0), the same with the residual adds outside the matrix products
#    (FLASHDRAFT_GEMM_ADD=0) and kernels = "aten" (each its own process; VARIANTS may add
#    engine_swiglu1: the gate / up product with SwiGLU in its epilogue, FLASHDRAFT_GEMM_SWIGLU=1, sm_90;
#    steps 11-13 of the engine's under --profile, its per-family GPU time): median
#    target forward ms over steps 14-24, step ms, peak GiB;
# 5. the hidden states at the real shape (tests/tools/target_states on 3072 random tokens,
#    layers 1, 9, 17, 25, 33) with both kernel settings against transformers' own bf16 forward
#    (SDPA), next to transformers' eager attention against the same (the noise of bf16 itself);
# 6. transformers' model (bf16, SDPA, output_hidden_states, inference mode, 34 layers): eager,
#    then torch.compile, median forward ms;
# 7. ours with the engine's kernels once more (after transformers: the spread of one version);
# 8. the table, each run's forward per step, and the card's SM clock / power in each phase.
set -uo pipefail
OUT=${OUT:-/tmp/target-forward-device}
mkdir -p "$OUT"
rm -rf /tmp/target-runs  # a warm machine keeps /tmp between calls: no log of an earlier call read as this one's
exec > >(tee "$OUT/target-forward-device.log") 2>&1
CKPT=/tmp/qwen3-8b-random
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
t0=$(date +%s)
# The card's SM clock, power and temperature every 200 ms, and when each phase began (summed per
# phase at the end: the card is measured as found, never set).
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 200 |
  while IFS= read -r line; do echo "$(date +%s.%N) $line"; done > /tmp/clocks.txt 2>/dev/null &
sampler=$!
: > /tmp/phases.txt
phase() { echo "$(date +%s.%N) $*" >> /tmp/phases.txt; }
python3 scripts/make-random-checkpoint --preset qwen3-8b --out $CKPT --device cuda > /tmp/checkpoint.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins test_cuda_ops target_states
echo "=== test_cuda_ops"
"$BUILD/bin/test_cuda_ops" > /tmp/test_cuda_ops.log 2>&1
echo "rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is" /tmp/test_cuda_ops.log | head -20
grep -E " ulp," /tmp/test_cuda_ops.log | grep -v " max 0 ulp" | head -30  # the frozen ops' differences
wait $ckpt; echo "=== checkpoint: rc $? ($(( $(date +%s) - t0 )) s)"; tail -1 /tmp/checkpoint.log

echo "=== matmul floor"
phase "matmul floor"
python3 - <<'PY' | tee "$OUT/floor.txt"
import statistics, torch
S, H, I, q, kv = 3072, 4096, 12288, 32 * 128, 8 * 128
shapes = {"qkv": (S, H, q + 2 * kv), "o": (S, q, H), "gate_up": (S, H, 2 * I), "down": (S, I, H)}
total = flop = 0.0
for name, (m, k, n) in shapes.items():
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    # Five warm-ups only: the rate of a short burst, the stricter floor. Half a second of products
    # back to back first ran them power-limited at 644-648 TFLOP/s on an H100 (2026-12-06), below
    # the 775 they reach inside the step between the memory-bound passes; cold, a burst may also
    # come out low (701 TFLOP/s at 07:04 that day): compare with the step's own products (profile).
    for _ in range(5): torch.nn.functional.linear(a, w)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); torch.nn.functional.linear(a, w); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ms = statistics.median(ts)
    total += ms; flop += 2 * m * k * n
    print(f"{name}: [{m} x {k}] x [{k} x {n}] {ms:.3f} ms = {2 * m * k * n / ms / 1e9:.0f} TFLOP/s")
print(f"one layer's products {total:.3f} ms ({flop / total / 1e9:.0f} TFLOP/s); 34 layers: floor {34 * total:.2f} ms")
PY
phase idle

# One training run of ours: engine, engine_pdl0 (the engine's kernels launched without programmatic
# dependent launch, FLASHDRAFT_PDL=0: what PDL buys, side by side), engine_gemm_add0 (each residual
# add in the norm after it, FLASHDRAFT_GEMM_ADD=0: what adding in the products buys), aten, engine_again (the engine
# once more after transformers' timing: the spread of one version, and any drift of the card).
run_ours() {
  local k=$1 kern=aten pdl=1 gemm_add=1 swiglu=0 prof="" log="$OUT/run_$1.log"
  case $k in engine*) kern=engine ;; esac
  [ $k = engine_pdl0 ] && pdl=0
  [ $k = engine_gemm_add0 ] && gemm_add=0 log=/tmp/run_engine_gemm_add0.log
  [ $k = engine_swiglu1 ] && swiglu=1 log=/tmp/run_engine_swiglu1.log
  [ $k = engine ] && prof="--profile 10:13"
  [ $k = engine_again ] && log=/tmp/run_engine_again.log  # (a call brings back 8 files of $OUT)
  sed -e "s/^name = .*/name = \"target_$k\"/" -e "s|^path = \"/tmp/qwen3-8b-random\"|path = \"$CKPT\"\nkernels = \"$kern\"|" \
    -e "s/^steps = 20/steps = 24/" -e "s/^target_layer_ids = \(.*\)/target_layer_ids = \1\nlabels = \"data\"/" \
    bench/qwen3_8b_hf_target.toml > /tmp/target_$k.toml
  phase "ours $k"
  FLASHDRAFT_PDL=$pdl FLASHDRAFT_GEMM_ADD=$gemm_add FLASHDRAFT_GEMM_SWIGLU=$swiglu timeout -k 5 150 "$BUILD/bin/flashdraft" run /tmp/target_$k.toml --out /tmp/target-runs $prof > "$log" 2>&1
  echo "=== run kernels = $k: rc $?"
  phase idle
  grep -E "^target|^error|^step +24/" "$log" | head -5
  grep -A44 "^profile" "$log" | grep -v "^step" | head -46
}
for k in ${VARIANTS:-engine engine_pdl0 engine_gemm_add0 aten}; do run_ours $k; done

echo "=== hidden states at the real shape against transformers"
python3 - "$BUILD" "$CKPT" <<'PY' | tee "$OUT/states.txt"
import subprocess, sys, torch
from safetensors.torch import save_file, load_file
build, ckpt = sys.argv[1:3]
torch.manual_seed(0)
tokens = torch.randint(0, 151936, (1, 3072))
save_file({"tokens": tokens, "lengths": torch.tensor([3072])}, "/tmp/states_in.safetensors")
layers = [1, 9, 17, 25, 33]
ours = {}
for k in ("engine", "aten"):
    p = subprocess.run([f"{build}/bin/target_states", "hf", ckpt, "/tmp/states_in.safetensors", f"/tmp/states_{k}.safetensors",
                        ",".join(map(str, layers)), "flash_cuda", "bfloat16", "cuda", k], capture_output=True, text=True)
    print(k, "rc", p.returncode, p.stderr.strip()[-300:])
    ours[k] = load_file(f"/tmp/states_{k}.safetensors")["hidden"]
from bench.device_common import rel, transformers_states
states = transformers_states(ckpt, tokens, layers, 35)  # hidden_states[34]: layer 33's output before any final norm
print("relative to transformers (SDPA, bf16): max |diff| / max |ref|, mean |diff| / mean |ref|")
for i, L in enumerate(layers):
    ref = states["sdpa"][i]
    print(f"layer {L}: ours engine {rel(ours['engine'][0, :, i], ref)}; ours aten {rel(ours['aten'][0, :, i], ref)}; "
          f"transformers eager attention {rel(states['eager'][i], ref)}; engine vs aten "
          f"{rel(ours['engine'][0, :, i], ours['aten'][0, :, i])}")
PY

echo "=== transformers' forward (34 layers, bf16, SDPA, output_hidden_states, inference mode)"
timeout -k 5 300 python3 - "$CKPT" <<'PY' | tee "$OUT/peer.txt"
import statistics, sys, time, torch, transformers
ckpt = sys.argv[1]
model = transformers.AutoModel.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa",
                                               num_hidden_layers=34).cuda().eval()
tokens = torch.randint(0, 151936, (1, 3072), device="cuda")
from bench.device_common import timed
def phase(name):  # as the shell's phase(): when each timed phase began, for the clock summary
    with open("/tmp/phases.txt", "a") as p:
        p.write(f"{time.time():.3f} {name}\n")
with torch.inference_mode():
    f = lambda: model(input_ids=tokens, output_hidden_states=True)
    phase("transformers eager")
    print(f"transformers eager: {timed(f):.2f} ms (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)", flush=True)
    phase("idle")
    compiled = torch.compile(model)
    t = time.time()
    g = lambda: compiled(input_ids=tokens, output_hidden_states=True)
    g()
    print(f"torch.compile first call {time.time() - t:.1f} s", flush=True)
    phase("transformers compiled")
    print(f"transformers torch.compile: {timed(g):.2f} ms", flush=True)
    phase("idle")
PY
echo "peer rc $?"
phase idle
run_ours engine_again
kill $sampler 2>/dev/null
python3 - <<'PY'
import statistics
phases = [l.split(" ", 1) for l in open("/tmp/phases.txt").read().splitlines()]
samples = []
for line in open("/tmp/clocks.txt"):
    parts = line.replace(",", " ").split()
    try:
        samples.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])))
    except (ValueError, IndexError):
        pass
print("the card while busy in each phase (samples every 200 ms drawing over 200 W: the run's loading and "
      "compiling left out): median SM MHz, median / max W, max C")
for i, (start, name) in enumerate(phases):
    if name == "idle":
        continue
    end = float(phases[i + 1][0]) if i + 1 < len(phases) else float("inf")
    s = [x for x in samples if float(start) <= x[0] < end and x[2] > 200]
    if s:
        print(f"  {name}: {statistics.median(x[1] for x in s):.0f} MHz, {statistics.median(x[2] for x in s):.0f} / "
              f"{max(x[2] for x in s):.0f} W, {max(x[3] for x in s):.0f} C ({len(s)} samples)")
PY

python3 - "$OUT" <<'PY' | tee "$OUT/results.md"
import os, re, statistics, sys
import h5py
out = sys.argv[1]
text = open(os.path.join(out, "floor.txt")).read()
floor = float(re.search(r"34 layers: floor ([0-9.]+) ms", text).group(1))
peer = open(os.path.join(out, "peer.txt")).read() if os.path.exists(os.path.join(out, "peer.txt")) else ""
best = [float(x) for x in re.findall(r"transformers [a-z.]+(?: [a-z]+)?: ([0-9.]+) ms", peer)]
# Each run's log, read once: forward and step times per step, the step's memory.
runs = {}
for k in ("engine", "engine_swiglu1", "engine_pdl0", "engine_gemm_add0", "aten", "engine_again"):
    try:
        with h5py.File(f"/tmp/target-runs/target_{k}.h5", "r", swmr=True) as f:
            runs[k] = (f["steps/target_time_s"][:], f["steps/step_time_s"][:], f["memory/step"][:])
    except OSError:
        pass
median_ms = lambda x: 1e3 * statistics.median(x[13:])  # steps 14-24
print("| target kernels | target forward ms | / matmul floor | / transformers' best | step ms | peak GiB |")
print("| --- | --- | --- | --- | --- | --- |")
for k in ("engine", "engine_swiglu1", "engine_pdl0", "engine_gemm_add0", "aten", "engine_again"):
    if k not in runs:
        print(f"| {k} | no log | | | | |"); continue
    target, step, memory = runs[k]
    t = median_ms(target)
    b = f"{t / min(best):.3f}" if best else "-"
    print(f"| {k} | {t:.1f} | {t / floor:.3f} | {b} | {median_ms(step):.1f} | {max(memory[13:]) / 2**30:.2f} |")
print(f"\nmatmul floor {floor:.2f} ms (34 layers x the four products at their shapes, measured here); "
      f"transformers: {', '.join(f'{x:.2f} ms' for x in best) or 'not measured'}")
# The products inside the step (the profile's target_forward part, nvjet kernels) and the issue's
# floor (products 40.30 + causal attention 2.63 TFLOP) at the better of the two GEMM rates. (On
# sm_90 with FLASHDRAFT_GEMM_SWIGLU=1 the gate / up product is the engine's kernel with SwiGLU in its
# epilogue: counted as a product.)
prod_flop = 34 * 2 * 3072 * 4096 * (6144 + 4096 + 24576 + 12288)
rates = [prod_flop / (floor * 1e-3)]
try:
    block = open(os.path.join(out, "run_engine.log")).read().split("device time by part", 1)[1]
    inside = 0.0
    for line in block.split("target_forward", 1)[1].splitlines()[1:]:  # the part's kernels, indented
        if not line.startswith("        "):
            break
        if "nvjet" in line or "gate_up_swiglu" in line:  # cuBLAS's products; the gate / up one with SwiGLU (sm_90)
            inside += float(line.split()[0])
    if inside > 0:
        rates.append(prod_flop / (inside * 1e-3))
        print(f"products inside the step (profile): {inside:.2f} ms ({rates[-1] / 1e12:.0f} TFLOP/s)")
except (OSError, IndexError, ValueError):
    pass
rate = max(rates)
issue_floor = 1e3 * (prod_flop + 34 * 4 * 3072 * 3072 / 2 * 128 * 32) / rate
print(f"the issue's floor (products + causal attention at {rate / 1e12:.0f} TFLOP/s, the better rate): "
      f"{issue_floor:.1f} ms")
for k in ("engine", "engine_swiglu1", "engine_pdl0", "engine_gemm_add0", "engine_again"):
    if k in runs:
        print(f"  {k}: {median_ms(runs[k][0]) / issue_floor:.3f}x that floor")
for k in ("engine", "engine_again"):
    if k in runs:
        steps = runs[k][0][1:]
        print(f"{k}: target forward ms, steps 2-{len(steps) + 1}: " + " ".join(f"{1e3 * x:.1f}" for x in steps))
PY
echo "=== done in $(( $(date +%s) - t0 )) s"

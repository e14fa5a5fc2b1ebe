#!/usr/bin/env bash
# On the GPU machine, in one call: at a preset's real shape (scripts/make-random-checkpoint --preset $PRESET --layers
# $N), ours in bf16 (target_states, flash_cuda, engine kernels) and transformers' own bf16 forward, each against
# transformers' float32 forward on the GPU over S random tokens: which of the two is off when they disagree.
#   device run: command `PRESET=nemotron-3-nano N=2 LAYERS=0,1 bash bench/states_fp32_device.sh`, carry
#   [".deps", "build-device"] after `scripts/stage-device-build flashdraft_cli flashdraft_all_plugins target_states
#   test_cuda_ops` here.
set -uo pipefail
PRESET=${PRESET:?PRESET: a scripts/make-random-checkpoint preset}
N=${N:-2} LAYERS=${LAYERS:-0,1} S=${S:-3072}
OUT=${OUT:-/tmp/states-fp32-device}
mkdir -p "$OUT"
exec > >(tee "$OUT/states-fp32-device.log") 2>&1
date -u
nvidia-smi --query-gpu=name --format=csv,noheader
CKPT=/tmp/$PRESET-states
python3 scripts/make-random-checkpoint --preset "$PRESET" --layers "$N" --out "$CKPT" --device cuda > /tmp/ckpt.log 2>&1 &
ckpt=$!
. bench/device_build.sh
device_build flashdraft_cli flashdraft_all_plugins target_states test_cuda_ops
wait $ckpt; tail -1 /tmp/ckpt.log
timeout -k 5 300 python3 - "$BUILD" "$CKPT" "$LAYERS" "$S" <<'PY'
import json, subprocess, sys, torch, transformers
from safetensors.torch import save_file, load_file
build, ckpt, layer_list, S = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
layers = [int(x) for x in layer_list.split(",")]
vocab = json.load(open(f"{ckpt}/config.json"))["vocab_size"]
torch.manual_seed(0)
tokens = torch.randint(0, vocab, (1, S))
save_file({"tokens": tokens, "lengths": torch.tensor([S])}, "/tmp/sf_in.safetensors")
p = subprocess.run([f"{build}/bin/target_states", "hf", ckpt, "/tmp/sf_in.safetensors", "/tmp/sf_ours.safetensors",
                    layer_list, "flash_cuda", "bfloat16", "cuda", "engine"], capture_output=True, text=True)
print("ours rc", p.returncode, p.stdout.strip().splitlines()[-1:] if p.returncode == 0 else p.stderr[-400:])
ours = load_file("/tmp/sf_ours.safetensors")["hidden"].float()
def run(dtype):
    model = transformers.AutoModel.from_pretrained(ckpt, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        h = model(input_ids=tokens.cuda(), output_hidden_states=True, use_cache=False).hidden_states
    out = [h[l + 1][0].float().cpu() for l in layers]
    del model; torch.cuda.empty_cache()
    return out
ref, bf16 = run(torch.float32), run(torch.bfloat16)
for e, l in enumerate(layers):
    def err(x):
        d = (x - ref[e]).abs()
        return f"max {d.max() / ref[e].abs().max():.2e}, mean {d.mean() / ref[e].abs().mean():.2e}"
    print(f"layer {l} against transformers fp32 (GPU): ours bf16 {err(ours[0, :, e])}; transformers bf16 {err(bf16[e])}")
PY

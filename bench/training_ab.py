#!/usr/bin/env python3
"""A/B of what a DFlash drafter is trained on, measured by the served acceptance length.

On CPU with a tiny random Qwen3 target (4 layers; weights wide enough that its greedy text
does not repeat one token), conversations of random prompts and responses, packed into rows
as a real run packs them, and a 1-layer DFlash drafter trained against the target online;
after training, tau_served = the held-out responses decoded by the target with the drafter
(greedy), the number a server measures. Two kinds of data:
  target  the responses are the target's own greedy continuations (data the target wrote);
  other   the responses are another random model's greedy continuations (data it did not).
Arms, each with 3 run seeds:
  old         flashdraft before 2026-12: documents = "joined", anchor_rule = "next_token",
              labels = "data", normalisation = "weights", gamma = 7, target layer [1]
  +documents  old with documents = "separate"
  +anchors    old with anchor_rule = "response"
  +argmax     old with labels = "target_argmax"
  +kl         old with labels = "target_kl"
  +defaults   old with the references' defaults: gamma by block size (4 for 8),
              normalisation = "positions", target layer ids by build_target_layer_ids ([2])
  all-argmax  every change, labels = "target_argmax"
  all-kl      every change, labels = "target_kl"

    .venv/bin/python bench/training_ab.py [--steps 300] [--seeds 3] [--out /tmp/training-ab]

Prints a markdown table: mean and sample standard deviation of tau_served over the seeds.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from hf_models import make_model  # noqa: E402

CLI = ROOT / "build" / "bin" / "flashdraft"

BASE = """
[run]
name = "{name}"
seed = {seed}
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 1000
[attention]
kernels = ["flash_cpu"]
[optimizer]
lr = 5e-3
warmup_steps = 20
[target]
plugin = "hf"
path = "{target}"
[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = 8
anchors = 16
{drafter}
[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 128
batch_size = 4
eval_sequences = 40
pack = true
[mask]
plugin = "dflash"
[eval]
enabled = true
every = 0
"""

OLD = dict(documents='"joined"', anchor_rule='"next_token"', labels='"data"', normalisation='"weights"', gamma="7.0",
           target_layer_ids="[1]")
NEW = dict(documents='"separate"', anchor_rule='"response"', normalisation='"positions"', gamma="0.0",
           target_layer_ids="[]")
ARMS = {
    "old": {},
    "+documents": dict(documents=NEW["documents"]),
    "+anchors": dict(anchor_rule=NEW["anchor_rule"]),
    "+argmax": dict(labels='"target_argmax"'),
    "+kl": dict(labels='"target_kl"'),
    "+defaults": dict(gamma=NEW["gamma"], normalisation=NEW["normalisation"], target_layer_ids=NEW["target_layer_ids"]),
    "all-argmax": dict(NEW, labels='"target_argmax"'),
    "all-kl": dict(NEW, labels='"target_kl"'),
}


def write_data(folder: Path, writer, rng, n=400):
    """Conversations: a random prompt, then `writer`'s greedy continuation."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens, mask, offsets = [], [], [0]
    for _ in range(n):
        prompt = rng.integers(8, 160, size=int(rng.integers(4, 12))).tolist()
        out = writer.generate(torch.tensor([prompt]), max_new_tokens=int(rng.integers(16, 40)), do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        tokens += prompt + out
        mask += [0] * len(prompt) + [1] * len(out)
        offsets.append(len(tokens))
    with h5py.File(folder / "shard-00000.h5", "w") as f:
        f["tokens"] = np.array(tokens, dtype=np.int32)
        f["loss_mask"] = np.array(mask, dtype=np.uint8)
        f["offsets"] = np.array(offsets, dtype=np.int64)
        f.attrs.update(format="flashdraft-tokens-v1", vocab_size=160, tokenizer="none", source="bench/training_ab.py")


def run_arm(out: Path, target: Path, data: Path, arm: str, seed: int, steps: int) -> float:
    keys = dict(OLD, **ARMS[arm])
    drafter = "\n".join(f"{k} = {v}" for k, v in keys.items())
    name = f"{arm.replace('+', 'p_')}_{seed}"
    shutil.rmtree(out / name, ignore_errors=True)  # a fresh run (a rerun would log to <name>-1.h5)
    exp = out / f"{name}.toml"
    exp.write_text(BASE.format(name=name, seed=seed, steps=steps, out=out / name, target=target, data=data,
                               drafter=drafter))
    # One thread per run: the runs are small, and threads only contend on a shared machine.
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        raise RuntimeError(f"{exp}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    with h5py.File(out / name / f"{name}.h5", "r", swmr=True) as f:
        return float(f["eval/tau_served"][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/training-ab")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "data_other" / "shard-00000.h5").exists():
        target = make_model(out / "target", "qwen3", seed=3, embedding_std=1.0, initializer_range=0.2)
        other = make_model(out / "other", "qwen3", seed=11, embedding_std=1.0, initializer_range=0.2)
        write_data(out / "data_target", target, np.random.default_rng(0))
        write_data(out / "data_other", other, np.random.default_rng(0))
    # Arms already measured in this folder (results.json, written after every arm) are kept:
    # an interrupted comparison continues where it stopped.
    saved = out / "results.json"
    results = {}
    if saved.exists():
        results = {tuple(k.split("|")): v for k, v in json.loads(saved.read_text()).items()}
    t0 = time.time()
    for kind in ("target", "other"):
        for arm in ARMS:
            if (kind, arm) in results and len(results[(kind, arm)]) == args.seeds:
                print(f"data {kind:6s} {arm:11s} tau_served {results[(kind, arm)]} (measured before)", flush=True)
                continue
            taus = [run_arm(out, out / "target", out / f"data_{kind}", arm, seed, args.steps)
                    for seed in range(args.seeds)]
            results[(kind, arm)] = taus
            saved.write_text(json.dumps({f"{k}|{a}": v for (k, a), v in results.items()}, indent=1))
            print(f"[{time.time() - t0:6.0f} s] data {kind:6s} {arm:11s} tau_served {taus}", flush=True)
    print(f"\n{args.seeds} seeds, {args.steps} steps each; tau_served by the target, greedy, on 40 held-out "
          "conversations (mean +- sample sd over seeds; change against old in parentheses)\n")
    print("| arm | data the target wrote | data it did not write |")
    print("|---|---|---|")
    for arm in ARMS:
        cells = []
        for kind in ("target", "other"):
            v = results[(kind, arm)]
            base = statistics.mean(results[(kind, "old")])
            m = statistics.mean(v)
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cells.append(f"{m:.3f} +- {sd:.3f}" + ("" if arm == "old" else f" ({100 * (m / base - 1):+.1f}%)"))
        print(f"| {arm} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()

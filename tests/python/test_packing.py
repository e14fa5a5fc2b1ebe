"""Packed rows train and validate what a server runs on each conversation alone.

A tiny random Qwen3 target writes the data (its greedy continuations of random prompts),
and a small DFlash drafter is trained against it online. Then one validation of that
drafter (tests/tools/eval_blocks.cpp) with the held-out conversations one per row, and one
with them packed into rows ([dataset] pack = true), with enough anchors that every block
that may start in a conversation is drafted in both. Every block is identified by its
conversation (its tokens) and its anchor's position in it:
  - [drafter] documents = "separate" (the default): the same blocks exist in both, and each
    proposes the same tokens (0 differences); the anchor tau and the served tau are equal;
  - documents = "joined" (flashdraft before 2026-12: a block sees the whole row before its
    anchor and may run into the next conversation): blocks of later conversations in a row
    propose otherwise, and blocks appear that cross into the next conversation.
"""
import subprocess

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import BINARY_DIR, CLI
from drafts import by_row
from hf_models import make_model
from test_served_tau import greedy

TOOL = BINARY_DIR / "bin" / "eval_blocks"
BS = 6

EXPERIMENT = """
[run]
name = "{name}"
seed = 0
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 50
[attention]
kernels = ["dense_ref"]
[optimizer]
lr = 1e-2
warmup_steps = 10
[target]
plugin = "hf"
path = "{target}"
[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = {bs}
anchors = {anchors}
target_layer_ids = [1, 2]
documents = "{documents}"
init = "{init}"
[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 96
batch_size = {batch}
eval_sequences = 12
pack = {pack}
[mask]
plugin = "dflash"
[eval]
enabled = true
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packing")
    model = make_model(tmp / "target", "qwen3", seed=3, embedding_std=1.0, initializer_range=0.2)
    rng = np.random.default_rng(1)
    prompts, new_tokens = [], []
    for _ in range(120):
        prompts.append(rng.integers(8, 160, size=int(rng.integers(4, 9))).tolist())
        new_tokens.append(int(rng.integers(10, 22)))
    tokens, mask, offsets = [], [], [0]
    for prompt, out in zip(prompts, greedy(model, prompts, new_tokens, eos=model.generation_config.eos_token_id)):
        tokens += prompt + out
        mask += [0] * len(prompt) + [1] * len(out)
        offsets.append(len(tokens))
    (tmp / "data").mkdir()
    with h5py.File(tmp / "data" / "shard-00000.h5", "w") as f:
        f["tokens"] = np.array(tokens, dtype=np.int32)
        f["loss_mask"] = np.array(mask, dtype=np.uint8)
        f["offsets"] = np.array(offsets, dtype=np.int64)
        f.attrs.update(format="flashdraft-tokens-v1", vocab_size=160, tokenizer="none", source="test")
    env = dict(target=tmp / "target", data=tmp / "data", bs=BS)
    exp = tmp / "train.toml"
    exp.write_text(EXPERIMENT.format(name="train", steps=80, out=tmp / "run", anchors=8, documents="separate",
                                     init="", pack="false", batch=4, **env))
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return dict(tmp=tmp, env=env, folder=tmp / "run" / "train.hf")


def blocks(setup, name, pack, documents):
    """{(conversation tokens, anchor offset): proposals} of one validation, and its figures."""
    exp = setup["tmp"] / f"{name}.toml"
    # One row per batch: every held-out row is validated, packed or not.
    exp.write_text(EXPERIMENT.format(name=name, steps=1, out=setup["tmp"] / name, anchors=96, documents=documents,
                                     init=setup["folder"], pack=pack, batch=1, **setup["env"]))
    out = setup["tmp"] / f"{name}.safetensors"
    p = subprocess.run([str(TOOL), str(exp), str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    d = by_row(load_file(str(out)))
    found = {}
    for r in range(d["tokens"].shape[0]):
        docs, begin = [], 0
        for n in d["documents"][r].tolist():
            if n > 0:
                docs.append((begin, begin + n))
                begin += n
        for n in range(d["anchors"].shape[1]):
            if not d["block_valid"][r, n]:
                continue
            a = int(d["anchors"][r, n])
            d0, d1 = next((x, y) for x, y in docs if x <= a < y)
            key = (tuple(d["tokens"][r, d0:d1].tolist()), a - d0)
            found[key] = tuple(d["predictions"][r, n, 1:].tolist())
    figures = {k: float(d[k]) for k in ("tau_anchor", "tau_served", "tau_served_data")}
    return found, figures


def test_packed_rows_draft_what_each_conversation_drafts_alone(setup):
    alone, a_fig = blocks(setup, "alone", "false", "separate")
    packed, p_fig = blocks(setup, "packed", "true", "separate")
    joined, j_fig = blocks(setup, "joined", "true", "joined")
    rows_of = lambda found: len({k[0] for k in found})  # noqa: E731
    differ = sum(alone[k] != packed.get(k) for k in alone)
    print(f"one per row: {len(alone)} blocks in {rows_of(alone)} conversations, figures {a_fig}")
    print(f"packed, documents separate: {len(packed)} blocks, {differ} propose otherwise, figures {p_fig}")
    assert rows_of(alone) == 12 and len(alone) > 100
    assert set(packed) == set(alone) and differ == 0
    assert p_fig == a_fig
    # The rule before 2026-12, on the same packed rows: blocks that cross into the next
    # conversation (not drafted alone), and blocks that see another conversation.
    crossing = sum(k not in alone for k in joined)
    changed = sum(joined[k] != alone[k] for k in joined if k in alone)
    print(f"packed, documents joined: {len(joined)} blocks, {crossing} not in one conversation alone, "
          f"{changed} of the others propose otherwise, figures {j_fig}")
    assert changed > 0 or crossing > 0
    assert changed > 0

"""End to end on CPU: a tiny random Qwen3 checkpoint made with transformers, a chat
tokenizer trained here, conversations through scripts/prepare-data, then `flashdraft
run` trains a DFlash drafter against the target run online: 50 steps, the loss falls,
and the log names the target's checkpoint, its architecture and the kernel variants that
ran inside the target. `flashdraft validate` accepts the experiment, and refuses a
drafter that asks for a layer the target does not have."""
import json
import random
import subprocess

import h5py
import numpy as np

from conftest import CLI
from hf_models import make_model
from tokens_tiny_tokenizer import CORPUS, PLAIN, make_tokenizer, prepare_data

EXPERIMENT = """
[run]
name = "hf_tiny"
seed = 0
steps = 50
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 10

[attention]
kernels = ["flash_cpu"]
on_fallback = "error"

[optimizer]
lr = 1e-2
warmup_steps = 5

[target]
plugin = "hf"
path = "{model}"

[drafter]
plugin = "dflash"
layers = 2
heads = 4
kv_heads = 2
block_size = 4
anchors = 4
target_layer_ids = [{layers}]

[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 64
batch_size = 4
eval_sequences = 8

[mask]
plugin = "dflash"
"""


def conversations(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        q, a = rng.choice(CORPUS), rng.choice(CORPUS)
        yield {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a + " " + a}]}


def setup(tmp_path):
    tok = make_tokenizer(tmp_path / "tokenizer", PLAIN)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in conversations(200)))
    prepare_data("--tokenizer", tok, "--input", jsonl, "--out", tmp_path / "data")
    make_model(tmp_path / "qwen3", "qwen3", seed=2, embedding_std=1.0, vocab_size=320)
    return tmp_path / "qwen3", tmp_path / "data"


def experiment(tmp_path, model, data, layers="0, 2"):
    path = tmp_path / "hf_tiny.toml"
    path.write_text(EXPERIMENT.format(out=tmp_path / "run", model=model, data=data, layers=layers))
    return path


def test_dflash_trains_against_an_online_hf_target(tmp_path):
    model, data = setup(tmp_path)
    exp = experiment(tmp_path, model, data)
    v = subprocess.run([str(CLI), "validate", str(exp)], capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "target attention" in v.stdout and "flash_cpu: selected" in v.stdout, v.stdout
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    log = next((tmp_path / "run").glob("hf_tiny*.h5"))
    with h5py.File(log, "r") as f:
        loss = f["steps/loss"][:]
        assert len(loss) == 50
        first, last = loss[:5].mean(), loss[-5:].mean()
        print(f"loss: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
        assert last < 0.8 * first, (first, last)
        target = f.attrs["target"]
        target = target.decode() if isinstance(target, bytes) else target
        assert "Qwen3ForCausalLM" in target and str(model) in target, target
        names = [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]
        fwd, bwd = f["kernels/forward"][:], f["kernels/backward"][:]
        assert fwd.shape == (50, 2 + 3), fwd.shape  # 2 drafter layers, then target layers 0..2
        for col in range(2, 5):
            assert all(names[i].startswith("flash_cpu/fwd/") for i in fwd[:, col]), (col, names)
            assert (bwd[:, col] == -1).all()  # the target is frozen: no backward
        assert (f["steps/target_time_s"][:] > 0).all()
        print("target:", target)
        print("target kernels:", sorted({names[i] for i in fwd[:, 2:].ravel()}))


def test_validate_refuses_a_layer_the_target_lacks(tmp_path):
    model, data = setup(tmp_path)
    exp = experiment(tmp_path, model, data, layers="0, 7")
    runs = [subprocess.run([str(CLI), cmd, str(exp)], capture_output=True, text=True, timeout=300)
            for cmd in ("validate", "run")]
    for p in runs:
        assert p.returncode == 2, p.stdout + p.stderr
        assert "target layer 7 does not exist" in p.stderr, p.stderr
    assert runs[0].stderr.splitlines()[0] == runs[1].stderr.splitlines()[0]


def test_resume_with_an_online_target_continues_exactly(tmp_path):
    """Checkpoint at step 5, resume from it in a copy of the run folder: steps 5..9 give the
    losses of the uninterrupted run bit for bit (data position, generators, optimizer)."""
    import shutil

    model, data = setup(tmp_path)
    exp = experiment(tmp_path, model, data)
    exp.write_text(exp.read_text().replace("steps = 50", "steps = 10") +
                   "\n[checkpoint]\nenabled = true\nevery = 5\nkeep = 3\n")
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    p = subprocess.run([str(CLI), "run", str(exp), "--out", str(tmp_path / "again"), "--resume",
                        str(tmp_path / "again" / "checkpoints" / "step_5")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    with h5py.File(tmp_path / "run" / "hf_tiny.h5", "r") as a, h5py.File(tmp_path / "again" / "hf_tiny.h5", "r") as b:
        assert list(b["steps/step"][:]) == list(range(10))
        assert np.array_equal(a["steps/loss"][:], b["steps/loss"][:]), (a["steps/loss"][:], b["steps/loss"][:])

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

import flashdraft_logs as fl
from conftest import CLI
from hf_models import edit_config, make_model
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


def setup(tmp_path, family="qwen3", **overrides):
    tok = make_tokenizer(tmp_path / "tokenizer", PLAIN)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in conversations(200)))
    prepare_data("--tokenizer", tok, "--input", jsonl, "--out", tmp_path / "data")
    make_model(tmp_path / family, family, seed=2, embedding_std=1.0, vocab_size=320, **overrides)
    return tmp_path / family, tmp_path / "data"


def experiment(tmp_path, model, data, layers="0, 2", **changes):
    path = tmp_path / "hf_tiny.toml"
    text = EXPERIMENT.format(out=tmp_path / "run", model=model, data=data, layers=layers)
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


def test_a_target_whose_full_layers_the_first_kernel_refuses_runs_them_alone_on_the_next(tmp_path):
    """Gemma 4 as the online target, its full layers' heads 320 wide (flash_cpu runs up to 256; flash_cuda refuses the
    published 512 the same way), [attention] kernels = ["flash_cpu", "dense_ref"] under on_fallback = "warn": the
    drafter and the target's sliding layers stay on flash_cpu, only the full layers run on dense_ref. The log says
    which kernel each column was chosen to run (kernels/column_kernels), its ledger shows each call on that kernel, one
    fallback event names the calls, and the notebook API flags no call as a foreign variant. Under "error" the run
    stops before step 0 with a sentence naming the refused calls."""
    model, data = setup(tmp_path, "gemma4", global_head_dim=320)
    kernels = {'kernels = ["flash_cpu"]': 'kernels = ["flash_cpu", "dense_ref"]', "steps = 50": "steps = 4",
               "print_every = 10": "print_every = 1"}
    exp = experiment(tmp_path, model, data, **kernels)
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode != 0 and "head_dim 320 unsupported" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "run the calls it refuses on 'dense_ref'" in p.stdout + p.stderr, p.stdout + p.stderr
    exp = experiment(tmp_path, model, data, **kernels, **{'on_fallback = "error"': 'on_fallback = "warn"'})
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dense_ref: selected (FALLBACK: not the first preference) for calls 1,3" in p.stdout, p.stdout
    log = max((tmp_path / "run").glob("hf_tiny*.h5"), key=lambda f: f.stat().st_mtime)
    with h5py.File(log, "r") as f:
        assert np.isfinite(f["steps/loss"][:]).all() and len(f["steps/loss"][:]) == 4
        names = [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]
        fwd = f["kernels/forward"][:]
        expected = f["kernels"].attrs["column_kernels"]
        expected = (expected.decode() if isinstance(expected, bytes) else expected).split("\n")
    # drafter calls 0-1, target layers 0-3 (sliding, full, sliding, full), the loss
    assert expected[:6] == ["flash_cpu", "flash_cpu", "flash_cpu", "dense_ref", "flash_cpu", "dense_ref"], expected
    assert expected[6].startswith("lm_head_ce/"), expected
    for col in range(6):
        ran = {names[i] for i in fwd[:, col]}
        assert all(r == expected[col] or r.startswith(expected[col] + "/") for r in ran), (col, ran)
    run = fl.load_run(log)
    assert (run.fallbacks["source"] == "ledger").sum() == 0, run.fallbacks
    events = run.fallbacks[run.fallbacks["source"] == "event"]["message"].tolist()
    assert any("target: kernel 'flash_cpu' refused" in m and "calls 1,3 on 'dense_ref'" in m for m in events), events
    assert run.kernel_summary["belongs_to_selected"].all(), run.kernel_summary
    shown = subprocess.run([str(CLI), "inspect", str(log)], capture_output=True, text=True, timeout=60).stdout
    assert "chosen per column:  dense_ref (3,5)  flash_cpu (0,1,2,4)" in shown, shown
    print(f"gemma4 target, full layers 320 wide: columns {expected}; {events[0]}")


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
        # what ran the layers' norms, RoPE and SwiGLU is in the log (on the CPU: transformers' ATen ops)
        assert "norms, RoPE, SwiGLU: transformers' ATen ops" in target, target
        names = [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]
        fwd, bwd = f["kernels/forward"][:], f["kernels/backward"][:]
        # 2 drafter layers, then target layers 0..3: the drafter reads 0 and 2, and its labels
        # ("auto": the target's greedy tokens) come from the last layer, 3
        assert fwd.shape == (50, 2 + 4), fwd.shape
        for col in range(2, 6):
            assert all(names[i].startswith("flash_cpu/fwd/") for i in fwd[:, col]), (col, names)
            assert (bwd[:, col] == -1).all()  # the target is frozen: no backward
        assert (f["steps/target_time_s"][:] > 0).all()
        print("target:", target)
        print("target kernels:", sorted({names[i] for i in fwd[:, 2:].ravel()}))


def test_dflash_trains_against_a_mixture_of_experts_target(tmp_path):
    """A Qwen3-MoE target (8 experts, 2 a token; layer 2 dense) online: the drafter trains (30 steps,
    the loss falls), the log names the architecture and its experts, and validation runs the
    target's other two paths on it too: anchor blocks verified by the target and served decoding
    with its key/value cache."""
    model, data = setup(tmp_path, "qwen3_moe")
    exp = experiment(tmp_path, model, data)
    exp.write_text(exp.read_text().replace("steps = 50", "steps = 30") + "\n[eval]\nenabled = true\n")
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    with h5py.File(tmp_path / "run" / "hf_tiny.h5", "r") as f:
        loss = f["steps/loss"][:]
        first, last = loss[:5].mean(), loss[-5:].mean()
        target = f.attrs["target"]
        target = target.decode() if isinstance(target, bytes) else target
        print(f"loss: first 5 steps {first:.3f}, last 5 steps {last:.3f}; target: {target[:160]}")
        assert len(loss) == 30 and last < 0.8 * first, (first, last)
        assert "Qwen3MoeForCausalLM" in target and "8 experts (2 a token)" in target, target
        for key, method in (("tau_anchor_method", "target verification"), ("tau_served_method", "target (greedy)")):
            m = f["eval/" + key][-1]
            assert (m.decode() if isinstance(m, bytes) else m) == method, key
        assert f["eval/tau_served"][-1] >= 1.0 and f["eval/served_responses"][-1] > 0
        print(f"eval: tau_anchor {f['eval/tau_anchor'][-1]:.3f}, tau_served {f['eval/tau_served'][-1]:.3f} over "
              f"{int(f['eval/served_responses'][-1])} responses")


def test_validate_refuses_a_layer_the_target_lacks(tmp_path):
    model, data = setup(tmp_path)
    exp = experiment(tmp_path, model, data, layers="0, 7")
    runs = [subprocess.run([str(CLI), cmd, str(exp)], capture_output=True, text=True, timeout=300)
            for cmd in ("validate", "run")]
    for p in runs:
        assert p.returncode == 2, p.stdout + p.stderr
        assert "target layer 7 does not exist" in p.stderr, p.stderr
    assert runs[0].stderr.splitlines()[0] == runs[1].stderr.splitlines()[0]


def test_a_plugins_warning_is_kept_in_the_run_log(tmp_path):
    """A target whose config.json says 8 positions, rows of up to 64 tokens: the target's warning
    is printed once and kept in the log's events (kind "warning", the line without its prefix);
    no other event is a warning."""
    model, data = setup(tmp_path)
    edit_config(model, max_position_embeddings=8)
    exp = experiment(tmp_path, model, data)
    exp.write_text(exp.read_text().replace("steps = 50", "steps = 3"))
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    said = [line for line in p.stdout.splitlines() if line.startswith("warning: ")]
    assert len(said) == 1 and "runs past the 8 positions the checkpoint is made for" in said[0], p.stdout
    with h5py.File(tmp_path / "run" / "hf_tiny.h5", "r") as f:
        kinds = [k.decode() if isinstance(k, bytes) else k for k in f["events/kind"][:]]
        messages = [m.decode() if isinstance(m, bytes) else m for m in f["events/message"][:]]
    warnings = [m for k, m in zip(kinds, messages) if k == "warning"]
    assert warnings == [said[0][len("warning: "):]], (kinds, messages)
    assert "finished" in kinds, kinds


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


def multi_turn(n, seed=1):
    rng = random.Random(seed)
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(2, 3)):
            turns += [{"role": "user", "content": rng.choice(CORPUS)}, {"role": "assistant", "content": rng.choice(CORPUS)}]
        yield {"messages": turns}


def test_validation_on_multi_turn_chat_data_with_an_online_target(tmp_path):
    """Chat data as prepare-data writes it: several assistant turns per conversation, the
    newline after each end-of-turn token outside the loss mask, short rows padded, packed
    rows. Validation with the target online (anchor blocks verified by the target, served
    decoding of every assistant turn) runs; positions without a label never reach the
    target (they once looked up embedding row -1: "index out of range in self")."""
    tok = make_tokenizer(tmp_path / "tokenizer", PLAIN)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in multi_turn(80)))
    prepare_data("--tokenizer", tok, "--input", jsonl, "--out", tmp_path / "data")
    make_model(tmp_path / "qwen3", "qwen3", seed=2, embedding_std=1.0, vocab_size=320)
    with h5py.File(tmp_path / "data" / "shard-00000.h5", "r") as f:
        mask, offsets = f["loss_mask"][:], f["offsets"][:]
    turns = [int(np.sum(np.diff(np.concatenate([[0], mask[a:b], [0]])) == 1)) for a, b in zip(offsets, offsets[1:])]
    assert min(turns) >= 2  # every conversation has several assistant turns, and unlabelled positions between them
    served = {}
    for pack in ("false", "true"):
        exp = tmp_path / f"chat_{pack}.toml"
        exp.write_text(EXPERIMENT.format(out=tmp_path / f"run_{pack}", model=tmp_path / "qwen3", data=tmp_path / "data",
                                         layers="0, 2")
                       .replace("steps = 50", "steps = 2").replace('name = "hf_tiny"', f'name = "chat_{pack}"')
                       .replace("eval_sequences = 8", f"eval_sequences = 8\npack = {pack}")
                       .replace("seq_len = 64", "seq_len = 160")
                       + "\n[eval]\nenabled = true\n")
        p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        lines = [l for l in p.stdout.splitlines() if l.startswith("eval")]
        print(f"pack = {pack}:", lines[-1][:220])
        log = tmp_path / f"run_{pack}" / f"chat_{pack}.h5"
        with h5py.File(log, "r") as f:
            method = f["eval/tau_anchor_method"][-1]
            assert (method.decode() if isinstance(method, bytes) else method) == "target verification"
            how = f["eval/tau_served_method"][-1]
            assert (how.decode() if isinstance(how, bytes) else how) == "target (greedy)"
            # the assistant turns of the 8 held-out conversations (within seq_len), a few per conversation
            served[pack] = (int(f["eval/served_responses"][-1]), float(f["eval/tau_served"][-1]),
                            int(f["eval/served_steps"][-1]))
            assert 2 * 8 <= served[pack][0] <= 8 * max(turns), served[pack]
            assert f["eval/tau_served"][-1] >= 1.0 and f["eval/tau_anchor"][-1] >= 1.0
    # Served decoding works per conversation: packing the held-out rows changes nothing.
    print("served (responses, tau, steps): unpacked", served["false"], "packed", served["true"])
    assert served["false"] == served["true"]

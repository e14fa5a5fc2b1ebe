"""Data-parallel training on CPU through c10d's Gloo backend, launched by the .venv's torchrun
(`torchrun --nproc-per-node 2 --no-python flashdraft run EXP.toml`).

- 2 ranks train 10 steps: the weights are identical on both after every step (the per-rank
  checksums of the log), the ranks read different batches, and the losses equal a single
  process with [optimizer] accumulate = 2 (the union of both ranks' batches, in the same
  micro-batches) within 1e-6, as do the trained weights.
- A rank whose batches carry no loss (no valid anchor) still joins every collective: the run
  finishes, that rank contributes nothing, and the losses equal the single-process run.
- A rank killed mid-run: the other stops within [distributed] timeout with a message naming
  the rank, and the log keeps every finished step.
- Resuming a checkpoint with another world size is refused with a sentence.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import CLI, SOURCE_DIR

TORCHRUN = Path(sys.executable).parent / "torchrun"

EMBEDDED = """
[run]
name = "{name}"
seed = 3
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 1
threads = 1

[attention]
kernels = ["flash_cpu"]
on_fallback = "error"

[optimizer]
lr = 3e-3
warmup_steps = 2
accumulate = {accumulate}

[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = 8
anchors = 4
target_layer_ids = [1, 3]

[dataset]
plugin = "embedded"
vocab = 256
hidden = 64
layers = 4
heads = 4
seq_len = 64
prompt_len = 8
train_sequences = 64
eval_sequences = 0
exported_layers = [1, 3]
batch_size = 2
generate_batch = 64

[mask]
plugin = "dflash"

[distributed]
timeout = {timeout}
bucket_mb = 0.05
{extra}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_embedded(folder: Path, name: str, steps=10, accumulate=1, timeout=30, extra=""):
    path = folder / f"{name}.toml"
    path.write_text(EMBEDDED.format(name=name, steps=steps, out=folder / name, accumulate=accumulate,
                                    timeout=timeout, extra=extra))
    return path


def clean_env():
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(k, None)
    return env


def torchrun(exp: Path, *extra, nproc=2, timeout=600, launcher=()):
    cmd = [str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), *launcher, "--no-python", str(CLI), "run", str(exp), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())


def single(exp: Path, *extra, timeout=600):
    return subprocess.run([str(CLI), "run", str(exp), *extra], capture_output=True, text=True, timeout=timeout,
                          env=clean_env())


def read_log(folder: Path):
    with h5py.File(folder / f"{folder.name}.h5", "r") as f:
        return {k: f[k][:] for k in ("steps/loss", "steps/step", "ranks/weights_sum", "ranks/weights_sumsq",
                                      "ranks/loss", "ranks/tokens", "ranks/kernels_forward",
                                      "ranks/kernels_backward", "kernels/forward") if k in f} | {
            "events": [k.decode() for k in f["events/kind"][:]],
            "messages": [m.decode() for m in f["events/message"][:]]}


def weights(folder: Path):
    path = next(folder.glob("*.weights.h5"))
    with h5py.File(path, "r") as f:
        return {k: f["weights"][k][:] for k in f["weights"]}


def check_identical_ranks(log, steps):
    s, q = log["ranks/weights_sum"], log["ranks/weights_sumsq"]
    assert s.shape == (steps, 2), s.shape
    assert (s[:, 0] == s[:, 1]).all() and (q[:, 0] == q[:, 1]).all(), (s, q)
    assert len(np.unique(s[:, 0])) == steps, "the weights did not change from step to step"


def test_two_ranks_equal_one_process_over_the_union(tmp_path):
    dp = torchrun(write_embedded(tmp_path, "dp"))
    assert dp.returncode == 0, dp.stdout + dp.stderr
    assert "distributed: 2 ranks (torchrun), backend gloo" in dp.stdout, dp.stdout
    assert "weights: identical on 2 ranks" in dp.stdout, dp.stdout
    # Every bucket left while the backward was still running (overlap), in several buckets.
    m = re.search(r"gradients all-reduced in (\d+) buckets, (\d+) of them sent during the backward", dp.stdout)
    assert m and int(m.group(1)) > 1 and m.group(1) == m.group(2), dp.stdout
    one = single(write_embedded(tmp_path, "one", accumulate=2))
    assert one.returncode == 0, one.stdout + one.stderr

    a, b = read_log(tmp_path / "dp"), read_log(tmp_path / "one")
    assert list(a["steps/step"]) == list(range(10))
    check_identical_ranks(a, 10)
    # The ranks read different batches (their own shards), with different losses.
    assert (a["ranks/loss"][:, 0] != a["ranks/loss"][:, 1]).all(), a["ranks/loss"]
    assert (a["ranks/tokens"] > 0).all()
    diff = np.abs(a["steps/loss"] - b["steps/loss"]).max()
    print(f"2 ranks vs 1 process, accumulate 2: max |loss difference| over 10 steps = {diff:.3g}")
    print("losses:", np.round(a["steps/loss"], 5))
    assert diff <= 1e-6, (a["steps/loss"], b["steps/loss"])
    assert a["steps/loss"][-1] < a["steps/loss"][0]
    wa, wb = weights(tmp_path / "dp"), weights(tmp_path / "one")
    worst = max(np.abs(wa[k] - wb[k]).max() for k in wa)
    print(f"trained weights, max |difference| = {worst:.3g}")
    assert worst <= 1e-6
    shown = subprocess.run([str(CLI), "inspect", str(tmp_path / "dp" / "dp.h5")], capture_output=True, text=True)
    assert "ranks     2 (accumulate 1); weights identical on every rank after every step: yes" in shown.stdout, \
        shown.stdout + shown.stderr
    # Both ranks ran flash_cpu in every layer and the LM-head loss, forward and backward:
    # per rank, its attention call then the loss.
    ids = a["ranks/kernels_forward"]
    assert ids.shape == (10, 4), ids.shape
    ids = ids.reshape(10, 2, 2)
    assert (ids[:, 0] == ids[:, 1]).all() and (ids >= 0).all(), ids


def test_the_union_is_not_the_first_rank_alone(tmp_path):
    """The comparison above can fail: one process on rank 0's batches alone (accumulate 1
    reads batches 0, 1, 2, ... not 0, 2, 4, ...) gives other losses."""
    dp = torchrun(write_embedded(tmp_path, "dp", steps=3))
    assert dp.returncode == 0, dp.stdout + dp.stderr
    one = single(write_embedded(tmp_path, "one", steps=3))
    assert one.returncode == 0, one.stdout + one.stderr
    a, b = read_log(tmp_path / "dp"), read_log(tmp_path / "one")
    assert np.abs(a["steps/loss"] - b["steps/loss"]).max() > 1e-4


TOKENS = """
[run]
name = "{name}"
seed = 1
steps = 6
device = "cpu"
dtype = "float32"
out = "{out}"
threads = 1

[attention]
kernels = ["flash_cpu"]

[optimizer]
lr = 1e-2
warmup_steps = 1
accumulate = {accumulate}

[target]
plugin = "hf"
path = "{model}"

[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = 4
anchors = 3
target_layer_ids = [0, 2]

[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 32
batch_size = 1
eval_sequences = 0
shuffle = false
min_loss_tokens = 0

[mask]
plugin = "dflash"

[distributed]
timeout = 60
"""


def write_shard(path: Path, conversations: int, vocab: int):
    """Conversations of 20..31 random tokens; the odd ones carry no assistant token (rank 1's
    batches with batch_size 1, shuffle off and 2 ranks: batch index step * 2 + rank)."""
    rng = np.random.default_rng(5)
    tokens, mask, offsets = [], [], [0]
    for i in range(conversations):
        n = int(rng.integers(20, 32))
        tokens.append(rng.integers(1, vocab, n).astype(np.int32))
        m = np.zeros(n, np.uint8)
        if i % 2 == 0:
            m[6:] = 1
        mask.append(m)
        offsets.append(offsets[-1] + n)
    with h5py.File(path, "w") as f:
        f["tokens"] = np.concatenate(tokens)
        f["loss_mask"] = np.concatenate(mask)
        f["offsets"] = np.array(offsets, np.int64)
        f.attrs["format"] = "flashdraft-tokens-v1"
        f.attrs["vocab_size"] = vocab
        f.attrs["tokenizer"] = "random"
        f.attrs["source"] = "test_distributed.py"


def test_a_rank_without_any_valid_anchor_joins_every_collective(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import make_model

    make_model(tmp_path / "qwen3", "qwen3", seed=2, embedding_std=1.0)
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "shard-00000.h5", 40, 160)

    def exp(name, accumulate):
        p = tmp_path / f"{name}.toml"
        p.write_text(TOKENS.format(name=name, out=tmp_path / name, accumulate=accumulate, model=tmp_path / "qwen3",
                                   data=tmp_path / "data"))
        return p

    dp = torchrun(exp("dp", 1))
    assert dp.returncode == 0, dp.stdout + dp.stderr
    one = single(exp("one", 2))
    assert one.returncode == 0, one.stdout + one.stderr
    a, b = read_log(tmp_path / "dp"), read_log(tmp_path / "one")
    check_identical_ranks(a, 6)
    tokens = a["ranks/tokens"]
    assert (tokens[:, 1] == 0).all() and (tokens[:, 0] > 0).all(), tokens
    assert np.isfinite(a["steps/loss"]).all()
    diff = np.abs(a["steps/loss"] - b["steps/loss"]).max()
    print(f"rank 1 empty: max |loss difference| against 1 process = {diff:.3g}; rank tokens {tokens.tolist()}")
    assert diff <= 1e-6, (a["steps/loss"], b["steps/loss"])


def start_rank(exp: Path, rank: int, port: int, output: Path):
    env = clean_env() | dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=str(port))
    with open(output, "w") as f:
        return subprocess.Popen([str(CLI), "run", str(exp)], stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_stops_the_other_within_the_timeout(tmp_path, victim):
    """The two processes get torchrun's environment by hand (torchrun itself would end the
    survivor on its own when a worker dies)."""
    timeout = 20
    exp = write_embedded(tmp_path, "kill", steps=100000, timeout=timeout)
    port = free_port()
    procs = [start_rank(exp, r, port, tmp_path / f"rank{r}.txt") for r in (0, 1)]
    try:
        deadline = time.time() + 300
        while "step     4/" not in (tmp_path / "rank0.txt").read_text():
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "rank0.txt").read_text() + (tmp_path / "rank1.txt").read_text()
            time.sleep(0.2)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.time()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=timeout + 30)
        elapsed = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = (tmp_path / f"rank{1 - victim}.txt").read_text()
    print(f"rank {victim} killed: rank {1 - victim} exited {code} after {elapsed:.1f} s:\n{out[-600:]}")
    assert code == 1, out
    assert elapsed < timeout, elapsed
    assert f"rank {victim} stopped answering" in out or (victim == 0 and "rank 0, which hosts it, is gone" in out), out
    assert "frame #" not in out, out  # the sentence, not c10d's warnings with their C++ stack traces
    if victim == 1:
        log = read_log(tmp_path / "kill")
        assert len(log["steps/loss"]) >= 4 and np.isfinite(log["steps/loss"]).all()
        assert log["events"][-1] == "error" and "rank 1" in log["messages"][-1], log["messages"]


def test_resume_with_another_world_size_is_refused(tmp_path):
    exp = write_embedded(tmp_path, "resume", steps=3, extra="[checkpoint]\nenabled = true\n")
    one = single(exp)
    assert one.returncode == 0, one.stdout + one.stderr
    # Rank 1 says why it stops: rank 0's reason, read from the store torchrun's agent hosts. The
    # agent ends the other workers when one fails, on its next look (every 0.1 s by default: on a
    # busy machine, before rank 1 has said anything); every 5 s here.
    dp = torchrun(exp, "--resume", "latest", "--steps", "5", launcher=("--monitor-interval", "5"))
    assert dp.returncode != 0, dp.stdout + dp.stderr
    assert "it was trained by 1 process with [optimizer] accumulate = 1, this run has 2" in dp.stderr, dp.stderr
    assert "rank 0 stopped" in dp.stderr, dp.stderr


def test_resume_on_two_ranks_continues_exactly(tmp_path):
    """Rank 0 writes the checkpoints; every rank resumes from the same one, and steps 3..5
    repeat the uninterrupted run's losses and weight checksums."""
    import shutil

    exp = write_embedded(tmp_path, "ck", steps=6, extra="[checkpoint]\nenabled = true\nevery = 3\nkeep = 3\n")
    dp = torchrun(exp)
    assert dp.returncode == 0, dp.stdout + dp.stderr
    shutil.copytree(tmp_path / "ck", tmp_path / "again")
    again = torchrun(exp, "--out", str(tmp_path / "again"), "--resume",
                     str(tmp_path / "again" / "checkpoints" / "step_3"))
    assert again.returncode == 0, again.stdout + again.stderr
    with h5py.File(tmp_path / "ck" / "ck.h5", "r") as a, h5py.File(tmp_path / "again" / "ck.h5", "r") as b:
        assert list(b["steps/step"][:]) == list(range(6))
        assert (a["steps/loss"][:] == b["steps/loss"][:]).all(), (a["steps/loss"][:], b["steps/loss"][:])
        assert (a["ranks/weights_sum"][:] == b["ranks/weights_sum"][:]).all()


@pytest.mark.parametrize("policy", ["error", "warn"])
def test_a_rank_running_another_kernel_variant(tmp_path, policy):
    """Rank 1 is given dense_ref where rank 0 runs flash_cpu (hand-made environments, one
    experiment file per rank). With on_fallback = "error" every rank stops at step 0 naming
    rank 1; with "warn" the run finishes and the log shows each rank's variants."""
    exps = []
    for rank, kernel in ((0, "flash_cpu"), (1, "dense_ref")):
        p = write_embedded(tmp_path, f"variant{rank}", steps=3)
        text = p.read_text().replace('kernels = ["flash_cpu"]', f'kernels = ["{kernel}"]')
        text = text.replace('on_fallback = "error"', f'on_fallback = "{policy}"')
        p.write_text(text.replace(f'out = "{tmp_path / f"variant{rank}"}"', f'out = "{tmp_path / "variant"}"'))
        exps.append(p)
    port = free_port()
    procs = [start_rank(exps[r], r, port, tmp_path / f"rank{r}.txt") for r in (0, 1)]
    codes = [p.wait(timeout=300) for p in procs]
    outs = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    print(f"on_fallback = {policy}: exit codes {codes}")
    if policy == "error":
        assert codes == [1, 1], outs
        for out in outs:
            assert "kernel variants differ between ranks at step 0: rank 1 ran 'dense_ref' in attention call 0" in out, out
    else:
        assert codes == [0, 0], outs
        with h5py.File(tmp_path / "variant" / "variant0.h5", "r") as f:
            names = [n.decode() for n in f["kernels/names"][:]]
            ids = f["ranks/kernels_forward"][:]
            kinds = [k.decode() for k in f["events/kind"][:]]
            messages = [m.decode() for m in f["events/message"][:]]
        # per rank: its attention call, then the LM-head loss
        assert all(names[i].startswith("flash_cpu/") for i in ids[:, 0]), (names, ids)
        assert all(names[i].startswith("dense_ref") for i in ids[:, 2]), (names, ids)
        assert all(names[i] == "lm_head_ce/chunked" for i in ids[:, 1]) and (ids[:, 1] == ids[:, 3]).all(), (names, ids)
        assert kinds.count("fallback") == 3 and "rank 1 ran 'dense_ref'" in messages[kinds.index("fallback")]


def test_a_rank_that_never_comes_stops_rank_0_within_the_timeout(tmp_path):
    exp = write_embedded(tmp_path, "alone", steps=3, timeout=5)
    t0 = time.time()
    p = start_rank(exp, 0, free_port(), tmp_path / "rank0.txt")
    code = p.wait(timeout=60)
    elapsed, out = time.time() - t0, (tmp_path / "rank0.txt").read_text()
    print(f"rank 1 never started: rank 0 exited {code} after {elapsed:.1f} s")
    assert code == 1 and elapsed < 30, out
    assert "could not join the gloo process group of 2 ranks" in out and "within 5 s" in out, out


@pytest.mark.parametrize("env, message", [
    (dict(RANK="2", WORLD_SIZE="2"), 'environment variable RANK = "2" is not accepted'),
    (dict(RANK="0", WORLD_SIZE="two"), 'environment variable WORLD_SIZE = "two" is not accepted'),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="1"), "environment variable MASTER_ADDR is not set"),
])
def test_a_malformed_launch_is_a_sentence(tmp_path, env, message):
    exp = write_embedded(tmp_path, "bad", steps=1)
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=60,
                       env=clean_env() | env)
    assert p.returncode == 1 and message in p.stderr, p.stdout + p.stderr

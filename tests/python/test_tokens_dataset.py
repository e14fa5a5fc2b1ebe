"""The tokens dataset plugin reads what scripts/prepare-data writes.

prepare-data turns the test conversations into several shards; h5py's view of them
(token ids and loss mask per conversation, in file order) is written to a text file,
and the GoogleTest TokensDataset.ReadsShardsOfPrepareData (tests/test_tokens_dataset.cpp)
opens the shards with the plugin and checks that its rows reproduce it. The rest of the
plugin (split, order, packing, refusals) is tested there on shards written in C++.
"""
import os
import subprocess

import h5py
import pytest

import tokens_tiny_tokenizer as tt
from conftest import BINARY_DIR, CLI

GTEST = BINARY_DIR / "bin" / "test_tokens_dataset"


def test_plugin_reads_prepare_data_shards(tmp_path):
    if not GTEST.is_file():
        pytest.fail(f"{GTEST} was not found; build the target test_tokens_dataset")
    tokenizer = tt.make_tokenizer(tmp_path / "tokenizer", tt.PLAIN)
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    out = tmp_path / "shards"
    tt.prepare_data("--tokenizer", tokenizer, "--input", data, "--out", out, "--shard-size", 2)
    shards = sorted(out.glob("*.h5"))
    assert len(shards) >= 3

    expected = tmp_path / "expected.txt"
    conversations = 0
    with open(expected, "w") as f:
        for path in shards:
            with h5py.File(path, "r") as h:
                tokens, mask, offsets = h["tokens"][()], h["loss_mask"][()], h["offsets"][()]
            for a, b in zip(offsets[:-1], offsets[1:]):
                f.write(" ".join(map(str, tokens[a:b])) + "\n" + " ".join(map(str, mask[a:b])) + "\n")
                conversations += 1
    assert conversations == sum(1 for _, reason in tt.LINES if reason is None)

    env = dict(os.environ, FLASHDRAFT_TOKENS_SHARDS=str(out), FLASHDRAFT_TOKENS_EXPECTED=str(expected))
    p = subprocess.run([str(GTEST), "--gtest_filter=TokensDataset.ReadsShardsOfPrepareData"], env=env,
                       capture_output=True, text=True, timeout=300)
    out_text = p.stdout + p.stderr
    assert p.returncode == 0, out_text
    assert "[  PASSED  ] 1 test." in out_text and "SKIPPED" not in out_text, out_text


def test_schema_lists_the_keys():
    p = subprocess.run([str(CLI), "schema", "tokens"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    for key in ("path : string (required)", "seq_len : integer = 2048", "batch_size : integer = 4",
                "pack : boolean = false", "eval_fraction : float = 0.02", "eval_sequences : integer = -1",
                "shuffle : boolean = true", "seed : integer = 0", "split_seed : integer = 1",
                "min_loss_tokens : integer = 1"):
        assert key in p.stdout, p.stdout


def test_input_tokens_per_second_counts_real_tokens(tmp_path):
    """/steps/input_tokens_per_s is the rate of the batches' real input tokens (padding not
    counted, every micro-batch): conversations of one length L < seq_len, batch_size 4,
    accumulate 2 give 2 x 4 x L input tokens per step; /steps/tokens_per_s counts the labelled
    positions, fewer."""
    import numpy as np

    L, seq_len, rows = 40, 64, 24
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    tokens = rng.integers(1, 300, size=rows * L).astype(np.int32)
    mask = np.tile(np.r_[np.zeros(10), np.ones(L - 10)], rows).astype(np.uint8)
    with h5py.File(data / "shard-00000.h5", "w") as f:
        f["tokens"], f["loss_mask"] = tokens, mask
        f["offsets"] = np.arange(0, rows * L + 1, L, dtype=np.int64)
        f.attrs.update(format="flashdraft-tokens-v1", vocab_size=320, tokenizer="none (test ids)", source="test")
    exp = tmp_path / "run.toml"
    exp.write_text(f"""
[run]
name = "rate"
steps = 3
device = "cpu"
dtype = "float32"
out = "{tmp_path / 'out'}"
[attention]
kernels = ["dense_ref"]
[optimizer]
accumulate = 2
[target]
plugin = "random"
hidden = 64
vocab = 320
layers = 4
[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = 4
anchors = 3
target_layer_ids = [1, 2]
[dataset]
plugin = "tokens"
path = "{data}"
seq_len = {seq_len}
batch_size = 4
eval_sequences = 0
[mask]
plugin = "dflash"
[eval]
enabled = false
""")
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    with h5py.File(tmp_path / "out" / "rate.h5", "r") as f:
        seconds = f["steps/step_time_s"][()]
        real = f["steps/input_tokens_per_s"][()] * seconds
        labelled = f["steps/tokens_per_s"][()] * seconds
    print(f"input tokens per step {real}, labelled {labelled}")
    assert np.allclose(real, 2 * 4 * L, rtol=1e-9)
    assert np.all(labelled > 0) and np.all(labelled < real)

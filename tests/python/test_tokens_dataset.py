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

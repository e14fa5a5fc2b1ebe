"""scripts/prepare-data: conversations (JSONL, both shapes, malformed lines planted) ->
token shards, checked against transformers.

The loss mask is checked independently of how prepare-data computes it: each
conversation is rendered with apply_chat_template(tokenize=False), every reply is
located in that text after the turns before it (its content followed by <|end|>), and
a token must be in the mask exactly when its first character lies in a reply.
"""
import json

import h5py
import numpy as np
import pytest
from transformers import AutoTokenizer

import tokens_tiny_tokenizer as tt

SHARD_SIZE = 2


def expected_mask(tok, messages):
    """(ids, mask) of a conversation from its rendered text: the test templates write a
    message as <|role|>, a newline, its content and <|end|>; a reply's span is its
    content and that <|end|>."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for m in messages:
        header = f"<|{m['role']}|>\n"
        at = text.find(header, cursor)
        assert at >= 0, f"no {header!r} in {text!r} after {cursor}"
        start = at + len(header)
        end = start + len(m["content"])
        assert text.startswith(m["content"] + tt.END, start), f"{m['content']!r} + {tt.END} not at {start} of {text!r}"
        if m["role"] == "assistant":
            spans.append((start, end + len(tt.END)))
        cursor = end
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def read_shards(out):
    """Every shard of a folder, in name order, checked for the layout: a list of
    (input line, ids, mask) and the root attributes of each shard."""
    conversations, attributes = [], []
    for path in sorted(out.glob("*.h5")):
        with h5py.File(path, "r") as f:
            assert sorted(f.keys()) == ["lines", "loss_mask", "offsets", "tokens"], path
            tokens, mask, offsets, lines = (f[k][()] for k in ("tokens", "loss_mask", "offsets", "lines"))
            attributes.append(dict(f.attrs))
        assert tokens.dtype == np.int32 and mask.dtype == np.uint8 and offsets.dtype == np.int64, path
        assert tokens.ndim == mask.ndim == offsets.ndim == 1 and len(tokens) == len(mask), path
        assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > 0), path
        assert len(lines) == len(offsets) - 1, path
        for i, line in enumerate(lines):
            a, b = offsets[i], offsets[i + 1]
            conversations.append((int(line), tokens[a:b].tolist(), mask[a:b].tolist()))
    return conversations, attributes


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizers")
    return {name: tt.make_tokenizer(folder / name, template)
            for name, template in (("plain", tt.PLAIN), ("generation", tt.GENERATION), ("unstable", tt.UNSTABLE))}


@pytest.mark.parametrize("template,method,used", [
    ("plain", "auto", "prefix"),
    ("generation", "auto", "generation"),
    ("generation", "prefix", "prefix"),
])
def test_shards_and_loss_mask(tokenizers, tmp_path, template, method, used):
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    out = tmp_path / "shards"
    p = tt.prepare_data("--tokenizer", tokenizers[template], "--input", data, "--out", out,
                        "--shard-size", SHARD_SIZE, "--mask-method", method)

    # Every planted malformed line is reported with its number and reason, nothing else.
    planted = {n: reason for n, (_, reason) in enumerate(tt.LINES, start=1) if reason}
    reported = {}
    for line in p.stderr.splitlines():
        prefix = f"prepare-data: {data}:"
        if line.startswith(prefix):
            number, rest = line[len(prefix):].split(": skipped (", 1)
            reported[int(number)] = rest.split(")", 1)[0]
    assert reported == planted, p.stderr
    with open(out / "skipped.tsv") as f:
        rows = [r.rstrip("\n").split("\t") for r in f][1:]
    assert {int(r[0]): r[1] for r in rows} == planted
    assert f"skipped {len(planted)} lines" in p.stdout, p.stdout
    for reason in set(planted.values()):
        count = sum(1 for r in planted.values() if r == reason)
        assert f"  {reason}: {count} (" in p.stdout, p.stdout

    # The shards: layout, attributes, and every good line once, in order.
    good = [(n, obj) for n, (obj, reason) in enumerate(tt.LINES, start=1) if reason is None]
    conversations, attributes = read_shards(out)
    assert len(list(out.glob("*.h5"))) == -(-len(good) // SHARD_SIZE)
    assert [c[0] for c in conversations] == [n for n, _ in good]
    tok = AutoTokenizer.from_pretrained(tokenizers[template], local_files_only=True)
    for a in attributes:
        assert a["format"] == "flashdraft-tokens-v1"
        assert a["vocab_size"] == len(tok)
        assert a["tokenizer"] == str(tokenizers[template].resolve())
        assert a["source"] == str(data.resolve())
        assert a["loss_mask_method"] == used

    tokens = assistant = 0
    for (line, ids, mask), (_, obj) in zip(conversations, good):
        messages = tt.messages_of(obj)
        want_ids, want_mask = expected_mask(tok, messages)
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"], line
        assert ids == want_ids, line
        assert mask == want_mask, f"line {line}: loss mask\n got  {mask}\n want {want_mask}\n " \
                                  f"tokens {tok.convert_ids_to_tokens(ids)}"
        tokens += len(ids)
        assistant += sum(mask)
    assert f"wrote {len(good)} conversations in" in p.stdout
    assert f"({tokens} tokens, {assistant} assistant tokens;" in p.stdout, p.stdout


def test_max_length_truncates(tokenizers, tmp_path):
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    full, cut = tmp_path / "full", tmp_path / "cut"
    tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", data, "--out", full)
    whole = {line: (ids, mask) for line, ids, mask in read_shards(full)[0]}
    limit = 12
    p = tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", data, "--out", cut, "--max-length", limit)
    kept = {line: (ids, mask) for line, ids, mask in read_shards(cut)[0]}
    # A truncated conversation is the first `limit` tokens of the whole one; one whose
    # replies all lie beyond the limit is skipped, with its reason.
    dropped = [line for line, (ids, mask) in whole.items() if not any(mask[:limit])]
    assert sorted(set(whole) - set(kept)) == sorted(dropped)
    for line in dropped:
        assert f"{data}:{line}: skipped (no assistant token)" in p.stderr, p.stderr
    longer = [line for line in kept if len(whole[line][0]) > limit]
    assert longer, "no conversation was long enough to be truncated"
    for line, (ids, mask) in kept.items():
        assert ids == whole[line][0][:limit] and mask == whole[line][1][:limit], line
    assert f"truncated {len(longer) + len(dropped)} conversation" in p.stdout, p.stdout


def test_unstable_template_is_reported(tokenizers, tmp_path):
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    p = tt.prepare_data("--tokenizer", tokenizers["unstable"], "--input", data, "--out", tmp_path / "out",
                        check=False)
    assert p.returncode == 1, p.stdout + p.stderr  # every conversation is refused
    for n, (obj, reason) in enumerate(tt.LINES, start=1):
        if reason is None:
            # A prefix that ends before the last message renders it without "(last)".
            assert f"{data}:{n}: skipped (template not prefix-stable)" in p.stderr, p.stderr


def test_nothing_written_is_an_error(tokenizers, tmp_path):
    """Started as a user starts it (a process of its own; the other tests call its main())."""
    bad = tt.write_jsonl(tmp_path / "bad.jsonl", [line for line in tt.LINES if line[1]])
    p = tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", bad, "--out", tmp_path / "out", check=False,
                        subprocess_run=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "no conversation was written" in p.stderr
    assert not list((tmp_path / "out").glob("*.h5"))


def test_refuses_to_mix_with_existing_shards(tokenizers, tmp_path):
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    out = tmp_path / "out"
    tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", data, "--out", out)
    p = tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", data, "--out", out, check=False)
    assert p.returncode == 2 and "already holds shards (shard-00000.h5)" in p.stderr, p.stderr


def test_generation_method_needs_tags(tokenizers, tmp_path):
    data = tt.write_jsonl(tmp_path / "conversations.jsonl")
    p = tt.prepare_data("--tokenizer", tokenizers["plain"], "--input", data, "--out", tmp_path / "out",
                        "--mask-method", "generation", check=False)
    assert p.returncode == 2 and "no {% generation %} tags" in p.stderr, p.stderr

"""EAGLE-3 end to end on CPU.

1. CI training: a tiny random Llama checkpoint made with transformers (8 layers), a chat
   tokenizer trained here, conversations through scripts/prepare-data, then `flashdraft run`
   trains the eagle3 drafter against the target run online for 100 steps with flash_cpu: the
   loss falls, the per-step accuracy rises, `flashdraft validate` reports every unroll call's
   problem, and the log's kernel columns show the variant of every unroll call, forward and
   backward, and each unroll step's loss through the engine's LM-head op.
2. Export: a run on the embedded data writes the Hugging Face EAGLE-3 folder (also through
   `flashdraft export --format hf`); its config.json and tensors are the layout vLLM/SGLang
   load; a plain PyTorch drafter read from that folder and fed transformers' hidden states of
   the data's target (hidden_states[l + 1]) reproduces the engine's chain-drafted proposals and
   validation loss (the engine imports the folder through [drafter] init).
"""
import json
import math
import random
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import BINARY_DIR, CLI
from drafts import by_row
from hf_models import make_model
from test_eagle3_oracle import rms_norm, rope
from tokens_tiny_tokenizer import CORPUS, PLAIN, make_tokenizer, prepare_data

TTT = 4
TRAIN = """
[run]
name = "eagle3_tiny"
seed = 0
steps = 100
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 10

[attention]
kernels = ["flash_cpu"]
on_fallback = "error"

[optimizer]
lr = 5e-3
warmup_steps = 5

[target]
plugin = "hf"
path = "{model}"

[drafter]
plugin = "eagle3"
heads = 4
kv_heads = 2
intermediate_size = 128
ttt_steps = {ttt}
draft_vocab = 160
rope_theta = 10000.0

[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 64
batch_size = 4
eval_sequences = 8

[mask]
plugin = "eagle3_ttt"
"""


def conversations(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        q, a = rng.choice(CORPUS), rng.choice(CORPUS)
        yield {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a + " " + a}]}


def names_of(f):
    return [n.decode() if isinstance(n, bytes) else n for n in f["kernels/names"][:]]


def test_eagle3_trains_against_an_online_hf_target(tmp_path):
    tok = make_tokenizer(tmp_path / "tokenizer", PLAIN)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in conversations(200)))
    prepare_data("--tokenizer", tok, "--input", jsonl, "--out", tmp_path / "data")
    make_model(tmp_path / "llama", "llama", seed=2, embedding_std=1.0, vocab_size=320, num_hidden_layers=8)
    exp = tmp_path / "eagle3_tiny.toml"
    exp.write_text(TRAIN.format(out=tmp_path / "run", model=tmp_path / "llama", data=tmp_path / "data", ttt=TTT))
    v = subprocess.run([str(CLI), "validate", str(exp)], capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    assert f"{TTT} distinct problems" in v.stdout and "flash_cpu: selected" in v.stdout, v.stdout
    for i in range(TTT):
        assert f"call {i}: cpu float Lq" not in v.stdout  # the problem is printed in full
        assert f"Lq=64 Lkv={64 * (i + 1)}" in v.stdout, v.stdout
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "fc reads" not in p.stdout  # 8 layers: the default ids {1, 3, 4}, no fallback note
    assert "auto: selected: lm_head_ce/chunked" in p.stdout, p.stdout  # each unroll step's loss through the op
    with h5py.File(tmp_path / "run" / "eagle3_tiny.h5", "r") as f:
        loss = f["steps/loss"][:]
        acc = f["steps/position_accuracy"][:]
        assert len(loss) == 100 and acc.shape == (100, TTT)
        first, last = loss[:10].mean(), loss[-10:].mean()
        acc_first, acc_last = acc[:10].mean(0), acc[-10:].mean(0)
        print(f"loss: first 10 steps {first:.4f}, last 10 steps {last:.4f}")
        print("per-step accuracy, first 10 steps:", np.round(acc_first, 3), "last 10:", np.round(acc_last, 3))
        assert last < 0.85 * first, (first, last)
        assert (acc_last > acc_first + 0.05).all(), (acc_first, acc_last)
        names = names_of(f)
        fwd, bwd = f["kernels/forward"][:], f["kernels/backward"][:]
        assert fwd.shape[1] == TTT + 8, fwd.shape  # the unroll calls, then the target's 8 layers
        for col in range(TTT):
            assert all(names[i].startswith("flash_cpu/fwd/") for i in fwd[:, col]), (col, names)
            assert all(names[i].startswith("flash_cpu/bwd/") for i in bwd[:, col]), (col, names)
        # The loss of every unroll step through the engine's LM-head op (chunked on the CPU).
        assert all(names[i] == "lm_head_ce/chunked" for i in f["kernels/loss"][:].ravel()), names
        names = f["steps"].attrs["position_names"]
        names = names.decode() if isinstance(names, bytes) else names
        assert names.split("\n") == [f"step {i}" for i in range(TTT)], names  # the unroll steps, named
        loss_kernel = f.attrs["loss_kernel"]
        loss_kernel = loss_kernel.decode() if isinstance(loss_kernel, bytes) else loss_kernel
        assert loss_kernel.startswith("lm_head_ce/chunked"), loss_kernel
        print("unroll-call kernels:", sorted({names[i] for i in np.concatenate([fwd[:, :TTT], bwd[:, :TTT]]).ravel()}))


# --- export and a plain PyTorch reader ---------------------------------------------------------

EMBEDDED = """
[run]
name = "{name}"
seed = 0
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 100
[attention]
kernels = ["dense_ref"]
[optimizer]
lr = 1e-2
warmup_steps = 5
[drafter]
plugin = "eagle3"
heads = 4
kv_heads = 2
intermediate_size = 64
ttt_steps = 3
draft_vocab = 96
rope_theta = 10000.0
eval_blocks = 8
init = "{init}"
[dataset]
plugin = "embedded"
vocab = 128
hidden = 32
layers = 4
heads = 4
seq_len = 48
prompt_len = 8
train_sequences = 64
eval_sequences = 8
exported_layers = [0, 1, 2, 3]
batch_size = 4
seed = 77
[mask]
plugin = "eagle3_ttt"
[eval]
enabled = true
{target}"""


def embedded_experiment(folder, name, out, steps=30, init="", target=None):
    path = folder / f"{name}.toml"
    path.write_text(EMBEDDED.format(name=name, out=out, steps=steps, init=init,
                                    target=f'[target]\nplugin = "hf"\npath = "{target}"\n' if target else ""))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_export")
    out = root / "run"
    exp = embedded_experiment(root, "drafter", out)
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Hugging Face EAGLE-3 layout" in p.stdout, p.stdout
    return dict(root=root, out=out, folder=out / "drafter.hf", target=next((out / "data").glob("*.target")))


EXPECTED = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"]


def test_export_layout(trained, tmp_path):
    again = tmp_path / "exported"
    p = subprocess.run([str(CLI), "export", str(trained["out"] / "drafter.h5"), "--format", "hf", str(again)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "EAGLE-3" in p.stdout
    for folder in (trained["folder"], again):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
        assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 4, 2, 8)
        assert (cfg["intermediate_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (64, 128, 96)
        assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
        assert cfg["max_position_embeddings"] == 2048 and cfg["rope_theta"] == 10000.0
        # 4 target layers: ids spread evenly {0, 1, 2}; the file holds vLLM's "input of layer l + 1".
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert cfg["flashdraft"]["target_layer_ids"] == [0, 1, 2]
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == sorted(EXPECTED)
            assert f.get_slice("d2t").get_dtype() == "I64" and f.get_slice("t2d").get_dtype() == "BOOL"
            assert f.get_slice("fc.weight").get_shape() == [32, 96]
            assert f.get_slice("midlayer.self_attn.q_proj.weight").get_shape() == [32, 64]
            assert f.get_slice("lm_head.weight").get_shape() == [96, 32]
        w = load_file(str(folder / "model.safetensors"))
        ids = torch.arange(96) + w["d2t"]
        assert torch.equal(w["t2d"].nonzero().flatten(), ids)  # the two maps agree
    a, b = load_file(str(trained["folder"] / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in EXPECTED)


@pytest.mark.parametrize("change,expected", [
    (dict(rope_theta=500000.0), "rope_theta 500000 with RoPE scaling \"default\", but the experiment's drafter has 10000"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)),
     "with RoPE scaling \"llama3\" (factor 8, original_max_position_embeddings 8192, low / high_freq_factor 1 / 4), "
     "but the experiment's drafter has 10000 with \"default\""),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_scaling.rope_type: \"dynamic\" is not a RoPE"),
])
def test_import_of_another_rope_is_refused(trained, tmp_path, change, expected):
    """A folder whose RoPE is not the experiment's drafter's (another base, a Llama 3.1 scaling, a type the drafter
    does not compute) is refused at import with a sentence; before, the importer read neither and ran the folder's
    weights under the experiment's RoPE."""
    folder = tmp_path / "other"
    shutil.copytree(trained["folder"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    exp = embedded_experiment(tmp_path, "import", tmp_path / "run", steps=1, init=folder)
    p = subprocess.run([str(CLI), "validate", str(exp)], capture_output=True, text=True, timeout=300)
    line = p.stderr.strip().splitlines()[0] if p.stderr.strip() else ""
    print(line)
    assert p.returncode == 2 and expected in line, p.stdout + p.stderr


def chain_draft(w, cfg, hs, tokens, prompt_len):
    """The exported drafter, plain PyTorch, on one row: per unroll step the greedy tokens at
    every position (chain drafting) and the soft cross-entropy loss against the target's
    distribution, as plugins/eagle3 defines them. hs: transformers' hidden_states of the row."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    H, Hq, Hkv, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    aux = [i - 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    n, S = cfg["flashdraft"]["ttt_steps"], tokens.shape[0]
    ids = torch.arange(cfg["draft_vocab_size"]) + w["d2t"]
    h = torch.cat([hs[l + 1][0] for l in aux], -1) @ w["fc.weight"].T                     # [S, H]
    target_logits = hs[-1][0] @ TARGET["head"].T                                          # final-normed state
    in_draft = w["t2d"][target_logits.argmax(-1)]
    probs = torch.softmax(target_logits[:, ids], -1)
    tok_in = torch.cat([tokens[1:], torch.zeros(1, dtype=torch.long)])
    ks, vs, chains, parts = [], [], [], []
    t = torch.arange(S)[:, None]
    for i in range(n):
        x = torch.cat([rms_norm(TARGET["emb"][tok_in], w["midlayer.input_layernorm.weight"], eps),
                       rms_norm(h, w["midlayer.hidden_norm.weight"], eps)], -1)
        proj = lambda name, k: (x @ w[f"midlayer.self_attn.{name}.weight"].T).view(S, k, D).transpose(0, 1)
        q = rope(proj("q_proj", Hq), theta, i)  # step i of column t at position t + i
        ks.append(rope(proj("k_proj", Hkv), theta, i))
        vs.append(proj("v_proj", Hkv))
        k = torch.cat(ks, 1).repeat_interleave(Hq // Hkv, 0)
        v = torch.cat(vs, 1).repeat_interleave(Hq // Hkv, 0)
        s = torch.arange((i + 1) * S)[None]
        visible = ((s < S) & (s % S <= t)) | ((s >= S) & (s % S == t))
        a = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~visible, float("-inf")), -1) @ v
        mid = h + a.transpose(0, 1).reshape(S, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        n2 = rms_norm(mid, w["midlayer.post_attention_layernorm.weight"], eps)
        h = mid + (torch.nn.functional.silu(n2 @ w["midlayer.mlp.gate_proj.weight"].T) *
                   (n2 @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        logits = rms_norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
        greedy = ids[logits.argmax(-1)]
        chains.append(greedy)
        pos = torch.arange(S)
        counted = (pos + 2 + i < S) & (pos + 2 + i >= prompt_len)
        counted[: S - 1 - i] &= in_draft[1 + i:]
        p = torch.zeros(S, len(ids))
        p[: S - 1 - i] = probs[1 + i:]
        ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
        parts.append((float((ce * counted).sum()), int(counted.sum())))
        tok_in = greedy
    return chains, parts


TARGET = {}


def test_plain_pytorch_reader_reproduces_the_engine(trained, tmp_path):
    exp = embedded_experiment(tmp_path, "blocks", trained["out"], init=trained["folder"], target=trained["target"])
    tool = BINARY_DIR / "bin" / "eval_blocks"
    p = subprocess.run([str(tool), str(exp), str(tmp_path / "blocks.safetensors")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    print(p.stdout.strip())
    dump = by_row(load_file(str(tmp_path / "blocks.safetensors")))
    cfg = json.loads((trained["folder"] / "config.json").read_text())
    w = load_file(str(trained["folder"] / "model.safetensors"))
    target = transformers.AutoModelForCausalLM.from_pretrained(trained["target"], dtype=torch.float32).eval()
    TARGET["emb"], TARGET["head"] = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    tokens, anchors, valid, pred = dump["tokens"], dump["anchors"], dump["block_valid"].bool(), dump["predictions"]
    R = tokens.shape[0]
    per_batch = R // len(dump["loss"])
    same = total = 0
    losses, rows, row_chains = [], [], []
    with torch.no_grad():
        for r in range(R):
            hs = target(input_ids=tokens[r:r + 1], output_hidden_states=True).hidden_states
            chains, parts = chain_draft(w, cfg, hs, tokens[r], prompt_len=8)
            row_chains.append(chains)
            for n in range(anchors.shape[1]):
                if not valid[r, n]:
                    continue
                t = int(anchors[r, n]) - 1
                for j in range(1, pred.shape[2]):
                    same += int(pred[r, n, j]) == int(chains[j - 1][t])
                    total += 1
            rows.append(parts)
            if (r + 1) % per_batch == 0:  # the engine pools a batch's rows per unroll step
                losses.append(sum(0.8 ** i * sum(p[i][0] for p in rows) / max(sum(p[i][1] for p in rows), 1)
                                  for i in range(len(parts))))
                rows = []
    err = max(abs(a - float(b)) / abs(float(b)) for a, b in zip(losses, dump["loss"]))
    print(f"reader vs engine: {same} of {total} chain-drafted proposals equal; validation loss per batch "
          f"max relative error {err:.1e}")
    assert total > 0 and same == total
    assert err <= 1e-5
    # Served validation (chain drafting as served): from the current position a the chain at
    # column a - 1 proposes min(ttt_steps, end - a - 1) tokens, the target accepts the leading
    # ones equal to its greedy text (the data: the embedded data is its target's greedy
    # output) plus its own next token, a moves on by what was produced. The reader's chains
    # give the same walk, response by response.
    spans = dump["served_responses"].tolist()
    acc, off = dump["served_acceptance"].tolist(), dump["served_acceptance_offsets"].tolist()
    steps = produced = 0
    for i, (r, prompt, end) in enumerate(spans):
        walk, a = [], prompt
        while a + 1 < end:
            count = min(cfg["flashdraft"]["ttt_steps"] + 1, end - a) - 1
            proposals = [int(row_chains[r][j][a - 1]) for j in range(count)]
            k = 0
            while k < count and proposals[k] == int(tokens[r, a + 1 + k]):
                k += 1
            n = min(k + 1, end - a - 1)
            walk.append(n)
            a += n
        assert acc[off[i]:off[i + 1]] == walk, (r, acc[off[i]:off[i + 1]], walk)
        steps += len(walk)
        produced += sum(walk)
    print(f"served chain drafting: {len(spans)} responses, {steps} steps, tau_served {produced / steps:.4f} "
          f"(engine {float(dump['tau_served']):.4f}, on the data's tokens {float(dump['tau_served_data']):.4f})")
    assert produced / steps == float(dump["tau_served"]) == float(dump["tau_served_data"])
    assert max(acc) > 2, "some step must accept more than one proposal"

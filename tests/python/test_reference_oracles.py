"""The public reference implementations as the oracles of our exports (CPU, float32).

A tiny random Qwen3 target (hf_models.make_model: 4 layers, hidden 64, vocabulary 320, tied
embeddings drawn with std 0.15: soft distributions, so that KL and CE labels differ; nothing
downloaded), a chat tokenizer trained here and conversations through scripts/prepare-data.
`flashdraft run` trains, against the target run online, a 1-layer DFlash drafter (60 steps;
labels = the target's distribution, "target_kl", as speculators trains) and an EAGLE-3 drafter
(30 steps), both with RoPE base 100 (a position off by one moves their outputs visibly), and
exports both Hugging Face folders. tests/tools/eval_blocks dumps one validation of each folder:
its held-out rows, anchors, block proposals and the loss of every batch. The references are
installed by scripts/install-deps (dflash==0.1.0, speculators==0.9.0, --no-deps on our torch
and transformers).

1. z-lab's dflash (what `dflash_generate` serves): DFlashDraftModel.from_pretrained(folder)
   reports no missing, unexpected or mismatched key; every tensor is bit-identical to the
   safetensors file and to the run's weights; the config values the reference reads
   (block_size, mask_token_id, target_layer_ids, num_target_layers, is_causal) are the ones we
   trained with. Its forward, fed transformers' hidden_states[L + 1] through its own
   extract_context_feature, proposes our tokens for every labelled block position and gives our
   validation loss (1e-5 relative).
   A 2-layer drafter whose first layer is "sliding_attention" (window 5, inside the block of
   8) exports layer_types / sliding_window, and z-lab's forward equals ours the same way; the
   same weights read with every layer full do not (so the window is what makes them equal).
   The same for a drafter with YaRN's RoPE (rope_parameters: factor 4, pretraining length 16)
   against the same weights read with a plain RoPE.

2. vLLM's speculators, DFlash: its converter (speculators.convert.dflash) accepts the folder
   and validates what it saved; its model (speculators.models.dflash) loads it with our tensors,
   the aux layer ids L + 1 (speculators reads hidden_states[id]) and our mask token. Its own
   training forward and loss (DFlashDraftModel.forward: its anchored-block mask, its targets
   from the verifier's last hidden state, its losses.utils.loss_function) run on each held-out
   batch packed as one row, one document per row (speculators' layout), with OUR anchors (its
   random select_anchors is replaced by the dump's) and our position weights (gamma = 5 passed
   to its dflash_loss_decay: w_j = exp(-(j - 1) / gamma), 0 at the anchor). Normalisation, as
   speculators 0.9.0 does it (losses/utils.py loss_function, per packed row, float32):
       L_spec = sum_i m_i w_i l_i / (sum_i m_i + 1e-5)
   with m_i = 1 on block positions j >= 1 of valid anchors whose token carries the data's loss
   mask (the count of labelled positions), l_i = KL(p_target || q_draft) ("kl_div") or the CE
   against the target's argmax ("ce"). Ours: normalisation = "positions" (the default) divides
   by the same count, "weights" by sum_i w_i; so L_spec = L_positions * n / (n + 1e-5) =
   L_weights * sum(w) / (n + 1e-5). Checked within 1e-5 relative for target_kl / positions,
   target_kl / weights and target_argmax / positions (speculators has no data-token labels:
   its targets are always the verifier's logits). speculators' DFlash attends bidirectionally
   inside a block in full-attention layers whatever the config says: a folder with
   is_causal = true is not what it computes, and is refused here.

3. vLLM's speculators, EAGLE-3: it has no from_pretrained for a folder in the vLLM/SGLang
   layout we export (SpeculatorModel.from_pretrained auto-converts DFlash folders only); its
   Eagle3Converter is the loader. It ignores the folder's eagle_config ids (without them it
   would fall back to [2, L // 2, L - 3], not distinct for a 4-layer target, and fail), so they
   are passed to it from our config.json; it loads with strict=False (missing or unexpected keys
   are only logged), so the keys are checked here: the converted checkpoint holds exactly our
   tensors (midlayer.* renamed layers.0.*), the run's weights, bit for bit, and Eagle3DraftModel adds only what it
   fills from the verifier. Eagle3DraftModel.from_pretrained leaves embed_tokens as the
   loader's uninitialised memory under transformers 5.23 (it reloads it from the verifier only
   when that memory happens to be NaN): the test sets it to NaN and calls its
   load_verifier_weights() again. Its forward teacher-forces the unroll, so the chain (each step
   fed its own greedy token, mapped to a target id with d2t as vLLM does) is driven here
   through its modules: fc, its first decoder layer with its KV cache, its dense mask
   (create_combined_mask_mod, extend_dense_mask_for_draft_tokens), rotary_emb, norm, lm_head.
   With OUR RoPE positions (every unroll step of column t at position t) the chains equal our
   validation's proposals at every held-out position and our validation loss recomputed from
   its logits equals ours (1e-5). speculators (its forward: position_ids + 1 per unroll step)
   and vLLM (EagleProposer: positions += 1 per drafted token) rotate step i of column t at
   t + i: with those positions 7 of 192 proposals differ and the loss by about 1e-3 here. That
   test is an expected failure (strict) until plugins/eagle3 rotates step i at t + i.

   An EAGLE-3 drafter with Llama 3.1's RoPE scaling (rope_type "llama3": factor 4 over a
   pretraining length of 16) exports rope_scaling as the published Llama 3.1 drafters write it;
   speculators' model builds its rotary embedding from it, and its chains equal ours the same way.

4. DFlash-2 (plugins/dflash2, 60 steps, 3 convolution taps, top-8 selector): z-lab's
   DFlash2DraftModel.from_pretrained loads the folder with no missing, unexpected or mismatched
   key (its codebooks stored without ".weight", as speculators and the MLX loader name them),
   every tensor bit-identical; its forward and candidate selector, fed the data's token before
   each block position, choose our validation's proposal at every labelled position.
   speculators has no converter for a DFlash-2 folder: its dflash2 model is built from the
   folder's config and loads our tensors strictly; its training loss (unary KL or CE, plus the
   selector's cross-entropy over its training candidates, alpha 1) with our anchors equals
   ours normalised as it normalises (1e-5). The test of the served loop against
   dflash_generate with DFlash2DraftModel is in test_served_tau.py.
"""
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import BINARY_DIR, CLI, SOURCE_DIR
from drafts import by_row
from hf_models import make_model
from tokens_tiny_tokenizer import CORPUS, PLAIN, make_tokenizer, prepare_data

TOL = 1e-5
BS, ANCHORS, IDS, GAMMA = 8, 4, [1, 2], 5.0
TARGET_LAYERS, VOCAB = 4, 320
TTT = 3
ROPE_THETA = 100.0  # a small base: a position off by one moves the drafters' outputs visibly

COMMON = """
[run]
name = "{name}"
seed = 0
steps = {steps}
device = "cpu"
dtype = "float32"
out = "{out}"
print_every = 100
[attention]
kernels = ["flash_cpu"]
[optimizer]
lr = {lr}
warmup_steps = 5
[target]
plugin = "hf"
path = "{target}"
[dataset]
plugin = "tokens"
path = "{data}"
seq_len = 64
batch_size = 4
eval_sequences = 8
[eval]
enabled = {eval}
served = false
"""

DFLASH = """
[drafter]
plugin = "dflash"
layers = 1
heads = 4
kv_heads = 2
block_size = {bs}
anchors = {anchors}
target_layer_ids = {ids}
gamma = {gamma}
rope_theta = {rope_theta}
labels = "{labels}"
normalisation = "{normalisation}"
init = "{init}"
[mask]
plugin = "dflash"
"""

# DFlash-2 (plugins/dflash2): DFlash's table and its own keys, 3 convolution taps, small codebooks.
DFLASH2 = DFLASH.replace('plugin = "dflash"\nlayers', 'plugin = "dflash2"\nconv_kernel_size = {kernel}\n'
                         'conv_group_size = {group}\nselector_rank = {rank}\nselector_top_k = {top_k}\nlayers', 1)
KERNEL, GROUP, RANK, TOP_K = 3, 8, 16, 8
# DFlash-2 with z-lab's scales and cap (dflash_config input_embedding_scale, output_multiplier, final_logit_softcapping):
# its selector re-ranks the logits as served.
DFLASH2_SCALED = DFLASH2.replace("rope_theta = {rope_theta}\n", "rope_theta = {rope_theta}\ninput_embedding_scale = 2.0\n"
                                 "output_multiplier = 1.5\nfinal_logit_softcapping = 4.0\n", 1)
# DFlash with a sliding-window layer first (window 5 < the block of 8: the window cuts inside
# the block too) and a full one after it.
WINDOW = 5
DFLASH_SLIDING = DFLASH.replace("layers = 1\n", 'layers = 2\nlayer_types = ["sliding_attention", "full_attention"]\n'
                                                "sliding_window = {window}\n", 1)
# DFlash with YaRN's RoPE (z-lab's Qwen3.5 / 3.6 drafters' kind): factor 4 over a pretraining length of 16, so that
# at base 100 and heads of 16 the slow 6 of 8 frequencies are divided by 4 and cos / sin scaled by 0.1 ln 4 + 1.
YARN_FACTOR, YARN_ORIGINAL = 4.0, 16
DFLASH_YARN = DFLASH.replace("rope_theta = {rope_theta}\n", "rope_theta = {rope_theta}\nrope_type = \"yarn\"\n"
                             f"rope_factor = {YARN_FACTOR}\nrope_original_max_position = {YARN_ORIGINAL}\n", 1)

EAGLE3 = """
[drafter]
plugin = "eagle3"
heads = 4
kv_heads = 2
intermediate_size = 128
ttt_steps = {ttt}
draft_vocab = 160
rope_theta = {rope_theta}
eval_blocks = 8
init = "{init}"
[mask]
plugin = "eagle3_ttt"
"""
# EAGLE-3 with Llama 3.1's RoPE scaling (the published Llama 3.1 EAGLE-3 drafters' kind).
LLAMA3_FACTOR, LLAMA3_ORIGINAL = 4.0, 16
EAGLE3_LLAMA3 = EAGLE3.replace("rope_theta = {rope_theta}\n", "rope_theta = {rope_theta}\nrope_type = \"llama3\"\n"
                               f"rope_factor = {LLAMA3_FACTOR}\nrope_original_max_position = {LLAMA3_ORIGINAL}\n", 1)


# One thread per process: tiny problems, a 2-core machine often busy with other work (a CPU run
# with spinning worker threads on a loaded machine is many times slower).
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli(*args, timeout=600):
    p = subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def eval_blocks(exp: Path, out: Path):
    tool = BINARY_DIR / "bin" / "eval_blocks"
    if not tool.exists():
        pytest.fail(f"{tool} was not built")
    p = subprocess.run([str(tool), str(exp), str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    return by_row(load_file(str(out)))


def experiment(path: Path, drafter: str, target_plugin="hf", **keys) -> Path:
    common = COMMON.format(**keys).replace('[target]\nplugin = "hf"', f'[target]\nplugin = "{target_plugin}"')
    path.write_text(common + drafter.format(**keys))
    return path


def trained(log: Path):
    """A drafter that learnt something: the training loss fell."""
    with h5py.File(log, "r") as f:
        loss = f["steps/loss"][:]
    first, last = loss[:5].mean(), loss[-5:].mean()
    print(f"{log.name}: training loss, first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last < 0.8 * first, (first, last)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The target, the tokenizer, the data; the target as transformers runs it; the data's rows
    (tokens, loss mask) to find a held-out row's loss mask by its tokens."""
    root = tmp_path_factory.mktemp("oracles")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from loguru import logger
    logger.disable("speculators")  # its converters log every step at INFO
    transformers.utils.logging.disable_progress_bar()
    tok = make_tokenizer(root / "tokenizer", PLAIN)
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        q, a = rng.choice(CORPUS), rng.choice(CORPUS)
        lines.append(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": a + " " + a}]}) + "\n")
    (root / "chat.jsonl").write_text("".join(lines))
    prepare_data("--tokenizer", tok, "--input", root / "chat.jsonl", "--out", root / "data")
    model = make_model(root / "qwen3", "qwen3", seed=2, embedding_std=0.15, vocab_size=VOCAB,
                       num_hidden_layers=TARGET_LAYERS)
    with h5py.File(next((root / "data").glob("*.h5")), "r") as f:
        tokens, mask, offsets = f["tokens"][:], f["loss_mask"][:], f["offsets"][:]
    rows = [(torch.from_numpy(tokens[a:b].astype("int64")), torch.from_numpy(mask[a:b].astype("int64")))
            for a, b in zip(offsets, offsets[1:])]
    yield dict(root=root, target_dir=root / "qwen3", data=root / "data", target=model, rows=rows)
    torch.set_num_threads(threads)


def loss_mask_of(world, tokens):
    """The data's loss mask of a held-out row (its first len(tokens) positions)."""
    for t, m in world["rows"]:
        if len(t) >= len(tokens) and torch.equal(t[:len(tokens)], tokens):
            return m[:len(tokens)]
    raise AssertionError("a held-out row is not in the data")


def target_pass(world, tokens):
    """transformers on one row: hidden_states (index 0 = embeddings), logits, and the last
    decoder layer's output before the final norm (speculators' verifier_last_hidden_states)."""
    target, last = world["target"], {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = target(input_ids=tokens[None], output_hidden_states=True)
    finally:
        hook.remove()
    return out.hidden_states, out.logits[0], last["x"][0]


def train_dflash(world, name, template, layout, dumps):
    """A drafter of the DFlash family trained against the online target (labels target_kl, 60
    steps): its folder, its weights, and one validation dump per (labels, normalisation) in
    `dumps` of the same folder."""
    root = world["root"] / name
    root.mkdir()
    keys = dict(out=root / "run", target=world["target_dir"], data=world["data"], bs=BS, anchors=ANCHORS, ids=IDS,
                gamma=GAMMA, rope_theta=ROPE_THETA, lr=1e-2, kernel=KERNEL, group=GROUP, rank=RANK, top_k=TOP_K,
                window=WINDOW)
    keys["target_plugin"] = world.get("target_plugin", "hf")
    exp = experiment(root / "train.toml", template, name=name, steps=60, eval="false", labels="target_kl",
                     normalisation="positions", init="", **keys)
    out = cli("run", exp)
    assert f"Hugging Face {layout} layout" in out, out
    trained(root / "run" / f"{name}.h5")
    folder = root / "run" / f"{name}.hf"
    out = {}
    for labels, normalisation in dumps:
        tag = f"{labels}_{normalisation}"
        exp = experiment(root / f"{tag}.toml", template, name=tag, steps=1, eval="true", labels=labels,
                         normalisation=normalisation, init=folder, **keys)
        out[(labels, normalisation)] = eval_blocks(exp, root / f"{tag}.safetensors")
    with h5py.File(root / "run" / f"{name}.weights.h5", "r") as f:
        weights = {k: torch.from_numpy(f["weights"][k][()]) for k in f["weights"]}
    return dict(folder=folder, weights=weights, dumps=out)


@pytest.fixture(scope="module")
def dflash(world):
    return train_dflash(world, "dflash", DFLASH, "DFlash", [("target_kl", "positions"), ("target_kl", "weights"),
                                                          ("target_argmax", "positions")])


@pytest.fixture(scope="module")
def stablelm_world(world):
    """The same data with a StableLM target (LayerNorms with biases, a quarter of each head rotated, an untied LM head:
    an architecture the hf target does not read), its states dumped by scripts/dump-hidden-states (layers IDS and the
    last) and read through the cache target."""
    root = world["root"] / "stablelm"
    config = transformers.StableLmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         partial_rotary_factor=0.25, max_position_embeddings=256)
    torch.manual_seed(4)
    model = transformers.StableLmForCausalLM(config).eval()
    with torch.no_grad():  # (world's kind of rows: soft distributions, so that KL and CE labels differ)
        model.get_input_embeddings().weight.normal_(0, 0.15)
        model.lm_head.weight.normal_(0, 0.15)
    model.save_pretrained(root / "target")
    p = subprocess.run([sys.executable, str(SOURCE_DIR / "scripts" / "dump-hidden-states"), "--model",
                        str(root / "target"), "--data", str(world["data"]), "--layers",
                        ",".join(map(str, [*IDS, TARGET_LAYERS - 1])), "--out", str(root / "cache"), "--device", "cpu",
                        "--dtype", "float32"], capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    return {**world, "root": root, "target": model, "target_dir": root / "cache", "target_plugin": "cache"}


@pytest.fixture(scope="module")
def dflash_stablelm(stablelm_world):
    return train_dflash(stablelm_world, "dflash_stablelm", DFLASH, "DFlash", [("target_kl", "positions")])


@pytest.fixture(scope="module")
def dflash_sliding(world):
    return train_dflash(world, "dflash_sliding", DFLASH_SLIDING, "DFlash", [("target_kl", "positions")])


@pytest.fixture(scope="module")
def dflash_yarn(world):
    return train_dflash(world, "dflash_yarn", DFLASH_YARN, "DFlash", [("target_kl", "positions")])


@pytest.fixture(scope="module")
def dflash2(world):
    return train_dflash(world, "dflash2", DFLASH2, "DFlash-2", [("target_kl", "positions"),
                                                               ("target_argmax", "positions")])


def train_eagle3(world, name, template):
    root = world["root"] / name
    root.mkdir()
    keys = dict(out=root / "run", target=world["target_dir"], data=world["data"], ttt=TTT, rope_theta=ROPE_THETA,
                lr=5e-3)
    out = cli("run", experiment(root / "train.toml", template, name=name, steps=30, eval="false", init="", **keys))
    assert "Hugging Face EAGLE-3 layout" in out, out
    trained(root / "run" / f"{name}.h5")
    folder = root / "run" / f"{name}.hf"
    dump = eval_blocks(experiment(root / "eval.toml", template, name="eval", steps=1, eval="true", init=folder,
                                  **keys), root / "eval.safetensors")
    with h5py.File(root / "run" / f"{name}.weights.h5", "r") as f:
        weights = {k: torch.from_numpy(f["weights"][k][()]) for k in f["weights"]}
    return dict(root=root, folder=folder, dump=dump, weights=weights)


@pytest.fixture(scope="module")
def dflash2_scaled(world):
    return train_dflash(world, "dflash2_scaled", DFLASH2_SCALED, "DFlash-2", [("target_kl", "positions")])


@pytest.fixture(scope="module")
def eagle3(world):
    return train_eagle3(world, "eagle3", EAGLE3)


@pytest.fixture(scope="module")
def eagle3_llama3(world):
    return train_eagle3(world, "eagle3_llama3", EAGLE3_LLAMA3)


def batches(dump):
    rows = dump["tokens"].shape[0] // len(dump["loss"])
    return [range(b * rows, (b + 1) * rows) for b in range(len(dump["loss"]))]


def rel(a, b):
    return abs(float(a) - float(b)) / abs(float(b))


# --- 1. z-lab's dflash -------------------------------------------------------------------

def test_dflash_reference_loads_the_export_and_reproduces_our_validation(world, dflash):
    from dflash.model import DFlashDraftModel

    folder = dflash["folder"]
    model, info = DFlashDraftModel.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    state, stored = model.state_dict(), load_file(str(folder / "model.safetensors"))
    assert sorted(state) == sorted(stored) == sorted(dflash["weights"])
    for name, t in stored.items():
        assert t.dtype == torch.float32 and torch.equal(state[name], t), name
        assert torch.equal(t, dflash["weights"][name]), name
    # What the reference reads, as we trained it.
    # ([drafter] mask_token = -1: the target's last id)
    assert (model.block_size, model.mask_token_id, list(model.target_layer_ids)) == (BS, VOCAB - 1, IDS)
    assert model.config.num_target_layers == TARGET_LAYERS
    assert json.loads((folder / "config.json").read_text())["is_causal"] is False
    assert all(layer.self_attn.is_causal is False for layer in model.layers)  # [mask] in_block bidirectional
    print(f"dflash: {len(stored)} tensors bit-identical (folder, run's weights, DFlashDraftModel); block_size "
          f"{model.block_size}, mask_token_id {model.mask_token_id}, target_layer_ids {model.target_layer_ids}")

    # Its forward on every held-out block: our proposals, our loss (target_kl, over the count).
    same, total, err = zlab_blocks(world, model, dflash["dumps"][("target_kl", "positions")])
    assert total >= 100 and same == total
    assert err <= TOL


def test_dflash_trained_from_a_cache_of_a_target_we_do_not_run_proposes_as_the_reference(stablelm_world,
                                                                                          dflash_stablelm):
    """A drafter trained through the cache target on a StableLM's dumped states (60 steps, target_kl): z-lab's
    DFlashDraftModel, fed transformers' own StableLM states and its LM head, proposes our tokens at every labelled
    block position and gives our validation loss. So the cache's layers, embedding and LM head are the ones the
    reference serves with."""
    from dflash.model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(dflash_stablelm["folder"], dtype=torch.float32).eval()
    same, total, err = zlab_blocks(stablelm_world, model, dflash_stablelm["dumps"][("target_kl", "positions")])
    print(f"StableLM through its cache: {same} of {total} block proposals equal z-lab's; loss max rel err {err:.1e}")
    assert total >= 100 and same == total
    assert err <= TOL


def zlab_block_states(world, model, dump, rows):
    """z-lab's forward on each valid held-out block of `rows`, as dflash_generate runs it
    (transformers' hidden_states through its own extract_context_feature, the block [token at
    the anchor, mask, ...] at positions anchor..anchor + BS - 1): (row, block, anchor, the
    target's logits of the row, the block's hidden states at positions 1..BS-1). The block's
    embeddings as dflash_generate makes them (_raw_input_embeddings, times the folder's
    input_embedding_scale)."""
    from dflash.model import _draft_value, _raw_input_embeddings, extract_context_feature

    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    tokens, anchors, valid = dump["tokens"], dump["anchors"], dump["block_valid"]
    for r in rows:
        hs, logits, _ = target_pass(world, tokens[r, :int(dump["lengths"][r])])
        context = extract_context_feature(hs, model.target_layer_ids)
        for n in range(anchors.shape[1]):
            if not valid[r, n]:
                continue
            a = int(anchors[r, n])
            block = torch.full((1, BS), model.mask_token_id)
            block[0, 0] = tokens[r, a]
            hidden = model(position_ids=torch.arange(a + BS)[None],
                           noise_embedding=_raw_input_embeddings(world["target"], block, scale),
                           target_hidden=context[:, :a])
            yield r, n, a, logits, hidden[0, 1:]


def zlab_blocks(world, model, dump):
    """z-lab's forward on every held-out block of a validation dump: how many of our labelled
    block proposals it proposes too, and the largest relative difference of its validation loss
    (target_kl, over the count of labelled positions) from ours per batch."""
    head = world["target"].lm_head
    labels, pred = dump["labels"], dump["predictions"]
    same = total = 0
    losses = []
    with torch.no_grad():
        for rows in batches(dump):
            num, count = 0.0, 0
            for r, n, a, logits, hidden in zlab_block_states(world, model, dump, rows):
                q = model.compute_logits(hidden, head).log_softmax(-1)
                for j in range(1, BS):
                    if labels[r, n, j] < 0:
                        continue
                    same += int(q[j - 1].argmax()) == int(pred[r, n, j])
                    total += 1
                    p = logits[a + j - 1].log_softmax(-1)
                    num += math.exp(-(j - 1) / GAMMA) * float((p.exp() * (p - q[j - 1])).sum())
                    count += 1
            losses.append(num / count)
    err = max(rel(a, b) for a, b in zip(losses, dump["loss"]))
    print(f"dflash forward: {same} of {total} block proposals equal ours; validation loss per batch "
          f"{[round(x, 6) for x in losses]} (ours {dump['loss'].tolist()}), max relative error {err:.1e}")
    return same, total, err


def reconfigured(world, name, folder, config):
    """A folder `name` holding `folder`'s weights (linked) under another config.json: the same weights as the reference
    reads them with one of the config's choices undone."""
    out = world["root"] / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    return out


def test_dflash_sliding_layers_load_into_the_reference_with_our_function(world, dflash_sliding):
    """[drafter] layer_types = ["sliding_attention", "full_attention"], sliding_window = 5: the
    folder says so (layer_types, use_sliding_window, sliding_window), z-lab's DFlashDraftModel
    masks its first layer to keys within 5 positions of each query (bidirectionally: is_causal
    false), and its forward proposes our tokens and gives our loss on every held-out block. Not
    vacuous: the same folder with the window removed from its config proposes otherwise."""
    from dflash.model import DFlashDraftModel

    folder = dflash_sliding["folder"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == WINDOW and cfg["use_sliding_window"] is True and cfg["is_causal"] is False
    model, info = DFlashDraftModel.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.sliding_window == WINDOW
    dump = dflash_sliding["dumps"][("target_kl", "positions")]
    same, total, err = zlab_blocks(world, model, dump)
    print(f"sliding window {WINDOW} in layer 0: {same} of {total} block proposals equal ours, loss max rel err {err:.1e}")
    assert total >= 100 and same == total
    assert err <= TOL
    unwindowed = reconfigured(world, "dflash_sliding_unwindowed", folder,
                              dict(cfg, layer_types=["full_attention", "full_attention"]))
    other = DFlashDraftModel.from_pretrained(unwindowed, dtype=torch.float32).eval()
    same_full, total_full, err_full = zlab_blocks(world, other, dump)
    print(f"the same weights with every layer full: {same_full} of {total_full} equal, loss rel err {err_full:.1e}")
    assert err_full > 100 * TOL


def test_dflash_yarn_rope_loads_into_the_reference_with_our_function(world, dflash_yarn):
    """[drafter] rope_type = "yarn" (factor 4, original_max_position 16): the folder's rope_parameters say so, z-lab's
    DFlashDraftModel builds its Qwen3RotaryEmbedding from them (attention scaling 0.1 ln 4 + 1), imports back into our
    drafter (the dump's validation runs from the folder), and its forward proposes our tokens and gives our loss on
    every held-out block. Not vacuous: the same weights read with a plain RoPE do not."""
    from dflash.model import DFlashDraftModel

    folder = dflash_yarn["folder"]
    cfg = json.loads((folder / "config.json").read_text())
    attention_factor = 0.1 * math.log(YARN_FACTOR) + 1
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == YARN_FACTOR, rope
    assert rope["original_max_position_embeddings"] == YARN_ORIGINAL and rope["rope_theta"] == ROPE_THETA, rope
    assert abs(rope["attention_factor"] - attention_factor) < 1e-12, rope
    model, info = DFlashDraftModel.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert abs(model.rotary_emb.attention_scaling - attention_factor) < 1e-6, model.rotary_emb.attention_scaling
    dump = dflash_yarn["dumps"][("target_kl", "positions")]
    same, total, err = zlab_blocks(world, model, dump)
    print(f"YaRN factor {YARN_FACTOR} over {YARN_ORIGINAL}: {same} of {total} block proposals equal ours, "
          f"loss max rel err {err:.1e}")
    assert total >= 100 and same == total
    assert err <= TOL
    unscaled = reconfigured(world, "dflash_yarn_unscaled", folder,
                            dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}))
    other = DFlashDraftModel.from_pretrained(unscaled, dtype=torch.float32).eval()
    same_plain, total_plain, err_plain = zlab_blocks(world, other, dump)
    print(f"the same weights with a plain RoPE: {same_plain} of {total_plain} equal, loss rel err {err_plain:.1e}")
    assert err_plain > 100 * TOL


# --- 2. speculators, DFlash ----------------------------------------------------------------

@pytest.fixture(scope="module")
def spec_dflash(world, dflash):
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    out = world["root"] / "speculators_dflash"
    DFlashConverter().convert(dflash["folder"], out, base_model=str(world["target_dir"]), validate=True)
    config = DFlashSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # dense masks (flex: torch.compile)
    return DFlashDraftModel.from_pretrained(out, config=config).eval()


def test_speculators_dflash_converts_and_loads_the_export(world, dflash, spec_dflash):
    model, target = spec_dflash, world["target"]
    cfg = json.loads((dflash["folder"] / "config.json").read_text())
    assert cfg["is_causal"] is False, "speculators' DFlash attends bidirectionally inside a block"
    assert model.target_layer_ids == [L + 1 for L in IDS]  # speculators reads hidden_states[id]
    assert (model.mask_token_id, model.block_size, model.config.draft_vocab_size) == (VOCAB - 1, BS, VOCAB)
    assert model.config.sample_from_anchor is False and not model.use_draft_vocab
    state, stored = model.state_dict(), load_file(str(dflash["folder"] / "model.safetensors"))
    verifier = {"embed_tokens.weight": target.get_input_embeddings().weight, "lm_head.weight": target.lm_head.weight,
                "verifier_lm_head.weight": target.lm_head.weight, "verifier_norm.weight": target.model.norm.weight}
    assert sorted(state) == sorted([*stored, *verifier])
    for name, t in {**stored, **verifier}.items():
        assert torch.equal(state[name], t), name
    print(f"speculators DFlash: {len(stored)} tensors as exported, aux layer ids {model.target_layer_ids}, "
          f"embedding / LM head / final norm from the verifier")


def packed_batch(world, dump, rows, aux_ids):
    """A held-out batch in speculators' layout: its rows packed as one, one document each, with
    our anchors (shifted to the packed row) and the target's states at aux_ids; and the count
    and the weight sum of our labelled positions."""
    tokens, anchors, valid, lab, lengths = (dump[k] for k in ("tokens", "anchors", "block_valid", "labels", "lengths"))
    parts = {k: [] for k in ("hidden", "ids", "mask", "last", "doc", "pos", "anchors", "valid")}
    start, count, wsum = 0, 0, 0.0
    for d, r in enumerate(rows):
        S = int(lengths[r])
        hs, _, last = target_pass(world, tokens[r, :S])
        mask = loss_mask_of(world, tokens[r, :S])
        parts["hidden"].append(torch.cat([hs[i][0] for i in aux_ids], -1))
        parts["last"].append(last)
        parts["ids"].append(tokens[r, :S])
        parts["mask"].append(mask)
        parts["doc"].append(torch.full((S,), d))
        parts["pos"].append(torch.arange(S))
        parts["anchors"].append(anchors[r] + start)
        parts["valid"].append(valid[r].bool())
        for n in range(anchors.shape[1]):
            for j in range(1, BS):
                if valid[r, n]:  # our labelled positions are the data's loss mask at anchor + j
                    assert (lab[r, n, j] >= 0) == bool(mask[int(anchors[r, n]) + j]), (r, n, j)
                if lab[r, n, j] >= 0:
                    count += 1
                    wsum += math.exp(-(j - 1) / GAMMA)
        start += S
    return {k: torch.cat(v) for k, v in parts.items()}, count, wsum


@pytest.mark.parametrize("labels,normalisation,loss_fn", [("target_kl", "positions", "kl_div"),
                                                           ("target_kl", "weights", "kl_div"),
                                                           ("target_argmax", "positions", "ce")])
def test_speculators_dflash_loss_with_our_anchors_equals_ours(world, dflash, spec_dflash, monkeypatch, labels,
                                                               normalisation, loss_fn):
    import speculators.models.dflash.core as core
    from speculators.losses import resolve_loss_config

    model, dump = spec_dflash, dflash["dumps"][(labels, normalisation)]
    for b, rows in enumerate(batches(dump)):
        cat, count, wsum = packed_batch(world, dump, rows, model.target_layer_ids)
        monkeypatch.setattr(core, "select_anchors", lambda loss_mask, num_anchors, block_size: (cat["anchors"],
                                                                                                cat["valid"]))
        with torch.no_grad():
            _, loss, _ = model(hidden_states=cat["hidden"][None], input_ids=cat["ids"][None],
                               loss_mask=cat["mask"][None], verifier_last_hidden_states=cat["last"][None],
                               document_ids=cat["doc"][None], position_ids=cat["pos"][None],
                               loss_config=resolve_loss_config(loss_fn, "eager"), gamma=GAMMA,
                               max_anchors=len(cat["anchors"]))
        ours = float(dump["loss"][b])
        expected = ours * (count if normalisation == "positions" else wsum) / (count + 1e-5)
        print(f"{labels}/{normalisation} batch {b}: speculators ({loss_fn}) {float(loss):.8f}, ours {ours:.8f}, "
              f"{count} labelled positions, sum of weights {wsum:.4f}; ours normalised as speculators "
              f"{expected:.8f}, relative difference {rel(loss, expected):.1e} (raw {rel(loss, ours):.1e})")
        assert count > 0 and rel(loss, expected) <= TOL
        if loss_fn == "ce":  # not vacuous: the target's distributions are soft, KL and CE differ
            assert rel(loss, dflash["dumps"][("target_kl", "positions")]["loss"][b]) > 1e-2


# --- 3. speculators, EAGLE-3 ---------------------------------------------------------------

@pytest.fixture(scope="module")
def spec_eagle3(world, eagle3):
    return speculators_eagle3(world, eagle3, "speculators_eagle3")


@pytest.fixture(scope="module")
def spec_eagle3_llama3(world, eagle3_llama3):
    return speculators_eagle3(world, eagle3_llama3, "speculators_eagle3_llama3")


def speculators_eagle3(world, eagle3, name):
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = json.loads((eagle3["folder"] / "config.json").read_text())
    out = world["root"] / name
    Eagle3Converter().convert(eagle3["folder"], out, base_model=str(world["target_dir"]), validate=True,
                              eagle_aux_hidden_state_layer_ids=cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    torch.nn.init.constant_(model.embed_tokens.weight, float("nan"))  # its "not loaded" mark
    model.load_verifier_weights()
    return dict(model=model, checkpoint=out, cfg=cfg)


def test_speculators_eagle3_converts_and_loads_the_export(world, eagle3, spec_eagle3):
    model, cfg, target = spec_eagle3["model"], spec_eagle3["cfg"], world["target"]
    stored = load_file(str(eagle3["folder"] / "model.safetensors"))
    assert sorted(stored) == sorted(eagle3["weights"])
    for name, t in stored.items():
        assert torch.equal(t, eagle3["weights"][name]), name  # the folder holds the run's weights
    ours = {k.replace("midlayer.", "layers.0."): t for k, t in stored.items()}
    saved = load_file(str(spec_eagle3["checkpoint"] / "model.safetensors"))
    assert sorted(saved) == sorted(ours)  # strict: nothing missing, nothing added
    for name, t in ours.items():
        assert t.dtype == saved[name].dtype and torch.equal(saved[name], t), name
    draft = torch.arange(model.draft_vocab_size) + ours["d2t"]
    verifier = {"embed_tokens.weight": target.get_input_embeddings().weight,
                "verifier_lm_head.weight": target.lm_head.weight[draft],
                "verifier_norm.weight": target.model.norm.weight}
    state = model.state_dict()
    assert sorted(state) == sorted([*ours, *verifier])
    for name, t in {**ours, **verifier}.items():
        assert torch.equal(state[name], t), name
    assert model.target_layer_ids == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [l + 1 for l in cfg["flashdraft"]["target_layer_ids"]]
    assert (model.draft_vocab_size, model.verifier_vocab_size) == (cfg["draft_vocab_size"], cfg["vocab_size"])
    assert torch.equal(ours["t2d"].nonzero().flatten(), draft)
    print(f"speculators EAGLE-3: {len(ours)} tensors as exported, aux layer ids {model.target_layer_ids}, "
          f"draft vocabulary {model.draft_vocab_size} of {model.verifier_vocab_size}")


def speculators_chains(world, spec, dump, speculators_positions):
    """Per held-out row: the chain of every column t (step i fed step i - 1's greedy token as a
    target id) through speculators' modules, and (sum of CE, count) per step of our validation
    loss from its logits. speculators_positions: step i at t + 1 + i (its forward, vLLM up to
    a shift); else t + 1 at every step (a uniform shift of ours: t)."""
    from speculators.models.attention import create_float_mask
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens

    model = spec["model"]
    ids = torch.arange(model.draft_vocab_size) + model.d2t
    out = []
    with torch.no_grad():
        for r in range(dump["tokens"].shape[0]):
            S = int(dump["lengths"][r])
            row = dump["tokens"][r, :S]
            hs, logits, _ = target_pass(world, row)
            lm = loss_mask_of(world, row).bool()
            probs = torch.softmax(logits[:, ids], -1)
            in_draft = model.t2d[logits.argmax(-1)]
            # speculators' shift_batch: column t pairs the target's states at t with the token at t + 1.
            T = S - 1
            h = model.fc(torch.cat([hs[i] for i in model.target_layer_ids], -1)[:, :T])
            tokens, pos = row[None, 1:], torch.arange(1, S)[None]
            mask = create_float_mask(create_combined_mask_mod(torch.zeros(T, dtype=torch.long), T), B=None, H=None,
                                     Q_LEN=T, KV_LEN=T, device="cpu")
            cache = transformers.DynamicCache()
            chains, parts = [], []
            for i in range(TTT):
                x = torch.cat([model.embed_tokens(tokens), h], -1)
                rope = model.rotary_emb(x, pos)
                for layer in model.layers:
                    h = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                              cache_position=torch.arange(i * T, (i + 1) * T), position_embeddings=rope)
                q = model.lm_head(model.norm(h))[0].log_softmax(-1)
                tokens = ids[q.argmax(-1)][None]
                chains.append(tokens[0])
                # Our loss: column t at step i predicts x_{t+2+i} (in the row, loss mask there) against
                # the target's distribution at t+1+i over the draft vocabulary, counted where the
                # target's full argmax is in it.
                t = torch.arange(T)
                at = (t + 2 + i).clamp(max=S - 1)
                counted = (t + 2 + i < S) & lm[at] & in_draft[(t + 1 + i).clamp(max=S - 1)]
                ce = -(probs[(t + 1 + i).clamp(max=S - 1)] * q).sum(-1)
                parts.append((float((ce * counted).sum()), int(counted.sum())))
                mask = extend_dense_mask_for_draft_tokens(mask, T)
                if speculators_positions:
                    pos = pos + 1
            out.append((chains, parts))
    return out


def compare_chains(dump, chains, decay=0.8):
    anchors, valid, pred = dump["anchors"], dump["block_valid"].bool(), dump["predictions"]
    same = total = 0
    for r, (chain, _) in enumerate(chains):
        for n in range(anchors.shape[1]):
            if valid[r, n]:
                t = int(anchors[r, n]) - 1
                for j in range(1, TTT + 1):
                    same += int(pred[r, n, j]) == int(chain[j - 1][t])
                    total += 1
    losses = []  # the engine pools a batch's rows per unroll step
    for rows in batches(dump):
        ce = [sum(chains[r][1][i][0] for r in rows) for i in range(TTT)]
        counted = [sum(chains[r][1][i][1] for r in rows) for i in range(TTT)]
        losses.append(sum(decay ** i * ce[i] / max(counted[i], 1) for i in range(TTT)))
    return same, total, max(rel(a, b) for a, b in zip(losses, dump["loss"]))


def test_speculators_eagle3_chain_proposals_equal_ours(world, eagle3, spec_eagle3):
    """speculators' own RoPE positions: step i of column t at t + 1 + i (its forward; vLLM's
    EagleProposer advances a drafted token's position by one per step too; ours is t + i, a
    uniform shift)."""
    chains_equal_ours(world, eagle3, spec_eagle3, "step i of column t at RoPE position t + 1 + i")


def chains_equal_ours(world, eagle3, spec, what):
    """speculators' chains (its positions) equal our validation's proposals, and our loss from its logits ours."""
    dump = eagle3["dump"]
    same, total, err = compare_chains(dump, speculators_chains(world, spec, dump, True))
    print(f"EAGLE-3 chains through speculators' modules, {what}: {same} of {total} proposals equal ours; our "
          f"validation loss from its logits: max relative error {err:.1e}")
    assert total >= 100 and same == total
    assert err <= TOL


def test_speculators_eagle3_with_llama3_rope_chains_equal_ours(world, eagle3_llama3, spec_eagle3_llama3):
    """[drafter] rope_type = "llama3" (Llama 3.1's: factor 4 over a pretraining length of 16, so that at base 100 and heads
    of 16 the slow frequencies are divided by 4 and the middle ones blended): the folder's rope_scaling says so (as the
    published Llama 3.1 EAGLE-3 drafters write it), speculators' model builds its rotary embedding from it, and its
    chains equal ours with our validation loss. Not vacuous: its frequencies are not the plain ones."""
    cfg = spec_eagle3_llama3["cfg"]
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": LLAMA3_FACTOR,
                                   "original_max_position_embeddings": LLAMA3_ORIGINAL, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0}, cfg
    model = spec_eagle3_llama3["model"]
    head_dim = model.layers[0].self_attn.head_dim
    plain = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    moved = int((model.rotary_emb.inv_freq - plain).abs().gt(1e-6 * plain).sum())
    assert moved >= 3, model.rotary_emb.inv_freq
    chains_equal_ours(world, eagle3_llama3, spec_eagle3_llama3,
                      f"Llama 3.1's RoPE ({moved} of {head_dim // 2} frequencies scaled)")


def test_every_step_at_one_position_would_not_be_ours(world, eagle3, spec_eagle3):
    """The comparison can tell the conventions apart: every unroll step of column t at one
    position (what plugins/eagle3 did before 2026-12) gives other chains and another loss."""
    dump = eagle3["dump"]
    same, total, err = compare_chains(dump, speculators_chains(world, spec_eagle3, dump, False))
    print(f"every step of column t at RoPE position t + 1: {same} of {total} proposals equal ours, "
          f"loss relative error {err:.1e}")
    assert same < total or err > 100 * TOL


# --- 4. DFlash-2: z-lab's DFlash2DraftModel and speculators' dflash2 ---------------------------

def zlab_name(name):
    """z-lab's in-memory name of a stored tensor (its codebooks are nn.Embedding modules; the
    stored names, ours and speculators', have no ".weight")."""
    return name + ".weight" if name.endswith("_codebook") else name


def test_dflash2_reference_loads_the_export_and_selects_our_tokens(world, dflash2):
    """DFlash2DraftModel.from_pretrained(folder): no missing, unexpected or mismatched key; every
    tensor bit-identical to the run's. Its forward and its candidate selector, on every held-out
    block, fed the data's token before each position (teacher forcing, as training and our
    validation's proposals are): the LM head's top-Kc of its hidden states, re-ranked by its
    codebooks, choose our proposal at every labelled position."""
    check_dflash2_selects_our_tokens(world, dflash2)


def test_dflash2_with_scales_and_cap_selects_our_tokens(world, dflash2_scaled):
    """The same for a DFlash-2 drafter with the reference's input_embedding_scale 2, output_multiplier 1.5 and
    final_logit_softcapping 4: the folder's dflash_config says so, and z-lab's compute_logits (times 1.5, capped at 4)
    feeds its selector, which chooses our proposal at every labelled position."""
    cfg = json.loads((dflash2_scaled["folder"] / "config.json").read_text())
    d = cfg["dflash_config"]
    assert (d["input_embedding_scale"], d["output_multiplier"], d["final_logit_softcapping"]) == (2.0, 1.5, 4.0), d
    check_dflash2_selects_our_tokens(world, dflash2_scaled)
    from dflash.model import DFlash2DraftModel

    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):  # not vacuous
        without = dict(cfg, dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != key})
        folder = reconfigured(world, f"dflash2_without_{key}", dflash2_scaled["folder"], without)
        model = DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
        same, total, _ = dflash2_choices(world, model, dflash2_scaled["dumps"][("target_kl", "positions")])
        print(f"the same folder without {key}: {same} of {total} proposals equal ours")
        assert same < total, key


def check_dflash2_selects_our_tokens(world, dflash2):
    from dflash.model import DFlash2DraftModel

    folder = dflash2["folder"]
    model, info = DFlash2DraftModel.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state, stored = model.state_dict(), load_file(str(folder / "model.safetensors"))
    assert sorted(state) == sorted(zlab_name(k) for k in stored)
    assert sorted(stored) == sorted(dflash2["weights"])
    for name, t in stored.items():
        assert t.dtype == torch.float32 and torch.equal(state[zlab_name(name)], t), name
        assert torch.equal(t, dflash2["weights"][name]), name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert (model.block_size, model.mask_token_id, list(model.target_layer_ids)) == (BS, VOCAB - 1, IDS)
    selector = model.candidate_selector
    assert selector.top_k == TOP_K and model.layers[0].attention_conv.kernel_size == KERNEL
    # Trained away from the identity start (DFlash-2 starts as DFlash): the convolutions matter here.
    assert float(model.layers[0].mlp_conv.kernel_projection.weight.detach().abs().max()) > 1e-3
    print(f"dflash2: {len(stored)} tensors bit-identical (folder, run's weights, DFlash2DraftModel); "
          f"conv_kernel_size {KERNEL}, conv_group_size {GROUP}, selector_rank {RANK}, selector_top_k {TOP_K}")

    same, total, unary_differs = dflash2_choices(world, model, dflash2["dumps"][("target_kl", "positions")])
    print(f"dflash2 forward and selector, teacher-forced: {same} of {total} block proposals equal ours "
          f"({unary_differs} differ from the LM head's argmax)")
    assert total >= 100 and same == total
    assert unary_differs > 0, "the selector never overrules the LM head here: the comparison proves little"


def dflash2_choices(world, model, dump):
    """z-lab's DFlash-2 forward and selector on every labelled held-out block position, teacher-forced: how many of our
    proposals it chooses too, of how many, and how many of its choices are not the LM head's argmax."""
    head, selector = world["target"].lm_head, model.candidate_selector
    tokens, labels, pred = dump["tokens"], dump["labels"], dump["predictions"]
    same = total = unary_differs = 0
    with torch.no_grad():
        for r, n, a, _, hidden in zlab_block_states(world, model, dump, range(tokens.shape[0])):
            unary = model.compute_logits(hidden, head)
            values, candidates = unary.topk(TOP_K, dim=-1)
            projected = selector.hidden_projection(hidden)
            for j in range(1, BS):
                if labels[r, n, j] < 0:
                    continue
                previous = tokens[r, a + j - 1]
                scores = values[j - 1] + torch.einsum(
                    "r,kr->k", selector.predecessor_codebook(previous) * projected[j - 1],
                    selector.successor_codebook(candidates[j - 1]))
                choice = int(candidates[j - 1, scores.argmax()])
                same += choice == int(pred[r, n, j])
                unary_differs += choice != int(candidates[j - 1, 0])
                total += 1
    return same, total, unary_differs


@pytest.fixture(scope="module")
def spec_dflash2(world, dflash2):
    """speculators' dflash2 model (it has no converter for a DFlash-2 folder: made from a config
    of the folder's values) holding our tensors and the verifier's (strict load)."""
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    folder = dflash2["folder"]
    cfg = json.loads((folder / "config.json").read_text())
    layer = transformers.Qwen3Config(**{k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "attention_bias")},
        tie_word_embeddings=False)
    layer._attn_implementation = "eager"
    d = cfg["dflash_config"]
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg["vocab_size"], block_size=d["block_size"],
        mask_token_id=d["mask_token_id"], aux_hidden_state_layer_ids=[L + 1 for L in d["target_layer_ids"]],
        sample_from_anchor=False, sliding_window_non_causal=True,
        **{k: d[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    model = DFlash2DraftModel(config).eval()
    target = world["target"]
    state = dict(load_file(str(folder / "model.safetensors")))
    state |= {"embed_tokens.weight": target.get_input_embeddings().weight, "lm_head.weight": target.lm_head.weight,
              "verifier_lm_head.weight": target.lm_head.weight, "verifier_norm.weight": target.model.norm.weight}
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("labels,loss_fn", [("target_kl", "kl_div"), ("target_argmax", "ce")])
def test_speculators_dflash2_loss_with_our_anchors_equals_ours(world, dflash2, spec_dflash2, monkeypatch, labels,
                                                                loss_fn):
    """speculators' dflash2 training forward and loss (its unary loss, its selector's Kc-way
    cross-entropy on its training candidates with teacher-forced predecessors, alpha 1) on each
    held-out batch with our anchors: our validation loss, normalised as speculators does."""
    import speculators.models.dflash.core as core
    from speculators.losses import resolve_loss_config

    model, dump = spec_dflash2, dflash2["dumps"][(labels, "positions")]
    for b, rows in enumerate(batches(dump)):
        cat, count, _ = packed_batch(world, dump, rows, model.target_layer_ids)
        monkeypatch.setattr(core, "select_anchors", lambda loss_mask, num_anchors, block_size: (cat["anchors"],
                                                                                                cat["valid"]))
        with torch.no_grad():
            _, loss, metrics = model(hidden_states=cat["hidden"][None], input_ids=cat["ids"][None],
                                     loss_mask=cat["mask"][None], verifier_last_hidden_states=cat["last"][None],
                                     document_ids=cat["doc"][None], position_ids=cat["pos"][None],
                                     loss_config=resolve_loss_config(loss_fn, "eager"),
                                     tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0], gamma=GAMMA,
                                     max_anchors=len(cat["anchors"]), selector_loss_alpha=1.0)
        ours = float(dump["loss"][b])
        expected = ours * count / (count + 1e-5)
        unary = float(metrics["unary_loss_sum"]) / float(metrics["unary_loss_total"]) \
            if "unary_loss_total" in metrics else float("nan")
        print(f"dflash2 {labels} batch {b}: speculators ({loss_fn} + selector) {float(loss):.8f}, ours {ours:.8f}, "
              f"{count} labelled positions; ours normalised as speculators {expected:.8f}, relative difference "
              f"{rel(loss, expected):.1e}; its unary term alone {unary:.6f}")
        assert count > 0 and rel(loss, expected) <= TOL
        assert float(loss) - unary > 1e-2, "the selector's term must weigh in, or the comparison proves little"

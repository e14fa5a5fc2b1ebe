"""A target's hidden states written once by scripts/dump-hidden-states (transformers) and read back instead of running
its decoder, by the hf target ([target] hidden_cache) or by the cache target ([target] plugin = "cache", any
architecture transformers runs): the states of padded, packed and cut documents equal the target's own, runs train to
the same losses as against the online target, a model the hf target does not read trains from its cache, and a cache
that lacks a layer or a document, or a model whose logits the cache cannot stand for, is refused with a sentence."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import CLI, SOURCE_DIR
from hf_models import make_model
from test_eagle3_training import TRAIN
from test_hf_target import rel, run_target
from test_hf_training import experiment, setup as make_inputs

DUMP = SOURCE_DIR / "scripts" / "dump-hidden-states"


def dump(model, data, out, layers="0,2,3", *more):
    return subprocess.run([sys.executable, str(DUMP), "--model", str(model), "--data", str(data), "--layers", layers,
                           "--out", str(out), "--dtype", "float32", "--device", "cpu", "--batch-tokens", "256",
                           "--shard-tokens", "2000", *map(str, more)],
                          capture_output=True, text=True, timeout=600)


def conversations(data):
    out = []
    for path in sorted(data.glob("*.h5")):
        with h5py.File(path, "r") as f:
            t, o = f["tokens"][:].astype(np.int64), f["offsets"][:]
        out.extend(torch.from_numpy(t[o[i]:o[i + 1]]) for i in range(len(o) - 1))
    return out


def test_cached_states_equal_the_targets_own_for_padded_packed_and_cut_documents(tmp_path):
    model, data = make_inputs(tmp_path)
    p = dump(model, data, tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    print(p.stdout.strip())
    files = sorted((tmp_path / "cache").glob("hidden-*.safetensors"))
    assert len(files) > 1, files  # (several files: the lookup crosses them)
    convs = conversations(data)
    by_length = sorted(range(len(convs)), key=lambda i: len(convs[i]))
    a, b, c = convs[by_length[0]], convs[by_length[1]], convs[by_length[-1]]  # two short ones, the longest
    cut = len(c) - 7  # row 2: a conversation cut (its first tokens only, as a row of seq_len cuts it)
    S = max(len(a) + len(b), cut)
    rows = torch.zeros(3, S, dtype=torch.long)
    rows[0, :len(a)] = a
    rows[1, :len(b)] = b
    rows[1, len(b):len(b) + len(a)] = a  # row 1 packs b and a
    rows[2, :cut] = c[:cut]
    lengths = torch.tensor([len(a), len(b) + len(a), cut])
    documents = torch.tensor([[len(a), 0], [len(b), len(a)], [cut, 0]])

    layers = [0, 2, 3]
    p, online = run_target(model, rows, lengths, layers, tmp_path, documents=documents)
    assert p.returncode == 0, p.stderr
    p, cached = run_target(model, rows, lengths, layers, tmp_path, documents=documents,
                           keys={"hidden_cache": tmp_path / "cache"})
    assert p.returncode == 0, p.stderr
    assert "hidden states read from" in p.stdout and "the decoder does not run" in p.stdout, p.stdout
    worst = max(rel(cached["hidden"][r, :int(lengths[r])], online["hidden"][r, :int(lengths[r])]) for r in range(3))
    print(f"cached against online states (padded, packed, cut at {cut} of {len(c)}): worst rel err {worst:.1e}")
    assert worst <= 1e-5, worst
    assert rel(cached["logits"][1, :int(lengths[1])], online["logits"][1, :int(lengths[1])]) <= 1e-5
    # Another token in a document: no conversation begins so; a sentence names the document.
    rows[0, 2] = (rows[0, 2] + 1) % 320
    p, _ = run_target(model, rows, lengths, layers, tmp_path, documents=documents,
                      keys={"hidden_cache": tmp_path / "cache"})
    assert p.returncode != 0 and f"no cached conversation begins with this document's {len(a)} tokens" in p.stderr, \
        p.stderr


def test_a_run_against_the_cache_trains_as_against_the_online_target(tmp_path):
    model, data = make_inputs(tmp_path)
    assert dump(model, data, tmp_path / "cache").returncode == 0
    changes = {"steps = 50": "steps = 6", "print_every = 10": "print_every = 1",
               "[mask]\n": "[eval]\nenabled = true\nserved_responses = 4\n\n[mask]\n"}
    losses = {}
    cache_target = f'[target]\nplugin = "cache"\npath = "{tmp_path / "cache"}"\n\n[drafter]'
    for name, target in [("online", {}), ("cached", {"[target]\n": f'[target]\nhidden_cache = "{tmp_path / "cache"}"\n'}),
                         ("cache_target", {f'[target]\nplugin = "hf"\npath = "{model}"\n\n[drafter]': cache_target})]:
        exp = experiment(tmp_path, model, data, **changes, **{'name = "hf_tiny"': f'name = "{name}"'}, **target)
        p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        with h5py.File(tmp_path / "run" / f"{name}.h5", "r") as f:
            losses[name] = f["steps/loss"][:]
            method = f["eval/tau_served_method"][-1] if "eval/tau_served_method" in f else b""
        method = method.decode() if isinstance(method, bytes) else str(method)
        print(f"{name}: served tau by {method}")
        if name != "online":
            assert "the decoder does not run" in p.stdout or "no decoder runs" in p.stdout, p.stdout
            assert method and "target" not in method, method  # (no decoder: served tau on the data's tokens)
    for name in ("cached", "cache_target"):
        diff = np.abs(losses[name] - losses["online"]) / np.abs(losses["online"])
        print(f"losses online {np.round(losses['online'], 5).tolist()}, {name} {np.round(losses[name], 5).tolist()}; "
              f"largest relative difference {diff.max():.1e}")
        assert diff.max() <= 1e-4, (name, diff)


def test_a_cache_without_a_layer_the_run_reads_is_refused(tmp_path):
    model, data = make_inputs(tmp_path)
    assert dump(model, data, tmp_path / "cache", "0,2").returncode == 0
    exp = experiment(tmp_path, model, data, **{"[target]\n": f'[target]\nhidden_cache = "{tmp_path / "cache"}"\n'})
    p = subprocess.run([str(CLI), "validate", str(exp)], capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "holds no states of layer 3" in out and "--layers" in out, out
    # A rerun of the dump with other arguments into the same folder stops (a folder holds one dump).
    p = dump(model, data, tmp_path / "cache", "0,2,3")
    assert p.returncode == 2 and "other arguments" in p.stderr, p.stderr
    # The cache target needs target.safetensors beside the states; without it (or with a number that is not one) a
    # sentence says what to use.
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "cache", bare)
    (bare / "target.safetensors").unlink()
    cache_target = {f'[target]\nplugin = "hf"\npath = "{model}"\n': f'[target]\nplugin = "cache"\npath = "{bare}"\n'}
    p = subprocess.run([str(CLI), "validate", str(experiment(tmp_path, model, data, **cache_target))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "holds no target.safetensors" in p.stderr and "hidden_cache" in p.stderr, p.stderr
    tensors = load_file(str(tmp_path / "cache" / "target.safetensors"))
    with safe_open(str(tmp_path / "cache" / "target.safetensors"), "pt") as f:
        meta = dict(f.metadata(), logit_scale="one")
    save_file(tensors, str(bare / "target.safetensors"), metadata=meta)
    p = subprocess.run([str(CLI), "validate", str(experiment(tmp_path, model, data, **cache_target))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and 'metadata logit_scale = "one" is not a number' in p.stderr, p.stderr
    # A cache dumped from part of the data (its first 120 of 200 conversations): `validate` and the run's start name
    # the first batch and document it lacks, before step 0.
    part = tmp_path / "part_data"
    part.mkdir()
    source = next(data.glob("*.h5"))
    with h5py.File(source, "r") as f, h5py.File(part / source.name, "w") as g:
        o = f["offsets"][:121]
        g["tokens"], g["loss_mask"], g["offsets"] = f["tokens"][:o[-1]], f["loss_mask"][:o[-1]], o
        for k, v in f.attrs.items():
            g.attrs[k] = v
    assert dump(model, part, tmp_path / "part_cache").returncode == 0
    partial = {"[target]\n": f'[target]\nhidden_cache = "{tmp_path / "part_cache"}"\n'}
    for command in ("validate", "run"):
        p = subprocess.run([str(CLI), command, str(experiment(tmp_path, model, data, **partial))], capture_output=True,
                           text=True, timeout=300)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "batch" in out and "no cached conversation begins with this document" in out, out
        assert "step     1/" not in out, out  # (before step 0)
    print(next(line for line in out.splitlines() if "no cached conversation" in line)[:300])
    # Not a cache: a sentence naming the folder.
    exp = experiment(tmp_path, model, data, **{"[target]\n": f'[target]\nhidden_cache = "{data}"\n'})
    p = subprocess.run([str(CLI), "validate", str(exp)], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "holds no hidden-*.safetensors file" in p.stdout + p.stderr, p.stdout + p.stderr


def test_dump_files_hold_what_the_format_says(tmp_path):
    model, data = make_inputs(tmp_path)
    assert dump(model, data, tmp_path / "cache").returncode == 0
    convs = conversations(data)
    seen = 0
    for path in sorted((tmp_path / "cache").glob("hidden-*.safetensors")):
        t = load_file(str(path))
        assert t["tokens"].dtype == torch.int32 and t["offsets"].dtype == torch.int64
        assert t["hidden"].shape == (t["tokens"].numel(), 3, 64), t["hidden"].shape
        n = t["offsets"].numel() - 1
        for i in range(n):
            o0, o1 = int(t["offsets"][i]), int(t["offsets"][i + 1])
            assert torch.equal(t["tokens"][o0:o1].long(), convs[seen + i])
        seen += n
    assert seen == len(convs)


def tiny(tmp_path, name, **extra):
    """A random transformers model of a family the hf target does not read, in the test data's vocabulary."""
    config = getattr(transformers, f"{name}Config")(vocab_size=320, hidden_size=64, intermediate_size=96,
                                                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=256, **extra)
    torch.manual_seed(5)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # (rows that separate tokens, as test_hf_training's models: a drafter borrowing them learns)
        model.get_input_embeddings().weight.normal_(0, 1.0)
        model.get_output_embeddings().weight.normal_(0, 1.0)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:  # (Phi's: drawn, not zeros)
            model.get_output_embeddings().bias.normal_(0, 1.0)
    folder = tmp_path / name
    model.save_pretrained(folder)
    return folder


def test_a_model_the_hf_target_does_not_read_trains_from_its_cache(tmp_path):
    """StableLM (LayerNorm with biases, a partial rotation): the hf target refuses its architecture; its cache, written
    by transformers, trains a DFlash drafter through the cache target (on the data's tokens as labels: the loss falls),
    and target.safetensors holds its embedding and untied LM head."""
    _, data = make_inputs(tmp_path)
    model = tiny(tmp_path, "StableLm", partial_rotary_factor=0.25)
    p = dump(model, data, tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    assert "target.safetensors written" in p.stdout, p.stdout
    print(p.stdout.strip())
    with safe_open(str(tmp_path / "cache" / "target.safetensors"), "pt") as f:
        assert f.metadata()["tied"] == "0" and f.metadata()["architecture"] == "StableLmForCausalLM"
        assert set(f.keys()) == {"embedding", "lm_head"}
    online = experiment(tmp_path, model, data)
    v = subprocess.run([str(CLI), "validate", str(online)], capture_output=True, text=True, timeout=300)
    assert v.returncode != 0 and "StableLmForCausalLM" in v.stdout + v.stderr, v.stdout + v.stderr
    exp = experiment(tmp_path, model, data, **{"steps = 50": "steps = 30", "block_size = 4\n": 'block_size = 4\nlabels = "data"\n',
                     f'[target]\nplugin = "hf"\npath = "{model}"\n': f'[target]\nplugin = "cache"\npath = "{tmp_path / "cache"}"\n'})
    p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    with h5py.File(tmp_path / "run" / "hf_tiny.h5", "r") as f:
        loss = f["steps/loss"][:]
    first, last = loss[:5].mean(), loss[-5:].mean()
    print(f"StableLM from its cache: loss first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert np.isfinite(loss).all() and last < 0.8 * first, (first, last)


def test_the_logit_rule_is_read_and_a_model_it_cannot_stand_for_is_refused(tmp_path):
    """Granite's logits are divided by logits_scaling: the dump writes 1 / logits_scaling as the logit scale (checked
    against the model's logits). Phi's LM head has a bias, which the cache's rule (scale, cap) cannot hold: the dump
    stops with a sentence before writing any state."""
    _, data = make_inputs(tmp_path)
    make_model(tmp_path / "granite", "granite", seed=3, vocab_size=320)
    p = dump(tmp_path / "granite", data, tmp_path / "cache")
    assert p.returncode == 0, p.stderr
    scaling = json.loads((tmp_path / "granite" / "config.json").read_text())["logits_scaling"]
    with safe_open(str(tmp_path / "cache" / "target.safetensors"), "pt") as f:
        assert float(f.metadata()["logit_scale"]) == pytest.approx(1.0 / scaling) and scaling != 1.0
    phi = tiny(tmp_path, "Phi")
    p = dump(phi, data, tmp_path / "phi_cache")
    assert p.returncode == 1 and "its logits are not its LM head times its last hidden state" in p.stderr, p.stderr
    assert not list((tmp_path / "phi_cache").glob("hidden-*")), "states written for a model the cache cannot stand for"


def test_two_processes_under_torchrun_write_the_files_one_process_writes(tmp_path):
    """torchrun --nproc-per-node 2 (here on the CPU): each process writes every other file; together the same files,
    tensor for tensor, as one process, and one target.safetensors."""
    model, data = make_inputs(tmp_path)
    assert dump(model, data, tmp_path / "one").returncode == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", "29533", str(DUMP), "--model",
                        str(model), "--data", str(data), "--layers", "0,2,3", "--out", str(tmp_path / "two"),
                        "--dtype", "float32", "--device", "cpu", "--batch-tokens", "256", "--shard-tokens", "2000"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "process 0 of 2" in p.stdout and "process 1 of 2" in p.stdout, p.stdout
    one = sorted(f.name for f in (tmp_path / "one").glob("*.safetensors"))
    assert one == sorted(f.name for f in (tmp_path / "two").glob("*.safetensors")) and "target.safetensors" in one
    for name in one:
        a, b = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    print(f"torchrun, 2 processes: the {len(one)} files equal one process's")


def test_eagle3_trains_from_the_cache_as_against_the_online_target(tmp_path):
    """EAGLE-3 reads three target layers and the last one (its soft labels are the target's distribution): against the
    cache target, six steps give the online run's losses."""
    _, data = make_inputs(tmp_path)
    model = tmp_path / "llama"
    make_model(model, "llama", seed=2, embedding_std=1.0, vocab_size=320, num_hidden_layers=8)
    p = dump(model, data, tmp_path / "cache", "1,3,4,7")
    assert p.returncode == 0, p.stderr
    losses = {}
    for name, target in [("online", f'[target]\nplugin = "hf"\npath = "{model}"\n'),
                         ("cache_target", f'[target]\nplugin = "cache"\npath = "{tmp_path / "cache"}"\n')]:
        text = TRAIN.format(out=tmp_path / "run", model=model, data=data, ttt=3)
        text = text.replace(f'[target]\nplugin = "hf"\npath = "{model}"\n', target).replace("steps = 100", "steps = 6")
        exp = tmp_path / f"{name}.toml"
        exp.write_text(text.replace('name = "eagle3_tiny"', f'name = "{name}"'))
        p = subprocess.run([str(CLI), "run", str(exp)], capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        with h5py.File(tmp_path / "run" / f"{name}.h5", "r") as f:
            losses[name] = f["steps/loss"][:]
    diff = np.abs(losses["cache_target"] - losses["online"]) / np.abs(losses["online"])
    print(f"EAGLE-3 losses online {np.round(losses['online'], 5).tolist()}, from the cache "
          f"{np.round(losses['cache_target'], 5).tolist()}; largest relative difference {diff.max():.1e}")
    assert diff.max() <= 1e-4, diff

"""The experiment recipes of experiments/ that read a Hugging Face checkpoint (Qwen3-8B's DFlash and
DFlash-2, gpt-oss-20b's and gpt-oss-120b's DFlash, Qwen3.5-27B's and Gemma 3 27B's DFlash) pass `flashdraft validate` as written: every key
is one the plugins take, with the checkpoint and data swapped for tiny stand-ins of the same family
(a random transformers model with as many layers as the recipe reads, gpt-oss-120b's experts in MXFP4
for its mxfp4 = "keep"; a tokens shard) and the GPU for the CPU. A key misspelt or dropped from a
plugin fails here, not on a user's GPU."""
import json
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from conftest import CLI, SOURCE_DIR
from hf_models import edit_config, make_model
from test_hf_target import to_mxfp4
from test_served_tau import write_shard

# recipe -> (the family of its tiny stand-in, its experts in MXFP4)
RECIPES = {"qwen3_8b_dflash.toml": ("qwen3", False), "qwen3_8b_dflash2.toml": ("qwen3", False),
           "gpt_oss_20b_dflash.toml": ("gpt_oss", False), "gpt_oss_120b_dflash.toml": ("gpt_oss", True),
           "qwen3_5_27b_dflash.toml": ("qwen3_5", False), "gemma_3_27b_dflash.toml": ("gemma3", False)}


def test_every_hf_recipe_is_listed():
    hf = sorted(p.name for p in (SOURCE_DIR / "experiments").glob("*.toml") if 'plugin = "hf"' in p.read_text())
    assert hf == sorted(RECIPES), hf


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_validates_with_a_tiny_checkpoint_of_its_family(recipe, tmp_path):
    text = (SOURCE_DIR / "experiments" / recipe).read_text()
    family, mxfp4 = RECIPES[recipe]
    layers = [int(x) for x in re.search(r"^target_layer_ids = \[([0-9, ]+)\]", text, re.M).group(1).split(",")]
    folder = tmp_path / "target"
    n = max(layers) + 2
    # (Qwen3.5's layer_types for n layers: three Gated DeltaNet layers, then an attention layer; a hidden size its
    # recipe's 40 drafter heads divide)
    extra = dict(layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                 hidden_size=80) if family == "qwen3_5" else {}
    if family == "gemma3":  # (Gemma 3's layer_types for n layers: every sixth full, the others sliding)
        extra = dict(layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)])
    make_model(folder, family, seed=1, num_hidden_layers=n, **extra)
    if mxfp4:
        weights = load_file(str(folder / "model.safetensors"))
        for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            weights[name + "_blocks"], weights[name + "_scales"] = to_mxfp4(weights.pop(name).transpose(1, 2).float())
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        edit_config(folder, quantization_config={"quant_method": "mxfp4"})
    write_shard(tmp_path / "data", [([5, 6, 7, 8], [9, 10, 11, 12] * 20)] * 8, 160)
    for old, new in [(r'^path = "/models/[^"]*"', f'path = "{folder}"'), (r'^path = "data/[^"]*"', f'path = "{tmp_path / "data"}"'),
                     (r'^device = "cuda"', 'device = "cpu"'), (r'^dtype = "bfloat16"', 'dtype = "float32"'),
                     (r'^kernels = \["flash_cuda"[^\]]*\]', 'kernels = ["flash_cpu"]'),
                     (r'^\[kernels\.flash_cuda\]\nconfig = .*\n', ''), (r'^seq_len = \d+', 'seq_len = 64'),
                     (r'^anchors = \d+', 'anchors = 2')]:
        text, n = re.subn(old, new, text, flags=re.M)
        assert n >= 1, (recipe, old)
    exp = tmp_path / recipe
    exp.write_text(text)
    p = subprocess.run([str(CLI), "validate", str(exp), "--out", str(tmp_path / "runs")], capture_output=True,
                       text=True, timeout=300)
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith(("target:", "validate", "ok"))))
    assert p.returncode == 0, p.stdout + p.stderr
    if mxfp4:  # mxfp4 = "keep" is read: the same stand-in without its quantization_config is refused by it
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["quantization_config"]
        (folder / "config.json").write_text(json.dumps(cfg))
        p = subprocess.run([str(CLI), "validate", str(exp), "--out", str(tmp_path / "runs")], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode != 0 and '[target] mxfp4: "keep" keeps a checkpoint\'s MXFP4 experts' in p.stderr, p.stderr


# The recipes that read a cache ([target] plugin = "cache") -> the layer count of their target.
CACHE_RECIPES = {"glm_4_5_dflash_cache.toml": 92}


def test_every_cache_recipe_is_listed():
    cache = sorted(p.name for p in (SOURCE_DIR / "experiments").glob("*.toml") if 'plugin = "cache"' in p.read_text())
    assert cache == sorted(CACHE_RECIPES), cache


@pytest.mark.parametrize("recipe", sorted(CACHE_RECIPES))
def test_cache_recipe_validates_with_a_tiny_cache(recipe, tmp_path):
    """The recipe as written, its cache dumped (by its own command's --layers) from a tiny model of its target's
    depth, its data a tokens shard: `flashdraft validate` passes, and a cache without the label layer is refused."""
    text = (SOURCE_DIR / "experiments" / recipe).read_text()
    layers = re.search(r"--layers ([0-9,]+)", text).group(1)
    make_model(tmp_path / "target", "qwen3", seed=1, num_hidden_layers=CACHE_RECIPES[recipe], hidden_size=80)  # (40 heads divide it)
    write_shard(tmp_path / "data", [([5, 6, 7, 8], [9, 10, 11, 12] * 20)] * 8, 160)
    for name, dumped in [("cache", layers), ("short", layers.rsplit(",", 1)[0])]:
        p = subprocess.run([sys.executable, str(SOURCE_DIR / "scripts" / "dump-hidden-states"), "--model",
                            str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--layers", dumped, "--out",
                            str(tmp_path / name), "--device", "cpu", "--dtype", "float32"],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        edited = text
        for old, new in [(r'^path = "cache/[^"]*"', f'path = "{tmp_path / name}"'),
                         (r'^path = "data/[^"]*"', f'path = "{tmp_path / "data"}"'), (r'^device = "cuda"', 'device = "cpu"'),
                         (r'^dtype = "bfloat16"', 'dtype = "float32"'), (r'^kernels = \["flash_cuda"[^\]]*\]', 'kernels = ["flash_cpu"]'),
                         (r'^seq_len = \d+', 'seq_len = 64'), (r'^anchors = \d+', 'anchors = 2')]:
            edited, n = re.subn(old, new, edited, flags=re.M)
            assert n >= 1, (recipe, old)
        exp = tmp_path / f"{name}.toml"
        exp.write_text(edited)
        p = subprocess.run([str(CLI), "validate", str(exp), "--out", str(tmp_path / "runs")], capture_output=True,
                           text=True, timeout=300)
        if name == "cache":
            assert p.returncode == 0, p.stdout + p.stderr
        else:
            assert p.returncode != 0 and f"holds no states of layer {layers.rsplit(',', 1)[1]}" in p.stderr, p.stderr

"""The hf target against transformers: tiny random Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Mixtral and GLM-4.5 checkpoints (tied and untied embeddings, one sharded save) made here; our target's
hidden states after every layer and the final logits must equal transformers'
`output_hidden_states` (layer id L = hidden_states[L + 1]) in fp32 on CPU. Padded
batches give every sequence the states it has alone; packed documents do not see each
other; corrupt or mismatched checkpoints are refused with a sentence."""
import atexit
import copy
import json
import os
import select
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import BINARY_DIR, SOURCE_DIR
from hf_models import FAMILIES, SMALL, edit_config, make_model

TOOL = BINARY_DIR / "bin" / "target_states"
BOUND = 1e-4  # fp32 relative error (max |a - b| / max |b|)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def rel_mean(a, b):
    return ((a.double() - b.double()).abs().mean() / b.double().abs().mean().clamp_min(1e-30)).item()


def run_target(model_dir, tokens, lengths, layers, tmp, documents=None, kernel="dense_ref", dtype="float32",
               device="cpu", env=None, keys=None):
    inp, out = tmp / "in.safetensors", tmp / "out.safetensors"
    tensors = {"tokens": tokens.long(), "lengths": lengths.long()}
    if documents is not None:
        tensors["documents"] = documents.long()
    save_file(tensors, str(inp))
    more = ["engine", *[f"{k}={v}" for k, v in keys.items()]] if keys else []  # more [target] keys
    args = ["hf", str(model_dir), str(inp), str(out), ",".join(map(str, layers)), kernel, dtype, device, *more]
    if env is None and device == "cpu":
        p = SERVER.run(args, tmp)
    else:  # (a process of its own: the engine reads some variables once; a CUDA error must not outlive its run)
        p = subprocess.run([str(TOOL), *args], capture_output=True, text=True, timeout=300,
                           env=None if env is None else {**os.environ, **env})
    return p, (load_file(str(out)) if p.returncode == 0 else None)


class StatesServer:
    """`target_states --serve`: the CPU runs of this file in one process, started on the first (LibTorch's start is
    ~0.4 s a process, and this file makes ~300 runs). A run's output and exit status as subprocess.run gives them; a
    run that kills the process (a crash) returns its signal as the status, and the next run starts a new one."""

    def __init__(self):
        self.proc = None

    def run(self, args, tmp, timeout=300):
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([str(TOOL), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        out, err = tmp / "target_states.stdout", tmp / "target_states.stderr"
        fields = [str(out), str(err), *args]
        assert not any("\t" in f or "\n" in f for f in fields), fields
        self.proc.stdin.write("\t".join(fields) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            raise subprocess.TimeoutExpired([str(TOOL), *args], timeout)
        line = self.proc.stdout.readline()
        code = int(line) if line.strip() else self.proc.wait()
        return subprocess.CompletedProcess([str(TOOL), *args], code, out.read_text(), err.read_text())

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


SERVER = StatesServer()
atexit.register(SERVER.close)


@pytest.fixture(scope="module", params=[f[0] for f in FAMILIES])
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_model(folder, request.param, seed=hash(request.param) % 1000)
    return request.param, folder, model


@pytest.mark.parametrize("kernel", ["dense_ref", "flash_cpu"])
def test_hidden_states_and_logits_match_transformers(family_model, kernel, tmp_path):
    family, folder, model = family_model
    if not TOOL.exists():
        pytest.fail(f"{TOOL} was not built")
    g = torch.Generator().manual_seed(7)
    B, S = 3, 24
    tokens = torch.randint(0, SMALL["vocab_size"], (B, S), generator=g)
    lengths = torch.tensor([24, 17, 9])
    layers = list(range(SMALL["num_hidden_layers"]))
    p, ours = run_target(folder, tokens, lengths, layers, tmp_path, kernel=kernel)
    assert p.returncode == 0, p.stderr
    assert f"kernels {kernel}" in p.stdout, p.stdout
    worst = 0.0
    for b in range(B):
        n = int(lengths[b])
        with torch.no_grad():
            ref = model(input_ids=tokens[b:b + 1, :n], output_hidden_states=True)
        for e, layer in enumerate(layers):
            err = rel(ours["hidden"][b, :n, e], ref.hidden_states[layer + 1][0])
            worst = max(worst, err)
            assert err <= BOUND, f"{family} row {b} layer {layer}: rel err {err:.2e}"
        err = rel(ours["logits"][b, :n], ref.logits[0])
        assert err <= BOUND, f"{family} row {b} logits: rel err {err:.2e}"
    print(f"{family} ({kernel}): worst hidden-state rel err {worst:.1e} (bound {BOUND:.0e})")


@pytest.mark.parametrize("family", ["qwen3_yarn", "llama_yarn"])
def test_yarn_past_the_pretraining_length_matches_transformers(family, tmp_path):
    """YaRN at 100 positions, past the pretraining lengths (64, 32) the configs give; and not
    vacuous: the same weights with plain RoPE give other states."""
    model = make_model(tmp_path / family, family, seed=11)
    S, last = 100, SMALL["num_hidden_layers"] - 1
    tokens = torch.randint(0, SMALL["vocab_size"], (1, S), generator=torch.Generator().manual_seed(3))
    p, ours = run_target(tmp_path / family, tokens, torch.tensor([S]), [1, last], tmp_path)
    assert p.returncode == 0, p.stderr
    plain_config = copy.deepcopy(model.config)
    plain_config.rope_parameters = {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    plain = type(model)(plain_config).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
        other = plain(input_ids=tokens, output_hidden_states=True).hidden_states
    errs = [rel(ours["hidden"][0, :, e], ref[layer + 1][0]) for e, layer in enumerate([1, last])]
    plain_err = rel(other[last + 1][0], ref[last + 1][0])
    print(f"{family}: {model.config.rope_parameters}; rel err {max(errs):.1e} at {S} positions; "
          f"plain RoPE differs by {plain_err:.1e}")
    # Not vacuous: plain RoPE is off by more than 10x the equality bound (our error is ~3e-7).
    assert max(errs) <= BOUND and plain_err > 10 * BOUND


@pytest.mark.parametrize("family", ["llama", "qwen3_yarn"])
def test_scaled_rope_without_a_pretraining_length_uses_max_position_embeddings(family, tmp_path):
    """A config whose rope_parameters omit original_max_position_embeddings (written by hand:
    save_pretrained always writes it): transformers takes max_position_embeddings, and so do we."""
    folder = tmp_path / family
    make_model(folder, family, seed=17)
    cfg = json.loads((folder / "config.json").read_text())
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "original_max_position_embeddings"}
    edit_config(folder, rope_parameters=rope, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.rope_parameters["original_max_position_embeddings"] == 128
    S, last = 100, SMALL["num_hidden_layers"] - 1
    tokens = torch.randint(0, SMALL["vocab_size"], (1, S), generator=torch.Generator().manual_seed(4))
    p, ours = run_target(folder, tokens, torch.tensor([S]), [last], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states[last + 1][0]
    err = rel(ours["hidden"][0, :, 0], ref)
    print(f"{family} without original_max_position_embeddings: rel err {err:.1e}")
    assert err <= BOUND


def test_packed_documents_do_not_see_each_other(tmp_path):
    folder = tmp_path / "qwen3"
    model = make_model(folder, "qwen3", seed=3)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 30), generator=g)
    documents = torch.tensor([[10, 14, 6], [30, 0, 0]])
    p, ours = run_target(folder, tokens, torch.tensor([30, 30]), [1, 3], tmp_path, documents=documents)
    assert p.returncode == 0, p.stderr
    start = 0
    for n in [10, 14, 6]:
        with torch.no_grad():
            ref = model(input_ids=tokens[0:1, start:start + n], output_hidden_states=True)
        for e, layer in enumerate([1, 3]):
            assert rel(ours["hidden"][0, start:start + n, e], ref.hidden_states[layer + 1][0]) <= BOUND
        start += n
    # The same tokens unpacked (one document) differ after the first document.
    with torch.no_grad():
        whole = model(input_ids=tokens[0:1], output_hidden_states=True)
    assert rel(ours["hidden"][0, 10:, 0], whole.hidden_states[2][0, 10:]) > 1e-3


@pytest.mark.parametrize("family, full, layers, first", [("mistral_swa", dict(sliding_window=None), [0, 3], 0),
                                                          ("qwen2_swa", dict(use_sliding_window=False,
                                                                             layer_types=["full_attention"] * 4),
                                                           [1, 2, 3], 2)])
def test_sliding_window_layers_see_only_their_window(family, full, layers, first, tmp_path):
    """Sliding-window attention (window 6; Mistral: every layer, Qwen2: layers 2 and 3 as its
    layer_types say) over 24 positions: ours equals transformers' with the window and, read with
    full attention, transformers' with full attention; the two differ from the first sliding layer
    on and not before it (the window is read, and applied where it should be). Qwen2's config.json
    without layer_types gives the same states (the rule: the layers from max_window_layers on)."""
    folder = tmp_path / family
    model = make_model(folder, family, seed=5)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    p, windowed = run_target(folder, tokens, torch.tensor([24]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    if family == "qwen2_swa":
        assert json.loads((folder / "config.json").read_text())["layer_types"][first] == "sliding_attention"
        edit_config(folder, layer_types=None)
        p, by_rule = run_target(folder, tokens, torch.tensor([24]), layers, tmp_path)
        assert p.returncode == 0, p.stderr
        assert torch.equal(by_rule["hidden"], windowed["hidden"])
    edit_config(folder, **full)
    p, plain = run_target(folder, tokens, torch.tensor([24]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        windowed_ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
        plain_ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            input_ids=tokens, output_hidden_states=True).hidden_states
    for e, layer in enumerate(layers):
        ours_w, ours_p = windowed["hidden"][:, :, e], plain["hidden"][:, :, e]
        err_w, err_p = rel(ours_w, windowed_ref[layer + 1]), rel(ours_p, plain_ref[layer + 1])
        moved = rel(ours_w, ours_p)
        print(f"{family} layer {layer}: rel err {err_w:.1e} windowed, {err_p:.1e} full; the window moves it {moved:.1e}")
        assert err_w <= BOUND and err_p <= BOUND
        assert moved > 10 * BOUND if layer >= first else moved <= BOUND


# (family, what the target prints, a config change that must move the states)
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(norm_topk_prob=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_experts_per_tok=1)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(topk_group=4)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(num_experts_per_tok=1)),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(norm_topk_prob=True)),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(num_experts_per_tok=1)),
    "granitemoe": ("GraniteMoeForCausalLM", dict(num_experts_per_tok=1)),
    "dots1": ("Dots1ForCausalLM", dict(topk_group=4)),
    "hunyuan_moe": ("HunYuanMoEV1ForCausalLM", dict(moe_topk=1)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(topk_method="greedy")),
    "olmoe": ("OlmoeForCausalLM", dict(norm_topk_prob=True)),
    "flex_olmo": ("FlexOlmoForCausalLM", dict(norm_topk_prob=False)),
    "llama4": ("Llama4ForCausalLM", dict(num_experts_per_tok=1)),
    "granite4_moe": ("GraniteMoeHybridForCausalLM", dict(num_experts_per_tok=1)),
    "granitemoe_shared": ("GraniteMoeSharedForCausalLM", dict(num_experts_per_tok=1)),
    "nemotron_h_moe": ("NemotronHForCausalLM", dict(topk_group=4)),
    "gemma4_moe": ("Gemma4ForCausalLM", dict(top_k_experts=1)),
    "mistral4": ("Mistral4ForCausalLM", dict(topk_group=4)),
    "afmoe": ("AfmoeForCausalLM", dict(num_experts_per_tok=1)),
    "solar_open": ("SolarOpenForCausalLM", dict(topk_group=4)),
    "granitemoe_swa": ("GraniteMoeSWAForCausalLM", dict(num_experts_per_tok=1)),
    "exaone_moe": ("ExaoneMoeForCausalLM", dict(topk_group=4)),
}


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_mixture_of_experts_routes_as_transformers(family, tmp_path):
    """Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and Qwen3.5-MoE: the states equal transformers' (the family test above)
    and that is not vacuous: the tokens spread over the experts, and the same checkpoint read with
    another routing (Qwen3-MoE: without the renormalisation over the chosen experts, norm_topk_prob
    false; Qwen2-MoE: with it; Mixtral and Qwen3.5-MoE, which always renormalise: one expert a token; GLM-4.5: its
    experts chosen from all 4 groups, not the best 2) gives other states from the first sparse layer on. Layer 1 is
    sparse in each (Qwen3-MoE: 2 dense; Qwen2-MoE, GLM-4.5 and Qwen3-Next: 0 dense; Qwen3.5-MoE: every layer
    sparse; Qwen3-Next, not renormalised here: with it; GLM-4.7-Flash, Granite's, Hunyuan's, Llama 4's: one expert a token; dots.llm1: its
    experts chosen from all 4 groups, as GLM-4.5's; DeepSeek-V2: greedy over every expert, not the best 2 groups; OLMoE: renormalised, FlexOlmo: not)."""
    architecture, other_routing = MOE_FAMILIES[family]
    folder = tmp_path / family
    model = make_model(folder, family, seed=21)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([40, 40])
    p, ours = run_target(folder, tokens, lengths, [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "8 experts (2 a token)" in p.stdout and architecture in p.stdout, p.stdout
    chosen = []  # layer 1's router: the experts of every token
    layer = model.model.layers[1]
    if hasattr(layer, "feed_forward"):  # (Llama 4's router returns its scores and logits: the top 2 logits chosen)
        hook = layer.feed_forward.router.register_forward_hook(lambda m, i, out: chosen.append(out[1].topk(2).indices))
    else:
        router = (layer.block_sparse_moe.router if hasattr(layer, "block_sparse_moe")  # (Granite's)
                  else layer.mixer.gate if hasattr(layer, "mixer")  # (Nemotron-H's)
                  else layer.router if hasattr(layer, "router")  # (Gemma 4's beside its MLP)
                  else layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate)  # (AFMoE's)
        hook = router.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True)
    hook.remove()
    for e, layer in enumerate([1, 3]):
        assert rel(ours["hidden"][:, :, e], ref.hidden_states[layer + 1]) <= BOUND
    counts = torch.bincount(chosen[0].flatten(), minlength=8)
    print(f"{family} layer 1: tokens per expert {counts.tolist()}")
    assert (counts > 0).sum() >= 6, counts  # not one or two experts taking every token
    edit_config(folder, **other_routing)
    p, plain = run_target(folder, tokens, lengths, [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    moved = [rel(plain["hidden"][:, :, e], ref.hidden_states[layer + 1]) for e, layer in enumerate([1, 3])]
    print(f"{family} with {other_routing}: rel err {moved[0]:.1e} (layer 1), {moved[1]:.1e} (layer 3)")
    assert min(moved) > 10 * BOUND, moved


def zeroed_against_transformers(family, suffix, tmp_path):
    """A tiny `family` checkpoint's layer-3 states, ours before and after the tensors whose names end
    with `suffix` are zeroed in the checkpoint, and transformers' with them zeroed in its model
    (parameters or buffers): (the zeroed tensors as saved, ours before, ours after, transformers')."""
    folder = tmp_path / family
    model = make_model(folder, family, seed=21)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([40, 40])
    weights = load_file(str(folder / "model.safetensors"))
    names = [k for k in weights if k.endswith(suffix)]
    saved = {k: weights[k] for k in names}
    p, before = run_target(folder, tokens, lengths, [3], tmp_path)
    assert p.returncode == 0, p.stderr
    for k in names:
        weights[k] = torch.zeros_like(weights[k])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    p, after = run_target(folder, tokens, lengths, [3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith(suffix):
                t.zero_()
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states[4]
    return saved, before["hidden"][:, :, 0], after["hidden"][:, :, 0], ref


def minimax_rotary_dim_is_read():
    """Whether this transformers' MiniMax-M2 reads rotary_dim as its partial rotary factor, as the released checkpoints
    mean it (5.23 does; 5.17 rotates every dimension whatever rotary_dim says)."""
    config = transformers.MiniMaxM2Config(**{**SMALL, "head_dim": 16, "rotary_dim": 8})
    return (config.rope_parameters or {}).get("partial_rotary_factor") == 0.5


def mamba_norm_is_grouped(family="granite4_h"):
    """Whether this transformers' Granite 4.0-H (or Bamba) normalises its Mamba-2 output per group of B and C, as
    mamba_ssm's RMSNormGated(group_size=d_inner / n_groups) does (5.23 does; 5.17 normalises over all of d_inner: the
    two agree where mamba_n_groups is 1, as in the published checkpoints)."""
    import inspect
    norm = (transformers.models.bamba.modeling_bamba.BambaRMSNormGated if family == "bamba" else
            transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated)
    return "group_size" in inspect.signature(norm.__init__).parameters


def gpt_oss_limit_is_read():
    """Whether this transformers' gpt-oss reads swiglu_limit from its config (5.23 does; 5.17 fixes it at 7.0)."""
    config = transformers.GptOssConfig(**{**SMALL, "swiglu_limit": 0.5})
    return transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config).limit == 0.5


def sinks_are_read(family, tmp_path):
    """`family`'s attention sinks (one a layer, drawn in make_model) zeroed in the checkpoint: ours follows transformers
    with them zeroed, and they move the states. Returns our states with them zeroed."""
    sinks, ours, unsunk, ref = zeroed_against_transformers(family, "self_attn.sinks", tmp_path)
    assert len(sinks) == 4 and all(t.abs().min() >= 0.5 for t in sinks.values())
    print(f"{family} with its sinks zeroed: rel err {rel(unsunk, ref):.1e}; the sinks move it {rel(ours, unsunk):.1e}")
    assert rel(unsunk, ref) <= BOUND and rel(ours, unsunk) > 10 * BOUND
    return unsunk


def test_gpt_oss_sinks_clamped_glu_and_windows_are_read_and_used(tmp_path):
    """gpt-oss's own parts each move the states, and ours follows transformers through each change
    (the family test gives the states equal with all of them): its attention sinks zeroed in the
    checkpoint, its GLU's limit at the published 7 (which this random model's products never reach,
    against 0.2), its sliding layers made full. Layer 3 of 4, 40 positions (past the window of 6)."""
    unsunk = sinks_are_read("gpt_oss", tmp_path)
    folder = tmp_path / "gpt_oss"
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    for change in (dict(swiglu_limit=7.0), dict(layer_types=["full_attention"] * 4)):
        edit_config(folder, **change)
        p, changed = run_target(folder, tokens, torch.tensor([40, 40]), [3], tmp_path)
        assert p.returncode == 0, p.stderr
        with torch.no_grad():
            theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
                input_ids=tokens, output_hidden_states=True).hidden_states[4]
        err, moved = rel(changed["hidden"][:, :, 0], theirs), rel(changed["hidden"][:, :, 0], unsunk)
        print(f"gpt_oss with {list(change)[0]} {str(list(change.values())[0])[:40]}: rel err {err:.1e}; the change "
              f"moves it {moved:.1e}")
        assert err <= BOUND and moved > 10 * BOUND
        unsunk = changed["hidden"][:, :, 0]


def recurrent_over_chunks_and_documents(family, says, tmp_path):
    """A recurrent family's states over 150 positions (its rule's chunks several times over) against transformers', and
    a row packed with documents of 70, 50 and 30 against each document alone; packing must move the later ones. The run
    must say `says`. Returns (transformers' model, the tokens, our states over the whole row)."""
    folder = tmp_path / family
    model = make_model(folder, family, seed=31)
    layers = [0, 1, 2, 3]
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(9))
    p, whole = run_target(folder, tokens, torch.tensor([150]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    assert says in p.stdout, p.stdout
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
    errs = [rel(whole["hidden"][0, :, e], ref[layer + 1][0]) for e, layer in enumerate(layers)]
    p, packed = run_target(folder, tokens, torch.tensor([150]), layers, tmp_path,
                           documents=torch.tensor([[70, 50, 30]]))
    assert p.returncode == 0, p.stderr
    start, doc_errs = 0, []
    for n in [70, 50, 30]:
        with torch.no_grad():
            alone = model(input_ids=tokens[:, start:start + n], output_hidden_states=True).hidden_states
        doc_errs += [rel(packed["hidden"][0, start:start + n, e], alone[layer + 1][0]) for e, layer in enumerate(layers)]
        start += n
    moved = rel(packed["hidden"][0, 70:, 0], whole["hidden"][0, 70:, 0])
    print(f"{family}: 150 positions rel err {max(errs):.1e}; packed documents {max(doc_errs):.1e}, packing moves "
          f"layer 0's states {moved:.1e}")
    assert max(errs) <= BOUND and max(doc_errs) <= BOUND and moved > 10 * BOUND
    return model, tokens, whole


def zeroed_tensors_are_read(family, suffixes, count, tmp_path):
    """Each of `suffixes` (count tensors of the checkpoint, none zero) zeroed: ours follows transformers and the change
    moves the states."""
    for suffix in suffixes:
        saved, before, after, theirs = zeroed_against_transformers(family, suffix, tmp_path / suffix)
        assert len(saved) == count and all(t.abs().max() > 0 for t in saved.values())
        print(f"{family} with {suffix} zeroed: rel err {rel(after, theirs):.1e}; the tensor moves it "
              f"{rel(before, after):.1e}")
        assert rel(after, theirs) <= BOUND and rel(before, after) > 10 * BOUND


def test_qwen3_5_gated_deltanet_over_chunks_documents_and_its_multimodal_checkpoint(tmp_path):
    """Qwen3.5 (Gated DeltaNet layers 0 and 2, gated attention 1 and 3): 150 positions (the rule's chunks
    of 64: three, the last partial) equal transformers'; a row packed with documents of 70, 50 and 30
    gives each document the states it has alone (no state or convolution history crosses a start), and
    packing them moves the later ones; dt_bias and A_log zeroed in the checkpoint, ours follows
    transformers and each moves the states (they are read); the same language model saved as
    Qwen3_5ForConditionalGeneration (config.json's text_config, tensors under model.language_model.)
    gives the same states."""
    model, tokens, whole = recurrent_over_chunks_and_documents("qwen3_5", "Qwen3_5ForCausalLM", tmp_path)
    layers = [0, 1, 2, 3]
    zeroed_tensors_are_read("qwen3_5", ("linear_attn.dt_bias", "linear_attn.A_log"), 2, tmp_path)

    # The multimodal checkpoint: a tiny vision tower beside the same language model and LM head.
    text = model.config.to_dict()
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                             out_hidden_size=SMALL["hidden_size"], patch_size=4),
        tie_word_embeddings=False)
    composite = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    composite.lm_head.load_state_dict(model.lm_head.state_dict())
    composite.save_pretrained(tmp_path / "qwen3_5_vl", safe_serialization=True)
    names = load_file(str(tmp_path / "qwen3_5_vl" / "model.safetensors")).keys()
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in names)
    assert any(k.startswith("model.visual.") for k in names)
    p, vl = run_target(tmp_path / "qwen3_5_vl", tokens, torch.tensor([150]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Qwen3_5ForConditionalGeneration" in p.stdout, p.stdout
    with torch.no_grad():
        theirs = composite(input_ids=tokens, output_hidden_states=True).hidden_states
    vl_errs = [rel(vl["hidden"][0, :, e], theirs[layer + 1][0]) for e, layer in enumerate(layers)]
    print(f"qwen3_5 as Qwen3_5ForConditionalGeneration: rel err {max(vl_errs):.1e} against its transformers model; "
          f"equal to the text-only checkpoint's: {torch.equal(vl['hidden'], whole['hidden'])}")
    assert max(vl_errs) <= BOUND and torch.equal(vl["hidden"], whole["hidden"])


def states_against(model, folder, tokens, layers, tmp_path):
    """Ours on `folder` and transformers' `model` over `tokens` (one row, every position real): (our run, our states,
    the worst relative error over `layers`)."""
    p, ours = run_target(folder, tokens, torch.tensor([tokens.size(1)]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
    return p, ours, max(rel(ours["hidden"][0, :, e], ref[L + 1][0]) for e, L in enumerate(layers))


def composite_checkpoint(name, text, vision, seed, tmp_path):
    """transformers' <name>ForConditionalGeneration of these text and vision configs with random weights (norms away
    from 1, routers far from even, the language model's biases and router correction biases that show, as make_model),
    saved to tmp_path / name: (the model, its folder)."""
    config = getattr(transformers, name + "Config")(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, name + "ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.1)
            elif n.endswith("bias") and "language_model" in n:
                p.normal_(0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def composite_states(model, folder, name, tmp_path, what="ForConditionalGeneration"):
    """Ours on a composite checkpoint's language model against transformers' model, 70 tokens, every layer (the bound
    asserted; the run names the architecture): (the tokens, our states)."""
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 70), generator=torch.Generator().manual_seed(4))
    p, ours, err = states_against(model, folder, tokens, [0, 1, 2, 3], tmp_path)
    assert name + "ForConditionalGeneration" in p.stdout, p.stdout
    print(f"{name}{what}: rel err {err:.1e} over layers [0, 1, 2, 3]")
    assert err <= BOUND
    return tokens, ours


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_language_model_matches_transformers(moe, tmp_path):
    """Qwen3-VL's and Qwen3-VL-MoE's language models (Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration: config.json's text_config, tensors under model.language_model., a vision
    tower beside them; text positions: interleaved mrope is plain RoPE) equal transformers' on 70 tokens, every layer.
    The MoE's experts stacked a layer (8 of 24, 2 a token, always renormalised; layer 2 dense): as transformers saves
    them and as published (each product's transpose, [E, H, 2 I] and [E, I, H]), which transformers reads too; the
    two give equal states."""
    text = dict(SMALL, head_dim=16, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 3, 3],
                                     mrope_interleaved=True))
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                    mlp_only_layers=[2])
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=SMALL["hidden_size"],
                  patch_size=4, deepstack_visual_indexes=[0])
    name = "Qwen3VLMoe" if moe else "Qwen3VL"
    model, folder = composite_checkpoint(name, text, vision, 23, tmp_path)
    tokens, ours = composite_states(model, folder, name, tmp_path)
    layers = [0, 1, 2, 3]
    if not moe:
        return
    tensors = load_file(str(folder / "model.safetensors"))
    stacked = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert len(stacked) == 6 and tensors[stacked[0]].shape[0] == 8, stacked
    published = tmp_path / (name + "_published")
    published.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (published / f.name).write_bytes(f.read_bytes())
    save_file({k: v.transpose(1, 2).contiguous() if k in stacked else v for k, v in tensors.items()},
              str(published / "model.safetensors"), metadata={"format": "pt"})
    reread = getattr(transformers, name + "ForConditionalGeneration").from_pretrained(published).eval()
    _, ours_published, err = states_against(reread, published, tokens, layers, tmp_path)
    print(f"{name} experts as published ({tuple(tensors[stacked[0]].transpose(1, 2).shape)}): rel err {err:.1e}; "
          f"equal to the saved layout's states: {torch.equal(ours_published['hidden'], ours['hidden'])}")
    assert err <= BOUND and torch.equal(ours_published["hidden"], ours["hidden"])


@pytest.mark.parametrize("name", ["Qwen2VL", "Qwen2_5_VL"])
def test_qwen2_vl_language_model_as_saved_and_as_published(name, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's language models (Qwen2's layers, q / k / v biases): as transformers 5 saves them
    (text_config, model.language_model.) and as published (the text keys at the top beside vision_config,
    rope_scaling {type "mrope", mrope_section}, tensors under model. and visual.), which transformers reads too: ours
    equals transformers' composite model both ways, the two giving equal states."""
    text = dict(SMALL, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]))
    vision = dict(depth=1, embed_dim=32, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=SMALL["hidden_size"],
                  patch_size=4)
    model, folder = composite_checkpoint(name, text, vision, 31, tmp_path)
    tokens, ours = composite_states(model, folder, name, tmp_path, "ForConditionalGeneration as saved")
    layers = [0, 1, 2, 3]
    published = tmp_path / (name + "_published")
    published.mkdir()
    saved = json.loads((folder / "config.json").read_text())
    flat = {**{k: v for k, v in saved.items() if k != "text_config"}, **without(saved["text_config"], "rope_parameters")}
    flat.update(rope_theta=1e6, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]), architectures=saved["architectures"],
                model_type=saved["model_type"])
    (published / "config.json").write_text(json.dumps(flat))
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}
    assert any(k.startswith("visual.") for k in renamed) and "model.embed_tokens.weight" in renamed
    save_file(renamed, str(published / "model.safetensors"), metadata={"format": "pt"})
    reread = getattr(transformers, name + "ForConditionalGeneration").from_pretrained(published).eval()
    _, ours_published, err = states_against(reread, published, tokens, layers, tmp_path)
    print(f"{name} as published: rel err {err:.1e}; equal to the saved layout's states: "
          f"{torch.equal(ours_published['hidden'], ours['hidden'])}")
    assert err <= BOUND and torch.equal(ours_published["hidden"], ours["hidden"])


@pytest.mark.parametrize("name", ["Glm4v", "Glm4vMoe", "Glm46V"])
def test_glm4v_language_model_matches_transformers(name, tmp_path):
    """GLM-4.1V's, GLM-4.5V / 4.6V's and GLM-4.6V-Flash's language models (Glm4vForConditionalGeneration and
    Glm46VForConditionalGeneration: GLM-4's layers, its rotated pairs interleaved; Glm4vMoeForConditionalGeneration:
    GLM-4.5's, half of each head rotated, experts with a sigmoid router and a shared one; config.json's text_config,
    tensors under model.language_model., a vision tower beside them; text positions: their mrope is plain RoPE) equal
    transformers' on 70 tokens, every layer."""
    moe = name == "Glm4vMoe"
    text = dict(SMALL, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 2] if moe else [2, 3, 3],
                                     partial_rotary_factor=0.5 if moe else 1.0))
    if moe:
        text.update(head_dim=16, attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                    norm_topk_prob=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=SMALL["hidden_size"],
                  patch_size=4)
    model, folder = composite_checkpoint(name, text, vision, 29, tmp_path)
    composite_states(model, folder, name, tmp_path)


def composite_matches(composite, name, tokens, layers, base, tmp_path):
    """The text model saved as the multimodal `composite` (its vision tower beside it): ours on that folder gives the
    text-only checkpoint's states `base` exactly, and transformers' composite's within BOUND. Returns the folder."""
    folder = tmp_path / f"{name}_vl"
    composite.save_pretrained(folder, safe_serialization=True)
    assert any("vision" in k or "visual" in k for k in load_file(str(folder / "model.safetensors")).keys())
    p, vl, vl_err = states_against(composite, folder, tokens, layers, tmp_path)
    architecture = type(composite).__name__
    assert architecture in p.stdout, p.stdout
    print(f"{name} as {architecture}: rel err {vl_err:.1e}; equal to the text-only checkpoint's: "
          f"{torch.equal(vl['hidden'], base['hidden'])}")
    assert vl_err <= BOUND and torch.equal(vl["hidden"], base["hidden"])
    return folder


def test_gemma3_reads_each_of_its_parts_and_its_multimodal_checkpoint(tmp_path):
    """Gemma 3 (the family test gives its states equal to transformers'): each of its own keys is read and moves the
    states, ours following transformers through every change (40 positions, layers 1-3): query_pre_attn_scalar, the
    sliding layers' RoPE base, the full layer's linear scaling, the sliding window, the config as published
    (rope_theta, rope_scaling, rope_local_base_freq; no layer_types: every sixth layer full); and the same language
    model saved as Gemma3ForConditionalGeneration (text_config, its tensors under language_model.model. as published, a
    vision tower beside them) gives the same states."""
    folder = tmp_path / "gemma3"
    model = make_model(folder, "gemma3", seed=29)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(5))
    layers = [1, 2, 3]
    p, base = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    config = transformers.Gemma3Config(
        text_config=model.config.to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        mm_tokens_per_image=4)
    composite = transformers.Gemma3ForConditionalGeneration(config).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    vl_folder = composite_matches(composite, "gemma3", tokens, layers, base, tmp_path)
    # (transformers writes it in the published layout: language_model.model.)
    names = load_file(str(vl_folder / "model.safetensors")).keys()
    assert any(k.startswith(("language_model.model.layers.0.", "model.language_model.layers.0.")) for k in names)
    made = json.loads((folder / "config.json").read_text())
    rope = made["rope_parameters"]
    published = {k: v for k, v in made.items() if k not in ("rope_parameters", "layer_types")}
    published.update(rope_theta=1e6, rope_scaling=dict(rope_type="linear", factor=4.0), rope_local_base_freq=1e4,
                     sliding_window_pattern=3)  # (layers 0, 1, 3 sliding: as layer_types said)
    changes = {
        "query_pre_attn_scalar 16": dict(query_pre_attn_scalar=16),
        "sliding layers' RoPE base 1e5": dict(rope_parameters={**rope, "sliding_attention": dict(
            rope_type="default", rope_theta=1e5)}),
        "full layer's RoPE unscaled": dict(rope_parameters={**rope, "full_attention": dict(
            rope_type="default", rope_theta=1e6)}),
        "sliding_window 64": dict(sliding_window=64),
    }
    for what, change in [*changes.items(), ("as published", None)]:
        if change is None:
            (folder / "config.json").write_text(json.dumps(published))
        else:
            (folder / "config.json").write_text(json.dumps({**made, **change}))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, ours, err = states_against(theirs, folder, tokens, layers, tmp_path)
        moved = rel(ours["hidden"][0, :, 2], base["hidden"][0, :, 2])
        print(f"gemma3 with {what}: rel err {err:.1e}; the change moves layer 3's states {moved:.1e}")
        assert err <= BOUND
        assert (moved == 0) if change is None else (moved > 10 * BOUND), (what, moved)


def test_gemma4_reads_each_of_its_parts_and_its_multimodal_checkpoint(tmp_path):
    """Gemma 4 (the family test gives its states and soft-capped logits equal to transformers'): each of its own keys
    is read and moves the states (or the logits), ours following transformers through every change (40 positions, every
    layer): the sliding layers' RoPE base, the full layers' proportional RoPE (the part turning, its factor), the
    sliding window, the soft cap; the config as published (global_head_dim and num_global_key_value_heads instead of
    per_layer_config; no rope_parameters: Gemma4TextConfig's defaults) gives the same states where it means the same
    model; and the language model saved as Gemma4ForConditionalGeneration (text_config, model.language_model., a
    vision tower beside it) gives the text-only checkpoint's states."""
    folder = tmp_path / "gemma4"
    model = make_model(folder, "gemma4", seed=31)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(5))
    layers = [0, 1, 2, 3]
    p, base = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    config = transformers.Gemma4Config(
        text_config=model.config.to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16),
        audio_config=None)
    composite = transformers.Gemma4ForConditionalGeneration(config).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    composite_matches(composite, "gemma4", tokens, layers, base, tmp_path)
    made = json.loads((folder / "config.json").read_text())
    rope = made["rope_parameters"]
    published = {k: v for k, v in made.items() if k not in ("per_layer_config",)}
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    defaults = {k: v for k, v in published.items() if k != "rope_parameters"}
    full = dict(rope_type="proportional", rope_theta=1e6)
    changes = {
        "sliding layers' RoPE base 1e5": dict(rope_parameters={**rope, "sliding_attention": dict(
            rope_type="default", rope_theta=1e5)}),
        "full layers turning half of the frequencies": dict(rope_parameters={**rope, "full_attention": dict(
            full, partial_rotary_factor=0.5)}),
        "full layers' RoPE factor 4": dict(rope_parameters={**rope, "full_attention": dict(
            full, partial_rotary_factor=0.25, factor=4.0)}),
        "sliding_window 64": dict(sliding_window=64),
        "final_logit_softcapping 2": dict(final_logit_softcapping=2.0),
    }
    for what, change, same in [*((w, {**made, **c}, False) for w, c in changes.items()),
                               ("as published", published, True), ("Gemma4TextConfig's RoPE defaults", defaults, True)]:
        (folder / "config.json").write_text(json.dumps(change))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        p, ours = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
        assert p.returncode == 0, p.stderr
        with torch.no_grad():
            ref = theirs(input_ids=tokens, output_hidden_states=True)
        err = max(max(rel(ours["hidden"][0, :, e], ref.hidden_states[l + 1][0]) for e, l in enumerate(layers)),
                  rel(ours["logits"][0], ref.logits[0]))
        moved = max(rel(ours["hidden"][0, :, 3], base["hidden"][0, :, 3]), rel(ours["logits"][0], base["logits"][0]))
        print(f"gemma4 with {what}: rel err {err:.1e}; the change moves layer 3's states or the logits {moved:.1e}")
        assert err <= BOUND
        assert (moved == 0) if same else (moved > 10 * BOUND), (what, moved)


def test_cwm_as_published_takes_cwmconfigs_defaults(tmp_path):
    """Meta's CWM (the family test gives its states equal to transformers'): a config.json without rope_parameters,
    layer_types and sliding_window is CwmConfig's defaults (Llama 3.1's scaling, factor 16 over 8192 at base 1e6;
    every fourth layer full; a window of 8192), ours following transformers; and its layer_types, changed, move the
    states with transformers'."""
    changed_configs_follow_transformers("cwm", 7, 3, [
        ("as published (CwmConfig's defaults)", lambda made: without(made, "rope_parameters", "layer_types",
                                                                     "sliding_window")),
        ("layers 0 and 1 full", lambda made: {**made, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2})],
        tmp_path)


def test_gemma4_full_layers_run_on_the_next_kernel_where_the_first_refuses_their_heads(tmp_path):
    """Gemma 4's full layers have heads of their own width (512 as published), wider than flash_cuda runs. With
    kernels [flash_cpu, dense_ref] under on_fallback = "warn" and full layers 320 wide (flash_cpu runs up to 256), the
    sliding layers stay on flash_cpu and only the full layers run on dense_ref: the choice says which calls run where,
    the ledger records both kernels, and the states equal transformers'."""
    folder = tmp_path / "gemma4"
    model = make_model(folder, "gemma4", seed=37, global_head_dim=320)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([24, 15])
    layers = [0, 1, 2, 3]
    p, ours = run_target(folder, tokens, lengths, layers, tmp_path, kernel="flash_cpu,dense_ref")
    assert p.returncode == 0, p.stderr
    assert "flash_cpu: selected for calls 0,2; refused for the others: flash_cpu: head_dim 320 unsupported" in p.stdout, \
        p.stdout
    assert "dense_ref: selected (FALLBACK: not the first preference) for calls 1,3" in p.stdout, p.stdout
    ran = next(line for line in p.stdout.splitlines() if line.startswith("kernels "))
    assert "flash_cpu/" in ran and "dense_ref" in ran, ran
    worst = 0.0
    for b in range(2):
        n = int(lengths[b])
        with torch.no_grad():
            ref = model(input_ids=tokens[b:b + 1, :n], output_hidden_states=True).hidden_states
        worst = max(worst, *(rel(ours["hidden"][b, :n, e], ref[L + 1][0]) for e, L in enumerate(layers)))
    assert worst <= BOUND, worst
    print(f"gemma4, full layers 320 wide: {ran}; worst hidden-state rel err {worst:.1e} (bound {BOUND:.0e})")
    p, _ = run_target(folder, tokens, lengths, layers, tmp_path, kernel="flash_cpu")
    assert p.returncode != 0 and "head_dim 320 unsupported" in p.stderr, (p.stdout, p.stderr)


@pytest.mark.parametrize("suffix,count", [("per_layer_projection.weight", 4), ("embed_tokens_per_layer.weight", 1)])
def test_gemma4_per_layer_embeddings_are_read(suffix, count, tmp_path):
    """Gemma 4 E2B / E4B's kind (the family test gives its states equal to transformers', its last two layers attending
    with layers 0's and 1's keys and values): each per-layer input's projection and the per-layer embedding table,
    zeroed in the checkpoint, move the states, and ours follows transformers with them zeroed."""
    saved, before, after, theirs = zeroed_against_transformers("gemma4_ple", suffix, tmp_path)
    assert len(saved) == count and all(t.abs().max() > 0 for t in saved.values())
    print(f"gemma4_ple with {suffix} zeroed: rel err {rel(after, theirs):.1e}; the tensor moves it "
          f"{rel(before, after):.1e}")
    assert rel(after, theirs) <= BOUND and rel(before, after) > 10 * BOUND


@pytest.mark.parametrize("change,key", [
    (dict(num_kv_shared_layers=4), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=3), "num_kv_shared_layers"),
    (dict(enable_moe_block=True, num_experts=8, top_k_experts=9, moe_intermediate_size=32), "top_k_experts"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    (dict(per_layer_config={"1": dict(head_dim=32, intermediate_size=64)}), "intermediate_size"),
    (dict(per_layer_config={"1": dict(head_dim=32), "3": dict(head_dim=64)}), "per_layer_config"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="yarn", factor=4.0),
                               sliding_attention=dict(rope_type="default"))), "rope_parameters")],
    ids=["shared_kv_all", "shared_kv_no_source", "top_k_experts", "bidirectional", "activation", "softcap", "layer_key",
         "uneven_full_heads", "rope_type"])
def test_gemma4_what_it_cannot_run_is_refused(change, key, tmp_path):
    """A Gemma 4 config.json with a part ours does not run (bidirectional text) or a value transformers would not run
    as ours reads it (every layer sharing keys and values, or a shared layer with no earlier layer of its kind; more
    experts a token than experts): refused with a sentence naming the key, its value and what is accepted."""
    check_refused("gemma4", change, key, tmp_path)


def check_refused(family, change, key, tmp_path):
    """`family`'s tiny checkpoint with its config.json `change`d: refused with a sentence naming `key` and what is
    accepted."""
    folder = tmp_path / family
    make_model(folder, family, seed=5)
    edit_config(folder, **change)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    p, _ = run_target(folder, tokens, torch.tensor([8]), [1], tmp_path)
    assert p.returncode != 0 and f"{key}:" in p.stderr and "accepted" in p.stderr, p.stderr
    print(f"{family} {change}: {p.stderr.strip().splitlines()[-1]}")


def quantize_fp8(folder, block):
    """Rewrites `folder`'s checkpoint as a block-wise FP8 release does: every 2-D projection weight (not the
    embedding, norms or routers) as F8_E4M3 values with a float32 weight_scale_inv per block of `block` (the ragged
    last blocks where the shape is not a multiple), and config.json's quantization_config. Returns the weights as
    that checkpoint means them (values x scales) in float32."""
    tensors = load_file(str(folder / "model.safetensors"))
    out, meant = {}, {}
    bn, bk = block
    for k, v in tensors.items():
        if not (k.endswith("proj.weight") and v.dim() == 2):
            out[k] = v
            continue
        N, K = v.shape
        grid = (-(-N // bn), -(-K // bk))
        padded = torch.zeros(grid[0] * bn, grid[1] * bk)
        padded[:N, :K] = v.float()
        blocks = padded.view(grid[0], bn, grid[1], bk)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).view(grid[0] * bn, grid[1] * bk)[:N, :K].to(torch.float8_e4m3fn)
        out[k], out[k + "_scale_inv"] = q, scale
        full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        meant[k] = q.float() * full
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                         weight_block_size=list(block))
    (folder / "config.json").write_text(json.dumps(config))
    return meant


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_is_dequantized_at_load_as_transformers_does(family, tmp_path):
    """A block-wise FP8 checkpoint (quantization_config quant_method "fp8": F8_E4M3 weights and their
    weight_scale_inv, as DeepSeek-V3, Qwen3's -FP8 releases and MiniMax-M2 publish) is dequantized at load: states
    equal to transformers' FineGrainedFP8Config(dequantize=True) model of the same folder (blocks of 16: every shape
    a multiple), and with ragged blocks of 40 (transformers refuses those) equal to the same model saved with the
    weights the checkpoint means in float32. The quantization moves the states (not vacuous)."""
    folder = tmp_path / family
    make_model(folder, family, seed=37)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    layers = [0, 3]
    p, plain = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    original = load_file(str(folder / "model.safetensors"))
    quantize_fp8(folder, (16, 16))
    p, ours = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = theirs(input_ids=tokens, output_hidden_states=True).hidden_states
    err = max(rel(ours["hidden"][0, :, e], ref[L + 1][0]) for e, L in enumerate(layers))
    moved = rel(ours["hidden"][0, :, 1], plain["hidden"][0, :, 1])
    print(f"{family} FP8 (blocks of 16): rel err {err:.1e} against transformers' dequantized model; FP8 moves the "
          f"states {moved:.1e}")
    assert err <= BOUND and moved > 10 * BOUND
    if family == "qwen3_moe":  # [target] fp8 = "keep": the routed experts kept in FP8, the same states bit for bit
        p, kept = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path, keys={"fp8": "keep"})
        assert p.returncode == 0, p.stderr
        assert "fp8 kept, dequantized a layer at a time" in p.stdout, p.stdout
        print(f"{family} FP8 experts kept: equal to dequantized at load: {torch.equal(kept['hidden'], ours['hidden'])}")
        assert torch.equal(kept["hidden"], ours["hidden"])
    # ragged blocks: against the weights the checkpoint means, saved unquantized
    save_file(original, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    meant = quantize_fp8(folder, (40, 40))
    p, ragged = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    dequantized = tmp_path / (family + "_meant")
    dequantized.mkdir()
    (dequantized / "config.json").write_text(json.dumps(config))
    save_file({**original, **meant}, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    p, reference = run_target(dequantized, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    print(f"{family} FP8 (ragged blocks of 40): equal to the meant weights' states: "
          f"{torch.equal(ragged['hidden'], reference['hidden'])}")
    assert torch.equal(ragged["hidden"], reference["hidden"])


def test_fp8_checkpoint_refusals(tmp_path):
    """An FP8 weight without its scale, a scale of the wrong grid, another fmt: a sentence naming the tensor or key,
    what it holds and what is accepted."""
    folder = tmp_path / "qwen3"
    make_model(folder, "qwen3", seed=2)
    quantize_fp8(folder, (16, 16))
    tokens, lengths = torch.randint(0, SMALL["vocab_size"], (1, 8)), torch.tensor([8])
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    cases = {
        "no scale": ({k: v for k, v in tensors.items() if k != name + "_scale_inv"}, None,
                     f"tensor '{name}' holds FP8 (F8_E4M3) values, which are read as block-wise FP8 weights: a 2-D "
                     f"weight with its '{name}_scale_inv'"),
        "wrong grid": ({**tensors, name + "_scale_inv": torch.ones(2, 2)}, None,
                       f"tensor '{name}_scale_inv' has shape [2, 2], but '{name}' [64, 96] in blocks of "
                       f"weight_block_size [16, 16] implies [4, 6]"),
        "fmt": (tensors, dict(quant_method="fp8", fmt="e5m2", weight_block_size=[16, 16]),
                "quantization_config: fmt \"e5m2\" is not read (accepted: \"e4m3\", FP8 E4M3 weights)"),
        "keep without experts": (tensors, None, "[target] fp8: \"keep\" keeps a block-wise FP8 checkpoint's routed "
                                 "experts, but"),
    }
    config = json.loads((folder / "config.json").read_text())
    for what, (weights, quantization, expected) in cases.items():
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization or
                                                        config["quantization_config"]}))
        p, _ = run_target(folder, tokens, lengths, [1], tmp_path,
                          keys={"fp8": "keep"} if what == "keep without experts" else None)
        line = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        print(f"{what}: {line[:220]}")
        assert p.returncode != 0 and expected in p.stderr, (what, p.stderr[-600:])


def changed_configs_follow_transformers(family, seed, token_seed, changes, tmp_path):
    """`family`'s tiny checkpoint; ours on layers 1 and 3 over 40 positions, then for each (what, change) of `changes`
    (change: the config.json as made -> the one to write) ours against transformers' model of the changed config,
    which must agree, and against ours before, which the change must move."""
    folder = tmp_path / family
    make_model(folder, family, seed=seed)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(token_seed))
    layers = [1, 3]
    p, base = run_target(folder, tokens, torch.tensor([40]), layers, tmp_path)
    assert p.returncode == 0, p.stderr
    made = json.loads((folder / "config.json").read_text())
    for what, change in changes:
        (folder / "config.json").write_text(json.dumps(change(made)))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, ours, err = states_against(theirs, folder, tokens, layers, tmp_path)
        moved = rel(ours["hidden"], base["hidden"])
        print(f"{family} with {what}: rel err {err:.1e}; the change moves the states {moved:.1e}")
        assert err <= BOUND and moved > 10 * BOUND


def without(config, *keys):
    return {k: v for k, v in config.items() if k not in keys}


def test_smollm3_nope_layers_are_read(tmp_path):
    """SmolLM3 (the family test gives its states equal to transformers'): its NoPE layers are read and move the states,
    ours following transformers: every layer rotating (no_rope_layers all 1), and no_rope_layer_interval 2 in place of
    the list (layers 1 and 3 without RoPE)."""
    changed_configs_follow_transformers("smollm3", 17, 2, [
        ("every layer rotating", lambda made: {**made, "no_rope_layers": [1, 1, 1, 1]}),
        ("no_rope_layer_interval 2", lambda made: {**without(made, "no_rope_layers"), "no_rope_layer_interval": 2})],
        tmp_path)


def test_glm4_rotates_the_part_of_each_head_its_config_says(tmp_path):
    """GLM-4 (the family test gives its states equal to transformers': half of each head rotated, its pairs
    interleaved): every dimension rotated instead (partial_rotary_factor 1) and a quarter (0.25) move the states, ours
    following transformers through each, so the factor is read, not assumed."""
    def factor(f):
        return lambda made: {**made, "partial_rotary_factor": f,
                             "rope_parameters": {**made["rope_parameters"], "partial_rotary_factor": f}}
    changed_configs_follow_transformers("glm4", 31, 5, [(f"partial_rotary_factor {f}", factor(f)) for f in (1.0, 0.25)],
                                        tmp_path)


def test_exaone4_layer_pattern_and_its_full_layers_without_rope(tmp_path):
    """EXAONE 4.0 (the family test gives its states equal to transformers': layers 0-2 sliding and rotating, layer 3
    full without RoPE): sliding_window_pattern 2 in place of layer_types, and no sliding_window (every layer full and
    rotating) move the states, ours following transformers; the pattern as a string ("LGLG", which transformers reads
    only through layer_types) gives the states of its integer form 2 (which differ from the default 4's)."""
    changed_configs_follow_transformers("exaone4", 37, 6, [
        ("sliding_window_pattern 2", lambda made: {**without(made, "layer_types"), "sliding_window_pattern": 2}),
        ("no sliding_window", lambda made: {**made, "sliding_window": None, "layer_types": ["full_attention"] * 4})],
        tmp_path)
    folder = tmp_path / "exaone4"
    made = json.loads((folder / "config.json").read_text())
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    states = {}
    for pattern in (2, "LGLG", 4):
        config = {**without(made, "layer_types"), "sliding_window": 6, "sliding_window_pattern": pattern}
        (folder / "config.json").write_text(json.dumps(config))
        p, states[pattern] = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
        assert p.returncode == 0, p.stderr
    print(f"exaone4, sliding_window_pattern \"LGLG\" against 2: {rel(states['LGLG']['hidden'], states[2]['hidden']):.1e}; "
          f"2 against 4: {rel(states[2]['hidden'], states[4]['hidden']):.1e}")
    assert torch.equal(states["LGLG"]["hidden"], states[2]["hidden"])
    assert rel(states[2]["hidden"], states[4]["hidden"]) > 10 * BOUND


def test_exaone4_5_language_model_matches_the_text_model(tmp_path):
    """EXAONE 4.5 (Exaone4_5_ForConditionalGeneration): EXAONE 4.0's language model saved with a vision tower
    (text_config, model.language_model.) gives the text-only checkpoint's states, and transformers' composite's."""
    folder = tmp_path / "exaone4"
    model = make_model(folder, "exaone4", seed=37)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    config = transformers.Exaone4_5_Config(
        text_config=model.config.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
    composite = transformers.Exaone4_5_ForConditionalGeneration(config).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    composite.lm_head.load_state_dict(model.lm_head.state_dict())
    composite_matches(composite, "exaone4_5", tokens, [1, 3], base, tmp_path)


def test_seed_oss_biases_of_q_k_v_and_of_o_are_read_apart(tmp_path):
    """Seed-OSS (the family test: biases on q / k / v, none on o): with attention_out_bias (o's bias too) and without
    attention_bias (o's alone) ours equals transformers, each checkpoint's own biases read."""
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(7))
    for qkv, out in ((True, True), (False, True)):
        folder = tmp_path / f"seed_oss_{qkv}_{out}"
        model = make_model(folder, "seed_oss", seed=41, attention_bias=qkv, attention_out_bias=out)
        _, _, err = states_against(model, folder, tokens, [1, 3], tmp_path)
        print(f"seed_oss with attention_bias {qkv}, attention_out_bias {out}: rel err {err:.2e}")
        assert err <= BOUND


def test_hunyuan_reads_its_ntk_alpha(tmp_path):
    """Hunyuan (the family test: q / k normed after RoPE, the base stretched by alpha 50): alpha 1000, and config.json
    as published (rope_theta and rope_scaling {type "dynamic", alpha 200} at the top) move the states, ours following
    transformers through each."""
    def alpha(a):
        return lambda made: {**made, "rope_parameters": {**made["rope_parameters"], "alpha": a}}

    def published(made):
        scaling = dict(type="dynamic", alpha=200.0, factor=1.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
        return {**without(made, "rope_parameters"), "rope_theta": 1e4, "rope_scaling": scaling}
    changed_configs_follow_transformers("hunyuan", 47, 10, [("alpha 1000", alpha(1000.0)),
                                                            ("config.json as published, alpha 200", published)],
                                        tmp_path)


def test_granite_reads_each_of_its_multipliers(tmp_path):
    """Granite (the family test: states and logits equal to transformers' with every multiplier set): each multiplier
    changed alone moves the states, ours following transformers through each, so none is assumed; and each absent is
    GraniteConfig's 1 (absent attention_multiplier: a softmax scale of 1, not head_dim^-1/2)."""
    def changed(key, value):
        return lambda made: {**made, key: value}

    changed_configs_follow_transformers("granite", 53, 12, [
        ("embedding_multiplier 12", changed("embedding_multiplier", 12.0)),
        ("residual_multiplier 0.5", changed("residual_multiplier", 0.5)),
        ("attention_multiplier 0.25", changed("attention_multiplier", 0.25)),
        ("no multipliers", lambda made: without(made, "embedding_multiplier", "residual_multiplier",
                                                "attention_multiplier"))], tmp_path)


@pytest.mark.parametrize("value", [0, -2.5, "16"])
def test_granite_multiplier_that_is_not_a_positive_number_is_refused(value, tmp_path):
    folder = tmp_path / "granite"
    make_model(folder, "granite", seed=5)
    edit_config(folder, logits_scaling=value)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    p, _ = run_target(folder, tokens, torch.tensor([8]), [1], tmp_path)
    assert p.returncode != 0
    assert "logits_scaling" in p.stderr and ("positive number" in p.stderr or "not a number" in p.stderr), p.stderr


def test_dots1_sliding_layers_without_layer_types_and_its_routing_default(tmp_path):
    """dots.llm1 (the family test: Qwen3's attention, GLM-4.5's experts): without layer_types, sliding_window 6 and
    max_window_layers 2 make layers 2 and 3 slide (Dots1Config's rule: no use_sliding_window key), and norm_topk_prob
    absent is Dots1Config's false, not GLM-4.5's true; each moves the states, ours following transformers."""
    changed_configs_follow_transformers("dots1", 59, 13, [
        ("sliding_window 6 from max_window_layers 2, no layer_types",
         lambda made: {**without(made, "layer_types"), "sliding_window": 6, "max_window_layers": 2}),
        ("norm_topk_prob absent", lambda made: without(made, "norm_topk_prob"))], tmp_path)


def test_hunyuan_moe_counts_listed_per_layer(tmp_path):
    """Hunyuan-A13B's config.json lists moe_topk per layer: an equal list is read as the integer (ours following
    transformers with moe_topk [1, 1, 1, 1], which moves the states from 2 a token); a count that changes between
    layers is refused with a sentence naming the key and the value."""
    layers = SMALL["num_hidden_layers"]
    changed_configs_follow_transformers("hunyuan_moe", 61, 14, [
        ("moe_topk listed per layer, 1 each", lambda made: {**made, "moe_topk": [1] * layers})], tmp_path)
    folder = tmp_path / "hunyuan_moe"
    edit_config(folder, moe_topk=[2, 1, 2, 2])
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    p, _ = run_target(folder, tokens, torch.tensor([8]), [1], tmp_path)
    assert p.returncode != 0 and "moe_topk" in p.stderr and "[2,1,2,2]" in p.stderr, p.stderr


def test_deepseek_v2_greedy_routing_q_projection_and_refusals(tmp_path):
    """DeepSeek-V2 (the family test: latent attention with q from a latent, group_limited_greedy): topk_method "greedy"
    (V2-Lite's; the default when absent) follows transformers and moves the states; a q_proj checkpoint (q_lora_rank
    null, V2-Lite's) equals transformers'; V3's "noaux_tc" is refused with a sentence."""
    changed_configs_follow_transformers("deepseek_v2", 67, 15, [
        ("topk_method greedy", lambda made: {**made, "topk_method": "greedy"}),
        ("topk_method absent", lambda made: without(made, "topk_method"))], tmp_path)
    lite = tmp_path / "lite"
    model = make_model(lite, "deepseek_v2", seed=3, q_lora_rank=None, topk_method="greedy")
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    _, _, err = states_against(model, lite, tokens, [1, 3], tmp_path)
    print(f"deepseek_v2 with q_proj (q_lora_rank null), greedy: rel err {err:.1e}")
    assert err <= BOUND
    edit_config(lite, topk_method="noaux_tc")
    p, _ = run_target(lite, tokens, torch.tensor([40]), [1], tmp_path)
    assert p.returncode != 0 and "topk_method" in p.stderr and "noaux_tc" in p.stderr, p.stderr


def test_cohere2_layer_pattern_and_its_layers_without_rope(tmp_path):
    """Cohere 2 (the family test: parallel layers, layers 0-2 sliding and rotating, layer 3 full without RoPE, logits
    times 0.4): sliding_window_pattern 2 in place of layer_types (layers 1 and 3 full, unrotated), and every layer
    sliding (each rotating) move the states, ours following transformers; Cohere's use_qk_norm is refused with a
    sentence."""
    changed_configs_follow_transformers("cohere2", 71, 16, [
        ("sliding_window_pattern 2, no layer_types",
         lambda made: {**without(made, "layer_types"), "sliding_window_pattern": 2}),
        ("every layer sliding and rotating", lambda made: {**made, "layer_types": ["sliding_attention"] * 4})],
        tmp_path)
    folder = tmp_path / "cohere"
    make_model(folder, "cohere", seed=9)
    edit_config(folder, use_qk_norm=True)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    p, _ = run_target(folder, tokens, torch.tensor([8]), [1], tmp_path)
    assert p.returncode != 0 and "use_qk_norm" in p.stderr, p.stderr


def test_olmoe_clip_qkv_is_read(tmp_path):
    """OLMoE (the family test: q / k / v clamped to +-0.5): without clip_qkv (null, as OLMoE-1B-7B publishes it) the
    states move, ours following transformers."""
    changed_configs_follow_transformers("olmoe", 73, 17, [("clip_qkv null", lambda made: {**made, "clip_qkv": None})],
                                        tmp_path)


def test_llama4_chunks_temperature_and_l2_norms_are_read(tmp_path):
    """Llama 4 (the family test: chunks of 16, NoPE layer 3 with its query temperature, L2 q / k norms, experts whose
    inputs are scaled): chunks of 8, no temperature tuning, no L2 norms and every layer rotating each move the states
    over 40 positions, ours following transformers through each."""
    changed_configs_follow_transformers("llama4", 79, 18, [
        ("attention_chunk_size 8", lambda made: {**made, "attention_chunk_size": 8}),
        ("attn_temperature_tuning false", lambda made: {**made, "attn_temperature_tuning": False}),
        ("use_qk_norm false", lambda made: {**made, "use_qk_norm": False}),
        ("every layer rotating", lambda made: {**made, "no_rope_layers": [1, 1, 1, 1]})], tmp_path)


def test_llama4_multimodal_checkpoint_language_model(tmp_path):
    """Llama 4 as Scout and Maverick are published (Llama4ForConditionalGeneration: config.json's text_config, the
    language model's tensors beside a vision tower) equals transformers' composite model on 70 tokens (chunks of 16),
    every layer."""
    text = dict(SMALL, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
                num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8,
                attn_scale=0.3, rope_theta=5e5, tie_word_embeddings=False, pad_token_id=0)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    model, folder = composite_checkpoint("Llama4", text, vision, 31, tmp_path)
    composite_states(model, folder, "Llama4", tmp_path)


# Mamba-2's families: (the checkpoint's prefix of its Mamba-2 tensors, how many Mamba-2 layers of 4, what the run
# says). Granite 4.0-H and Bamba: Mamba-2 layers 0, 1 and 3, attention layer 2. Nemotron-H: a Mamba-2 block, an MLP
# block, attention, an MLP block.
MAMBA2 = {"granite4_h": ("mamba.", 3, "3 Mamba-2 layers (mamba_n_heads 8"),
          "nemotron_h": ("mixer.", 1, "1 Mamba-2 layers (mamba_n_heads 8"),
          "bamba": ("mamba.", 3, "3 Mamba-2 layers (mamba_n_heads 8")}


@pytest.mark.parametrize("family", list(MAMBA2))
def test_mamba2_over_chunks_documents_and_its_tensors(family, tmp_path):
    """Granite 4.0-H and Nemotron-H (their Mamba-2 layers in chunks of 16; the family test gives their states equal to
    transformers'): 150 positions (ten chunks, the last partial) equal transformers'; a row packed with documents of
    70, 50 and 30 gives each document the states it has alone (no state or convolution history crosses a start), and
    packing moves the later ones; D, dt_bias and the convolution's bias zeroed in the checkpoint, ours follows
    transformers and each moves the states (they are read)."""
    prefix, count, says = MAMBA2[family]
    recurrent_over_chunks_and_documents(family, says, tmp_path)
    zeroed_tensors_are_read(family, tuple(prefix + suffix for suffix in ("D", "dt_bias", "conv1d.bias")), count,
                            tmp_path)


def test_granite4_h_reads_its_layer_types_time_step_limit_and_chunks(tmp_path):
    """Granite 4.0-H's keys, each changed alone, ours following transformers (layers 1 and 3 of 4, 40 positions):
    time_step_limit (0, 0.05) and (0, 2) in place of the family's (0, inf) move the states (transformers' decoding
    step ignores the limit, its forward applies it: ours applies it everywhere); layer_types absent (GraniteMoeHybridConfig's default: every layer Mamba-2) is
    read so, as transformers does; the names transformers 5 writes ("linear_attention", "full_attention") and chunks
    of 256 in place of 16 leave them (equal in float32)."""
    changed_configs_follow_transformers("granite4_h", 37, 6, [
        ("time_step_limit (0, 0.05)", lambda made: {**made, "time_step_limit": [0.0, 0.05]}),
        ("time_step_limit (0, 2)", lambda made: {**made, "time_step_limit": [0.0, 2.0]})],
        tmp_path / "moves")
    # every layer Mamba-2, layer_types left out of config.json
    folder = tmp_path / "all_mamba"
    make_model(folder, "granite4_h", seed=37, layer_types=["mamba"] * 4)
    (folder / "config.json").write_text(json.dumps(without(json.loads((folder / "config.json").read_text()),
                                                           "layer_types")))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert all(layer.mamba is not None for layer in theirs.model.layers)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, ours = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():  # (use_cache off: transformers 5.23's cache of a model without attention layers refuses)
        ref = theirs(input_ids=tokens, output_hidden_states=True, use_cache=False).hidden_states
    err = max(rel(ours["hidden"][0, :, e], ref[layer + 1][0]) for e, layer in enumerate([1, 3]))
    print(f"granite4_h without layer_types (every layer Mamba-2): rel err {err:.1e}")
    assert err <= BOUND and "4 Mamba-2 layers" in p.stdout, p.stdout
    folder = tmp_path / "granite4_h"
    make_model(folder, "granite4_h", seed=37)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    made = json.loads((folder / "config.json").read_text())
    for what, cfg in [("transformers' layer type names", {**made, "layer_types": ["linear_attention"] * 2 + [
                          "full_attention", "linear_attention"]}),
                      ("chunks of 256", {**made, "mamba_chunk_size": 256})]:
        (folder / "config.json").write_text(json.dumps(cfg))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, ours, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
        print(f"granite4_h with {what}: rel err {err:.1e}; against ours before {rel(ours['hidden'], base['hidden']):.1e}")
        assert err <= BOUND and rel(ours["hidden"], base["hidden"]) <= BOUND


def test_bamba_attention_layers_are_read_and_bad_ones_refused(tmp_path):
    """Bamba (the family test gives its states equal to transformers'): attn_layer_indices [1] in place of [2] (the
    checkpoint's tensors made so) follows transformers; an index past the layers, or not a list, is refused with a
    sentence naming the key."""
    folder = tmp_path / "bamba"
    model = make_model(folder, "bamba", seed=7, attn_layer_indices=[1])
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    p, ours, err = states_against(model, folder, tokens, [1, 3], tmp_path)
    print(f"bamba with attention at layer 1: rel err {err:.1e}")
    assert err <= BOUND and "3 Mamba-2 layers" in p.stdout, p.stdout
    for bad in ([4], 2):
        edit_config(folder, attn_layer_indices=bad)
        p, _ = run_target(folder, tokens, torch.tensor([40]), [1], tmp_path)
        assert p.returncode != 0 and "attn_layer_indices:" in p.stderr, p.stderr
        print(f"bamba attn_layer_indices {bad}: {p.stderr.strip().splitlines()[-1]}")


def test_nemotron_h_reads_its_blocks_and_time_step_min(tmp_path):
    """Nemotron-H's keys, each changed alone, ours following transformers (layers 1 and 3 of 4, 40 positions):
    time_step_min 0.5 (the least dt its Mamba-2 takes) moves the states; its blocks listed in layers_block_type, with
    transformers 5's names or the legacy ones, in place of hybrid_override_pattern leave them."""
    changed_configs_follow_transformers("nemotron_h", 41, 7, [
        ("time_step_min 0.5", lambda made: {**made, "time_step_min": 0.5})], tmp_path / "moves")
    folder = tmp_path / "nemotron_h"
    make_model(folder, "nemotron_h", seed=41)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(7))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    made = without(json.loads((folder / "config.json").read_text()), "hybrid_override_pattern", "layers_block_type")
    for what, cfg in [("hybrid_override_pattern M-*-", {**made, "hybrid_override_pattern": "M-*-"}),
                      ("legacy block names", {**made, "layers_block_type": ["mamba", "mlp", "attention", "mlp"]}),
                      ("transformers 5's block names", {**made, "layers_block_type": [
                          "linear_attention", "mlp", "full_attention", "mlp"]})]:
        (folder / "config.json").write_text(json.dumps(cfg))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, ours, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
        print(f"nemotron_h with {what}: rel err {err:.1e}; against ours before {rel(ours['hidden'], base['hidden']):.1e}")
        assert err <= BOUND and torch.equal(ours["hidden"], base["hidden"])


def test_nemotron_h_experts_as_published_and_their_scale(tmp_path):
    """Nemotron 3's experts blocks (the family and routing tests give their states equal to transformers'): the experts
    saved one at a time (mixer.experts.E.up_proj.weight, as the published checkpoints hold them) give the states the
    stacked ones give; routed_scaling_factor 1 in place of 2.5 moves the states, ours following transformers; a config
    whose moe_latent_size the weights do not have (or one that is not a width) is refused with a sentence (the latent
    kind itself: the nemotron_h_latent family)."""
    changed_configs_follow_transformers("nemotron_h_moe", 43, 8, [
        ("routed_scaling_factor 1", lambda made: {**made, "routed_scaling_factor": 1.0})], tmp_path / "moves")
    folder = tmp_path / "nemotron_h_moe"
    make_model(folder, "nemotron_h_moe", seed=43)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(8))
    p, stacked = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    weights = load_file(str(folder / "model.safetensors"))
    for name in [k for k in weights if k.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj"))]:
        for e, t in enumerate(weights.pop(name)):
            weights[f"{name.rsplit('.', 1)[0]}.{e}.{name.rsplit('.', 1)[1]}.weight"] = t.clone()
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in weights
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    p, each = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    print(f"nemotron_h_moe with its experts one at a time: equal to the stacked ones: "
          f"{torch.equal(each['hidden'], stacked['hidden'])}")
    assert torch.equal(each["hidden"], stacked["hidden"])
    edit_config(folder, moe_latent_size=0)
    p, _ = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    print(f"nemotron_h_moe moe_latent_size 0: {p.stderr.strip()}")
    assert p.returncode != 0 and "moe_latent_size: value 0 is not an integer >= 1" in p.stderr, p.stderr
    edit_config(folder, moe_latent_size=32)
    p, _ = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    print(f"nemotron_h_moe moe_latent_size 32 without latent weights: {p.stderr.strip()}")
    assert p.returncode != 0 and "mixer.fc1_latent_proj.weight' is missing" in p.stderr, p.stderr


@pytest.mark.parametrize("change,key", [
    (dict(hybrid_override_pattern="M-X-"), "hybrid_override_pattern"),
    (dict(layers_block_type=["mamba", "mlp", "cross_attention", "mlp"]), "layers_block_type"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
    (dict(n_groups=3), "n_groups")], ids=["letter", "block_name", "activation", "groups"])
def test_nemotron_h_bad_keys_are_refused(change, key, tmp_path):
    """A Nemotron-H config.json ours would not run as transformers does: refused with a sentence naming the key, its
    value and what is accepted."""
    folder = tmp_path / "nemotron_h"
    make_model(folder, "nemotron_h", seed=5)
    cfg = without(json.loads((folder / "config.json").read_text()), "layers_block_type", "hybrid_override_pattern")
    (folder / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": "M-*-", **change}))
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(1))
    p, _ = run_target(folder, tokens, torch.tensor([8]), [1], tmp_path)
    assert p.returncode != 0 and f"{key}:" in p.stderr and "accepted" in p.stderr, p.stderr
    print(f"nemotron_h {change}: {p.stderr.strip().splitlines()[-1]}")


@pytest.mark.parametrize("change,key", [
    (dict(layer_types=["mamba", "mamba", "cross_attention", "mamba"]), "layer_types"),
    (dict(time_step_limit=[0.0]), "time_step_limit"),
    (dict(time_step_limit=[1.0, 0.5]), "time_step_limit"),
    (dict(time_step_limit=[0.0, "big"]), "time_step_limit"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    (dict(mamba_d_head=12), "mamba_d_head"),
    (dict(hidden_act="gelu"), "hidden_act")], ids=["layer_type", "limit_of_one", "limit_reversed", "limit_not_number",
                                                   "groups", "head_width", "activation"])
def test_granite4_h_bad_keys_are_refused(change, key, tmp_path):
    """A Granite 4.0-H config.json that transformers would not run as ours reads it: refused with a sentence naming
    the key, its value and what is accepted."""
    check_refused("granite4_h", change, key, tmp_path)


def test_olmo3_as_published_its_layer_types_and_its_two_ropes(tmp_path):
    """OLMo 3 (the family test gives its states equal to transformers': sliding layers with their own unscaled RoPE,
    the full one with YaRN): config.json as published (rope_theta and rope_scaling at the top, which transformers
    gives the full layers, the sliding ones its default_theta 500000), without layer_types (three of every four
    layers sliding), and with another sliding window: ours follows transformers through each, and each moves the
    states (layers 1 and 3 of 4, 40 positions)."""
    def published(made):
        full = without(made["rope_parameters"]["full_attention"], "rope_theta")
        return {**without(made, "rope_parameters"), "rope_theta": 2e5, "rope_scaling": full}
    changed_configs_follow_transformers("olmo3", 29, 4, [
        ("config.json as published", published), ("no layer_types", lambda made: without(made, "layer_types")),
        ("sliding_window 3", lambda made: {**made, "sliding_window": 3})], tmp_path)


def test_deepseek_v3_latent_attention_reads_its_rope_layout_scale_and_q_projection(tmp_path):
    """DeepSeek-V3's latent attention (the family test gives its states equal to transformers'): each part is read
    and moves the states, ours following transformers through every change (layer 3 of 4, 40 positions): its
    rotated pairs read as laid out (rope_interleave false), YaRN's mscale_all_dim out of the softmax scale, and a
    checkpoint whose q comes from q_proj (q_lora_rank null) instead of a latent."""
    folder = tmp_path / "deepseek_v3"
    make_model(folder, "deepseek_v3", seed=21, initializer_range=0.1)  # (scores far enough from even that the scale shows)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([40, 40])

    def ours_and_theirs():
        p, ours = run_target(folder, tokens, lengths, [3], tmp_path)
        assert p.returncode == 0, p.stderr
        with torch.no_grad():
            theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
                input_ids=tokens, output_hidden_states=True).hidden_states[4]
        return ours["hidden"][:, :, 0], theirs

    before, theirs = ours_and_theirs()
    assert rel(before, theirs) <= BOUND
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    for change in (dict(rope_interleave=False), dict(rope_parameters={**rope, "mscale_all_dim": 0.0})):
        edit_config(folder, **change)
        changed, theirs = ours_and_theirs()
        err, moved = rel(changed, theirs), rel(changed, before)
        print(f"deepseek_v3 with {change}: rel err {err:.1e}; the change moves it {moved:.1e}")
        assert err <= BOUND and moved > 10 * BOUND
        before = changed
    folder = tmp_path / "deepseek_v3_q"
    model = make_model(folder, "deepseek_v3", seed=22, initializer_range=0.1, q_lora_rank=None)
    assert model.model.layers[0].self_attn.q_proj is not None
    p, ours = run_target(folder, tokens, lengths, [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
    err = max(rel(ours["hidden"][:, :, e], ref[layer + 1]) for e, layer in enumerate([1, 3]))
    print(f"deepseek_v3 with q_proj (q_lora_rank null): rel err {err:.1e}")
    assert err <= BOUND


def test_mistral4_reads_its_query_scale_and_rotates_all_of_its_rotated_part(tmp_path):
    """Mistral 4 (the family test gives its states equal to transformers'; the routing test its groups): its
    rope_parameters' partial_rotary_factor (qk_rope / (qk_nope + qk_rope), as transformers writes it) is the latent
    attention's rotated part, not a share of it, and the query factor past the pretraining length of 16 is read and
    moves the states: with llama_4_scaling_beta 2 (0.1 here: a factor of at most 1.11 over 40 positions, which this
    random model's flat attention hardly feels) and with YaRN's factor 8, ours follows transformers."""
    folder = tmp_path / "mistral4"
    make_model(folder, "mistral4", seed=23)
    made = json.loads((folder / "config.json").read_text())
    assert made["rope_parameters"]["partial_rotary_factor"] == 8 / 24, made["rope_parameters"]
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    rope = made["rope_parameters"]
    for what, change in [("llama_4_scaling_beta 2", {**rope, "llama_4_scaling_beta": 2.0}),
                         ("YaRN factor 8", {**rope, "factor": 8.0})]:
        edit_config(folder, rope_parameters=change)
        # (transformers' auto classes do not map Mistral4Config: its own class reads the folder)
        theirs = transformers.Mistral4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, ours, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
        moved = rel(ours["hidden"][0, :, 1], base["hidden"][0, :, 1])
        print(f"mistral4 with {what}: rel err {err:.1e}; the change moves layer 3's states {moved:.1e}")
        assert err <= BOUND and moved > 10 * BOUND


def test_afmoe_reads_its_router_biases_embedding_scale_and_layer_pattern(tmp_path):
    """AFMoE (the family test gives its states equal to transformers'; the routing test its choices): its router biases
    zeroed in the checkpoint move the states and ours follows transformers; mup_enabled false (no sqrt(hidden) on the
    embedding) moves them, ours following; without layer_types, global_attn_every_n_layers 2 gives the same layers
    (0 and 2 sliding) and the same states."""
    biases, ours, unbiased, ref = zeroed_against_transformers("afmoe", "mlp.expert_bias", tmp_path)
    assert len(biases) == 3 and all(b.abs().max() > 0 for b in biases.values())
    print(f"afmoe without its router biases: rel err {rel(unbiased, ref):.1e}; with them {rel(ours, unbiased):.1e}")
    assert rel(unbiased, ref) <= BOUND and rel(ours, unbiased) > 10 * BOUND
    folder = tmp_path / "afmoe"
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    made = json.loads((folder / "config.json").read_text())
    for what, config, same in [("mup_enabled false", {**made, "mup_enabled": False}, False),
                               ("no layer_types", without(made, "layer_types"), True)]:
        (folder / "config.json").write_text(json.dumps(config))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, changed, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
        moved = rel(changed["hidden"][0, :, 1], base["hidden"][0, :, 1])
        print(f"afmoe with {what}: rel err {err:.1e}; the change moves layer 3's states {moved:.1e}")
        assert err <= BOUND and ((moved == 0) if same else (moved > 10 * BOUND))


def test_granite_swa_reads_its_sinks_bases_and_layer_pattern(tmp_path):
    """Granite SWA (the family test gives its states equal to transformers'): its sinks zeroed in the checkpoint move the
    states and ours follows transformers; each change of layer_rope_theta (the sliding layers' base, the NoPE layer
    rotating) and the default layer pattern (no layer_types: layer 0 full, the others sliding) moves them, ours following
    (40 positions); a full layer whose base differs from another full layer's is refused with a sentence."""
    sinks_are_read("granite_swa", tmp_path)
    folder = tmp_path / "granite_swa"
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    # (a softmax scale of 2, not the family's 0.09: attention sharp enough that the positions' rotation shows)
    made = {**json.loads((folder / "config.json").read_text()), "attention_multiplier": 2.0}
    (folder / "config.json").write_text(json.dumps(made))
    p, base = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    for what, config in [("sliding layers' base 10", {**made, "layer_rope_theta": [1e6, 10.0, 0, 10.0]}),
                         ("layer 2 rotating", {**made, "layer_rope_theta": [1e6, 1e4, 1e6, 1e4]}),
                         ("no layer_types", without(made, "layer_types"))]:
        (folder / "config.json").write_text(json.dumps(config))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _, changed, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
        moved = rel(changed["hidden"][0, :, 1], base["hidden"][0, :, 1])
        print(f"granite_swa with {what}: rel err {err:.1e}; the change moves layer 3's states {moved:.1e}")
        assert err <= BOUND and moved > 10 * BOUND
    (folder / "config.json").write_text(json.dumps({**made, "layer_rope_theta": [1e6, 1e4, 5e5, 1e4]}))
    p, _ = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    print(f"granite_swa with two full layers' bases: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode != 0 and "layer_rope_theta" in p.stderr and "accepted" in p.stderr, p.stderr


def test_ministral3_query_scale_and_its_multimodal_checkpoint(tmp_path):
    """Ministral 3 (the family test gives its states equal to transformers'): the query factor past the pretraining
    length is read and moves the states (llama_4_scaling_beta 0: ours follows transformers), and the same language
    model saved as Mistral3ForConditionalGeneration (text_config, tensors under model.language_model., a vision tower
    beside them) gives the same states."""
    folder = tmp_path / "ministral3"
    model = make_model(folder, "ministral3", seed=23, initializer_range=0.1)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(6))
    p, scaled = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True).hidden_states
    assert max(rel(scaled["hidden"][0, :, e], ref[L + 1][0]) for e, L in enumerate([1, 3])) <= BOUND
    # the composite checkpoint first (config.json still as made)
    config = transformers.Mistral3Config(
        text_config=model.config.to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, image_size=32, patch_size=16),
        tie_word_embeddings=False)  # (tied, loading the LM head would overwrite the embedding)
    composite = transformers.Mistral3ForConditionalGeneration(config).eval()
    composite.model.language_model.load_state_dict(model.model.state_dict())
    composite.lm_head.load_state_dict(model.lm_head.state_dict())
    composite.save_pretrained(tmp_path / "mistral3", safe_serialization=True)
    p, vl = run_target(tmp_path / "mistral3", tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Mistral3ForConditionalGeneration" in p.stdout, p.stdout
    print(f"ministral3 as Mistral3ForConditionalGeneration: equal to the text-only checkpoint's: "
          f"{torch.equal(vl['hidden'], scaled['hidden'])}")
    assert torch.equal(vl["hidden"], scaled["hidden"])
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    edit_config(folder, rope_parameters={**rope, "llama_4_scaling_beta": 0.0})
    p, plain = run_target(folder, tokens, torch.tensor([40]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            input_ids=tokens, output_hidden_states=True).hidden_states
    err = max(rel(plain["hidden"][0, :, e], theirs[L + 1][0]) for e, L in enumerate([1, 3]))
    early, late = rel(plain["hidden"][0, :16, 1], scaled["hidden"][0, :16, 1]), rel(plain["hidden"][0, 16:, 1],
                                                                                      scaled["hidden"][0, 16:, 1])
    print(f"ministral3 without the query factor: rel err {err:.1e}; it moves positions 16-39 {late:.1e}, 0-15 {early:.1e}")
    assert err <= BOUND and late > 10 * BOUND and early == 0


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def to_mxfp4(w):
    """w [E, rows, cols] (cols % 32 == 0) as MXFP4: blocks [E, rows, cols / 32, 16] uint8 (two e2m1
    codes a byte, the first value in the low nibble) and scales [E, rows, cols / 32] uint8 (each 32
    values' power of two + 127), each value the nearest code to it over its group's power of two."""
    E, R, C = w.shape
    g = w.reshape(E, R, C // 32, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6))
    codes = ((g / 2 ** e).unsqueeze(-1) - E2M1).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (e.squeeze(-1) + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_are_dequantized_as_transformers_does(tmp_path):
    """gpt-oss as published: its experts' weights in MXFP4 (<name>_blocks / _scales, quant_method
    "mxfp4"). Ours dequantizes at load and equals transformers' model loaded from the same folder
    with Mxfp4Config(dequantize=True); the quantization moves the weights (so the blocks are read, not
    some other copy), and a scale tensor of another dtype is refused with a sentence."""
    folder = tmp_path / "gpt_oss_mxfp4"
    model = make_model(folder, "gpt_oss", seed=4)
    weights = load_file(str(folder / "model.safetensors"))
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[name + "_blocks"], weights[name + "_scales"] = to_mxfp4(weights.pop(name).transpose(1, 2).float())
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    edit_config(folder, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    dequantized = ref.model.layers[1].mlp.experts.gate_up_proj
    original = model.model.layers[1].mlp.experts.gate_up_proj
    moved_weights = rel(dequantized, original)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    p, ours = run_target(folder, tokens, torch.tensor([40, 33]), [1, 3], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "8 experts (2 a token, mxfp4 dequantized)" in p.stdout, p.stdout
    errs, moved = [], []
    for b, n in enumerate([40, 33]):
        with torch.no_grad():
            theirs = ref(input_ids=tokens[b:b + 1, :n], output_hidden_states=True).hidden_states
            unquantized = model(input_ids=tokens[b:b + 1, :n], output_hidden_states=True).hidden_states
        for e, layer in enumerate([1, 3]):
            errs.append(rel(ours["hidden"][b, :n, e], theirs[layer + 1][0]))
            moved.append(rel(ours["hidden"][b, :n, e], unquantized[layer + 1][0]))
    print(f"gpt_oss mxfp4: the quantization moves the experts' weights {moved_weights:.1e} and the states "
          f"{min(moved):.1e}-{max(moved):.1e}; ours against transformers' dequantized model: rel err {max(errs):.1e}")
    assert max(errs) <= BOUND and moved_weights > 1e-2 and min(moved) > 10 * BOUND
    # [target] mxfp4 = "keep": the blocks kept and dequantized in each forward, the same states
    p, kept = run_target(folder, tokens, torch.tensor([40, 33]), [1, 3], tmp_path, keys={"mxfp4": "keep"})
    assert p.returncode == 0, p.stderr
    assert "mxfp4 kept, dequantized a layer at a time" in p.stdout, p.stdout
    assert torch.equal(kept["hidden"], ours["hidden"])
    weights["model.layers.2.mlp.experts.down_proj_scales"] = weights["model.layers.2.mlp.experts.down_proj_scales"].float()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    p, _ = run_target(folder, tokens, torch.tensor([40, 33]), [3], tmp_path)
    line = p.stderr.strip().splitlines()[-1]
    print(line[:200])
    assert p.returncode == 1 and "model.layers.2.mlp.experts.down_proj_scales' is F32 (MXFP4 blocks and scales are U8" \
        in line, line


def test_keeping_mxfp4_experts_of_a_checkpoint_without_them_is_refused(tmp_path):
    make_model(tmp_path / "gpt_oss", "gpt_oss", seed=4)
    p, _ = run_target(tmp_path / "gpt_oss", torch.randint(0, 160, (1, 8)), torch.tensor([8]), [3], tmp_path,
                      keys={"mxfp4": "keep"})
    line = p.stderr.strip().splitlines()[-1]
    print(line[:240])
    assert p.returncode == 1 and line.startswith("error: ") and "mxfp4" in line and \
        '(no quantization_config with quant_method "mxfp4"); accepted here: "dequantize" (the default)' in line, line


@pytest.mark.parametrize("family", ["glm4_moe", "exaone_moe"])
def test_glm_router_biases_choose_the_experts(family, tmp_path):
    """GLM-4.5's correction biases (mlp.gate.e_score_correction_bias, float32) only choose: the
    family test above gives transformers' states with random biases, and the same checkpoint with
    the biases zeroed gives other states (so the biases are read and used), and transformers agrees.
    The same for K-EXAONE's (DeepSeek-V3's router), stored beside the router (mlp.e_score_correction_bias)."""
    biases, ours, unbiased, ref = zeroed_against_transformers(family, "e_score_correction_bias", tmp_path)
    assert len(biases) == 3 and all(b.dtype == torch.float32 and b.abs().max() > 0 for b in biases.values())
    moved = rel(ours, ref)
    print(f"{family} without its router biases: rel err {rel(unbiased, ref):.1e}; with them {moved:.1e}")
    assert rel(unbiased, ref) <= BOUND and moved > 10 * BOUND


def test_minimax_m2_as_published_its_router_biases_and_norms_over_all_heads(tmp_path):
    """MiniMax-M2 (the family test gives its states equal to transformers'): config.json as published (rotary_dim and
    a top-level rope_theta, no rope_parameters; use_qk_norm, qk_norm_type "per_layer", scoring_func "sigmoid",
    use_routing_bias, shared_intermediate_size 0) gives the same states; its router's correction biases
    (block_sparse_moe.e_score_correction_bias) are read and used (zeroed, ours still follows transformers and the
    states move); rotary_dim is read (16, every dimension rotated: ours follows transformers and the states move). Its q
    / k norms over all heads ([heads D] weights) are in the family test."""
    biases, ours, unbiased, ref = zeroed_against_transformers("minimax_m2", "e_score_correction_bias", tmp_path)
    assert len(biases) == 4 and all(k.endswith("block_sparse_moe.e_score_correction_bias") for k in biases), biases
    moved = rel(ours, ref)
    print(f"minimax_m2 without its router biases: rel err {rel(unbiased, ref):.1e}; with them {moved:.1e}")
    assert rel(unbiased, ref) <= BOUND and moved > 10 * BOUND
    folder = tmp_path / "published"
    model = make_model(folder, "minimax_m2", seed=23)
    made = json.loads((folder / "config.json").read_text())
    published = {k: v for k, v in made.items() if k != "rope_parameters"}
    published.update(rope_theta=made["rope_parameters"]["rope_theta"], rotary_dim=8, use_qk_norm=True,
                     qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0)
    (folder / "config.json").write_text(json.dumps(published))
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    _, mine, err = states_against(model, folder, tokens, [1, 3], tmp_path)
    print(f"minimax_m2 with config.json as published: rel err {err:.1e}")
    assert err <= BOUND
    # rotary_dim read: every dimension rotated instead moves the states, ours following transformers
    (folder / "config.json").write_text(json.dumps({**published, "rotary_dim": 16}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _, whole, err = states_against(theirs, folder, tokens, [1, 3], tmp_path)
    print(f"minimax_m2 with rotary_dim 16: rel err {err:.1e}; the change moves the states {rel(whole['hidden'], mine['hidden']):.1e}")
    assert err <= BOUND and rel(whole["hidden"], mine["hidden"]) > 10 * BOUND


def test_ernie4_5_moe_router_biases_and_its_sparse_layers(tmp_path):
    """ERNIE 4.5's mixture of experts (the family test: layers 1-2 sparse, a softmax router whose choice adds correction
    biases): the biases (mlp.moe_statics.e_score_correction_bias, [1, E]) zeroed move the states, ours following
    transformers; checkpoints made with moe_layer_end_index -1 (every layer from the start sparse) and with
    moe_layer_interval 2 (layers 1 and 3) read as transformers reads them (a layer misread as sparse or dense is refused
    for its tensors' names)."""
    biases, ours, unbiased, ref = zeroed_against_transformers("ernie4_5_moe", "e_score_correction_bias", tmp_path)
    assert len(biases) == 2 and all(b.shape == (1, 8) for b in biases.values()), biases
    print(f"ernie4_5_moe without its router biases: rel err {rel(unbiased, ref):.1e}; with them {rel(ours, ref):.1e}")
    assert rel(unbiased, ref) <= BOUND and rel(ours, ref) > 10 * BOUND
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(9))
    for keys in (dict(moe_layer_end_index=-1), dict(moe_layer_end_index=3, moe_layer_interval=2)):
        folder = tmp_path / "_".join(f"{k}{v}" for k, v in keys.items())
        model = make_model(folder, "ernie4_5_moe", seed=43, **keys)
        _, _, err = states_against(model, folder, tokens, [1, 3], tmp_path)
        print(f"ernie4_5_moe with {keys}: rel err {err:.1e}")
        assert err <= BOUND


def test_qwen2_moe_shared_expert_gate_is_read_and_used(tmp_path):
    """Qwen2-MoE's shared expert runs on every token times sigmoid(h mlp.shared_expert_gate^T): the
    family test gives transformers' states with a random gate; with the gates set to zero (sigmoid
    1/2 on every token) ours still equals transformers' and the states move (the gate is read)."""
    gates, ours, half, ref = zeroed_against_transformers("qwen2_moe", "mlp.shared_expert_gate.weight", tmp_path)
    assert len(gates) == 3 and all(g.shape == (1, SMALL["hidden_size"]) for g in gates.values()), gates
    moved = rel(ours, ref)
    print(f"qwen2_moe with its shared-expert gates zeroed: rel err {rel(half, ref):.1e}; with the random gates "
          f"{moved:.1e}")
    assert rel(half, ref) <= BOUND and moved > 10 * BOUND


def test_phi3_rotates_the_part_of_each_head_its_config_says(tmp_path):
    """Phi-3 / Phi-4 (packed qkv_proj and gate_up_proj; the family test gives transformers' states at
    partial_rotary_factor 0.75): the same weights with the factor at 1 (every dimension rotated) give
    other states, and those equal transformers' at 1, so the factor is read, not assumed."""
    folder = tmp_path / "phi3"
    model = make_model(folder, "phi3", seed=21)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([40, 40])
    with torch.no_grad():
        three_quarters = model(input_ids=tokens, output_hidden_states=True).hidden_states[4]
    # (transformers 5 writes the factor into rope_parameters, where it reads it first; so do we)
    edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    p, whole = run_target(folder, tokens, lengths, [3], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            input_ids=tokens, output_hidden_states=True).hidden_states[4]
    err, moved = rel(whole["hidden"][:, :, 0], ref), rel(whole["hidden"][:, :, 0], three_quarters)
    print(f"phi3 with partial_rotary_factor 1: rel err {err:.1e} from transformers at 1, {moved:.1e} from it at 0.75")
    assert err <= BOUND and moved > 10 * BOUND


def test_phi3_longrope_takes_the_short_or_long_factors_as_transformers_does(tmp_path):
    """LongRoPE (Phi-3.5-mini, Phi-4-mini): pretraining length 32 of 256 (factor 8: cos and sin times
    sqrt(1 + ln 8 / ln 32)), 6 factors a set for the 12 rotated of 16 dimensions. A forward of 24
    positions takes the short factors, one of 40 the long ones (transformers picks them per forward
    by its longest position): ours equals transformers' in both, and the first 24 positions differ
    between the two (both sets are read and used)."""
    folder = tmp_path / "phi3_longrope"
    rope = dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5], long_factor=[1.0, 2.0, 4.0, 8.0, 12.0, 16.0])
    model = make_model(folder, "phi3", seed=21, rope_parameters=rope, original_max_position_embeddings=32)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(8))
    ours = {}
    for S in (24, 40):
        p, out = run_target(folder, tokens[:, :S], torch.tensor([S]), [1, 3], tmp_path)
        assert p.returncode == 0, p.stderr
        with torch.no_grad():
            ref = model(input_ids=tokens[:, :S], output_hidden_states=True).hidden_states
        err = max(rel(out["hidden"][:, :, e], ref[layer + 1]) for e, layer in enumerate([1, 3]))
        ours[S] = out["hidden"]
        print(f"phi3 longrope, {S} positions ({'long' if S > 32 else 'short'} factors): rel err {err:.1e}")
        assert err <= BOUND
    moved = rel(ours[40][:, :24], ours[24])
    print(f"the first 24 positions, long factors against short: {moved:.1e}")
    assert moved > 10 * BOUND


# (family, config change, what the error line says beside the key)
MOE_REFUSED = {
    "num_experts_per_tok": ("qwen3_moe", dict(num_experts_per_tok=9),
                            "9 is more than the 8 experts of num_local_experts (accepted: 1..8)"),
    "mlp_only_layers": ("qwen3_moe", dict(mlp_only_layers=[2, 4]), "holds 4; accepted: layer indices 0..3"),
    "hidden_act": ("qwen3_moe", dict(hidden_act="gelu"), 'value "gelu" is not supported (accepted: "silu")'),
    "moe_intermediate_size": ("qwen3_moe", dict(moe_intermediate_size=48),
                              "mlp.experts.0.gate_proj.weight' has shape [32, 64]"),
    "num_local_experts": ("mixtral", dict(num_local_experts=6),
                          "block_sparse_moe.gate.weight' has shape [8, 64], but"),
    "intermediate_size": ("mixtral", dict(intermediate_size=64),
                          "block_sparse_moe.experts.0.w1.weight' has shape [96, 64], but"),
    "n_group": ("glm4_moe", dict(n_group=3), "3 groups of 8 experts (accepted: a divisor of the experts leaving at "
                                             "least 2 in each group)"),
    "topk_group": ("glm4_moe", dict(topk_group=5), "5 is more than n_group 4"),
    "shared_expert_intermediate_size": ("qwen2_moe", dict(shared_expert_intermediate_size=40),
                                        "mlp.shared_expert.gate_proj.weight' has shape [48, 64], but"),
    "n_shared_experts": ("glm4_moe", dict(n_shared_experts=2),
                         "mlp.shared_experts.gate_proj.weight' has shape [32, 64], but"),
    "swiglu_limit": ("gpt_oss", dict(swiglu_limit=-1.0), "swiglu_alpha and swiglu_limit must be positive"),
    "scoring_func": ("minimax_m2", dict(scoring_func="softmax"),
                     'value "softmax" is not supported (MiniMax-M2\'s router: "sigmoid", as transformers runs it)'),
    "use_routing_bias": ("minimax_m2", dict(use_routing_bias=False), "false is not supported (MiniMax-M2's router "
                                                                     "chooses by e_score_correction_bias"),
    "shared_intermediate_size": ("minimax_m2", dict(shared_intermediate_size=64),
                                 "value 64 asks for a shared expert, which MiniMax-M2 does not have (accepted: 0)"),
    "qk_norm_type": ("minimax_m2", dict(qk_norm_type="per_head"),
                     'value "per_head" is not supported (accepted: "per_layer", one norm over all heads'),
    "use_qk_norm": ("minimax_m2", dict(use_qk_norm=False), "false is not supported (transformers' MiniMaxM2Attention "
                                                           "norms q and k always"),
    "use_bias": ("ernie4_5", dict(use_bias=True), "true is not supported (ERNIE 4.5's linear layers' biases would not "
                                                  "be read"),
    "mlp_bias": ("qwen3_moe", dict(mlp_bias=True), "true is not supported (the MLP's biases would not be read"),
    "sliding_window_pattern": ("exaone4", dict(layer_types=None, sliding_window_pattern="LLXG"),
                               'value "LLXG"; accepted: an integer >= 1 (every n-th layer full) or a string of L and G'),
    "quantization_config": ("qwen3_moe", dict(quantization_config={"quant_method": "awq", "bits": 4}),
                            'quant_method "awq": a quantized Qwen3MoeForCausalLM checkpoint is not read (accepted: an '
                            'unquantized checkpoint, block-wise "fp8" weights, or gpt-oss\'s "mxfp4" experts)'),
}


@pytest.mark.parametrize("key", list(MOE_REFUSED))
def test_a_mixture_of_experts_config_the_weights_or_target_cannot_run_is_refused(tmp_path, key):
    family, changes, expected = MOE_REFUSED[key]
    folder = tmp_path / "moe"  # (not the key: the line must name it, not its folder)
    make_model(folder, family, seed=4)
    edit_config(folder, **changes)
    p, _ = run_target(folder, torch.randint(0, 160, (1, 8)), torch.tensor([8]), [3], tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and key in line and expected in line, line
    print(f"{key}: {line[:240]}")


def test_a_conversation_past_the_checkpoints_length_is_warned_of_once(tmp_path):
    """max_position_embeddings = 16: a padded row of 24 real tokens is warned of (once, with the
    length, the limit and config.json); rows whose real tokens fit are not, whatever the padding,
    nor packed documents that each fit; YaRN's factor x its pretraining length (64 x 4 = 256)
    extends the limit past a smaller max_position_embeddings."""
    folder = tmp_path / "qwen3"
    make_model(folder, "qwen3", seed=5)
    edit_config(folder, max_position_embeddings=16)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 30), generator=g)
    p, ours = run_target(folder, tokens, torch.tensor([24, 9]), [1], tmp_path)
    assert p.returncode == 0, p.stderr
    warnings = [line for line in p.stdout.splitlines() if line.startswith("warning: target:")]
    assert len(warnings) == 1, p.stdout
    assert "a conversation of 24 tokens runs past the 16 positions" in warnings[0], warnings[0]
    assert str(folder / "config.json") in warnings[0] and "seq_len <= 16" in warnings[0], warnings[0]
    for lengths, documents in [([16, 9], None), ([30, 30], [[10, 14, 6], [16, 14, 0]])]:
        docs = None if documents is None else torch.tensor(documents)
        p, _ = run_target(folder, tokens, torch.tensor(lengths), [1], tmp_path, documents=docs)
        assert p.returncode == 0 and "warning: target:" not in p.stdout, (lengths, documents, p.stdout)
    docs = torch.tensor([[10, 20, 0], [30, 0, 0]])  # a packed document of 20 and an unpacked row of 30
    p, _ = run_target(folder, tokens, torch.tensor([30, 30]), [1], tmp_path, documents=docs)
    assert "a conversation of 30 tokens runs past the 16 positions" in p.stdout, p.stdout
    yarn = tmp_path / "qwen3_yarn"
    make_model(yarn, "qwen3_yarn", seed=5)
    edit_config(yarn, max_position_embeddings=16)
    p, _ = run_target(yarn, tokens, torch.tensor([30, 9]), [1], tmp_path)
    assert p.returncode == 0 and "warning: target:" not in p.stdout, p.stdout


def random_checkpoint_script():
    """scripts/make-random-checkpoint as a module (it has no .py name)."""
    import importlib.util
    from importlib.machinery import SourceFileLoader
    loader = SourceFileLoader("make_random_checkpoint", str(SOURCE_DIR / "scripts" / "make-random-checkpoint"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", sorted(random_checkpoint_script().PRESETS))
def test_make_random_checkpoint_presets_read_as_transformers_reads_them(preset, tmp_path, monkeypatch):
    """The benchmarks' checkpoints (scripts/make-random-checkpoint, its own safetensors writer) at
    each preset's layout, shrunk: transformers loads every tensor the script writes and wants no
    other (but lm_head for its bare model), and our target's states equal transformers' in float32."""
    script = random_checkpoint_script()
    cfg = dict(script.PRESETS[preset])
    small = dict(hidden_size=128, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=300)
    for key, value in [("moe_intermediate_size", 32), ("num_experts", 16), ("n_routed_experts", 16),
                       ("num_local_experts", 8), ("num_experts_per_tok", 2), ("shared_expert_intermediate_size", 48),
                       ("rotary_dim", 16)]:
        if key in cfg:
            small[key] = value
    if "linear_num_key_heads" in cfg:  # (Qwen3.5: 4 layers, the last attention; transformers runs no all-linear one)
        small.update(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16)
    if "mamba_n_heads" in cfg:  # (Granite 4.0-H: 6 layers, the last attention; Mamba-2 heads of 64 over 2 x 128; the
        # embedding unscaled, so that two layers' residual_multiplier-scaled outputs move it by more than the bound)
        small.update(num_hidden_layers=6, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16, shared_intermediate_size=48,
                     embedding_multiplier=1.0)
    if "mamba_num_heads" in cfg:  # (Nemotron 3: blocks M E M E M *)
        small.update(num_hidden_layers=6, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2,
                     moe_shared_expert_intermediate_size=48)
    cfg.update(small)
    monkeypatch.setitem(script.PRESETS, "small", cfg)
    folder = tmp_path / preset
    monkeypatch.setattr("sys.argv", ["make-random-checkpoint", "--preset", "small", "--out", str(folder),
                                     "--device", "cpu", "--dtype", "float32", "--seed", "3"])
    script.main()
    model, info = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= {"lm_head.weight"}, info
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    p, ours = run_target(folder, tokens, torch.tensor([24]), [0, 1], tmp_path)
    assert p.returncode == 0, p.stderr
    with torch.no_grad():
        ref = model.eval()(input_ids=tokens, output_hidden_states=True).hidden_states
    errs = [rel(ours["hidden"][0, :, e], ref[layer + 1][0]) for e, layer in enumerate([0, 1])]
    # not vacuous: the two layers change the states by far more than the bound
    moved = rel(ref[2][0], ref[0][0])
    print(f"{preset} ({cfg['architectures'][0]}, shrunk): rel err {max(errs):.1e}; the layers move the "
          f"embedding by {moved:.1e}")
    assert max(errs) <= BOUND and moved > 100 * BOUND


def test_only_the_requested_layers_are_loaded_and_run(tmp_path):
    folder = tmp_path / "llama"
    make_model(folder, "llama", seed=5)
    p, ours = run_target(folder, torch.randint(0, 160, (1, 8)), torch.tensor([8]), [1], tmp_path)
    assert p.returncode == 0, p.stderr
    assert ours["hidden"].shape == (1, 8, 1, SMALL["hidden_size"])


def corrupt(tmp_path, how):
    folder = tmp_path / how
    make_model(folder, "qwen2", seed=1)  # sharded: model.safetensors.index.json
    index = folder / "model.safetensors.index.json"
    shards = sorted(folder.glob("model-*.safetensors"))
    if how == "truncated shard":
        data = shards[-1].read_bytes()
        shards[-1].write_bytes(data[: len(data) - 100])
    elif how == "header length past the end":
        data = bytearray(shards[0].read_bytes())
        data[0:8] = (len(data) * 2).to_bytes(8, "little")
        shards[0].write_bytes(bytes(data))
    elif how == "unknown dtype":
        data = shards[0].read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].replace(b'"F32"', b'"Q17"', 1)
        shards[0].write_bytes(data[:8] + header + data[8 + n:])
    elif how == "overlapping offsets":
        data = shards[0].read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        names = [k for k in header if k != "__metadata__"]
        a, b = sorted(names, key=lambda k: header[k]["data_offsets"][0])[:2]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (n - len(text)) if len(text) <= n else b""
        assert len(text) == n
        shards[0].write_bytes(data[:8] + text + data[8 + n:])
    elif how == "tensor missing from the index":
        idx = json.loads(index.read_text())
        del idx["weight_map"]["model.layers.2.mlp.up_proj.weight"]
        index.write_text(json.dumps(idx))
    elif how == "shape disagrees with config.json":
        edit_config(folder, intermediate_size=100)
    elif how == "unsupported architecture":
        edit_config(folder, architectures=["GPT2LMHeadModel"])
    elif how == "unsupported RoPE scaling":
        edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})
    elif how == "longrope factors of another length":
        edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0, 1.5],
                                             "long_factor": [2.0, 3.0], "original_max_position_embeddings": 64})
    elif how == "partial rotary":
        edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    return folder


EXPECTED = {
    "truncated shard": "truncated",
    "header length past the end": "header",
    "unknown dtype": "Q17",
    "overlapping offsets": "overlap",
    "tensor missing from the index": "model.layers.2.mlp.up_proj.weight",
    "shape disagrees with config.json": "implies",
    "unsupported architecture": "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                "Qwen3MoeForCausalLM",
    "unsupported RoPE scaling": 'rope type "dynamic" is not supported (supported: default, linear, llama3, yarn, '
                                'longrope)',
    "partial rotary": "rotates part of each head, which Qwen2ForCausalLM does not (accepted: 1 or absent)",
    "longrope factors of another length": "short_factor: [1.0,1.5] (accepted: a list of 8 positive numbers, one a "
                                          "rotated pair of the head's 16 rotated dimensions)",
}


@pytest.mark.parametrize("how", list(EXPECTED))
def test_corrupt_checkpoints_are_refused_with_a_sentence(tmp_path, how):
    folder = corrupt(tmp_path, how)
    p, _ = run_target(folder, torch.randint(0, 160, (1, 8)), torch.tensor([8]), [3], tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), line
    assert EXPECTED[how] in line, line
    print(f"{how}: {line[:200]}")


HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# (Bamba: the tiny random model's own bf16 forward is 4.4e-02 from its float32 one at layer 3, ours the same)
# (Gemma 4: a softmax of scale 1 over normed queries and keys, the values normed too, and the layer scalar: the tiny
# random model's own bf16 forward is 4.5e-02 from its fp32 one at layer 0 (E2B / E4B's kind 1.1e-01) on an H100,
# 2026-12-07, transformers 5.17; ours 3.4e-02 and 8.1e-02 there)
NOISY_FAMILIES = (*HYBRID_FAMILIES, "gemma3", "bamba", "gemma4", "gemma4_ple")
BF16_BOUND = 3e-2  # bf16 (8 bits of mantissa) through 4 layers, relative to the fp32 reference
# The hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: the Gated DeltaNet's recurrence and convolution over bf16
# inputs) and the mixtures of experts (a token near a router's tie goes to another expert in any bf16 forward): their
# bf16 error is that of their kind, not of rounding alone. Measured on an H100 (2026-12-07, transformers 5.17),
# transformers' own bf16 forward against its fp32 one: Qwen3.5 3.3e-02-6.2e-02, Qwen3.5-MoE 1.2e-02-7.6e-02,
# Qwen3-Next 9.6e-03-4.4e-02, gpt-oss 2.2e-02-2.8e-02, GLM-4.7-Flash 2.1e-02-3.1e-02 (ours: 1.6e-02-5.2e-02,
# 1.2e-02-7.1e-02, 9.0e-03-4.1e-02, 2.7e-02-3.3e-02, 2.1e-02-3.5e-02). There BF16_BOUND gives way to transformers' own
# error where that is near it: ours within 1.25x it (+1e-3), and 2x as everywhere. Gemma 3's kind is as noisy (its
# embedding times sqrt(hidden), four norms a layer: transformers' own 2.8e-02-6.6e-02 at layers 0-1 on an H100,
# 2026-12-07, ours 3.0e-02-7.1e-02). transformers' own error varies between the batch's rows by more than ours (Qwen3.5
# at heads of 256, last layer: 9.7e-02 on row 0, 6.2e-02 on row 1; ours 9.4e-02 and 9.0e-02): the 1.25x compares each
# layer's worst over the rows, the 2x each row.


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", [f[0] for f in FAMILIES])
@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [0, 2]])
def test_bf16_on_cuda_with_flash_cuda_matches_transformers(family, layers, tmp_path):
    """bf16 on the GPU: ours (flash_cuda) and transformers' own bf16 forward, each against
    transformers in fp32; ours must stay within the bound and within 2x transformers' bf16 error.
    The engine's path puts a residual add into the matrix product before it where that overwrites
    no recorded state: with every layer recorded only layer 0's first (on the embedding's rows);
    with layers 0 and 2 also layer 1's second and layer 2's first (the bookkeeping that must leave
    layer 0's state alone)."""
    # head_dim 64: a size flash_cuda runs forward and backward. gpt-oss under a transformers that fixes its GLU's
    # limit at 7.0 whatever config.json says (5.17 does): the published 7.0, so that both read the same.
    # MiniMax-M2 under a transformers that rotates every dimension whatever rotary_dim says (5.17): rotary_dim = head_dim,
    # so that both rotate all of it (the partial rotation is the CPU test's, against 5.23). Granite 4.0-H under a
    # transformers that normalises its Mamba-2 output over all groups at once (5.17): one group.
    extra = dict(head_dim=64, swiglu_limit=7.0) if family == "gpt_oss" and not gpt_oss_limit_is_read() else dict(head_dim=64)
    if family == "minimax_m2" and hasattr(transformers, "MiniMaxM2Config") and not minimax_rotary_dim_is_read():
        extra = dict(head_dim=64, rotary_dim=64)
    if family in ("granite4_h", "bamba") and not mamba_norm_is_grouped(family):  # (one group: both versions alike)
        extra = dict(head_dim=64, mamba_n_groups=1)
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4"):  # (latent attention: qk_nope + qk_rope = 64)
        extra = dict(qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=48)
    if family.startswith("gemma4"):  # (its full layers' heads of their own width: 128, which flash_cuda runs)
        extra = dict(head_dim=64, global_head_dim=128)
    check_bf16_on_cuda(family, layers, tmp_path, extra)


# The published head widths of the families whose heads are wider than 128, which flash_cuda runs forward only:
# Qwen3.5's and Gemma 3's 256 (its sliding layers' windows too), DeepSeek-V3's 128 + 64 (values 128, padded to 192),
# GLM-4.7-Flash's 192 + 64 (values 256). Gemma 3 at 256 with its published query_pre_attn_scalar 256 (1B-12B): with the
# family's 24 (a softmax 3.3x sharper than a head of 256 has) the random model's bf16 forward was chaos, transformers'
# own error 2.9e-01-3.7e-01 from its fp32 (H100, 2026-12-07), and ours 3.9e-01 against it on one row's last layer.
WIDE_HEADS = {"qwen3_5": dict(head_dim=256), "gemma3": dict(head_dim=256, query_pre_attn_scalar=256),
              "deepseek_v2": dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
              "deepseek_v3": dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
              "glm4_moe_lite": dict(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", list(WIDE_HEADS))
def test_bf16_on_cuda_with_wide_heads_matches_transformers(family, tmp_path):
    """The same at the families' own head widths (192, 256): the target's attention on flash_cuda's forward-only
    variant, where the GPU's shared memory holds it (target_states prints the kernel that ran)."""
    heads = WIDE_HEADS[family]
    width = heads.get("head_dim") or heads["qk_nope_head_dim"] + heads["qk_rope_head_dim"]
    p = check_bf16_on_cuda(family, [0, 1, 2, 3], tmp_path, heads)
    ran = p.stdout.strip().splitlines()[-1]
    print(f"{family}: {ran}")
    assert ran.startswith("kernels ") and "flash_cuda/fwd/" in ran and f"/d{width}/" in ran, ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_cuda_gemma4_at_its_published_widths_runs_its_sliding_layers_on_flash_cuda(tmp_path):
    """Gemma 4 at its published head widths (sliding layers 256, full layers 512): flash_cuda runs heads up to 256
    forward, so with kernels "flash_cuda,dense_ref" (on_fallback = "warn") its sliding layers run on flash_cuda and only
    the full layers on dense_ref, and the states compare with transformers' as the family's others do."""
    p = check_bf16_on_cuda("gemma4", [0, 1, 2, 3], tmp_path, dict(head_dim=256, global_head_dim=512),
                           kernel="flash_cuda,dense_ref")
    ran = p.stdout.strip().splitlines()[-1]
    print(f"gemma4 at 256 / 512: {ran}")
    assert "dense_ref: selected (FALLBACK: not the first preference) for calls 1,3" in p.stdout, p.stdout
    assert ran.startswith("kernels ") and "flash_cuda/fwd/" in ran and "/d256/" in ran and "dense_ref" in ran, ran


# The Mamba-2 families at the widths of every published checkpoint that the engine's kernels take (a state of 128,
# heads of 64): their rule through frozen::ssd_chunks.
MAMBA2_WIDE = {"granite4_h": dict(mamba_d_state=128), "nemotron_h": dict(ssm_state_size=128, mamba_head_dim=64),
               "bamba": dict(mamba_d_state=128)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", list(MAMBA2_WIDE))
def test_bf16_on_cuda_mamba2_on_the_engines_kernels_matches_transformers(family, tmp_path):
    """The Mamba-2 rule on the engine's two kernels (chunks of 64, each chunk's Q K^T once a group) in the bf16
    comparison; against the same run with FLASHDRAFT_SSD=0 (only the rule on ATen's ops, in the model's chunks) its
    states differ (the kernels ran) by no more than bf16's noise."""
    extra = dict(head_dim=64, **MAMBA2_WIDE[family])
    if family in ("granite4_h", "bamba") and not mamba_norm_is_grouped(family):  # (see check_bf16_on_cuda's caller)
        extra["mamba_n_groups"] = 1
    check_bf16_on_cuda(family, [0, 1, 2, 3], tmp_path, extra)
    g = torch.Generator().manual_seed(5)  # check_bf16_on_cuda's tokens
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 128), generator=g)
    lengths = torch.tensor([128, 77])
    runs = {}
    for ssd in ("1", "0"):
        p, runs[ssd] = run_target(tmp_path / family, tokens, lengths, [0, 1, 2, 3], tmp_path, kernel="flash_cuda",
                                  dtype="bfloat16", device="cuda", env={"FLASHDRAFT_SSD": ssd})
        assert p.returncode == 0, p.stderr
    moved = rel(runs["1"]["hidden"], runs["0"]["hidden"])
    print(f"{family}: the engine's kernels against ATen's ops for the Mamba-2 rule: {moved:.1e}")
    assert 0 < moved <= BF16_BOUND, moved


def check_bf16_on_cuda(family, layers, tmp_path, extra, kernel="flash_cuda"):
    """Runs the comparison; returns target_states' run with every layer (its last line: the kernels that ran)."""
    folder = tmp_path / family
    model = make_model(folder, family, seed=13, hidden_size=256, intermediate_size=384, **extra)
    # A mixture of experts: a token near a tie of the router goes to another expert in any bf16
    # forward (transformers' own: 1-2 of 128 tokens a layer at this shape), which moves its state by
    # more than rounding does; the largest error over the tokens would then say which tokens tied,
    # so there the comparison takes the mean error over all values.
    moe = getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0)
    error = rel_mean if moe else rel
    bf16 = copy.deepcopy(model).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    B, S = 2, 128
    tokens = torch.randint(0, SMALL["vocab_size"], (B, S), generator=g)
    lengths = torch.tensor([128, 77])
    p, ours = run_target(folder, tokens, lengths, layers, tmp_path, kernel=kernel, dtype="bfloat16", device="cuda")
    assert p.returncode == 0, p.stderr
    noisy = moe or family in NOISY_FAMILIES
    worst = {}  # layer -> (ours, transformers') worst over the rows
    for b in range(B):
        n = int(lengths[b])
        with torch.no_grad():
            ref = model(input_ids=tokens[b:b + 1, :n], output_hidden_states=True)
            theirs = bf16(input_ids=tokens[b:b + 1, :n].cuda(), output_hidden_states=True)
        for e, layer in enumerate(layers):
            mine = error(ours["hidden"][b, :n, e], ref.hidden_states[layer + 1][0])
            hf = error(theirs.hidden_states[layer + 1][0].float().cpu(), ref.hidden_states[layer + 1][0])
            print(f"{family} row {b} layer {layer}: ours bf16 {mine:.1e}, transformers bf16 {hf:.1e}")
            assert (noisy or mine <= BF16_BOUND) and mine <= 2 * hf + 1e-3, (family, b, layer, mine, hf)
            w = worst.get(layer, (0.0, 0.0))
            worst[layer] = (max(w[0], mine), max(w[1], hf))
    for layer, (mine, hf) in worst.items():  # (the noisy families: against transformers' own, the batch's worst)
        assert not noisy or mine <= max(BF16_BOUND, 1.25 * hf + 1e-3), (family, layer, mine, hf)
    if layers == [0, 2]:
        # The same with each add in the norm after it (FLASHDRAFT_GEMM_ADD=0): cuBLAS's epilogue
        # rounds as the separate add does at most shapes (equal), at some once (within bf16 noise).
        p, apart = run_target(folder, tokens, lengths, layers, tmp_path, kernel=kernel, dtype="bfloat16",
                              device="cuda", env={"FLASHDRAFT_GEMM_ADD": "0"})
        assert p.returncode == 0, p.stderr
        moved = error(ours["hidden"][0, :, 1], apart["hidden"][0, :, 1])  # row 0: all 128 positions real
        print(f"{family} layer 2, adds in the products against adds apart: {moved:.1e}")
        assert moved <= BF16_BOUND, (family, moved)
    return p

"""Cross-implementation check of the DFlash drafter step.

The C++ side (tests/test_dflash_export.cpp, run here through subprocess) writes, for several
configurations, the weights, a batch, the anchors its step drew, its loss and every
parameter gradient to HDF5. This test rebuilds each step in plain PyTorch from DESIGN.md's
definition -- context features fc + RMSNorm injected as keys/values in every Qwen3-style
layer, the dense DFlash mask written out here, the weighted block loss -- and matches the
loss and every gradient within 1e-5 relative (fp32). The configurations:
  old            data labels, loss / sum of weights, anchors before a response token
                 (flashdraft before 2026-12);
  defaults       loss / count of labelled positions (vLLM speculators), anchors on a
                 response token followed by another;
  packed         row 0 packs two documents: a block sees its own document's context only,
                 never runs past its document's end, and positions count from the document's
                 start (as a server decoding the conversation alone);
  target_argmax  labels = the target's greedy token: argmax of the target's logits at
                 anchor + j - 1 (the final-normed last-layer state times the LM head);
  target_kl      labels = the target's distribution at temperature 0.7: the loss is
                 KL(p || q) per position, weighted and normalised as above;
  scaled         target_kl with z-lab's scaled and capped drafter (dflash_config's
                 input_embedding_scale 2.5: the block's embeddings times it; output_multiplier
                 1.7 and final_logit_softcapping 1.5: logits = 1.5 tanh(1.7 z / 1.5)) against a
                 target that serves its logits times 1.3, capped at 2 (its distribution is of those).
"""
import glob
import math
import os
import subprocess
from pathlib import Path

import h5py
import pytest
import torch


def find_exporter():
    names = []
    binary_dir = os.environ.get("FLASHDRAFT_BINARY_DIR")
    if binary_dir:
        names.append(Path(binary_dir) / "bin" / "test_dflash_export")
    source_dir = Path(os.environ.get("FLASHDRAFT_SOURCE_DIR", Path(__file__).resolve().parents[2]))
    names += [Path(p) for p in sorted(glob.glob(str(source_dir / "build*" / "bin" / "test_dflash_export")),
                                      key=os.path.getmtime, reverse=True)]
    for n in names:
        if n.is_file() and os.access(n, os.X_OK):
            return n
    raise FileNotFoundError(
        "test_dflash_export was not found (looked at: " + ", ".join(str(n) for n in names) +
        "); build it (cmake --build <build> --target test_dflash_export) and set FLASHDRAFT_BINARY_DIR")


CASES = ["old", "defaults", "packed", "target_argmax", "target_kl", "scaled"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash") / "export.h5"
    env = dict(os.environ, FLASHDRAFT_DFLASH_EXPORT=str(path))
    run = subprocess.run([str(find_exporter())], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    with h5py.File(path, "r") as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return data


@pytest.fixture(scope="module", params=CASES)
def export(request, exported):
    prefix = request.param + "/"
    case = {k[len(prefix):]: v for k, v in exported.items() if k.startswith(prefix)}
    assert case, f"no case {request.param} in the export"
    case["name"] = request.param
    return case


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[..., None] * inv  # [B, T, D/2]
    ang = torch.cat([ang, ang], -1)[:, None]      # [B, 1, T, D]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def documents_of(data, b):
    """[(begin, end)] of row b: its documents, or one of its length."""
    lengths = [int(x) for x in data["batch/documents"][b] if x > 0]
    out, begin = [], 0
    for n in lengths:
        out.append((begin, begin + n))
        begin += n
    return out


def reference_step(data):
    c = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("config/")}
    params = {k.split("/", 1)[1]: torch.tensor(v, requires_grad=True) for k, v in data.items() if k.startswith("params/")}
    tokens = torch.tensor(data["batch/tokens"])
    hidden = torch.tensor(data["batch/hidden"])
    loss_mask = torch.tensor(data["batch/loss_mask"]).bool()
    emb = torch.tensor(data["target/embedding"])
    head = torch.tensor(data["target/lm_head"])
    exported = list(data["target/exported_layers"])
    anchors = torch.tensor(data["step/anchors"])
    valid = torch.tensor(data["step/block_valid"]).bool()
    L, Hq, Hkv, D, BS = (int(c[k]) for k in ("layers", "heads", "kv_heads", "head_dim", "block_size"))
    mask_token, gamma, theta, eps = int(c["mask_token"]), float(c["gamma"]), float(c["rope_theta"]), float(c["rms_eps"])
    labels_mode, temperature = int(c["labels"]), float(c["label_temperature"])
    B, S = tokens.shape
    N = anchors.shape[1]
    Lq = N * BS

    # Each position's document (begin, end), and its position counted from the document's start.
    doc = [[None] * S for _ in range(B)]
    for b in range(B):
        for d0, d1 in documents_of(data, b):
            for p in range(d0, d1):
                doc[b][p] = (d0, d1)
    ctx_pos = torch.tensor([[p - doc[b][p][0] if doc[b][p] else p - documents_of(data, b)[-1][1]
                             for p in range(S)] for b in range(B)])

    # The anchors obey the rule: inside a document with the whole block, and (defaults) on
    # a response token followed by another; else before a response token.
    for b in range(B):
        for n in range(N):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            assert doc[b][a] is not None and a + BS <= doc[b][a][1], (b, n, a)
            if int(c["response_anchors"]):
                assert loss_mask[b, a] and loss_mask[b, a + 1], (b, a)
            else:
                assert loss_mask[b, a + 1], (b, a)

    # Block tokens, positions, labels and weights, straight from the definition.
    j = torch.arange(BS)
    pos = torch.stack([torch.stack([anchors[b, n] - doc[b][int(anchors[b, n])][0] + j if valid[b, n] else anchors[b, n] + j
                                    for n in range(N)]) for b in range(B)]).reshape(B, Lq)
    block = torch.full((B, N, BS), mask_token)
    block[:, :, 0] = torch.gather(tokens, 1, anchors)
    block = block.reshape(B, Lq)
    labels = torch.full((B, Lq), -1)
    source = torch.full((B, Lq), -1)  # the position whose target logits predict the label
    weights = torch.zeros(B, Lq, dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            if not valid[b, n]:
                continue
            end = doc[b][int(anchors[b, n])][1]
            for jj in range(1, BS):
                p = int(anchors[b, n]) + jj
                if p < end and loss_mask[b, p]:
                    labels[b, n * BS + jj] = tokens[b, p]
                    source[b, n * BS + jj] = p - 1
                    weights[b, n * BS + jj] = math.exp(-(jj - 1) / gamma)

    # Dense DFlash mask [B, 1, Lq, S + Lq]: a block sees its anchor's document before the
    # anchor, and its own block.
    mask = torch.zeros(B, 1, Lq, S + Lq, dtype=torch.bool)
    for b in range(B):
        for q in range(Lq):
            n = q // BS
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            d0 = doc[b][a][0]
            mask[b, 0, q, d0:a] = True
            mask[b, 0, q, S + n * BS:S + (n + 1) * BS] = True

    ids = [exported.index(t) for t in c["target_layer_ids"]]
    feats = hidden[:, :, ids, :].reshape(B, S, -1)
    context = rms_norm(feats @ params["fc.weight"].T, params["hidden_norm.weight"], eps)

    def heads(t, h):
        return t.view(B, t.shape[1], h, D).transpose(1, 2)

    def served(z, scale, cap):  # the reference's compute_logits: times the multiplier, then the cap
        z = z * scale
        return torch.tanh(z / cap) * cap if cap > 0 else z

    x = emb[block] * float(c["input_embedding_scale"])
    for l in range(L):
        P = {k[len(f"layers.{l}."):]: v for k, v in params.items() if k.startswith(f"layers.{l}.")}
        h = rms_norm(x, P["input_layernorm.weight"], eps)
        q = rope(rms_norm(heads(h @ P["self_attn.q_proj.weight"].T, Hq), P["self_attn.q_norm.weight"], eps), pos, theta)
        k_proj, v_proj, k_norm = P["self_attn.k_proj.weight"], P["self_attn.v_proj.weight"], P["self_attn.k_norm.weight"]
        k = torch.cat([rope(rms_norm(heads(context @ k_proj.T, Hkv), k_norm, eps), ctx_pos, theta),
                       rope(rms_norm(heads(h @ k_proj.T, Hkv), k_norm, eps), pos, theta)], 2)
        v = torch.cat([heads(context @ v_proj.T, Hkv), heads(h @ v_proj.T, Hkv)], 2)
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # padding rows see nothing: output 0
        a = (p @ v).transpose(1, 2).reshape(B, Lq, Hq * D)
        x = x + a @ P["self_attn.o_proj.weight"].T
        h2 = rms_norm(x, P["post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(h2 @ P["mlp.gate_proj.weight"].T) * (h2 @ P["mlp.up_proj.weight"].T)) \
            @ P["mlp.down_proj.weight"].T
    logits = served(rms_norm(x, params["norm.weight"], eps) @ head.T, float(c["output_multiplier"]),
                    float(c["final_logit_softcapping"]))
    counted = labels >= 0
    logq = torch.log_softmax(logits[counted], -1)
    wanted = labels[counted]
    if labels_mode:  # from the target: its logits at the position before each label
        last = exported.index(max(exported))  # the target's last layer
        rows = torch.stack([hidden[b, source[b, i], last] for b, i in counted.nonzero().tolist()])
        target = served(rows @ head.T, float(c["target_logit_scale"]), float(c["target_logit_softcap"]))
        wanted = target.argmax(-1)
        if labels_mode == 2:
            logp = torch.log_softmax(target / temperature, -1)
            per_row = (logp.exp() * (logp - logq)).sum(-1)
    if labels_mode != 2:
        per_row = -logq.gather(1, wanted[:, None])[:, 0]
    w = weights[counted].to(per_row.dtype)
    denominator = float(counted.sum()) if int(c["by_positions"]) else w.sum()
    loss = (per_row * w).sum() / denominator
    loss.backward()
    # The labels the accuracy compares with, per block position.
    compared = torch.full((B, Lq), -1)
    compared[counted] = wanted
    return loss, params, logits.detach(), compared


def test_loss_and_every_gradient_match(export):
    loss, params, logits, labels = reference_step(export)
    cpp_loss = float(export["step/loss"])
    assert abs(loss.item() - cpp_loss) <= 1e-5 * abs(cpp_loss), (loss.item(), cpp_loss)
    names = sorted(k.split("/", 1)[1] for k in export if k.startswith("grads/"))
    assert names == sorted(params), (names, sorted(params))
    assert len(names) == 2 + 2 * 11 + 1
    print(f"{export['name']}: loss {loss.item():.6f} (C++ {cpp_loss:.6f})")
    for name in names:
        ref = params[name].grad
        got = torch.tensor(export["grads/" + name])
        assert ref is not None and got.shape == ref.shape, name
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: reference gradient is all zero"
        err = (got - ref).abs().max().item()
        assert err <= 1e-5 * scale, f"{name}: max |C++ - PyTorch| = {err:.3e}, max |grad| = {scale:.3e}"


def test_accuracy_per_position_matches(export):
    _, _, logits, labels = reference_step(export)
    BS = int(export["config/block_size"])
    pred = logits.argmax(-1).view(labels.shape[0], -1, BS)
    lab = labels.view(labels.shape[0], -1, BS)
    for j in range(1, BS):
        counted = lab[:, :, j] >= 0
        acc = (pred[:, :, j][counted] == lab[:, :, j][counted]).double().mean().item() if counted.any() else 0.0
        assert abs(acc - export["step/position_accuracy"][j - 1]) < 1e-12


def test_each_scale_and_cap_moves_the_scaled_case(exported):
    """Not vacuous: the scaled case's step with any one of its five numbers at its default (1, or no cap) is a loss
    other than the C++ step's, so the match above needs each of them applied where it is."""
    case = {k[len("scaled/"):]: v for k, v in exported.items() if k.startswith("scaled/")}
    cpp_loss = float(case["step/loss"])
    for key, default in [("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0),
                         ("target_logit_scale", 1.0), ("target_logit_softcap", 0.0)]:
        assert float(case["config/" + key]) != default, key
        loss, *_ = reference_step({**case, "config/" + key: default})
        moved = abs(loss.item() - cpp_loss) / abs(cpp_loss)
        print(f"scaled with {key} = {default}: loss {loss.item():.6f} (C++ {cpp_loss:.6f}), {moved:.1e} away")
        assert moved > 1e-3, (key, loss.item(), cpp_loss)

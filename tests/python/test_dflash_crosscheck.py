"""Cross-implementation check of the DFlash drafter step.

The C++ side (tests/test_dflash_export.cpp, run here through subprocess) writes the
weights, a batch, the anchors its step drew, its loss and every parameter gradient to
HDF5. This test rebuilds the step in plain PyTorch from DESIGN.md's definition -- context
features fc + RMSNorm injected as keys/values in every Qwen3-style layer, the dense DFlash
mask written out here, weighted block cross-entropy -- and matches the loss and every
gradient within 1e-5 relative (fp32).
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


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash") / "export.h5"
    env = dict(os.environ, FLASHDRAFT_DFLASH_EXPORT=str(path))
    run = subprocess.run([str(find_exporter())], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    with h5py.File(path, "r") as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return data


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


def reference_step(data):
    c = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("config/")}
    params = {k.split("/", 1)[1]: torch.tensor(v, requires_grad=True) for k, v in data.items() if k.startswith("params/")}
    tokens = torch.tensor(data["batch/tokens"])
    hidden = torch.tensor(data["batch/hidden"])
    loss_mask = torch.tensor(data["batch/loss_mask"]).bool()
    lengths = torch.tensor(data["batch/lengths"])
    emb = torch.tensor(data["target/embedding"])
    head = torch.tensor(data["target/lm_head"])
    exported = list(data["target/exported_layers"])
    anchors = torch.tensor(data["step/anchors"])
    valid = torch.tensor(data["step/block_valid"]).bool()
    L, Hq, Hkv, D, BS = (int(c[k]) for k in ("layers", "heads", "kv_heads", "head_dim", "block_size"))
    mask_token, gamma, theta, eps = int(c["mask_token"]), float(c["gamma"]), float(c["rope_theta"]), float(c["rms_eps"])
    B, S = tokens.shape
    N = anchors.shape[1]
    Lq = N * BS

    # Block tokens, positions, labels and weights, straight from the definition.
    j = torch.arange(BS)
    pos = (anchors[:, :, None] + j).reshape(B, Lq)
    block = torch.full((B, N, BS), mask_token)
    block[:, :, 0] = torch.gather(tokens, 1, anchors)
    block = block.reshape(B, Lq)
    labels = torch.full((B, Lq), -1)
    weights = torch.zeros(B, Lq, dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            for jj in range(1, BS):
                p = int(anchors[b, n]) + jj
                if valid[b, n] and p < int(lengths[b]) and loss_mask[b, p]:
                    labels[b, n * BS + jj] = tokens[b, p]
                    weights[b, n * BS + jj] = math.exp(-(jj - 1) / gamma)

    # Dense DFlash mask [B, 1, Lq, S + Lq].
    qi = torch.arange(Lq)
    kv = torch.arange(S + Lq)
    qblock = qi // BS
    ctx_vis = kv[None, None, :] < anchors.gather(1, qblock[None].expand(B, -1))[:, :, None]
    ctx_vis = ctx_vis & (kv < S)[None, None, :]
    blk_vis = ((kv - S) // BS)[None, None, :] == qblock[None, :, None]
    blk_vis = blk_vis & (kv >= S)[None, None, :]
    mask = (ctx_vis | blk_vis) & valid.gather(1, qblock[None].expand(B, -1))[:, :, None]
    mask = mask[:, None]

    ids = [exported.index(t) for t in c["target_layer_ids"]]
    feats = hidden[:, :, ids, :].reshape(B, S, -1)
    context = rms_norm(feats @ params["fc.weight"].T, params["hidden_norm.weight"], eps)
    ctx_pos = torch.arange(S)[None].expand(B, S)

    def heads(t, h):
        return t.view(B, t.shape[1], h, D).transpose(1, 2)

    x = emb[block]
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
    logits = rms_norm(x, params["norm.weight"], eps) @ head.T
    counted = labels >= 0
    ce = torch.nn.functional.cross_entropy(logits[counted], labels[counted], reduction="none")
    w = weights[counted].to(ce.dtype)
    loss = (ce * w).sum() / w.sum()
    loss.backward()
    return loss, params, logits.detach(), labels


def test_loss_and_every_gradient_match(export):
    loss, params, logits, labels = reference_step(export)
    cpp_loss = float(export["step/loss"])
    assert abs(loss.item() - cpp_loss) <= 1e-5 * abs(cpp_loss), (loss.item(), cpp_loss)
    names = sorted(k.split("/", 1)[1] for k in export if k.startswith("grads/"))
    assert names == sorted(params), (names, sorted(params))
    assert len(names) == 2 + 2 * 11 + 1
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

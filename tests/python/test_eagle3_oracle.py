"""The EAGLE-3 training step written in plain PyTorch from its definition, against the plugin.

tests/test_eagle3.cpp (run here through subprocess) binds the eagle3 drafter to a random
target (4 layers, vocabulary 50, draft vocabulary 24, hidden 32, two rows of 12 tokens, the
second shorter and packed from two documents), runs one fp32 training step through the
engine's dispatcher with the eagle3_ttt mask on dense_ref and on flash_cpu, and writes the
weights, the batch, the vocabulary maps, the losses and every gradient. This file rebuilds the
step from plugins/eagle3's definition -- its own draft-vocabulary count, fc of the three target
states, the 3-step unroll with the attention pattern written out densely here, soft
cross-entropy against the target's distribution (its logits times its logit scale, 0.625 here,
as Granite's 1 / logits_scaling, then soft-capped at 1.5 as Gemma 4's final_logit_softcapping; the cap
moves the distribution, checked) over the draft vocabulary with EAGLE-3's
position mask, step_decay^i weights -- and requires the same loss and every parameter gradient
within 1e-5 relative (fp32, CPU) for both kernels. It also replays validation's chain drafting
and requires the same proposals.
"""
import glob
import os
import subprocess
from pathlib import Path

import h5py
import pytest
import torch

TOL = 1e-5


def find_binary(name):
    names = []
    binary_dir = os.environ.get("FLASHDRAFT_BINARY_DIR")
    if binary_dir:
        names.append(Path(binary_dir) / "bin" / name)
    source_dir = Path(os.environ.get("FLASHDRAFT_SOURCE_DIR", Path(__file__).resolve().parents[2]))
    names += [Path(p) for p in sorted(glob.glob(str(source_dir / "build*" / "bin" / name)), key=os.path.getmtime,
                                      reverse=True)]
    for n in names:
        if n.is_file() and os.access(n, os.X_OK):
            return n
    raise FileNotFoundError(f"{name} was not found (looked at: {', '.join(map(str, names))}); build it")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3") / "export.h5"
    env = dict(os.environ, FLASHDRAFT_EAGLE3_EXPORT=str(path))
    run = subprocess.run([str(find_binary("test_eagle3")), "--gtest_filter=Eagle3.WritesOneStepPerKernel*"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    with h5py.File(path, "r") as f:
        data = {}
        f.visititems(lambda name, obj: data.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return data


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta, offset=0):
    """RoPE at positions offset .. offset + S - 1 (unroll step i: offset i)."""
    S, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(offset, offset + S, dtype=torch.float64)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Problem:
    def __init__(self, data):
        c = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("config/")}
        self.n, self.Hq, self.Hkv, self.Vd = (int(c[k]) for k in ("ttt_steps", "heads", "kv_heads", "draft_vocab"))
        self.decay, self.theta, self.eps = float(c["step_decay"]), float(c["rope_theta"]), float(c["rms_eps"])
        self.tokens = torch.tensor(data["batch/tokens"])
        self.hidden = torch.tensor(data["batch/hidden"])
        self.loss_mask = torch.tensor(data["batch/loss_mask"]).bool()
        self.lengths = torch.tensor(data["batch/lengths"])
        self.emb = torch.tensor(data["target/embedding"])
        self.head = torch.tensor(data["target/lm_head"])
        self.logit_scale = float(data["target/logit_scale"])  # (the target's logits: states head^T times it)
        self.logit_softcap = float(data["target/logit_softcap"])  # (then cap tanh(logits / cap))
        self.B, self.S = self.tokens.shape
        self.V, self.H = self.emb.shape
        # Documents: row 0 one document of its length; row 1 the packed documents; padding after.
        docs = [[int(self.lengths[0])], [int(x) for x in data["batch/documents_1"]]]
        self.doc = torch.zeros(self.B, self.S, dtype=torch.long)       # document number of each position
        self.doc_end = torch.zeros(self.B, self.S, dtype=torch.long)   # its end, within the length
        for b in range(self.B):
            start = 0
            for d, n in enumerate(docs[b] + [self.S - sum(docs[b])]):
                self.doc[b, start:start + n] = d
                self.doc_end[b, start:start + n] = min(start + n, int(self.lengths[b])) if d < len(docs[b]) else 0
                start += n

    def draft_vocabulary(self):
        count = torch.zeros(self.V, dtype=torch.long)
        for b in range(self.B):
            for p in range(int(self.lengths[b])):
                if self.loss_mask[b, p]:
                    count[self.tokens[b, p]] += 1
        order = sorted(range(self.V), key=lambda v: (-int(count[v]), v))[: self.Vd]
        return torch.tensor(sorted(order))

    def mask(self, steps):
        """[B, 1, S, steps * S]: query t sees (0, s) for s <= t in its document, (j >= 1, t)."""
        S = self.S
        t = torch.arange(S)[:, None]
        s = torch.arange(steps * S)[None, :]
        j, pos = s // S, s % S
        same_doc = self.doc[:, :, None] == self.doc.gather(1, pos.expand(S, -1).reshape(1, -1).expand(self.B, -1)
                                                           ).view(self.B, S, -1)
        return (((j == 0) & (pos <= t))[None] & same_doc | ((j >= 1) & (pos == t))[None])[:, None]

    def run(self, params, train=True):
        B, S, H, n = self.B, self.S, self.H, self.n
        P = params
        ids = self.draft_vocabulary()
        feats = self.hidden[:, :, :3].reshape(B, S, 3 * H)
        scaled = (self.hidden[:, :, 3] @ self.head.T) * self.logit_scale  # [B, S, V]
        target_logits = self.logit_softcap * torch.tanh(scaled / self.logit_softcap)
        full_argmax = target_logits.argmax(-1)
        in_draft = torch.isin(full_argmax, ids)
        probs = torch.softmax(target_logits[..., ids], -1)
        # (the cap is not idle here: it moves the soft labels)
        assert (probs - torch.softmax(scaled[..., ids], -1)).abs().max() > 1e-2
        h = feats @ P["fc.weight"].T
        D = P["midlayer.self_attn.q_proj.weight"].shape[0] // self.Hq
        tok_in = torch.zeros(B, S, dtype=torch.long)
        tok_in[:, : S - 1] = self.tokens[:, 1:]
        ks, vs, loss, acc, chains = [], [], 0.0, [], []
        for i in range(n):
            x = torch.cat([rms_norm(self.emb[tok_in], P["midlayer.input_layernorm.weight"], self.eps),
                           rms_norm(h, P["midlayer.hidden_norm.weight"], self.eps)], -1)
            heads = lambda w, k: (x @ w.T).view(B, S, k, D).transpose(1, 2)
            q = rope(heads(P["midlayer.self_attn.q_proj.weight"], self.Hq), self.theta, i)
            ks.append(rope(heads(P["midlayer.self_attn.k_proj.weight"], self.Hkv), self.theta, i))
            vs.append(heads(P["midlayer.self_attn.v_proj.weight"], self.Hkv))
            k = torch.cat(ks, 2).repeat_interleave(self.Hq // self.Hkv, 1)
            v = torch.cat(vs, 2).repeat_interleave(self.Hq // self.Hkv, 1)
            scores = (q @ k.transpose(-1, -2)) / D ** 0.5
            a = torch.softmax(scores.masked_fill(~self.mask(i + 1), float("-inf")), -1) @ v
            mid = h + a.transpose(1, 2).reshape(B, S, -1) @ P["midlayer.self_attn.o_proj.weight"].T
            n2 = rms_norm(mid, P["midlayer.post_attention_layernorm.weight"], self.eps)
            h = mid + (torch.nn.functional.silu(n2 @ P["midlayer.mlp.gate_proj.weight"].T) *
                       (n2 @ P["midlayer.mlp.up_proj.weight"].T)) @ P["midlayer.mlp.down_proj.weight"].T
            logits = rms_norm(h, P["norm.weight"], self.eps) @ P["lm_head.weight"].T   # [B, S, Vd]
            # Position t at step i predicts x_{t+2+i}; the target's distribution is at t+1+i.
            counted = torch.zeros(B, S, dtype=torch.bool)
            target_p = torch.zeros(B, S, self.Vd)
            target_arg = torch.zeros(B, S, dtype=torch.long)
            for b in range(B):
                for t in range(S):
                    p = t + 2 + i
                    if p < self.doc_end[b, t] and self.loss_mask[b, p] and in_draft[b, t + 1 + i]:
                        counted[b, t] = True
                        target_p[b, t] = probs[b, t + 1 + i]
                        target_arg[b, t] = probs[b, t + 1 + i].argmax()
            ce = -(target_p * torch.log_softmax(logits, -1)).sum(-1)
            loss = loss + self.decay ** i * (ce * counted).sum() / max(int(counted.sum()), 1)
            hits = (logits.argmax(-1) == target_arg) & counted
            acc.append(float(hits.sum()) / max(int(counted.sum()), 1))
            greedy = ids[logits.argmax(-1)]                                  # target ids
            chains.append(greedy)
            if i + 1 < n:
                if train:
                    tok_in = torch.zeros(B, S, dtype=torch.long)
                    tok_in[:, : S - 2 - i] = self.tokens[:, 2 + i:]
                else:
                    tok_in = greedy
        return loss, acc, chains, ids


@pytest.fixture(scope="module")
def problem(export):
    return Problem(export)


def params_of(export):
    return {k.split("/", 1)[1]: torch.tensor(v, requires_grad=True) for k, v in export.items() if k.startswith("params/")}


@pytest.mark.parametrize("kernel", ["dense_ref", "flash_cpu"])
def test_loss_and_every_gradient_match(export, problem, kernel):
    params = params_of(export)
    assert len(params) == 13, sorted(params)
    loss, acc, _, _ = problem.run(params)
    loss.backward()
    got = float(export[f"{kernel}/loss"])
    rel = abs(loss.item() - got) / abs(got)
    print(f"{kernel}: loss PyTorch {loss.item():.8f} plugin {got:.8f}, relative error {rel:.2e}")
    assert rel <= TOL, (loss.item(), got)
    worst = 0.0
    for name, p in params.items():
        ref = p.grad
        mine = torch.tensor(export[f"{kernel}/grads/{name}"])
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: reference gradient is all zero"
        err = (mine - ref).abs().max().item() / scale
        worst = max(worst, err)
        assert err <= TOL, f"{kernel} {name}: max |plugin - PyTorch| / max |grad| = {err:.3e}"
    print(f"{kernel}: 13 parameter gradients, worst max-abs error relative to the gradient's max: {worst:.2e}")
    assert list(export[f"{kernel}/position_accuracy"]) == pytest.approx(acc, abs=1e-12)


def test_draft_vocabulary_and_maps(export, problem):
    ids = problem.draft_vocabulary()
    for kernel in ("dense_ref", "flash_cpu"):
        d2t = torch.tensor(export[f"{kernel}/buffers/d2t"])
        t2d = torch.tensor(export[f"{kernel}/buffers/t2d"]).bool()
        assert torch.equal(torch.arange(len(d2t)) + d2t, ids)     # target = d + d2t[d]
        assert torch.equal(t2d.nonzero().flatten(), ids)
    # The position mask is exercised: some target argmaxes fall outside the draft vocabulary.
    full = (problem.hidden[:, :, 3] @ problem.head.T).argmax(-1)
    assert 0 < (~torch.isin(full, ids)).sum() < full.numel()


@pytest.mark.parametrize("kernel", ["dense_ref", "flash_cpu"])
def test_validation_is_chain_drafting(export, problem, kernel):
    params = {k: v.detach() for k, v in params_of(export).items()}
    with torch.no_grad():
        loss, _, chains, _ = problem.run(params, train=False)
    assert abs(loss.item() - float(export[f"{kernel}/eval/loss"])) <= TOL * abs(loss.item())
    drafted = export[f"{kernel}/eval/tokens"]
    rows, starts = export[f"{kernel}/eval/rows"], export[f"{kernel}/eval/starts"]
    checked = 0
    for d in range(drafted.shape[0]):  # draft d: unroll step j's greedy token at t = start - 1
        b, t = int(rows[d]), int(starts[d]) - 1
        for j in range(drafted.shape[1]):
            assert drafted[d, j] == int(chains[j][b, t]), (d, j)
            checked += 1
    assert checked >= 12

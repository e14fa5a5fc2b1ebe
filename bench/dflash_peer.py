"""The PyTorch peer of flashdraft's DFlash drafter step: one training step written the
way a careful PyTorch user writes it today, at the shapes of a Qwen3-8B DFlash drafter.

  python3 bench/dflash_peer.py [--variant eager compiled] [--layers 1 5] [shape flags]
  python3 bench/dflash_peer.py --floor --layers 1 5      (the matmul floor; no device work)

Semantics: those of plugins/dflash/dflash.cpp (the engine's drafter), re-implemented here:
  context  c = RMSNorm(fc(concat of the E target layers' hidden states))   [B, S, H]
           (random normal bf16 states [B, S, E, H] drawn on the device each step, as the
           engine's synthetic target does)
  blocks   N anchors per sequence, drawn each step uniformly without replacement from
           0..S-BS (a block and its labels inside the sequence), sorted; block n holds the
           token at anchor_n then MASK (= vocab - 1) x (BS - 1), at positions anchor_n + j;
           x = frozen embedding of the block tokens                         [B, N*BS, H]
  layers   Qwen3-style pre-norm decoder layers; queries from the blocks only, keys/values
           [context | blocks], the context's k/v made by this layer's k_proj/v_proj (KV
           injection) at positions 0..S-1; per-head RMSNorm on q and k, then RoPE
           (rotate-half, theta rope_theta); GQA; SwiGLU MLP. Mask ("dflash"): block n's
           queries see context keys < anchor_n and the whole of their own block.
  output   logits = frozen LM head(RMSNorm(x)); block position j = 1..BS-1 predicts the
           token at anchor_n + j with weight exp(-(j-1)/gamma); loss = sum w*CE / sum w.
           Per-position accuracy (argmax == label) is computed as the engine does, left
           on the device.
  update   clip_grad_norm_(1.0), AdamW(lr 6e-4, betas (0.9, 0.95), eps 1e-8, wd 0,
           fused), zero_grad(set_to_none). Constant learning rate (the engine's warm-up/
           cosine schedule costs nothing measurable).

Mixed precision as a careful user does it: fp32 master parameters, torch.autocast(bf16)
(RMSNorm computed in fp32 and returned in bf16, as dflash.cpp does), frozen bf16
embedding and LM head (buffers, no gradient). The LM head runs on the labelled rows only
(N*(BS-1) of the N*BS block rows: position 0 carries no label, so its logits are never
needed; `--lm-rows all` runs it on every row as dflash.cpp does, with weight 0 there).

Attention: flex_attention with a BlockMask made by create_block_mask from this step's
anchors (rebuilt every step, as a real run must). The mask_mod is created once and reads
the anchors from a persistent device tensor updated in place, so that neither the
compiled flex_attention nor the compiled layers see a new closure (and recompile) each step.
Variants (--variant):
  eager     eager model, flex_attention through torch.compile(flex_attention)
  compiled  the same with torch.compile on every decoder layer (one graph shared by all
            layers: parameters are graph inputs) and on the loss (final norm + LM head +
            weighted CE + argmax: inductor fuses the fp32 upcast, log-sum-exp and argmax
            into one pass over the bf16 logits instead of materialising fp32 copies)

On CPU (smoke tests at tiny shapes) FlexAttention has no backward in torch 2.11, so the
attention there is dense SDPA with the boolean mask materialised from the same mask_mod
(impl "torch-<variant>+dense"); --check compares flex's forward with it.

Measure (/work/.library/device/METHOD.md): first step wall seconds, synchronised,
compilation included (the first call of the process: run each configuration in its own
process with empty TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR for a cold-cache figure);
then --warmup steps; then --steps steps, each timed by a synchronised wall clock (median
and min ms), and --steps more back to back with one synchronisation at the end (mean ms);
the reported step time is the better of the two. tokens/s = labelled positions per step / median step seconds. Peak GiB =
torch.cuda.max_memory_allocated over the measured steps after a reset (parameters,
optimizer state, frozen embedding/LM head included, like the engine's memory/step).
Prints one JSON line per configuration, then a human-readable line.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    p.add_argument("--layers", nargs="+", type=int, default=[1, 5])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=12288)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--target-layers", type=int, default=5, help="E: target layers concatenated into the context")
    p.add_argument("--seq", type=int, default=3072, help="S: context tokens per sequence")
    p.add_argument("--anchors", type=int, default=512, help="N: blocks per sequence")
    p.add_argument("--block", type=int, default=16, help="BS: tokens per block, anchor included")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--lm-rows", choices=["labelled", "all"], default="labelled")
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="flex: flex_attention + BlockMask; dense: SDPA with the materialised boolean mask (made by "
                        "the same mask_mod; FlexAttention has no backward on CPU in torch 2.11); auto: flex on CUDA, "
                        "dense on CPU")
    p.add_argument("--check", action="store_true",
                   help="before measuring: check the mask against one built block by block from the definition, and "
                        "flex_attention's forward against dense SDPA on the same inputs (fp32)")
    p.add_argument("--check-only", action="store_true", help="run --check and exit (no training step)")
    p.add_argument("--steps", type=int, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps after the first, not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--floor", action="store_true", help="print the matmul floor for each --layers and exit")
    p.add_argument("--tflops", type=float, default=693.0, help="matmul rate for --floor (bf16 8192^3 on the H200)")
    p.add_argument("--json-out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--target", default=None, metavar="FOLDER",
                   help="the co-located pipeline: a Hugging Face checkpoint folder whose model (transformers, bf16, "
                        "SDPA, output_hidden_states, no gradient) computes each step's hidden states from the step's "
                        "tokens, in place of the synthetic random states")
    p.add_argument("--target-ids", nargs="+", type=int, default=[1, 9, 17, 25, 33],
                   help="with --target: the layers read (id L = transformers' hidden_states[L + 1]); the model is "
                        "cut after the deepest, its final norm left out (nothing computed past what is read)")
    p.add_argument("--target-mode", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"],
                   help="with --target: the target's forward as it is, or under torch.compile")
    a = p.parse_args(argv)
    if a.target:
        a.target_layers = len(a.target_ids)
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.anchors > a.seq - a.block + 1:
        p.error("--anchors exceeds the anchor candidates 0..S-BS (this peer has no padding blocks)")
    return a


# --------------------------------------------------------------------------------------
# The matmul floor: FLOPs of every linear at these shapes, forward and backward.
# --------------------------------------------------------------------------------------
def floor_flops(a, layers, lm_rows):
    """FLOPs (2*m*n*k per product) of the linears of one step. Backward: dX and dW for
    trainable weights, except dX where the input needs no gradient (fc's input: the
    target's states; layer 0's q/k/v on the block rows: the frozen embedding) and dW of
    the frozen LM head. Attention (visible pairs) is counted separately."""
    B, S, H, F = a.batch, a.seq, a.hidden, a.ffn
    L = a.anchors * a.block
    R = a.anchors * (a.block - 1) if lm_rows == "labelled" else L
    dq, dkv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    mm = lambda m, n, k: 2.0 * B * m * n * k
    fc = mm(S, H, a.target_layers * H) * 2  # fwd + dW
    per_layer_fwd = mm(L, dq, H) + 2 * mm(S + L, dkv, H) + mm(L, H, dq) + 3 * mm(L, F, H)
    linears = fc + layers * 3 * per_layer_fwd - (mm(L, dq, H) + 2 * mm(L, dkv, H))  # layer 0: no dX on block rows
    lm = mm(R, a.vocab, H) * 2  # fwd + dX
    # attention: per query head, visible pairs = L * (E[anchor] + BS), anchors uniform on 0..S-BS;
    # 4*pairs*D forward, 2.5x that backward (as bench/flex_reference.py counts)
    pairs = B * a.heads * L * ((S - a.block) / 2.0 + a.block)
    attn = layers * 3.5 * 4.0 * pairs * a.head_dim
    return {"linears": linears + lm, "lm_head": lm, "attention": attn}


def print_floor(a):
    for layers in a.layers:
        lab, allr = floor_flops(a, layers, "labelled"), floor_flops(a, layers, "all")
        rate = a.tflops * 1e12
        rec = {
            "layers": layers,
            "tflops": a.tflops,
            "linear_tflop_labelled_rows": lab["linears"] / 1e12,
            "linear_tflop_all_rows": allr["linears"] / 1e12,
            "attention_tflop": lab["attention"] / 1e12,
            "floor_ms_labelled_rows": 1e3 * lab["linears"] / rate,
            "floor_ms_all_rows": 1e3 * allr["linears"] / rate,
            "floor_ms_labelled_rows_plus_attention": 1e3 * (lab["linears"] + lab["attention"]) / rate,
        }
        print(json.dumps(rec), flush=True)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------
def build(a, torch):
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def rms_norm(x, w, eps):
        # fp32 statistics, result in x's dtype (bf16 under autocast) times the weight in that dtype
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(x.dtype) * w.to(x.dtype)

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def rope(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    def rope_tables(pos, dtype):
        """cos/sin [B, 1, T, D] of angles pos * theta^(-2i/D) (fp64, as dflash.cpp), rotate-half layout."""
        inv = a.rope_theta ** (-torch.arange(0, a.head_dim, 2, dtype=torch.float64, device=pos.device) / a.head_dim)
        ang = pos.to(torch.float64)[..., None] * inv
        full = torch.cat((ang, ang), dim=-1)[:, None]
        return full.cos().to(dtype), full.sin().to(dtype)

    class DecoderLayer(nn.Module):
        def __init__(self, attention):
            super().__init__()
            H, dq, dkv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
            lin = lambda i, o: nn.Linear(i, o, bias=False)
            self.input_layernorm = nn.Parameter(torch.ones(H))
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = lin(H, dq), lin(H, dkv), lin(H, dkv), lin(dq, H)
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))
            self.post_attention_layernorm = nn.Parameter(torch.ones(H))
            self.gate_proj, self.up_proj, self.down_proj = lin(H, a.ffn), lin(H, a.ffn), lin(a.ffn, H)
            self.attention = attention  # a plain function attribute, not a submodule

        def forward(self, x, context, cos_c, sin_c, cos_b, sin_b, block_mask):
            B, L, _ = x.shape
            S = context.shape[1]
            D = a.head_dim
            h = rms_norm(x, self.input_layernorm, a.eps)
            q = rms_norm(self.q_proj(h).view(B, L, a.heads, D), self.q_norm, a.eps).transpose(1, 2)
            q = rope(q, cos_b, sin_b)
            kb = rms_norm(self.k_proj(h).view(B, L, a.kv_heads, D), self.k_norm, a.eps).transpose(1, 2)
            kc = rms_norm(self.k_proj(context).view(B, S, a.kv_heads, D), self.k_norm, a.eps).transpose(1, 2)
            vb = self.v_proj(h).view(B, L, a.kv_heads, D).transpose(1, 2)
            vc = self.v_proj(context).view(B, S, a.kv_heads, D).transpose(1, 2)
            k = torch.cat((rope(kc, cos_c, sin_c), rope(kb, cos_b, sin_b)), dim=2)  # [B, Hkv, S + L, D]
            v = torch.cat((vc, vb), dim=2)
            o = self.attention(q, k, v, block_mask=block_mask, scale=1.0 / math.sqrt(D), enable_gqa=True)
            x = x + self.o_proj(o.transpose(1, 2).reshape(B, L, a.heads * D))
            h2 = rms_norm(x, self.post_attention_layernorm, a.eps)
            return x + self.down_proj(F.silu(self.gate_proj(h2)) * self.up_proj(h2))

    def dense_attention(q, k, v, block_mask, scale, enable_gqa):
        # block_mask here is the materialised boolean mask [B, 1, Lq, Lkv]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    def weighted_ce(x, norm_w, lm_head, labels, weights):
        """x [R, H] (bf16), labels [R], weights [R] -> (loss, correct [R] bool)."""
        logits = F.linear(rms_norm(x, norm_w, a.eps), lm_head)  # bf16 [R, V]
        nll = F.cross_entropy(logits.float(), labels, reduction="none")
        loss = (nll * weights).sum() / weights.sum()
        with torch.no_grad():
            correct = logits.argmax(-1) == labels
        return loss, correct

    class Drafter(nn.Module):
        def __init__(self, variant, n_layers, dev, attention_kind):
            super().__init__()
            H = a.hidden
            if attention_kind == "dense":
                attention = dense_attention
            else:
                attention = flex_attention if variant == "compiled" else torch.compile(flex_attention, dynamic=False)
            self.fc = nn.Linear(a.target_layers * H, H, bias=False)
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.layers = nn.ModuleList(DecoderLayer(attention) for _ in range(n_layers))
            self.norm = nn.Parameter(torch.ones(H))
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
            self.to(dev)  # fp32 master parameters
            # frozen target parts, bf16, never parameters
            g = torch.Generator(device=dev).manual_seed(0x7A11E7)
            bf = dict(device=dev, dtype=torch.bfloat16)
            self.register_buffer("embedding", torch.randn(a.vocab, H, generator=g, **bf).mul_(0.02), persistent=False)
            self.register_buffer("lm_head", torch.randn(a.vocab, H, generator=g, **bf).mul_(0.02), persistent=False)
            self.loss_fn = torch.compile(weighted_ce, dynamic=False) if variant == "compiled" else weighted_ce
            if variant == "compiled":
                for layer in self.layers:
                    layer.compile(dynamic=False)
            S = a.seq
            ctx_pos = torch.arange(S, device=dev)[None].expand(a.batch, S)
            self.cos_c, self.sin_c = rope_tables(ctx_pos, torch.bfloat16)

        def forward(self, hidden, block_tok, block_pos, labels, weights, block_mask):
            B, S = hidden.shape[:2]
            context = rms_norm(self.fc(hidden.reshape(B, S, -1)), self.hidden_norm, a.eps)
            cos_b, sin_b = rope_tables(block_pos, torch.bfloat16)
            x = F.embedding(block_tok, self.embedding)  # [B, L, H] bf16, no grad
            for layer in self.layers:
                x = layer(x, context, self.cos_c, self.sin_c, cos_b, sin_b, block_mask)
            if a.lm_rows == "labelled":  # drop each block's position 0 (no label)
                x = x.view(B, a.anchors, a.block, -1)[:, :, 1:].reshape(-1, x.shape[-1])
            else:
                x = x.reshape(-1, x.shape[-1])
            return self.loss_fn(x, self.norm, self.lm_head, labels.reshape(-1), weights.reshape(-1))

    return Drafter, create_block_mask, flex_attention, dense_attention


def make_mask(a, torch, dev):
    """The DFlash mask_mod, made once; it reads this step's anchors from a persistent
    device buffer [B, N] that each step updates in place. Block n = q // BS sees context
    keys kv < anchor_n and its own block S + n*BS <= kv < S + (n+1)*BS (bidirectional).
    No padding blocks here: N <= S - BS + 1 candidates, all blocks valid."""
    S, BS = a.seq, a.block
    anchors_buf = torch.zeros(a.batch, a.anchors, dtype=torch.long, device=dev)

    def dflash_mask(b, h, q, kv):
        n = q // BS
        return (kv < anchors_buf[b, n]) | ((kv >= S) & ((kv - S) // BS == n))

    return anchors_buf, dflash_mask


def load_target(a, torch, dev, mode):
    """The target's states [B, S, E, H] of tokens [B, S]: transformers' base model from --target
    cut after the deepest id (its final norm replaced by the identity, so that hidden_states[L + 1]
    is layer L's output for every id), bf16, SDPA, evaluated without gradient; `mode` "compiled":
    under torch.compile."""
    import transformers
    model = transformers.AutoModel.from_pretrained(a.target, dtype=torch.bfloat16, attn_implementation="sdpa")
    deepest = max(a.target_ids)
    model.layers = model.layers[:deepest + 1]
    model.config.num_hidden_layers = deepest + 1
    model.norm = torch.nn.Identity()
    model = model.to(dev).eval().requires_grad_(False)
    forward = torch.compile(model) if mode == "compiled" else model
    if model.config.hidden_size != a.hidden or model.config.vocab_size != a.vocab:
        sys.exit(f"--target {a.target}: hidden {model.config.hidden_size}, vocabulary {model.config.vocab_size}; the "
                 f"drafter's shape flags say {a.hidden} and {a.vocab}")

    def states(tokens):
        with torch.no_grad():
            out = forward(input_ids=tokens, output_hidden_states=True, use_cache=False)
        return torch.stack([out.hidden_states[i + 1] for i in a.target_ids], dim=2)

    return states


def make_step(a, torch, model, create_block_mask, attention_kind, dev, target=None):
    B, S, N, BS, E, H, V = a.batch, a.seq, a.anchors, a.block, a.target_layers, a.hidden, a.vocab
    L = N * BS
    mask_token = V - 1
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # a device without fused AdamW
        opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
        fused = False
    j = torch.arange(BS, device=dev)
    w_j = torch.exp(-(j[1:] - 1).double() / a.gamma).float()  # positions 1..BS-1
    if a.lm_rows == "labelled":
        weights = w_j.expand(B, N, BS - 1).contiguous()
    else:
        weights = torch.cat((torch.zeros(1, device=dev), w_j)).expand(B, N, BS).contiguous()

    anchors_buf, dflash_mask = make_mask(a, torch, dev)
    autocast_dev = "cuda" if dev.type == "cuda" else "cpu"
    from torch.nn.attention.flex_attention import create_mask

    def step():
        tokens = torch.randint(V, (B, S), device=dev)
        if target is None:
            hidden = torch.randn(B, S, E, H, device=dev, dtype=torch.bfloat16)  # the synthetic target
        else:
            hidden = target(tokens)
        anchors = torch.stack([torch.randperm(S - BS + 1, device=dev)[:N].sort().values for _ in range(B)])
        anchors_buf.copy_(anchors)
        if attention_kind == "flex":
            block_mask = create_block_mask(dflash_mask, B, None, L, S + L, device=dev)
        else:
            block_mask = create_mask(dflash_mask, B, 1, L, S + L, device=dev)
        pos = anchors[:, :, None] + j  # [B, N, BS]
        block_tok = torch.full((B, N, BS), mask_token, dtype=torch.long, device=dev)
        block_tok[:, :, 0] = tokens.gather(1, anchors)
        if a.lm_rows == "labelled":
            labels = tokens.gather(1, pos[:, :, 1:].reshape(B, -1))
        else:
            labels = tokens.gather(1, pos.reshape(B, -1)).view(B, N, BS)
            labels[:, :, 0] = 0  # weight 0 there
        with torch.autocast(autocast_dev, dtype=torch.bfloat16):
            loss, correct = model(hidden, block_tok.view(B, L), pos.view(B, L), labels, weights, block_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), correct

    return step, fused, sum(p.numel() for p in params)


def run_config(a, torch, variant, layers, first_in_process, attention_kind, target_mode=None):
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(a.seed)
    Drafter, create_block_mask, _, _ = build(a, torch)
    model = Drafter(variant, layers, dev, attention_kind)
    target = load_target(a, torch, dev, target_mode) if target_mode else None
    step, fused, n_params = make_step(a, torch, model, create_block_mask, attention_kind, dev, target)
    counters = __import__("torch._dynamo.utils", fromlist=["counters"]).counters
    sync()

    t0 = time.perf_counter()
    losses = [step()[0]]
    sync()
    first = time.perf_counter() - t0
    for _ in range(a.warmup):
        losses.append(step()[0])
    sync()
    graphs_before = counters["stats"]["unique_graphs"]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss, correct = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    # The same number of steps back to back, one synchronisation at the end: what a loop
    # that reads nothing from the device between steps gets (no per-step host wait).
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss, correct = step()
        losses.append(loss)
    sync()
    back_to_back = (time.perf_counter() - t0) / a.steps
    losses = [float(x) for x in losses]
    labelled = a.batch * a.anchors * (a.block - 1)
    # The peer's step time: the better of the per-step median (each step synchronised) and
    # the back-to-back mean, so that the peer is never charged for a wait it need not have.
    med = min(statistics.median(times), back_to_back)
    fl = floor_flops(a, layers, a.lm_rows)
    rec = {
        "impl": f"torch-{variant}+{attention_kind}" + (f", target transformers-{target_mode}" if target_mode else ""),
        "layers": layers,
        "median_ms": round(1e3 * med, 3),
        "min_ms": round(1e3 * min(times), 3),
        "synced_median_ms": round(1e3 * statistics.median(times), 3),
        "back_to_back_ms": round(1e3 * back_to_back, 3),
        "first_step_s": round(first, 3),
        "peak_gib": None if peak is None else round(peak, 3),
        "tokens_per_s": round(labelled / med, 1),
        "labelled_per_step": labelled,
        "steps": a.steps,
        "warmup": a.warmup,
        "first_in_process": first_in_process,
        "recompiled_graphs_while_measured": counters["stats"]["unique_graphs"] - graphs_before,
        "lm_rows": a.lm_rows,
        "params": n_params,
        "fused_adamw": fused,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "finite": all(math.isfinite(x) for x in losses),
        "floor_ms": round(1e3 * fl["linears"] / (a.tflops * 1e12), 3),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {k: getattr(a, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "target_layers",
                                              "seq", "anchors", "block", "batch")},
    }
    line = json.dumps(rec)
    print(line, flush=True)
    if a.json_out:
        with open(a.json_out, "a") as f:
            f.write(line + "\n")
    print(f"{rec['impl']:22s} layers {layers}: median {rec['median_ms']:.1f} ms (min {rec['min_ms']:.1f}, "
          f"{a.steps} steps), {rec['tokens_per_s']:.0f} tok/s, peak "
          f"{'-' if peak is None else f'{peak:.2f}'} GiB, first step {first:.2f} s"
          f"{'' if first_in_process else ' (not first in process: warm caches)'}, loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}, recompiles while measured {rec['recompiled_graphs_while_measured']}", flush=True)
    del model, step, target
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def check(a, torch):
    """The mask against one built block by block from its definition; flex_attention's
    forward (compiled, no grad) against dense SDPA with that mask, fp32, GQA."""
    from torch.nn.attention.flex_attention import create_mask

    dev = torch.device(a.device)
    B, S, N, BS = a.batch, a.seq, a.anchors, a.block
    L = N * BS
    _, create_block_mask, flex_attention, dense_attention = build(a, torch)
    anchors_buf, mask_mod = make_mask(a, torch, dev)
    anchors = torch.stack([torch.randperm(S - BS + 1, device=dev)[:N].sort().values for _ in range(B)])
    anchors_buf.copy_(anchors)
    ref = torch.zeros(B, 1, L, S + L, dtype=torch.bool, device=dev)
    for b in range(B):
        for n in range(N):
            rows = slice(n * BS, (n + 1) * BS)
            ref[b, 0, rows, : int(anchors[b, n])] = True
            ref[b, 0, rows, S + n * BS : S + (n + 1) * BS] = True
    dense = create_mask(mask_mod, B, 1, L, S + L, device=dev)
    ok_mask = bool(torch.equal(dense, ref))
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, a.heads, L, a.head_dim, device=dev, generator=g)
    k = torch.randn(B, a.kv_heads, S + L, a.head_dim, device=dev, generator=g)
    v = torch.randn(B, a.kv_heads, S + L, a.head_dim, device=dev, generator=g)
    scale = 1.0 / math.sqrt(a.head_dim)
    out_dense = dense_attention(q, k, v, block_mask=ref, scale=scale, enable_gqa=True)
    try:
        bm = create_block_mask(mask_mod, B, None, L, S + L, device=dev)
        with torch.no_grad():
            out_flex = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)
        err = ((out_flex - out_dense).norm() / out_dense.norm()).item()
        flex_msg = f"flex_attention compiled forward vs dense SDPA (fp32): rel. error {err:.2e}"
        ok_flex = err < 1e-3
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        flex_msg, ok_flex = f"flex_attention forward failed here: {type(e).__name__}: {str(e)[:200]}", False
    print(f"check: mask_mod == mask built from the definition: {ok_mask}; {flex_msg}; "
          f"{'PASS' if ok_mask and ok_flex else 'FAIL'}", flush=True)
    if not ok_mask:
        raise SystemExit(1)


def main():
    a = parse_args()
    if a.floor:
        print_floor(a)
        return 0
    import torch

    if a.device.startswith("cuda"):
        torch.cuda.init()
        torch.ones(1, device=a.device)  # context and allocator up before any timing
    attention_kind = a.attention if a.attention != "auto" else ("flex" if a.device.startswith("cuda") else "dense")
    if attention_kind == "dense":
        print("attention: dense SDPA with the materialised DFlash mask (not flex_attention: "
              f"{'FlexAttention has no backward on CPU in torch ' + torch.__version__ if a.device == 'cpu' else 'asked for'})",
              flush=True)
    if a.check or a.check_only:
        check(a, torch)
        if a.check_only:
            return 0
    first = True
    for variant in a.variant:
        for layers in a.layers:
            for target_mode in a.target_mode if a.target else [None]:
                rec = run_config(a, torch, variant, layers, first, attention_kind, target_mode)
                first = False
                if not rec["finite"]:
                    print(f"non-finite loss in {rec['impl']} layers {layers}", file=sys.stderr)
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

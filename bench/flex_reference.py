"""PyTorch's own attention on the shapes of bench_flash_cuda (run on the GPU machine).

  python3 bench/flex_reference.py bench <xchg dir> <rows.md>
      bf16, B = 1, H = 32, D = 128. DFlash mask (S = 4096 context, 512 anchors x 16,
      the anchors bench_flash_cuda wrote to <xchg dir>/dflash_anchors.txt) through
      flex_attention compiled with create_block_mask; causal L = 8192 through
      flex_attention compiled, SDPA flash (FA2) and SDPA cuDNN. Appends markdown rows
      (the same columns as bench_flash_cuda) to <rows.md>.
  python3 bench/flex_reference.py check <xchg dir> [<xchg dir> ...]
      For each folder (one `bench_flash_cuda dump <dir> <config>` per configuration, say):
      reads the inputs and flash_cuda's outputs that `bench_flash_cuda dump` wrote, runs
      flex_attention (compiled, fp32 on the upcast bf16 inputs: the reference) with the
      DFlash mask written here from the anchors, and prints the relative errors
      max|a - b| / max|b| of flash_cuda's out, lse, dq, dk, dv against it (bound 2e-2
      for bf16), next to flex_attention's own bf16 errors for scale. Exit code 1 when any
      folder fails. The mask here is written from DESIGN.md's definition, not from our code.

  python3 bench/flex_reference.py bench-sm120 <xchg dir> <rows.md>
      The same DFlash and causal cases through flex_attention as it runs on sm_120 cards
      (RTX 50xx, RTX PRO 6000): Triton emitting mma.sync instead of wgmma
      (DISABLE_MMA_V3=1, set here before Triton loads, with fresh Inductor/Triton caches
      so no wgmma kernel is reused) and torch's sm_120 default Flex configurations passed
      as kernel_options (forward 128x64, 2 stages, 8 warps; backward 64x64x64x64, 1
      stage, 4 warps). Prints how many of the compiled kernels contain wgmma (must be 0).

Timing: triton.testing.do_bench, median, after its warm-up; bwd = (fwd + bwd) - fwd.
TFLOP/s over visible pairs: 4 * pairs * D per head forward, 2.5x that backward.
Peak GiB: torch.cuda.max_memory_allocated during one forward + backward minus what was
allocated before (q, k, v, dout, block mask).
"""
import json
import math
import os
import sys
import tempfile

# Flex as it runs on sm_120: must be set before Triton is imported.
SM120 = len(sys.argv) > 1 and sys.argv[1] == "bench-sm120"
if SM120:
    os.environ["DISABLE_MMA_V3"] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flex_sm120_inductor_")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="flex_sm120_triton_")
# torch's default Flex configurations for sm_120 (forward / backward)
SM120_OPTIONS = {
    "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 2, "fwd_num_warps": 8,
    "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
    "bwd_num_stages": 1, "bwd_num_warps": 4,
}

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

flex_compiled = torch.compile(flex_attention, dynamic=False)


def dflash_mask_mod(anchors, valid, S, BS):
    """DFlash: query q of block n = q // BS sees context kv < anchors[b, n] and its own
    block (S + n*BS <= kv < S + (n+1)*BS); padding blocks (valid 0) see nothing."""

    def mask_mod(b, h, q, kv):
        n = q // BS
        ctx = kv < anchors[b, n]
        own = (kv >= S) & ((kv - S) // BS == n)
        return (valid[b, n] != 0) & (ctx | own)

    return mask_mod


def causal_mod(b, h, q, kv):
    return kv <= q


def gib(x):
    return x / 1024.0**3


def measure(fwd, make_grads, dout):
    """fwd() -> out; returns fwd ms, fwd+bwd ms, peak GiB above the current allocation."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fwd()
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    make_grads()

    def fwd_only():
        with torch.no_grad():
            fwd()

    def fwd_bwd():
        make_grads()
        fwd().backward(dout)

    t_f = do_bench(fwd_only, warmup=100, rep=500, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=100, rep=500, return_mode="median")
    return t_f, t_fb, gib(peak)


def row(case, impl, pairs, D, t_f, t_fb, peak):
    t_b = t_fb - t_f
    f_tf = 4.0 * pairs * D / (t_f * 1e-3) / 1e12
    b_tf = 2.5 * 4.0 * pairs * D / (t_b * 1e-3) / 1e12
    return f"| {case} | {impl} | {t_f:.3f} | {t_b:.3f} | {t_fb:.3f} | {f_tf:.0f} | {b_tf:.0f} | {peak:.3f} |"


def bench(xdir, rows_path, sm120=False):
    dev = "cuda"
    options = SM120_OPTIONS if sm120 else None
    flex_name = "flex_attention compiled, as on sm_120 (mma.sync)" if sm120 else "flex_attention compiled"
    B, H, D = 1, 32, 128
    pairs = dict(line.split() for line in open(os.path.join(xdir, "pairs.txt")))
    rows = []

    def qkv(Lq, Lkv):
        torch.manual_seed(11)
        mk = lambda L: torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
        q, k, v, dout = mk(Lq), mk(Lkv), mk(Lkv), mk(Lq)
        for t in (q, k, v):
            t.requires_grad_(True)

        def zero():
            for t in (q, k, v):
                t.grad = None

        return q, k, v, dout, zero

    # DFlash
    S, N, BS = 4096, 512, 16
    anchors = torch.tensor([[int(x) for x in open(os.path.join(xdir, "dflash_anchors.txt"))]], device=dev)
    valid = torch.ones(1, N, dtype=torch.int32, device=dev)
    Lq, Lkv = N * BS, S + N * BS
    bm = create_block_mask(dflash_mask_mod(anchors, valid, S, BS), None, None, Lq, Lkv, device=dev)
    q, k, v, dout, zero = qkv(Lq, Lkv)
    # pairs from the mask itself, checked against bench_flash_cuda's count
    with torch.no_grad():
        qi = torch.arange(Lq, device=dev)[:, None]
        ki = torch.arange(Lkv, device=dev)[None, :]
        ours = int(pairs["dflash"])
        here = int(dflash_mask_mod(anchors, valid, S, BS)(0, 0, qi, ki).sum().item()) * H
        print(f"DFlash visible pairs: flex mask {here}, flash_cuda mask {ours}", flush=True)
        if here != ours:
            print("MISMATCH in visible pairs between the two masks", flush=True)
    case = "DFlash S=4096, 512x16 (Lq 8192, Lkv 12288)"
    t = measure(lambda: flex_compiled(q, k, v, block_mask=bm, kernel_options=options), zero, dout)
    rows.append(row(case, flex_name, ours, D, *t))
    print(rows[-1], flush=True)
    del q, k, v, dout, bm

    # causal 8192
    L = 8192
    q, k, v, dout, zero = qkv(L, L)
    case = "causal 8192"
    ours = int(pairs["causal"])
    bm = create_block_mask(causal_mod, None, None, L, L, device=dev)
    t = measure(lambda: flex_compiled(q, k, v, block_mask=bm, kernel_options=options), zero, dout)
    rows.append(row(case, flex_name, ours, D, *t))
    print(rows[-1], flush=True)
    if sm120:
        wgmma = total = 0
        for root, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]):
            for f in files:
                if f.endswith(".ptx"):
                    total += 1
                    wgmma += "wgmma.mma_async" in open(os.path.join(root, f)).read()
        print(f"flex as on sm_120: {wgmma} of {total} compiled Triton kernels use wgmma", flush=True)
        with open(rows_path, "a") as f:
            f.write("\n".join(rows) + "\n")
        return
    for name, backend in (("SDPA flash (FA2)", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
        try:
            def fwd(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            t = measure(fwd, zero, dout)
            rows.append(row(case, name, ours, D, *t))
        except Exception as e:  # a backend this build lacks: say so in the table
            rows.append(f"| {case} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | | | |")
        print(rows[-1], flush=True)
    with open(rows_path, "a") as f:
        f.write("\n".join(rows) + "\n")


def load_raw(xdir, name, dtype, shape):
    data = bytearray(open(os.path.join(xdir, name + ".bin"), "rb").read())
    return torch.frombuffer(data, dtype=dtype).reshape(shape).clone().cuda()


def rel(a, b):
    a, b = a.double(), b.double()
    ref = b.abs().max().item()
    return (a - b).abs().max().item() / ref if ref > 0 else (0.0 if (a - b).abs().max().item() == 0 else math.inf)


def check(xdir):
    m = json.load(open(os.path.join(xdir, "meta.json")))
    B, Hq, Hkv, Lq, Lkv, D = (m[x] for x in ("B", "Hq", "Hkv", "Lq", "Lkv", "D"))
    bf = torch.bfloat16
    q = load_raw(xdir, "q", bf, (B, Hq, Lq, D))
    k = load_raw(xdir, "k", bf, (B, Hkv, Lkv, D))
    v = load_raw(xdir, "v", bf, (B, Hkv, Lkv, D))
    dout = load_raw(xdir, "dout", bf, (B, Hq, Lq, D))
    got = {
        "out": load_raw(xdir, "out", bf, (B, Hq, Lq, D)),
        "lse": load_raw(xdir, "lse", torch.float32, (B, Hq, Lq)),
        "dq": load_raw(xdir, "dq", bf, (B, Hq, Lq, D)),
        "dk": load_raw(xdir, "dk", bf, (B, Hkv, Lkv, D)),
        "dv": load_raw(xdir, "dv", bf, (B, Hkv, Lkv, D)),
    }
    anchors = torch.tensor(m["anchors"], device="cuda")
    valid = torch.tensor(m["valid"], device="cuda", dtype=torch.int32)
    bm = create_block_mask(dflash_mask_mod(anchors, valid, m["S"], m["BS"]), B, None, Lq, Lkv, device="cuda")

    def run_flex(dtype, fn):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        out, lse = fn(qq, kk, vv, block_mask=bm, scale=m["scale"], enable_gqa=True, return_lse=True)
        out.backward(dout.to(dtype))
        return {"out": out.detach(), "lse": lse.detach().float(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}

    # the reference: flex_attention uncompiled (its plain PyTorch path) in fp32;
    # flex compiled in bf16 for the scale of bf16 rounding
    ref = run_flex(torch.float32, flex_attention)
    flex_bf16 = run_flex(bf, flex_compiled)
    # rows with no visible key, from the mask definition itself: lse is compared on the
    # others; on these flash_cuda must give lse -inf, out 0, dq 0
    with torch.no_grad():
        mod = dflash_mask_mod(anchors, valid, m["S"], m["BS"])
        qi = torch.arange(Lq, device="cuda")[:, None]
        ki = torch.arange(Lkv, device="cuda")[None, :]
        seen = torch.stack([mod(b, 0, qi, ki).any(-1) for b in range(B)])  # [B, Lq]
        seen = seen[:, None, :].expand(B, Hq, Lq)
    print(f"flex check: DFlash B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lkv={Lkv} D={D}, "
          f"flash_cuda {m['variant_fwd']} / {m['variant_bwd']} ({m.get('note', '')}); "
          f"reference flex_attention fp32", flush=True)
    empty = ~seen
    ok = bool((got["lse"][empty] == -math.inf).all().item() and (got["out"][empty] == 0).all().item()
              and (got["dq"][empty] == 0).all().item())
    print(f"  rows with no visible key: {int(empty.sum().item())} (flash_cuda: lse -inf, out 0, dq 0: {ok})",
          flush=True)
    for name in ("out", "lse", "dq", "dk", "dv"):
        if name == "lse":
            e_ours = rel(got[name][seen], ref[name][seen])
            e_flex = rel(flex_bf16[name][seen], ref[name][seen])
        else:
            e_ours, e_flex = rel(got[name], ref[name]), rel(flex_bf16[name], ref[name])
        nan = torch.isnan(got[name]).any().item()
        good = e_ours <= 2e-2 and not nan
        ok &= good
        print(f"  {name:4s} flash_cuda bf16 vs flex fp32: {e_ours:.2e}   flex bf16 vs flex fp32: {e_flex:.2e}"
              f"   NaN: {nan}   {'ok' if good else 'FAIL'} (bound 2e-2)", flush=True)
    print(f"flex check: {'PASS' if ok else 'FAIL'} ({m['variant_bwd']})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "bench":
        bench(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "bench-sm120":
        bench(sys.argv[2], sys.argv[3], sm120=True)
    elif len(sys.argv) >= 3 and sys.argv[1] == "check":
        sys.exit(max(check(d) for d in sys.argv[2:]))
    else:
        print(__doc__)
        sys.exit(2)

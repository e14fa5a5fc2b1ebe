"""What the device scripts' Python parts share (bench/*_device.sh; they run from the repository
root, so `from bench.device_common import timed, rel, transformers_states`)."""
import statistics

import torch


def timed(fn, n=10, warm=3):
    """The median milliseconds of n calls of fn, each between two CUDA events, after `warm` calls."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def rel(a, ref):
    """'max M, mean m': max |a - ref| / max |ref| and mean |a - ref| / mean |ref|."""
    d = (a - ref).abs()
    return f"max {d.max().item() / ref.abs().max().item():.2e}, mean {d.mean().item() / ref.abs().mean().item():.2e}"


def transformers_states(ckpt, tokens, layers, num_hidden_layers, impls=("sdpa", "eager")):
    """transformers' own bf16 forward of the checkpoint cut to num_hidden_layers (one past the
    deepest layer read: hidden_states[L + 1] is then layer L's output before any final norm, as
    ours is), once per attention implementation: {impl: [layer L's states [S, H] float32 on the
    CPU, for L in layers]} for the first row of tokens."""
    import transformers
    states = {}
    for impl in impls:
        model = transformers.AutoModel.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation=impl,
                                                       num_hidden_layers=num_hidden_layers).cuda().eval()
        if getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0):
            print(impl, "experts implementation:", getattr(model.config, "_experts_implementation", None))
        with torch.inference_mode():
            hs = model(input_ids=tokens.cuda(), output_hidden_states=True).hidden_states
        states[impl] = [hs[L + 1][0].float().cpu() for L in layers]
        del model, hs
        torch.cuda.empty_cache()
    return states

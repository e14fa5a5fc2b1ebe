#!/usr/bin/env python3
"""Where the device sits idle inside one named part of a profiled step.

    python3 bench/trace_gaps.py TRACE.json [PART]     (PART: target_forward by default)

TRACE is the Chrome trace that `flashdraft run --profile A:B` writes next to its log. The
part's kernels are those inside the device-side ranges of `flashdraft/PART` (one per
profiled step). For every idle gap between two of them it tells whether the second kernel's
launch call had already returned before the first one ended (the host was ahead: the gap is
the device's own, launch to launch) or came later (the host was behind: the gap is host
time), and sums the gaps by the pair of kernels around them; and how long the device sat idle
before the part's first kernel.
"""
import collections
import json
import signal
import sys


def short(name, n=48):
    for prefix in ("void ", "flashdraft::"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name if len(name) <= n else name[: n - 3] + "..."


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: python3 bench/trace_gaps.py TRACE.json [PART]  (TRACE: the Chrome trace of "
                 "`flashdraft run --profile A:B`; PART: target_forward by default)")
    path = sys.argv[1]
    part = sys.argv[2] if len(sys.argv) > 2 else "target_forward"
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"trace_gaps: {path} is not a readable Chrome trace with traceEvents ({e})")
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "gpu_user_annotation" and e.get("name") == "flashdraft/" + part)
    if not ranges:
        sys.exit(f"trace_gaps: no device range named flashdraft/{part} in {path}")
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps = len(ranges)
    total_gap = host_gap = 0.0
    by_pair = collections.Counter()
    host_by_pair = collections.Counter()
    sizes = collections.Counter()
    busy = before = overlap = 0.0
    overlaps = 0
    for lo, hi in ranges:
        inside = [k for k in kernels if lo <= k["ts"] < hi]
        ends = [k["ts"] + k["dur"] for k in kernels if k["ts"] < lo]
        if inside and ends:
            before += max(0.0, inside[0]["ts"] - max(ends))
        busy += sum(k["dur"] for k in inside)
        for a, b in zip(inside, inside[1:]):
            end = a["ts"] + a["dur"]
            gap = b["ts"] - end
            if gap < 0:  # started before the last one ended: a programmatic dependent launch
                overlaps += 1
                overlap -= gap
            if gap <= 0:
                continue
            launch = launches.get(b.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] + launch.get("dur", 0) > end
            total_gap += gap
            pair = f"{short(a['name'], 40)}  ->  {short(b['name'], 40)}"
            by_pair[pair] += gap
            if late:
                host_gap += min(gap, launch["ts"] + launch.get("dur", 0) - end)
                host_by_pair[pair] += gap
            sizes["< 2 us" if gap < 2 else "2-5 us" if gap < 5 else "5-20 us" if gap < 20 else ">= 20 us"] += 1
    span = sum(hi - lo for lo, hi in ranges)
    print(f"{part}: {steps} profiled steps; per step: range {span / steps / 1e3:.2f} ms, kernels "
          f"{busy / steps / 1e3:.2f} ms, idle gaps between kernels {total_gap / steps / 1e3:.2f} ms, of which the "
          f"next launch returned after the last kernel ended (host behind) {host_gap / steps / 1e3:.2f} ms")
    print(f"  device idle between the kernel before the part and its first kernel: {before / steps / 1e3:.2f} ms")
    if overlaps:
        print(f"  kernels that started before the one before them ended (programmatic dependent launch; their "
              f"time counts the wait): {overlaps / steps:.0f} per step, {overlap / steps / 1e3:.2f} ms of overlap")
    print("  gaps by size (count per step): " +
          ", ".join(f"{k} {sizes[k] / steps:.0f}" for k in ("< 2 us", "2-5 us", "5-20 us", ">= 20 us")))
    print("  largest gap totals by the kernels around them (ms per step; host behind in brackets):")
    for pair, g in by_pair.most_common(12):
        print(f"    {g / steps / 1e3:6.3f} ({host_by_pair[pair] / steps / 1e3:.3f})  {pair}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    main()

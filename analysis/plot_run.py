#!/usr/bin/env python3
"""Writes the figures of a flashdraft run log as PNG files and prints their paths.

    plot_run.py RUN.h5 OUTDIR [--compare OTHER.h5]

Figures: loss.png, position_accuracy.png, tau_sim.png, memory.png,
kernel_timeline.png, and compare.png with --compare. Exit status 2 when a log
cannot be read (the reason goes to stderr).
"""
import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only; no display needed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashdraft_logs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot a flashdraft run log to PNG files.")
    p.add_argument("run", help="run log (.h5) written by `flashdraft run`")
    p.add_argument("outdir", help="folder for the PNG files (created if missing)")
    p.add_argument("--compare", metavar="OTHER.h5", help="a second run log to compare with")
    p.add_argument("--dpi", type=int, default=110)
    a = p.parse_args(argv)
    try:
        run = flashdraft_logs.load_run(a.run)
        other = flashdraft_logs.load_run(a.compare) if a.compare else None
        paths = flashdraft_logs.plot_all(run, a.outdir, compare=other, dpi=a.dpi)
    except flashdraft_logs.LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

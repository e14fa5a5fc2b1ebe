#!/usr/bin/env python3
"""Prints a table of the kernels in a ptxas resource report (nvcc -Xptxas -v output):
registers, spill stores / loads in bytes and stack frame, one row per kernel and
architecture, kernels that spill first.

Usage: ptxas_report.py PTXAS_LOG [NAME_SUBSTRING ...]
       (build.sh writes its report to <outdir>/ptxas.log and prints this table)
Only kernels whose short name contains one of the substrings are listed (all if none).
Exit status 0; 2 when the file holds no kernel entry (not a -Xptxas -v report).
"""
import re
import signal
import sys

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def short_name(mangled):
    """flash_bwd_dq_kernel<bf16, 128, 1, 2> from an Itanium-mangled name, for the template
    arguments this project's kernels take (a type and integer or bool literals); any other
    name is returned as it is."""
    s = mangled[3:] if mangled.startswith("_ZN") else mangled[2:] if mangled.startswith("_Z") else None
    if s is None:
        return mangled
    pos, name = 0, None
    while pos < len(s) and s[pos].isdigit():  # <length><identifier>, the last one is the name
        m = re.match(r"\d+", s[pos:])
        n = int(m.group(0))
        pos += len(m.group(0))
        name = s[pos:pos + n]
        pos += n
    if name is None:
        return mangled
    if pos >= len(s) or s[pos] != "I":
        return name
    pos += 1
    args = []
    while pos < len(s) and s[pos] != "E":
        m = re.match(r"L([ib])(\d+)E", s[pos:])
        if m:
            args.append(("true" if m.group(2) == "1" else "false") if m.group(1) == "b" else m.group(2))
            pos += len(m.group(0))
            continue
        m = re.match(r"(\d+)", s[pos:])
        if not m:
            return mangled
        n = int(m.group(1))
        ident = s[pos + len(m.group(1)):pos + len(m.group(1)) + n]
        args.append({"__nv_bfloat16": "bf16", "__half": "fp16"}.get(ident, ident))
        pos += len(m.group(1)) + n
    return f"{name}<{', '.join(args)}>"


def parse(text):
    """[(short name, arch, registers, spill stores, spill loads, stack frame)]"""
    rows, cur, spill = [], None, None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            cur, spill = (short_name(m.group(1)), m.group(2)), None
            continue
        m = SPILL.search(line)
        if m and cur:
            spill = (int(m.group(2)), int(m.group(3)), int(m.group(1)))
            continue
        m = USED.search(line)
        if m and cur and spill:
            rows.append((cur[0], cur[1], int(m.group(1)), spill[0], spill[1], spill[2]))
            cur, spill = None, None
    return rows


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        rows = parse(f.read())
    if not rows:
        print(f"ptxas_report: {argv[1]} holds no 'Compiling entry function' entry (build with -Xptxas -v)",
              file=sys.stderr)
        return 2
    keep = argv[2:]
    # build.sh's report holds every object's entries: check_flash_cuda.o repeats the kernels
    rows = list(set(r for r in rows if not keep or any(k in r[0] for k in keep)))
    rows.sort(key=lambda r: (-(r[3] + r[4]), r[0], r[1]))
    print("| kernel | arch | registers | spill stores B | spill loads B | stack B |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the table quietly
    sys.exit(main(sys.argv))

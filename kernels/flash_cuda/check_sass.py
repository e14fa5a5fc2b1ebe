#!/usr/bin/env python3
"""Checks the SASS of the sm90a forward for a ptxas hazard the tests on the GPU also catch.

The forward holds Q in registers as wgmma A fragments for every step (flash_sm90a.cu). ptxas
(CUDA 13.0) was seen reusing those registers inside the loop for other values, so every step
after the first computed S from garbage (NOTES.md v12); an xor with a zero ptxas cannot see
through (wg::carry) keeps them live. This check needs no GPU: in every sm90a forward kernel
it finds the registers ldmatrix fills (LDSM), the first HGMMA that reads them as its A
operand, and fails if any later instruction writes one of them other than that xor.

Usage: check_sass.py PLUGIN_OR_CUBIN     (cuobjdump from $CUOBJDUMP, PATH, or the
        nvidia-cuda-cuobjdump wheel in this Python's site-packages; it runs nvdisasm, from
        the nvidia-cuda-nvdisasm wheel beside it)
Exit status 0: checked; 1: a hazard or a forward that no longer looks as this check expects;
2: cuobjdump not found or failed.
"""
import glob
import os
import re
import shutil
import site
import subprocess
import sys

KERNEL = "wg_fwd_kernel"
INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LDSM = re.compile(r"^(?:@!?U?P\w+\s+)?LDSM\.16\.M88\.4\s+R(\d+),")
HGMMA_A = re.compile(r"^HGMMA\S*\s+R\d+,\s+R(\d+),")
WRITE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b")
# opcodes whose first register operand is read, not written (HGMMA writes only accumulators,
# and LDSM is the load being checked)
NO_DEST = ("ST", "RED", "ATOM", "BAR", "SYNCS", "HGMMA", "LDSM")


def find_cuobjdump():
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    on_path = shutil.which("cuobjdump")
    if on_path:
        return on_path
    for d in site.getsitepackages():
        hits = sorted(glob.glob(os.path.join(d, "nvidia", "cu*", "bin", "cuobjdump")))
        if hits:
            return hits[-1]
    return None


def check_function(name, body):
    """Returns (problems, summary) for one kernel's SASS."""
    lines = [(int(a, 16), ins) for a, ins in INS.findall(body)]
    frag = set()
    for _, ins in lines:
        m = LDSM.match(ins)
        if m:
            frag.update(range(int(m.group(1)), int(m.group(1)) + 4))
    if not frag:
        return [f"{name}: no ldmatrix (LDSM) in the kernel: the forward no longer holds Q in registers, "
                "so this check no longer applies; update it with the kernel"], ""
    first = next((a for a, ins in lines if (m := HGMMA_A.match(ins)) and int(m.group(1)) in frag), None)
    if first is None:
        return [f"{name}: no HGMMA reads the ldmatrix registers R{min(frag)}..R{max(frag)} as its A operand"], ""
    problems, carried = [], {}
    for a, ins in lines:
        if a <= first:
            continue
        m = WRITE.match(ins)
        if not m or m.group(1).startswith(NO_DEST) or int(m.group(2)) not in frag:
            continue
        r = m.group(2)
        # the carry: LOP3.LUT Rr, Rr, <zero>, RZ, 0x3c (xor), !PT
        if re.match(rf"^LOP3\.LUT\s+R{r},\s+R{r},\s+\S+,\s+RZ,\s+0x3c,", ins):
            carried[int(r)] = carried.get(int(r), 0) + 1
            continue
        problems.append(f"{name}: at 0x{a:x}, after the first S product (0x{first:x}), `{ins}` overwrites "
                        f"Q fragment register R{r} that the next step's S reads")
    # one xor per register in each copy of the step (the forward has one copy for steps
    # with masking and one without)
    counts = sorted(set(carried.get(r, 0) for r in frag))
    if len(counts) != 1 or counts[0] < 1:
        problems.append(f"{name}: carry xors per Q fragment register {counts} for {len(frag)} registers "
                        "(expected the same number, at least one, for each)")
    return problems, f"{len(frag)} Q fragment registers, carried {counts[-1]}x each"


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = sys.argv[1]
    tool = find_cuobjdump()
    if tool is None:
        print("check_sass: cuobjdump not found (set CUOBJDUMP, put it on PATH, or pip install "
              "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm into this Python; scripts/install-deps does)",
              file=sys.stderr)
        return 2
    run = subprocess.run([tool, "-sass", "-arch", "sm_90a", path], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"check_sass: `{tool} -sass -arch sm_90a {path}` failed: {run.stderr.strip()}", file=sys.stderr)
        return 2
    funcs = re.split(r"\n\s+Function : ", run.stdout)[1:]
    checked, problems = [], []
    for f in funcs:
        name = f.split("\n", 1)[0].strip()
        if KERNEL not in name:
            continue
        short = re.sub(r"^_ZN.*?(" + KERNEL + ")", r"\1", name)  # the template arguments stay
        p, summary = check_function(short, f)
        checked.append(short)
        print(f"  {short}: {summary or f'{len(p)} problems'}")
        for line in p[:4]:
            print("FAIL " + line)
        if len(p) > 4:
            print(f"FAIL {short}: ... and {len(p) - 4} more")
        problems += p
    if not checked:
        problems.append(f"no {KERNEL} function in the sm_90a SASS of {path}")
        print("FAIL " + problems[-1])
    print(f"check_sass: {len(checked)} sm90a forward kernels, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

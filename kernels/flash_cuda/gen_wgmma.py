#!/usr/bin/env python3
"""Prints the wgmma inline-PTX wrappers pasted into wgmma.cuh (one per shape and type).

wgmma_ss_n<N>_<t>:     D(64xN) (+)= A(smem, K-major) * B(smem, K-major), N in {64, 128}
wgmma_rs_n<N>_<t>:     D(64xN) (+)= A(registers) * B(smem, MN-major), N in {64, 128}
wgmma_rsk_n128_<t>:    D(64x128) (+)= A(registers) * B(smem, K-major)
with <t> in {bf16, f16}, fp32 accumulators; `acc` = 0 overwrites D (scale-d false).
Usage: python3 gen_wgmma.py > /tmp/wgmma_ops.inc
"""
def ss(n, ty):
    nr = n // 2
    outs = ",".join(f"%{i}" for i in range(nr))
    a, b, sc = nr, nr + 1, nr + 2
    s = []
    s.append(f"__device__ __forceinline__ void wgmma_ss_n{n}_{ty}(float (&d)[{nr}], uint64_t a, uint64_t b, int acc) {{")
    s.append('  asm volatile(')
    s.append('      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(sc) + ', 0;\\n"')
    s.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} "')
    s.append('      "{' + outs + '}, %' + str(a) + ', %' + str(b) + ', p, 1, 1, 0, 0;\\n}\\n"')
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nr))
    s.append(f'      : {cons}')
    s.append('      : "l"(a), "l"(b), "r"(acc));')
    s.append("}")
    return "\n".join(s)
def rs(n, ty, kmajor=False):
    nr = n // 2
    outs = ",".join(f"%{i}" for i in range(nr))
    a0 = nr; b = nr + 4
    s = []
    name = "rsk" if kmajor else "rs"
    s.append(f"__device__ __forceinline__ void wgmma_{name}_n{n}_{ty}(float (&d)[{nr}], const uint32_t (&a)[4], uint64_t b, int acc) {{")
    s.append('  asm volatile(')
    s.append('      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(b+1) + ', 0;\\n"')
    s.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} "')
    s.append('      "{' + outs + '}, {%' + str(a0) + ', %' + str(a0+1) + ', %' + str(a0+2) + ', %' + str(a0+3) + '}, %' + str(b) + ', p, 1, 1, ' + ('0' if kmajor else '1') + ';\\n}\\n"')
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nr))
    s.append(f'      : {cons}')
    s.append('      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));')
    s.append("}")
    return "\n".join(s)
out = []
for ty in ("bf16", "f16"):
    out.append(ss(64, ty))
    out.append(ss(128, ty))
    out.append(rs(64, ty))
    out.append(rs(128, ty))
    out.append(rs(128, ty, kmajor=True))
print("\n".join(out))

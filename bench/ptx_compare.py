"""Compares the PTX `kernel_ptx` wrote for two commits, function by function, to show that a
refactor of the kernels kept their arithmetic. Comments, .loc/.file lines and debug sections are
dropped first. Each function (every arch file in B_DIR) is then one of: identical text; the same
floating-point and shuffle instructions (operands' register numbers ignored, counted as a
multiset: only integer/address code, register allocation or instruction order differ); or
different floating-point instructions (listed, A-only and B-only).

Usage: python3 bench/ptx_compare.py A_DIR B_DIR
  (each from `target/release/kernel_ptx DIR` built at one commit: DIR/<file>.<sm_XY>.ptx)"""
import collections
import glob
import os
import re
import sys

ENTRY = re.compile(r"\n(?=(?:\.visible |\.weak |\.extern )?(?:\.entry|\.func) )")
NAME = re.compile(r"(?:\.visible |\.weak |\.extern )?(?:\.entry|\.func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")
FLOAT = re.compile(
    r"^(add|sub|mul|fma|div|rsqrt|sqrt|ex2|lg2|max|min|neg|abs|rcp|tanh|cvt|setp|selp)\S*"
    r"\.(f32|f64|f16|bf16|bf16x2|f16x2)\b|^shfl|^ex2|^rsqrt|^cvt\.rn\.(f16|bf16)")
REG = re.compile(r"%(r|rd|f|fd|p|rs|h|hh)\d+")


def functions(path):
    text = re.sub(r"//[^\n]*", "", open(path).read())
    text = re.sub(r"\n\s*\.(loc|file)\b[^\n]*", "", text)
    text = text.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    out = {}
    for part in ENTRY.split(text)[1:]:
        m = NAME.match(part)
        name = m.group(1) if m else part[:40]
        out[name] = "\n".join(l.strip() for l in part.splitlines() if l.strip())
    return out


def float_ops(body):
    return collections.Counter(REG.sub(r"%\1", l) for l in body.splitlines() if FLOAT.search(l))


def main(a_dir, b_dir):
    count = collections.Counter()
    differ = []
    for bp in sorted(glob.glob(os.path.join(b_dir, "*.ptx"))):
        ap = os.path.join(a_dir, os.path.basename(bp))
        if not os.path.exists(ap):
            count["file only in B"] += 1
            continue
        fa, fb = functions(ap), functions(bp)
        for name in sorted(set(fa) | set(fb)):
            if name not in fa or name not in fb:
                count["function on one side only"] += 1
            elif fa[name] == fb[name]:
                count["identical"] += 1
            elif float_ops(fa[name]) == float_ops(fb[name]):
                count["same floating-point instructions"] += 1
            else:
                count["floating-point instructions differ"] += 1
                ca, cb = float_ops(fa[name]), float_ops(fb[name])
                differ.append((os.path.basename(bp), name, dict(ca - cb), dict(cb - ca)))
    for k, v in count.items():
        print(f"{k}: {v}")
    for f, name, a_only, b_only in differ:
        print(f"{f} {name}: A only {a_only}; B only {b_only}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

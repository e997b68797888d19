#!/usr/bin/env python3
"""Summarises an ncu report's SASS source page (CSV from
`ncu -i REP --page source --csv --print-source sass`): total warp instructions and stall
samples, the stall reasons over all samples, the opcode mix, and the executed basic blocks
(runs of instructions with the same execution count) with their share of instructions and of
stall samples; with RAW.csv (`--page raw --csv`), the pipe, issue and stall metrics too.
Usage: ncu_summary.py SOURCE.csv [TOP_BLOCKS [RAW.csv]]"""
import csv
import sys
from collections import Counter


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


RAW_KEYS = ("pipe_xu", "pipe_fma", "pipe_alu", "pipe_lsu", "inst_executed_pipe", "issue_active",
            "warps_issue_stalled")


def raw_metrics(path):
    """The first kernel's pipe, issue and stall metrics from a raw-page CSV (names, units, then
    one row per kernel)."""
    rows = list(csv.reader(open(path, newline="")))
    for name, unit, value in zip(rows[0], rows[1], rows[2]):
        if any(k in name for k in RAW_KEYS) and value not in ("", "0"):
            print(name, unit, value)


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    raw = sys.argv[3] if len(sys.argv) > 3 else None
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The header is the first row naming the address column.
    h = next(i for i, r in enumerate(rows) if "Address" in r)
    head, rows = rows[h], rows[h + 1:]
    col = {name: i for i, name in enumerate(head)}
    src = col.get("Source")
    ex = next(i for n, i in col.items() if n.startswith("Instructions Executed"))
    samp = next(i for n, i in col.items() if n.startswith("Warp Stall Sampling (All"))
    reasons = [(n, i) for n, i in col.items() if n.startswith("stall_") or "Stall Reason" in n]
    total_inst = sum(num(r[ex]) for r in rows)
    total_samp = sum(num(r[samp]) for r in rows) or 1.0
    print(f"total warp inst {total_inst:.0f} samples {total_samp:.0f}")
    if reasons:
        per = sorted(((n, 100 * sum(num(r[i]) for r in rows) / total_samp) for n, i in reasons),
                     key=lambda t: -t[1])
        print("stall reasons (% of all samples):", [(n, round(p, 1)) for n, p in per if p >= 0.5])
    else:
        print("columns:", head)
    ops = Counter()
    for r in rows:
        op = r[src].split()[0] if src is not None and r[src].split() else "?"
        if op.startswith("@") and len(r[src].split()) > 1:
            op = r[src].split()[1]
        ops[op.split(".")[0]] += num(r[ex])
    print("opcode mix (% of inst):",
          [(o, round(100 * c / total_inst, 1)) for o, c in ops.most_common(18)])
    # Basic blocks: consecutive rows with the same (non-zero) execution count.
    blocks, cur = [], None
    for r in rows:
        e = num(r[ex])
        if cur is None or e != cur["exec"]:
            cur = {"addr": r[col["Address"]], "exec": e, "n": 0, "samp": 0.0, "ops": Counter()}
            blocks.append(cur)
        cur["n"] += 1
        cur["samp"] += num(r[samp])
        if src is not None and r[src].split():
            cur["ops"][r[src].split()[0]] += 1
    blocks = [b for b in blocks if b["exec"] > 0]
    blocks.sort(key=lambda b: -(b["exec"] * b["n"]))
    for b in blocks[:top]:
        print(f"{b['addr']} exec {b['exec']:9.0f} x {b['n']:4d} instr = "
              f"{100 * b['exec'] * b['n'] / total_inst:5.1f}% inst, "
              f"{100 * b['samp'] / total_samp:5.1f}% samples {b['ops'].most_common(5)}")
    if raw:
        raw_metrics(raw)


if __name__ == "__main__":
    main()

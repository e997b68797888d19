#!/usr/bin/env python3
"""Summarises an ncu report's stall sampling: the kernel-wide stall reasons (raw page,
smsp__pcsamp_warps_issue_stalled_*) and the SASS lines with the most samples (source page).
Usage: ncu_src.py RAW_CSV SOURCE_CSV [top]"""
import csv, sys

raw, src = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 40


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"') or "," in l]
    return list(csv.reader(lines))


r = rows(raw)
if len(r) >= 2:
    head, units = r[0], r[1]
    for data in r[2:]:
        name = data[head.index("Kernel Name")] if "Kernel Name" in head else "?"
        stalls = []
        for i, h in enumerate(head):
            if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("_not_issued"):
                try:
                    val = float(data[i].replace(",", ""))
                except ValueError:
                    continue
                if val > 0:
                    stalls.append((val, h.replace("smsp__pcsamp_warps_issue_stalled_", "")))
        tot = sum(v for v, _ in stalls) or 1
        print(f"ncu_src {name}: stall samples {tot:.0f}: " +
              ", ".join(f"{n} {100 * v / tot:.0f}%" for v, n in sorted(stalls, reverse=True)[:12]))
s = rows(src)
if s:
    head = s[0]
    def col(*names):
        for n in names:
            for i, h in enumerate(head):
                if h.strip() == n:
                    return i
        return None
    ci = col("Warp Stall Sampling (All Samples)", "Warp Stall Sampling (All Cycles)")
    cs = col("Source")
    ca = col("Address", "# Address")
    ce = col("Instructions Executed")
    if ci is None or cs is None:
        print("ncu_src: source columns:", head[:20])
    else:
        body = []
        for d in s[1:]:
            try:
                body.append((float(d[ci].replace(",", "") or 0), d))
            except (ValueError, IndexError):
                pass
        total = sum(v for v, _ in body) or 1
        print(f"ncu_src SASS lines {len(body)}, stall samples {total:.0f}; top {top} (samples %, executed, address, SASS):")
        for v, d in sorted(body, key=lambda t: -t[0])[:top]:
            ex = d[ce] if ce is not None else ""
            ad = d[ca] if ca is not None else ""
            print(f"  sass {100 * v / total:5.1f}%  {ex:>8}  {ad:>6}  {d[cs][:90]}")
        # The whole listing in order, with samples, for reading the kernel's phases.
        print("ncu_src listing (address, samples, SASS):")
        for v, d in body:
            ad = d[ca] if ca is not None else ""
            print(f"  L {ad:>6} {v:6.0f}  {d[cs][:100]}")

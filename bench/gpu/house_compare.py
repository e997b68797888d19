"""The op benches of two commits, before (A) and after (B), run interleaved on one GPU by
bench/gpu/house_ab_run.sh (A1, B1, A2, B2 per bench): per case the ratio B/A of the mean of
each side's two medians, and the run-to-run noise of that case, the larger of |A2/A1 - 1| and
|B2/B1 - 1|. A case is "within noise" when |B/A - 1| <= max(noise, FLOOR); per bench the
geometric means of B/A and of A2/A1, and the cases outside noise listed.

Usage: python3 house_compare.py OUT_DIR   (OUT_DIR holds <bench>.<A|B><round>.log)"""
import json
import math
import os
import sys

FLOOR = 0.03  # a smaller difference is not claimed either way, whatever the noise measured
BENCHES = ["rnn", "selective_scan", "flash_attention", "dense", "dense_sm90"]


def key(bench, row):
    """What names a case in each bench's rows (the same in A and B)."""
    if bench == "rnn":
        return (row["cell"], row["case"], row["path"])
    if bench == "flash_attention":
        # Each kernel timed on a shape, whether the router picks it ("name") or not ("name
        # (alt)"): routes that changed since A still compare like for like.
        return (row["name"].removesuffix(" (alt)"), row["kernel"])
    if bench == "dense":
        return (row["case"], row["type"])
    return (row["case"],)


def rows(out, bench, run):
    """{case: median_us} of one run's log (every line that is a JSON object)."""
    path = os.path.join(out, f"{bench}.{run}.log")
    got = {}
    if not os.path.exists(path):
        return got
    for line in open(path, errors="replace"):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "median_us" in row:
            got[key(bench, row)] = float(row["median_us"])
    return got


def gmean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(out):
    gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
    print(f"GPU: {gpu}")
    print(f"B/A: mean of B1, B2 over mean of A1, A2 (median µs each); noise: max(|A2/A1-1|, |B2/B1-1|); floor {FLOOR:.0%}")
    verdict = []
    for bench in BENCHES:
        runs = {r: rows(out, bench, r) for r in ["A1", "B1", "A2", "B2"]}
        common = sorted(set.intersection(*(set(v) for v in runs.values())))
        print(f"\n== {bench}: {len(common)} cases in all four runs "
              f"(A1 {len(runs['A1'])}, B1 {len(runs['B1'])}, A2 {len(runs['A2'])}, B2 {len(runs['B2'])})")
        if not common:
            verdict.append(f"{bench}: no case in all four runs")
            continue
        ratios, aa, outside = [], [], []
        for case in common:
            a1, b1, a2, b2 = (runs[r][case] for r in ["A1", "B1", "A2", "B2"])
            ratio = (b1 + b2) / (a1 + a2)
            noise = max(abs(a2 / a1 - 1), abs(b2 / b1 - 1))
            ratios.append(ratio)
            aa.append(a2 / a1)
            within = abs(ratio - 1) <= max(noise, FLOOR)
            mark = "" if within else "  <-- outside noise"
            print(f"  {' | '.join(case):60s} A {a1:9.1f} {a2:9.1f}  B {b1:9.1f} {b2:9.1f}  "
                  f"B/A {ratio:5.3f}  noise {noise:5.3f}{mark}")
            if not within:
                outside.append(f"{' | '.join(case)} B/A {ratio:.3f} (noise {noise:.3f})")
        line = (f"{bench}: {len(common)} cases, B/A geomean {gmean(ratios):.3f} "
                f"(range {min(ratios):.3f}-{max(ratios):.3f}), A2/A1 geomean {gmean(aa):.3f}, "
                f"{len(common) - len(outside)} within noise, {len(outside)} outside")
        print("  " + line)
        for o in outside:
            print("    outside: " + o)
        verdict.append(line)
    print("\n== summary")
    for v in verdict:
        print(v)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

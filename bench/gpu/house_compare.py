"""The Rust op benches of one run against the numbers bench/RESULTS.md holds for the same
cases: before (the RESULTS table, with the machine it names) and now (this run's JSON, with the
GPU of gpu.txt), per case and as a geometric mean per op. A ratio is a like-for-like check only
when both machines are the same kind; the header of each op says which they were.

Usage: python3 bench/gpu/house_compare.py OUT_DIR [RESULTS_MD]
OUT_DIR holds what bench/gpu/house_check.sh writes: gpu.txt, dense_kernels.json,
dense_sm90.jsonl, fa_kernels.json, rnn_ours.jsonl, scan_ours.jsonl."""
import json
import math
import os
import re
import sys

NOISE = 0.10  # |now/before - 1| within this counts as "within noise" in the summary


def norm(case):
    return re.sub(r"\s+", " ", case.replace("×", "x").replace("³", "^3").replace("**", "")).strip()


def number(cell):
    """The first number of a table cell (µs); a 'shipped ... a–b' range gives its mean."""
    shipped = re.search(r"shipped[^:]*:\s*([\d.,]+)\s*[–-]\s*([\d.,]+)", cell)
    if shipped:
        a, b = (float(x.replace(",", "")) for x in shipped.groups())
        return (a + b) / 2
    m = re.search(r"[\d,]*\d(?:\.\d+)?", cell.replace("**", ""))
    return float(m.group(0).replace(",", "")) if m else None


def sections(md):
    """{heading: (machine line, [table rows as lists of cells])} of RESULTS.md."""
    out, head, machine, rows = {}, None, "", []
    for line in open(md, encoding="utf-8"):
        line = line.rstrip("\n")
        if line.startswith("## "):
            if head:
                out[head] = (machine, rows)
            head, machine, rows = line[3:], "", []
        elif head and not machine and line.startswith("NVIDIA"):
            machine = line.split(" (")[0].split(",")[0]
        elif head and line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    if head:
        out[head] = (machine, rows)
    return out


def section(secs, prefix):
    for k, v in secs.items():
        if k.startswith(prefix):
            return v
    return ("", [])


def lines(path):
    if not os.path.exists(path):
        return []
    text = open(path).read().strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(l) for l in text.splitlines() if l.strip().startswith("{")]


def before_dense(secs):
    machine, rows = section(secs, "dense / swiglu")
    return machine, {(norm(r[0]), r[1]): number(r[3]) for r in rows[1:] if len(r) > 3}


def now_dense(out):
    p = os.path.join(out, "dense_kernels.json")
    if not os.path.exists(p):
        return {}
    return {(norm(k["case"]), k["type"]): k["median_us"] for k in json.load(open(p))["kernels"]}


def before_sm90(secs):
    machine, rows = section(secs, "dense on Hopper")
    return machine, {norm(r[0]): number(r[1]) for r in rows[1:] if len(r) > 1}


def now_sm90(out):
    names = {"dense none": "dense (bare GEMM)"}
    return {norm(names.get(r["case"], r["case"])): r["median_us"] for r in lines(os.path.join(out, "dense_sm90.jsonl"))}


def before_flash(secs):
    machine, rows = section(secs, "flash_attention")
    got, last = {}, None
    for r in rows[1:]:
        m = re.search(r"B(\d+) H(\d+) S(\d+) D(\d+)", r[0])
        causal = "causal" in r[0]
        if m:
            dtype = r[0].split()[-1]
            last = tuple(int(x) for x in m.groups()) + (dtype,)
        if last is None:
            continue
        got[last + (causal,)] = number(r[2])
    return machine, got


def now_flash(out):
    got = {}
    for r in lines(os.path.join(out, "fa_kernels.json")):
        if r["name"].endswith("(alt)"):
            continue
        got[(r["b"], r["h"], r["s"], r["d"], r["dtype"], r["causal"])] = r["median_us"]
    return got


def before_rnn(secs):
    machine, rows = section(secs, "LSTM / GRU")
    return machine, {(r[0].lower(), norm(r[1])): number(r[3]) for r in rows[1:] if len(r) > 3}


def now_rnn(out):
    return {
        (r["cell"], norm(r["case"])): r["median_us"]
        for r in lines(os.path.join(out, "rnn_ours.jsonl"))
        if r.get("default") and "median_us" in r
    }


def before_scan(secs):
    machine, rows = section(secs, "Selective scan")
    return machine, {norm(r[0]): number(r[1]) for r in rows[1:] if len(r) > 1}


def now_scan(out):
    return {norm(r["case"]): r["median_us"] for r in lines(os.path.join(out, "scan_ours.jsonl"))}


def model(name):
    m = re.search(r"NVIDIA (\S+)", name or "")
    return m.group(1) if m else None


def label(key):
    if isinstance(key, tuple):
        if len(key) == 6:
            b, h, s, d, dt, causal = key
            return f"B{b} H{h} S{s} D{d} {dt}" + (" causal" if causal else "")
        return " ".join(str(k) for k in key)
    return key


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    md = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "RESULTS.md")
    secs = sections(md)
    gpu = open(os.path.join(out, "gpu.txt")).read().strip().split(",")[0] if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
    ops = [
        ("dense", before_dense, now_dense),
        ("dense_sm90", before_sm90, now_sm90),
        ("flash_attention", before_flash, now_flash),
        ("rnn (default path)", before_rnn, now_rnn),
        ("selective_scan", before_scan, now_scan),
    ]
    all_ratios = []
    for name, before_of, now_of in ops:
        machine, before = before_of(secs)
        now = now_of(out)
        same = model(machine) is not None and model(machine) == model(gpu)
        print(f"\n== {name}: before = RESULTS.md ({machine or 'no machine named'}), now = {gpu}"
              + ("" if same else "  [different GPUs: ratios are not a noise check]"))
        ratios = []
        print(f"  {'case':52} {'before µs':>10} {'now µs':>10} {'now/before':>10}")
        for key, b in before.items():
            n = now.get(key)
            if b is None or n is None:
                print(f"  {label(key)[:52]:52} {b if b is not None else '-':>10} {'not run':>10}")
                continue
            ratios.append(n / b)
            flag = "" if abs(n / b - 1) <= NOISE else "  <-- outside ±10%"
            print(f"  {label(key)[:52]:52} {b:10.1f} {n:10.1f} {n / b:10.3f}{flag}")
        if ratios:
            geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            inside = sum(abs(r - 1) <= NOISE for r in ratios)
            print(f"  {len(ratios)} cases, geometric mean now/before {geo:.3f}, {inside} within ±{NOISE:.0%}")
            if same:
                all_ratios += ratios
        else:
            print("  no case of this op was rerun")
    if all_ratios:
        geo = math.exp(sum(math.log(r) for r in all_ratios) / len(all_ratios))
        print(f"\nSame-GPU cases: {len(all_ratios)}, geometric mean now/before {geo:.3f}")


if __name__ == "__main__":
    main()

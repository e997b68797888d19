#!/usr/bin/env python3
"""Interleaved A/B of our CPU rows between builds or settings, on a noisy machine.

    /work/venv-cpu/bin/python bench/cpu/ab.py --threads 2 --rows attention,dense \\
        --variant old=FUSED_KERNELS_NIF_PATH=/tmp/old.so --variant new= [--rounds 30]

Each `--variant NAME=ENV` starts one `mix run bench/cpu/side.exs` server (ENV: comma-separated
KEY=VALUE pairs added to the environment, e.g. the NIF library to load) on the inputs
bench/cpu/side.py writes; rounds then time every row on every variant in turn (the order
rotating each round), so drift and other jobs on the machine touch all variants alike. Prints
per variant the median ms per call over all rounds, and per variant after the first the median
over rounds of its per-round median divided by the first variant's (with the 25th and 75th
percentiles of that ratio). Every batch starts after side.py's --settle pause. Needs numpy
only: no ONNX Runtime or PyTorch in the process, so no foreign thread pool spins beside ours,
unless --foreign times them too, in the same rotating order as ours (as side.py does).
--backbones adds our backbone rows (ours only).
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2,
                    help="FUSED_KERNELS_CPU_THREADS unless a variant sets it")
    ap.add_argument("--rows", default="attention")
    ap.add_argument("--backbones", default="")
    ap.add_argument("--calls", type=int, default=0, help="calls per row per round (0: side.py's)")
    ap.add_argument("--settle", type=float, default=100.0,
                    help="ms slept before every batch, as in side.py (0: none)")
    ap.add_argument("--variant", action="append", required=True, help="NAME=K1=V1,K2=V2")
    ap.add_argument("--foreign", action="store_true",
                    help="also time ONNX Runtime and PyTorch in each row, in the rotating order, as "
                         "side.py does (their thread pools then run beside ours)")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    variants = []
    for v in args.variant:
        name, _, env = v.partition("=")
        extra = dict(kv.split("=", 1) for kv in env.split(",") if kv)
        variants.append((name, extra))
    rows = [r for r in args.rows.split(",") if r]
    kinds = [k for k in args.backbones.split(",") if k]
    inputs = side.make_inputs(np.random.default_rng(20261123))
    with tempfile.TemporaryDirectory(prefix="fk_ab_") as dir_:
        for row, t in inputs.items():
            side.write(dir_, row, t)
        servers = {}
        for name, extra in variants:
            saved = dict(os.environ)
            os.environ.update(extra)
            try:
                threads = int(extra.get("FUSED_KERNELS_CPU_THREADS", args.threads))
                servers[name] = side.Ours(dir_, threads, root)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            print(f"{name}: {servers[name].ready} {extra}", flush=True)
            if kinds:
                servers[name].ask(f"backbones {','.join(kinds)}")
        rows += [f"backbone_{k}_{m}" for k in kinds for m in ["window", "frame"]]
        calls = {r: args.calls or side.CALLS.get(r) or
                 side.BACKBONE_CALLS[r.rsplit("_", 1)[1]][r.split("_")[1]] for r in rows}
        per_round = {}
        names = [n for n, _ in variants]
        foreign = {}
        if args.foreign:
            ort, tch = side.Ort(inputs, args.threads), side.Torch(inputs, args.threads)
            # The op rows only: side.py builds the foreign backbones from side.exs's export.
            for row in (r for r in rows if not r.startswith("backbone_")):
                foreign[row] = ([("onnxruntime", ort.runner(row))] if ort.has(row) else []) + [
                    ("pytorch", tch.runner(row))]
        for r in range(args.rounds):
            for row in rows:
                # Ours and the foreign libraries in one order that rotates each round, as in
                # side.py: each runs right after each other one in turn (a foreign pool still
                # spinning from its batch, our workers parking after ours).
                order = [(n, None) for n in names] + foreign.get(row, [])
                order = order[r % len(order):] + order[:r % len(order)]
                for name, run in order:
                    side.settle(args.settle)
                    if run is None:
                        ms = servers[name].time(row, calls[row])
                    else:
                        ms = side.time_py(run, calls[row])
                    per_round.setdefault((row, name), []).append(float(np.median(ms[1:])))
        for s in servers.values():
            s.close()
    print(f"\nthreads {args.threads}, {args.rounds} rounds; median ms per call "
          f"(ratio to {names[0]}: median over rounds [p25, p75])")
    for row in rows:
        base = np.array(per_round[(row, names[0])])
        cells = []
        for name in names + [n for n, _ in foreign.get(row, [])]:
            m = np.array(per_round[(row, name)])
            cell = f"{name} {np.median(m):.4f}"
            if name != names[0]:
                q = np.percentile(m / base, [50, 25, 75])
                cell += f" ({q[0]:.3f} [{q[1]:.3f}, {q[2]:.3f}])"
            cells.append(cell)
        print(f"{row:<24} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torch.nn.LSTM / nn.GRU (cuDNN) side by side with our fused RNN, same shapes, dtypes,
device and run. Ours comes from the Rust bench (`bench_rnn --json FILE`, benches/rnn.rs),
one JSON line per case and CUDA path (batch-1 cluster / persistent kernel / batched tensor-core steps /
batched cuBLAS steps / resident tensor-core kernel; `default` marks the path `Path::choose` picks): CUDA events around
the whole call (input projection GEMMs + recurrences), inputs and weights already on the
GPU. cuDNN is timed the same way (CUDA events, `timing.event_ms`), median of 100 (30 for
long sequences) after warm-up. Weights are random with the same shapes (timing does not
depend on their values).

Usage: python3 bench/gpu/side_rnn.py OURS_JSONL"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402

DT = {"f32": torch.float32, "bf16": torch.bfloat16}


def parse(case):
    # "B1 T60 I288 H256 x2 f32"
    f = case.split()
    return int(f[0][1:]), int(f[1][1:]), int(f[2][1:]), int(f[3][1:]), int(f[4][1:]), f[5]


ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
torch.backends.cudnn.benchmark = True
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
rows = []
nan = float("nan")
for cell in ["lstm", "gru"]:
    for case in dict.fromkeys(r["case"] for r in ours if r.get("cell") == cell):
        b, t, i, h, layers, dt = parse(case)
        mod = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(i, h, layers, batch_first=True)
        mod = mod.cuda().to(DT[dt]).eval()
        x = torch.randn(b, t, i, device="cuda", dtype=DT[dt])
        rep = 30 if t * h > 100_000 else 100
        with torch.no_grad():
            te = event_ms(lambda: mod(x), rep=rep) * 1e3
            # PyTorch lets cuDNN use TF32 for f32 by default; ours is true FP32 accuracy
            # (1e-5), so f32 rows are also timed with TF32 off.
            te32 = te
            if dt == "f32":
                torch.backends.cudnn.allow_tf32 = False
                te32 = event_ms(lambda: mod(x), rep=rep) * 1e3
                torch.backends.cudnn.allow_tf32 = True
        mine = {r["path"]: r for r in ours if r["cell"] == cell and r["case"] == case}
        default = next(r for r in mine.values() if r["default"])
        us = {p: mine.get(p, {}).get("median_us", nan) for p in ["cluster", "persistent", "batched", "batched_cublas", "resident", "resident_tf32"]}
        variants = {p: r.get("median_us", nan) for p, r in mine.items() if ":" in p}
        # ratio_resident_tf32: our opt-in TF32 against cuDNN's default (TF32 allowed).
        row = dict(cell=cell, case=case, variants_us=variants, cudnn_us=te, cudnn_fp32_us=te32, ours_us=default.get("median_us", nan),
                   ours_path=default["path"], **{p + "_us": v for p, v in us.items()},
                   ratio=te / default.get("median_us", nan), ratio_fp32=te32 / default.get("median_us", nan),
                   **{"ratio_" + p: te / v for p, v in us.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)

print(f"\n{'cell':5} {'case':28} {'cuDNN':>8} {'ours':>8} {'ratio':>6} {'path':>10} | {'clus':>8} {'pers':>8} {'mma':>8} {'cublas':>8} {'resid':>8} | {'clus':>5} {'pers':>5} {'mma':>5} {'cublas':>5} {'resid':>5} | {'FP32':>8} {'ratio':>5} | {'ourTF32':>8} {'ratio':>5}")
for r in rows:
    print(f"{r['cell']:5} {r['case']:28} {r['cudnn_us']:8.1f} {r['ours_us']:8.1f} {r['ratio']:5.2f}x {r['ours_path']:>10} | "
          f"{r['cluster_us']:8.1f} {r['persistent_us']:8.1f} {r['batched_us']:8.1f} {r['batched_cublas_us']:8.1f} {r['resident_us']:8.1f} | "
          f"{r['ratio_cluster']:5.2f} {r['ratio_persistent']:5.2f} {r['ratio_batched']:5.2f} {r['ratio_batched_cublas']:5.2f} {r['ratio_resident']:5.2f} | "
          f"{r['cudnn_fp32_us']:8.1f} {r['ratio_fp32']:5.2f} | {r['resident_tf32_us']:8.1f} {r['ratio_resident_tf32']:5.2f}")

print("\ntilings (batched:full = one block per SM, all of K in flight; batched:mtN = N m-tiles; resident:mMnN = M m-tiles x N 8-unit groups per block)")
for r in rows:
    if r["variants_us"]:
        v = "  ".join(f"{k} {u:8.1f} ({r['cudnn_us'] / u:4.2f}x)" for k, u in r["variants_us"].items())
        print(f"{r['cell']:5} {r['case']:28} batched {r['batched_us']:8.1f} resident {r['resident_us']:8.1f}  {v}")

"""torch.nn.LSTM / nn.GRU (cuDNN) side by side with our fused RNN, same shapes, dtypes,
device and run. Ours comes from the Rust bench (`core_tests rnn::tests::bench --ignored`),
one JSON line per case and CUDA path (cluster (batch 1, sm_90+) / persistent kernel /
batched cuBLAS steps, the default choice first): the whole call (input projection GEMMs +
recurrences), inputs and weights already on the GPU, CUDA events around each call
(`cuda::timing::time_calls`, median). cuDNN is timed with CUDA events too (`timing.event_ms`,
median of 200 after warm-up), plus wall-until-idle for reference. Weights are random with the
same shapes (timing does not depend on their values).

Usage: python3 bench/gpu/side_rnn.py OURS_JSONL"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms, wall_ms  # noqa: E402

DT = {"f32": torch.float32, "bf16": torch.bfloat16}
PATHS = ["cluster", "persistent", "batched"]


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
        rep = 30 if t * h > 100_000 else 200
        with torch.no_grad():
            ev = event_ms(lambda: mod(x), rep=rep)
            wall = wall_ms(lambda: mod(x), rep=rep)
            # PyTorch lets cuDNN use TF32 for f32 by default; ours is true FP32 (1e-5), so
            # f32 rows are also timed with TF32 off.
            ev32 = ev
            if dt == "f32":
                torch.backends.cudnn.allow_tf32 = False
                ev32 = event_ms(lambda: mod(x), rep=rep)
                torch.backends.cudnn.allow_tf32 = True
        mine = {r["path"]: r for r in ours if r["cell"] == cell and r["case"] == case}
        default = next(r for r in mine.values() if r["default"])
        ms = {p: mine.get(p, {}).get("median_ms", nan) for p in PATHS}
        row = dict(cell=cell, case=case, cudnn_event_ms=ev, cudnn_wall_ms=wall, cudnn_fp32_event_ms=ev32,
                   ours_path=default["path"], ours_ms=default.get("median_ms", nan),
                   **{f"{p}_ms": ms[p] for p in PATHS},
                   **{f"ratio_{p}": ev / ms[p] for p in PATHS},
                   ratio=ev / default.get("median_ms", nan),
                   ratio_fp32=ev32 / default.get("median_ms", nan))
        print(json.dumps(row))
        rows.append(row)

print("\nratio = cuDNN event median / ours event median (higher is better for us)")
print(f"{'cell':5} {'case':26} {'cuDNN ev':>9} {'ours':>9} {'ratio':>6} {'path':>10} "
      + " ".join(f"{p:>10} {'ratio':>6}" for p in PATHS) + f" {'cuDNN32':>9} {'ratio':>6}")
for r in rows:
    print(f"{r['cell']:5} {r['case']:26} {r['cudnn_event_ms']*1e3:6.1f} us {r['ours_ms']*1e3:6.1f} us {r['ratio']:5.2f}x "
          f"{r['ours_path']:>10} "
          + " ".join(f"{r[p + '_ms']*1e3:7.1f} us {r['ratio_' + p]:5.2f}x" for p in PATHS)
          + f" {r['cudnn_fp32_event_ms']*1e3:6.1f} us {r['ratio_fp32']:5.2f}x")

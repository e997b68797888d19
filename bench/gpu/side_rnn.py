"""torch.nn.LSTM / nn.GRU (cuDNN) side by side with our fused RNN, same shapes, dtypes,
device and run. Ours comes from the Rust bench (`core_tests rnn::tests::bench --ignored`),
one JSON line per case and CUDA path (persistent kernel / batched cuBLAS steps, the default
choice first): wall time until the device is idle around the whole call (input projection
GEMMs + recurrences), inputs and weights already on the GPU. cuDNN is timed the
same way (wall until idle) and with CUDA events; median of 200 after warm-up. Weights are
random with the same shapes (timing does not depend on their values).

Usage: python3 bench/gpu/side_rnn.py OURS_JSONL"""
import json
import sys
import time

import torch

DT = {"f32": torch.float32, "bf16": torch.bfloat16}


def parse(case):
    # "B1 T60 I288 H256 x2 f32"
    f = case.split()
    return int(f[0][1:]), int(f[1][1:]), int(f[2][1:]), int(f[3][1:]), int(f[4][1:]), f[5]


def timed(fn, rep):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    wall, ev = [], []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
        ev.append(s.elapsed_time(e))
    wall.sort()
    ev.sort()
    return wall[len(wall) // 2], ev[len(ev) // 2]


ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
torch.backends.cudnn.benchmark = True
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
rows = []
for cell in ["lstm", "gru"]:
    # Rows of the Rust kernel bench (rnn_run.sh); the harness passes bench.json, which has none.
    for case in dict.fromkeys(r["case"] for r in ours if r.get("cell") == cell):
        b, t, i, h, layers, dt = parse(case)
        mod = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(i, h, layers, batch_first=True)
        mod = mod.cuda().to(DT[dt]).eval()
        x = torch.randn(b, t, i, device="cuda", dtype=DT[dt])
        rep = 30 if t * h > 100_000 else 200
        with torch.no_grad():
            tw, te = timed(lambda: mod(x), rep)
            # PyTorch lets cuDNN use TF32 for f32 by default; ours is true FP32 (1e-5), so
            # f32 rows are also timed with TF32 off.
            tw32 = tw
            if dt == "f32":
                torch.backends.cudnn.allow_tf32 = False
                tw32, _ = timed(lambda: mod(x), rep)
                torch.backends.cudnn.allow_tf32 = True
        mine = {r["path"]: r for r in ours if r["cell"] == cell and r["case"] == case}
        default = next(r for r in mine.values() if r["default"])
        nan = float("nan")
        pers, bat = mine.get("persistent", {}).get("median_ms", nan), mine.get("batched", {}).get("median_ms", nan)
        row = dict(cell=cell, case=case, cudnn_wall_ms=tw, cudnn_event_ms=te, cudnn_fp32_wall_ms=tw32,
                   ours_ms=default["median_ms"], ours_path=default["path"],
                   persistent_ms=pers, batched_ms=bat,
                   ratio=tw / default["median_ms"], ratio_persistent=tw / pers, ratio_batched=tw / bat,
                   ratio_fp32=tw32 / default["median_ms"])
        print(json.dumps(row))
        rows.append(row)

print(f"\n{'cell':5} {'case':30} {'cuDNN wall':>11} {'cuDNN ev':>10} {'ours':>10} {'ratio':>7} {'path':>10} {'persistent':>11} {'ratio':>7} {'batched':>10} {'ratio':>7} {'cuDNN FP32':>11} {'ratio':>7}")
for r in rows:
    print(f"{r['cell']:5} {r['case']:30} {r['cudnn_wall_ms']*1e3:8.1f} us {r['cudnn_event_ms']*1e3:7.1f} us "
          f"{r['ours_ms']*1e3:7.1f} us {r['ratio']:6.2f}x {r['ours_path']:>10} {r['persistent_ms']*1e3:8.1f} us {r['ratio_persistent']:6.2f}x "
          f"{r['batched_ms']*1e3:7.1f} us {r['ratio_batched']:6.2f}x {r['cudnn_fp32_wall_ms']*1e3:8.1f} us {r['ratio_fp32']:6.2f}x")

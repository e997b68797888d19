"""PyTorch side by side with `mix bench`'s CUDA rows, same shapes and dtypes, same device,
same run. PyTorch eager does what a user writes without a fused op: scale, mask, softmax.
Timed like ours (wall clock around the call until the device is idle, median of many after
warm-up), and with CUDA events for the kernel-only view. Prints a table with our ratio.

Usage: python3 bench/gpu/side_scaled_softmax.py BENCH_JSON"""
import json
import sys
import time

import torch

DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def wall_ms(fn, warm=10, rep=200):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def event_ms(fn, warm=10, rep=200):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


CASES = {
    "scaled_softmax exphil scores": dict(scale=0.125, causal=True),
    "scaled_softmax B4 H16 512x512": dict(scale=0.125, causal=False),
}

rows = json.load(open(sys.argv[1]))["rows"]
ours = {(r["case"], r["backend"]): r for r in rows}
table = []
for case, opts in CASES.items():
    r = ours.get((case, "cuda_resident"))
    if r is None:
        continue
    shape, dtype = r["shape"], DT[r["type"]]
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    sq, sk = shape[-2], shape[-1]
    mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq) if opts["causal"] else None

    def eager():
        s = x * opts["scale"]
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1)

    t_wall, t_event = wall_ms(eager), event_ms(eager)
    line = dict(case=case, shape=shape, type=r["type"], ours_resident_ms=r["median_ms"],
                ours_host_ms=ours.get((case, "cuda"), {}).get("median_ms"),
                torch_wall_ms=t_wall, torch_event_ms=t_event, speedup_vs_torch_wall=t_wall / r["median_ms"])
    print(json.dumps(line))
    table.append(line)

print(f"\n{'case':32} {'shape':16} {'type':5} {'ours (GPU-resident)':>20} {'torch eager':>12} {'ratio':>7}")
for t in table:
    print(f"{t['case']:32} {'x'.join(map(str, t['shape'])):16} {t['type']:5} "
          f"{t['ours_resident_ms']*1e3:17.1f} us {t['torch_wall_ms']*1e3:9.1f} us {t['speedup_vs_torch_wall']:6.2f}x")

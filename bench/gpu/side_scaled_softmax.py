"""PyTorch side by side with `mix bench`'s CUDA rows, same shapes and dtypes, same device,
same run. PyTorch eager does what a user writes without a fused op: scale, mask, softmax.
Timed like ours (wall clock around the call until the device is idle, median of many after
warm-up), and with CUDA events for the kernel-only view. Prints a table with our ratio.

Usage: python3 bench/gpu/side_scaled_softmax.py BENCH_JSON"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms, wall_ms  # noqa: E402

DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


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

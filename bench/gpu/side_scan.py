"""The PyTorch anchor for the selective-scan rows of the Rust bench (`bench_selective_scan
--json FILE`, benches/selective_scan.rs), same shapes, same device, same run: the sequential
loop a user writes without a fused kernel (the anchor in ../shared/exphil.md), timed with CUDA
events, median after warm-up. Prints each of our rows with the ratio.

Usage: python3 bench/gpu/side_scan.py OURS_JSONL"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402
from scan_ref import scan_loop  # noqa: E402


anchor = {}
for key, (b, l, d, n) in {"B32 D512 L60 N16": (32, 60, 512, 16), "B8 D2048 L4096 N16": (8, 4096, 2048, 16)}.items():
    u = torch.randn(b, l, d, device="cuda")
    delta = torch.rand(b, l, d, device="cuda") * 0.1
    A = -torch.rand(d, n, device="cuda") - 0.1
    B, C = torch.randn(b, l, n, device="cuda"), torch.randn(b, l, n, device="cuda")
    anchor[key] = event_ms(lambda: scan_loop(u, delta, A, B, C), warm=1, rep=20 if l <= 60 else 3) * 1e3
print(json.dumps({"torch_loop_us": anchor, "device": torch.cuda.get_device_name()}))
print(f"{'case':52} {'variant':22} {'ours':>10} {'b2b':>9} {'floor':>8} {'x floor':>8} {'torch loop':>11} {'ratio':>7}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = next((k for k in anchor if r["case"].startswith(k)), None)
    t = anchor.get(key) if key and "f32" in r["case"] and "+" not in r["case"] else None
    ratio = f"{t / r['median_us']:6.0f}x" if t else "      -"
    tt = f"{t:9.0f}us" if t else "          -"
    print(f"{r['case']:52} {r['variant']:22} {r['median_us']:8.1f}us {r['back_to_back_us']:7.1f}us "
          f"{r['floor_us']:6.1f}us {r['over_floor']:7.2f}x {tt} {ratio}")

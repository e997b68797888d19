"""PyTorch side by side with `mix bench`'s selective-scan and Mamba-block rows, same shapes,
same device, same run. PyTorch's scan is the sequential loop a user writes without a fused
kernel (the anchor in ../shared/exphil.md); the block is Edifice's Mamba block in eager
PyTorch (2 layers, ExPhil's configuration). Also measures the device copy bandwidth and
reports our achieved bandwidth against the minimal bytes of each scan.

Usage: python3 bench/gpu/side_mamba.py BENCH_JSON"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms, wall_ms  # noqa: E402
from scan_ref import scan_loop  # noqa: E402
import torch.nn.functional as F


def copy_gbps():
    x = torch.empty(256 * 1024 * 1024 // 4, device="cuda")
    y = torch.empty_like(x)
    ms = wall_ms(lambda: y.copy_(x), warm=5, rep=20)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def block(x, p):
    h = F.layer_norm(x, (x.shape[-1],), p["g"], p["b"], 1e-5)
    xz = h @ p["win"] + p["bin"]
    inner = xz.shape[-1] // 2
    xs, z = xz[..., :inner], xz[..., inner:]
    xc = F.conv1d(F.pad(xs.transpose(1, 2), (3, 0)), p["conv"], p["bconv"], groups=inner).transpose(1, 2)
    xc = F.silu(xc)
    bc = xc @ p["wbc"] + p["bbc"]
    n = bc.shape[-1] // 2
    dt = F.softplus((xc @ p["wdtr"] + p["bdtr"]) @ p["wdtp"] + p["bdtp"]).clamp(0.001, 0.1)
    y = scan_loop(xc, dt, p["A"], bc[..., :n], bc[..., n:])
    return (y * F.silu(z)) @ p["wout"] + p["bout"] + x


rows = json.load(open(sys.argv[1]))["rows"]
ours = {(r["case"], r["backend"]): r for r in rows}
bw = copy_gbps()
print(json.dumps({"device_copy_GBps": bw, "device": torch.cuda.get_device_name()}))
table = []
for case, (b, l, d, n) in {
    "selective_scan B32 D512 L60 N16": (32, 60, 512, 16),
    "selective_scan B8 D2048 L4096 N16": (8, 4096, 2048, 16),
}.items():
    r = ours.get((case, "cuda_resident"))
    u = torch.randn(b, l, d, device="cuda")
    delta = torch.rand(b, l, d, device="cuda") * 0.1
    A = -torch.rand(d, n, device="cuda") - 0.1
    B, C = torch.randn(b, l, n, device="cuda"), torch.randn(b, l, n, device="cuda")
    rep = 50 if l <= 60 else 3
    t_torch = wall_ms(lambda: scan_loop(u, delta, A, B, C), warm=1, rep=rep)
    # Minimal bytes: u, delta read, out written (f32), B and C read; A once.
    nbytes = 4 * (3 * b * l * d + 2 * b * l * n + d * n)
    floor_ms = nbytes / (bw * 1e9) * 1e3
    line = dict(case=case, torch_loop_ms=t_torch, bytes=nbytes, byte_floor_ms=floor_ms)
    if r:
        line.update(ours_resident_ms=r["median_ms"], speedup=t_torch / r["median_ms"],
                    ours_GBps=nbytes / (r["median_ms"] * 1e-3) / 1e9, over_floor=r["median_ms"] / floor_ms)
    print(json.dumps(line))
    table.append(line)

h, inner, n, rk = 256, 512, 16, 16
layers = []
for _ in range(2):
    rnd = lambda *s, sc=0.1: (torch.rand(*s, device="cuda") * 2 - 1) * sc
    layers.append(dict(g=rnd(h, sc=1.0), b=rnd(h), win=rnd(h, 2 * inner), bin=rnd(2 * inner),
                       conv=rnd(inner, 1, 4, sc=0.5), bconv=rnd(inner), wbc=rnd(inner, 2 * n), bbc=rnd(2 * n),
                       wdtr=rnd(inner, rk), bdtr=rnd(rk), wdtp=rnd(rk, inner, sc=0.3), bdtp=rnd(inner, sc=1.0),
                       A=-(torch.arange(n, device="cuda").float() + 1).expand(inner, n).contiguous(),
                       wout=rnd(inner, h)))
    layers[-1]["bout"] = rnd(h)
x = torch.randn(1, 60, h, device="cuda")


def two_blocks():
    y = x
    for p in layers:
        y = block(y, p)
    return y


case = "mamba_block exphil B1 L60 H256 (x2 layers)"
t_block = wall_ms(two_blocks, rep=50)
r = ours.get((case, "cuda_resident"))
line = dict(case=case, torch_eager_ms=t_block)
if r:
    line.update(ours_resident_ms=r["median_ms"], ours_host_ms=ours.get((case, "cuda"), {}).get("median_ms"),
                speedup=t_block / r["median_ms"])
print(json.dumps(line))
table.append(line)

print(f"\n{'case':46} {'ours (resident)':>16} {'torch':>12} {'ratio':>8}")
for t in table:
    o = t.get("ours_resident_ms")
    tt = t.get("torch_loop_ms", t.get("torch_eager_ms"))
    print(f"{t['case']:46} {o*1e3 if o else float('nan'):13.1f} us {tt*1e3:9.1f} us {t.get('speedup', float('nan')):7.1f}x"
          + (f"  {t['ours_GBps']:.0f} GB/s, {t['over_floor']:.2f}x floor" if 'ours_GBps' in t else ""))

"""PyTorch side by side with `bench_dense_sm90 --json FILE` (the Hopper wgmma dense kernel):
the same 4096³ bf16 cases, timed with CUDA events (median after warm-up, bench/gpu/timing.py
event_ms), inputs already on the GPU. Per case: PyTorch eager's unfused sequence (cuBLAS
matmul, then separate bias / activation / residual / norm ops, what a user writes without our
op) and the bare cuBLAS matmul x @ W of the same shape (twice for SwiGLU).

Usage: python3 bench/gpu/dense_sm90_torch.py OURS_JSONL [OUT_JSON]"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402

ACTS = {
    "none": lambda y: y,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def unfused(case, m, k, n):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    x, w, b = r(m, k), r(k, n) / k**0.5, r(n)
    if case.startswith("dense"):
        act = case.split("+")[1] if "+" in case else "none"
        res = r(m, n) if case.endswith("+residual") else None
        bias = b if "bias" in case else None

        def fn():
            y = x @ w
            if bias is not None:
                y = y + bias
            y = ACTS[act](y)
            return y + res if res is not None else y

        return fn, lambda: x @ w, 1
    if case.startswith("swiglu"):
        wu, bu = r(k, n) / k**0.5, r(n)

        def fn():
            g = x @ w
            g = g + b
            u = x @ wu
            u = u + bu
            return F.silu(g) * u

        return fn, lambda: (x @ w, x @ wu), 2
    g = r(k) * 0.5 + 1
    beta = r(k) * 0.5

    def fn():
        if case.startswith("layer_norm"):
            xn = F.layer_norm(x, (k,), g, beta, 1e-5)
        else:
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
        y = xn @ w
        return y + b

    return fn, lambda: x @ w, 1


ours = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = []
for o in ours:
    m, k, n = o["mkn"]
    fn, mm, products = unfused(o["case"], m, k, n)
    t_unfused = event_ms(fn, warm=10, rep=50) * 1e3
    t_mm = event_ms(mm, warm=10, rep=50) * 1e3
    flops = 2 * m * k * n * products
    row = dict(o, torch_unfused_us=t_unfused, cublas_matmul_us=t_mm,
               cublas_tflops=flops / (t_mm * 1e-6) / 1e12,
               vs_unfused=t_unfused / o["median_us"], vs_cublas=t_mm / o["median_us"],
               device=torch.cuda.get_device_name())
    rows.append(row)
    print(json.dumps(row), flush=True)

if len(sys.argv) > 2:
    json.dump(rows, open(sys.argv[2], "w"), indent=1)
print(f"\n{'case (4096^3 bf16)':28} {'ours us':>8} {'TFLOP/s':>8} {'torch unfused':>14} {'cuBLAS mm':>10} "
      f"{'cuBLAS TF/s':>11} {'vs unfused':>10} {'vs cuBLAS':>9}")
for t in rows:
    print(f"{t['case']:28} {t['median_us']:8.1f} {t['tflops']:8.1f} {t['torch_unfused_us']:11.1f} us "
          f"{t['cublas_matmul_us']:7.1f} us {t['cublas_tflops']:11.1f} {t['vs_unfused']:9.2f}x {t['vs_cublas']:8.2f}x")

"""PyTorch side by side with `mix bench`'s dense rows (cuda_resident: operands already on the
GPU, output left there), same shapes and dtypes, same device, same run. PyTorch eager runs the
unfused sequence a user writes without our op: matmul, then separate bias add, norm,
activation and residual add (f32 matmuls without TF32). Timed like ours (wall clock around
the call until the device is idle, median of many after warm-up) and with CUDA events.

Bytes moved: each op's tensors read once and written once (the floor of that op); fused =
operands read once + output written once; "saved" = 1 - fused / unfused.

Usage: python3 bench/gpu/side_dense.py BENCH_JSON   (mix bench rows: wall clock, as above)
       python3 bench/gpu/side_dense.py KERNELS_JSON [OUT_JSON]
  KERNELS_JSON comes from `bench_dense --json FILE` (benches/dense.rs):
  our kernels timed with CUDA events (cuda::timing::time_calls), operands on the GPU. PyTorch's
  unfused sequence is timed with events too (timing.event_ms): kernel against kernel, no
  Elixir call overhead on either side. Speedup = torch events median / ours events median."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms, wall_ms  # noqa: E402
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
ACTS = {"none": lambda y: y, "gelu": F.gelu}


# name -> (kind, activation, residual?) ; shapes and dtype come from bench.json
CASES = {
    "dense 1x288x768 bias+gelu": ("dense", "gelu", False),
    "dense 60x256x1024 bias+gelu": ("dense", "gelu", False),
    "dense 60x256x1024 bias+gelu bf16": ("dense", "gelu", False),
    "dense 3840x256x256 bias+residual": ("dense", "none", True),
    "dense 3840x256x256 bias+residual bf16": ("dense", "none", True),
    "swiglu 60x256x1024": ("swiglu", "none", False),
    "layer_norm_dense 60x256x1024": ("layer_norm_dense", "none", False),
    "rms_norm_dense 3840x256x256": ("rms_norm_dense", "none", False),
    "dense 4096^3 bias+gelu+residual bf16": ("dense", "gelu", True),
    "dense 4096^3 bias+gelu f32": ("dense", "gelu", False),
    "swiglu 4096^3 bf16": ("swiglu", "none", False),
    "rms_norm_dense 4096^3 bf16": ("rms_norm_dense", "none", False),
    "layer_norm_dense 4096^3 bf16": ("layer_norm_dense", "none", False),
}


def build(kind, act, residual, m, k, n, dt):
    """The unfused PyTorch sequence and the bytes it and our fused kernel move."""
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt)
    x, w, b = r(m, k), r(k, n) / k**0.5, r(n)
    es = torch.finfo(dt).bits // 8
    MK, KN, MN = m * k, k * n, m * n
    res = r(m, n) if residual else None
    if kind == "dense":
        def fn():
            y = x @ w
            y = y + b
            y = ACTS[act](y)
            return y + res if res is not None else y
        unfused = (MK + KN + MN) + (2 * MN + n) + (2 * MN if act != "none" else 0) + (3 * MN if residual else 0)
        fused = MK + KN + n + MN + (MN if residual else 0)
    elif kind == "swiglu":
        wu, bu = r(k, n) / k**0.5, r(n)
        def fn():
            g = x @ w
            g = g + b
            u = x @ wu
            u = u + bu
            return F.silu(g) * u
        unfused = 2 * (MK + KN + MN) + 2 * (2 * MN + n) + 2 * MN + 3 * MN
        fused = MK + 2 * KN + 2 * n + MN
    else:
        g = r(k) * 0.5 + 1
        beta = r(k) * 0.5
        def fn():
            if kind == "layer_norm_dense":
                xn = F.layer_norm(x, (k,), g, beta, 1e-5)
            else:
                xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
            y = xn @ w
            return y + b
        # layer_norm: one fused op; RMSNorm written out: pow, mean, add+rsqrt, 2 muls.
        norm = 2 * MK + 2 * k if kind == "layer_norm_dense" else (2 * MK) + (MK + m) + 2 * m + (2 * MK + m) + (2 * MK + k)
        unfused = norm + (MK + KN + MN) + (2 * MN + n)
        fused = MK + KN + n + MN + (2 * k if kind == "layer_norm_dense" else k)
    return fn, unfused * es, fused * es


KINDS = {"Dense": "dense", "Swiglu": "swiglu", "RmsNormDense": "rms_norm_dense",
         "LayerNormDense": "layer_norm_dense"}


def kernel_table(doc, out_path):
    """Kernel-vs-kernel: our event timings from the Rust bench against torch's, same run."""
    table, torch_ms = [], {}
    for r in doc["kernels"]:
        (m, k, n), dt = r["mkn"], DT[r["type"]]
        kind, act = KINDS[r["kind"]], r["activation"].lower()
        fn, b_unfused, b_fused = build(kind, act, r["residual"], m, k, n, dt)
        key = (r["case"], r["type"])  # variants of one case share torch's timing
        if key not in torch_ms:
            big = m * k * n > 1 << 30
            torch_ms[key] = event_ms(fn, warm=5 if big else 20, rep=30 if big else 200)
        t_event = torch_ms[key]
        ours_ms = r["median_us"] * 1e-3
        if r["stats_prepass"]:  # our norm pre-pass reads x once more and writes M (mean, rstd)
            b_fused += m * k * torch.finfo(dt).bits // 8 + 8 * m
        line = dict(r, torch_event_ms=t_event, ours_event_ms=ours_ms, speedup=t_event / ours_ms,
                    bytes_unfused=b_unfused, bytes_fused=b_fused, traffic_saved=1 - b_fused / b_unfused)
        print(json.dumps(line), flush=True)
        table.append(line)
    if out_path:
        json.dump(dict(device=doc.get("device"), torch=torch.__version__, rows=table), open(out_path, "w"), indent=1)
    print(f"\n{'case':36} {'type':5} {'kernel':26} {'ours':>10} {'torch':>10} {'ratio':>6} "
          f"{'MB unf.':>8} {'MB fused':>8} {'saved':>6} {'TFLOP/s':>8}")
    for t in table:
        print(f"{t['case']:36} {t['type']:5} {t['function']:26} {t['ours_event_ms']*1e3:7.1f} us "
              f"{t['torch_event_ms']*1e3:7.1f} us {t['speedup']:5.2f}x {t['bytes_unfused']/1e6:8.2f} "
              f"{t['bytes_fused']/1e6:8.2f} {t['traffic_saved']*100:5.1f}% {t['tflops']:8.1f}")


doc = json.load(open(sys.argv[1]))
if "kernels" in doc:
    kernel_table(doc, sys.argv[2] if len(sys.argv) > 2 else None)
    sys.exit(0)
rows = doc["rows"]
ours = {(r["case"], r["backend"]): r for r in rows}
table = []
for case, (kind, act, residual) in CASES.items():
    r = ours.get((case, "cuda_resident"))
    if r is None:
        continue
    (m, k, n), dt = r["shape"], DT[r["type"]]
    fn, b_unfused, b_fused = build(kind, act, residual, m, k, n, dt)
    t_wall, t_event = wall_ms(fn), event_ms(fn)
    line = dict(case=case, mkn=[m, k, n], type=r["type"], ours_resident_ms=r["median_ms"],
                ours_host_ms=ours.get((case, "cuda"), {}).get("median_ms"),
                torch_wall_ms=t_wall, torch_event_ms=t_event,
                speedup_vs_torch_wall=t_wall / r["median_ms"],
                bytes_unfused=b_unfused, bytes_fused=b_fused, traffic_saved=1 - b_fused / b_unfused,
                ours_tflops=2 * m * k * n * (2 if kind == "swiglu" else 1) / (r["median_ms"] * 1e-3) / 1e12)
    print(json.dumps(line))
    table.append(line)

print(f"\n{'case':40} {'type':5} {'ours (resident)':>16} {'torch unfused':>14} {'torch events':>13} {'ratio':>6} "
      f"{'MB unfused':>10} {'MB fused':>9} {'saved':>6} {'TFLOP/s':>8}")
for t in table:
    print(f"{t['case']:40} {t['type']:5} {t['ours_resident_ms']*1e3:13.1f} us {t['torch_wall_ms']*1e3:11.1f} us "
          f"{t['torch_event_ms']*1e3:10.1f} us {t['speedup_vs_torch_wall']:5.2f}x {t['bytes_unfused']/1e6:10.2f} "
          f"{t['bytes_fused']/1e6:9.2f} {t['traffic_saved']*100:5.1f}% {t['ours_tflops']:8.1f}")

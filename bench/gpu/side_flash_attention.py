"""PyTorch SDPA side by side with our flash_attention kernel, same shapes, same device, same run.

Our kernel times come from the Rust bench (`bench_flash_attention --json FILE`,
benches/flash_attention.rs; FILE is $FA_BENCH_JSON, default fa_kernels.json beside BENCH_JSON): CUDA events around one call,
median after warm-up, rotating among input sets. SDPA is timed the same way here, per backend
(flash, cuDNN, efficient; f32 only has 'efficient' and 'math'). Whole calls from Elixir (host
tensors in and out) come from mix bench's `cuda` rows in BENCH_JSON.

Usage: python3 bench/gpu/side_flash_attention.py BENCH_JSON"""
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def event_us(fn, sets, warm=20, rep=200):
    for i in range(warm):
        fn(i % sets)
    torch.cuda.synchronize()
    ts = []
    for i in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i % sets)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    bench_json = sys.argv[1] if len(sys.argv) > 1 else None
    kpath = os.environ.get("FA_BENCH_JSON") or (
        os.path.join(os.path.dirname(bench_json), "fa_kernels.json") if bench_json else "")
    if not os.path.exists(kpath):
        print(f"side_flash_attention: no kernel timings at {kpath!r}; run the Rust bench first")
        return
    ours = json.load(open(kpath))
    elixir = {}
    if bench_json and os.path.exists(bench_json):
        for r in json.load(open(bench_json))["rows"]:
            if r["case"].startswith("flash_attention"):
                elixir[(r["case"], r["backend"])] = r["median_ms"] * 1e3
    rows = []
    torch_cache = {}
    for o in ours:
        b, h, s, d, causal = o["b"], o["h"], o["s"], o["d"], o["causal"]
        dtype = DT[o["dtype"]]
        sets = 2 if b * s * h * d > (1 << 22) else 8
        rep = 30 if sets == 2 else 200
        # SDPA takes {b, h, s, d}; transposed views of {b, s, h, d} tensors, as FlashAttention's
        # layout is what we take.
        qkv = [[torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
                for _ in range(3)] for _ in range(sets)]
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        line = dict(o, torch={})
        key = (b, h, s, d, o["dtype"], causal)
        if key in torch_cache:  # an alternative kernel of a shape already timed
            line["torch"] = torch_cache[key]
        for name, be in ([] if key in torch_cache else BACKENDS.items()):
            try:
                with sdpa_kernel([be]):
                    t = event_us(lambda i: sdpa(*qkv[i], is_causal=causal), sets, rep=rep)
                line["torch"][name] = t
            except Exception as e:  # backend refuses this dtype/shape
                line["torch"][name] = None
                line.setdefault("torch_errors", {})[name] = str(e).splitlines()[0][:120]
        torch_cache[key] = line["torch"]
        best = [v for v in line["torch"].values() if v]
        line["ratio_vs_flash"] = (line["torch"]["flash"] / o["median_us"]) if line["torch"]["flash"] else None
        line["ratio_vs_best"] = (min(best) / o["median_us"]) if best else None
        line["torch_tflops"] = {k: (flops / (v * 1e-6) / 1e12 if v else None) for k, v in line["torch"].items()}
        print(json.dumps(line))
        rows.append(line)

    print(f"\n{'case':20} {'kernel':22} {'ours us':>9} {'b2b us':>8} {'TF/s':>6} "
          f"{'flash':>8} {'cudnn':>8} {'effic':>8} {'vs flash':>9} {'vs best':>8}")
    fmt = lambda v: f"{v:8.1f}" if v else "       -"
    for r in rows:
        t = r["torch"]
        vf = f"{r['ratio_vs_flash']:8.2f}x" if r["ratio_vs_flash"] else "        -"
        vb = f"{r['ratio_vs_best']:7.2f}x" if r["ratio_vs_best"] else "       -"
        print(f"{r['name']:20} {r['kernel']:22} {r['median_us']:9.1f} {r['back_to_back_us']:8.1f} "
              f"{r['tflops']:6.1f} {fmt(t['flash'])} {fmt(t['cudnn'])} {fmt(t['efficient'])} {vf} {vb}")
    if elixir:
        print("\nWhole calls from Elixir (mix bench medians, us):")
        for (case, backend), us in sorted(elixir.items()):
            print(f"  {case:52} {backend:14} {us:10.1f}")


main()

#!/usr/bin/env python3
"""Where a jitted loop of attention calls spends its time: JAX's profiler (CUPTI on the device,
XLA's thunk annotations on the host) over B1 H4 S60 D64 causal f32 attention in a
lax.fori_loop of --n calls (or --chain: the calls written out), made several ways in one
process: our FFI handler from each given library (with --alias also with out aliasing q) and
JAX's attention. For each, per loop iteration: the device's kernels and copies (count, mean µs),
the device's busy time against the iteration's span, and the host's annotated spans (XLA's
thunks, count and mean µs), over --runs traced runs after warm-up. Command buffers follow
XLA_FLAGS, as in fa_chain.py. Usage:
  prof_loop.py --ffi ours=LIB [--ffi other=LIB2] [--alias] [--chain] [--n 200] [--runs 3] --out DIR
"""
import argparse, collections, ctypes, glob, os, sys, time
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--ffi", action="append", default=[], help="label=path of a fused_kernels_xla .so")
ap.add_argument("--alias", action="store_true")
ap.add_argument("--chain", action="store_true", help="the calls written out instead of a fori_loop")
ap.add_argument("--no-jax", action="store_true")
ap.add_argument("--n", type=int, default=200)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--top", type=int, default=14)
ap.add_argument("--out", default="prof_out")
a = ap.parse_args()

import jax, jax.numpy as jnp
from jax.profiler import ProfileData

b, s, h, d = 1, 60, 4, 64
rng = np.random.default_rng(11)
q, k, v = (jnp.asarray(rng.uniform(-2, 2, (b, s, h, d)), jnp.float32) for _ in range(3))
outs = [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, s), jnp.float32)]
steps = {}
for spec in a.ffi:
    label, path = spec.split("=", 1)
    lib = ctypes.CDLL(os.path.abspath(path))
    cap = jax.ffi.pycapsule(lib.fused_kernels_flash_attention)
    tname = f"fk_{label}_attention"
    init = True
    if hasattr(lib, "fused_kernels_xla_initializes"):
        init = lib.fused_kernels_xla_initializes(b"fused_kernels_flash_attention") == 1
    jax.ffi.register_ffi_target(tname, {"initialize": cap, "execute": cap} if init else cap, platform="CUDA")
    f = jax.ffi.ffi_call(tname, outs)
    steps[f"ffi {label}"] = (lambda f: lambda x: f(x, k, v, causal=True)[0])(f)
    if a.alias:
        fa = jax.ffi.ffi_call(tname, outs, input_output_aliases={0: 0})
        steps[f"ffi {label} alias"] = (lambda f: lambda x: f(x, k, v, causal=True)[0])(fa)
if not a.no_jax:
    steps["jax"] = lambda x: jax.nn.dot_product_attention(x, k, v, is_causal=True)

n = a.n
mode = "chain" if a.chain else "fori_loop"
fns, ref = {}, None
for key, st in steps.items():
    if a.chain:
        def run(x, st=st):
            for _ in range(n):
                x = st(x)
            return x
        run = jax.jit(run)
    else:
        run = jax.jit(lambda x, st=st: jax.lax.fori_loop(0, n, lambda _, y: st(y), x))
    out = np.asarray(run(q)).astype(np.float64)
    os.makedirs(a.out, exist_ok=True)
    try:
        # The optimized HLO: what XLA runs per iteration (copies into the loop-carried buffer,
        # the loop's trip count, command buffers).
        hlo = run.lower(q).compile().as_text()
        with open(os.path.join(a.out, f"{mode}_{key.replace(' ', '_')}.hlo.txt"), "w") as fh:
            fh.write(hlo)
        shown = 0
        for ln in hlo.splitlines():
            t = ln.strip()
            if shown < 60 and any(w in t for w in (" copy(", " copy-start", "custom-call(", " while(", "known_trip_count",
                                    "command_buffer", " fusion(", " call(")):
                print(f"  hlo {key}: {t[:200]}")
                shown += 1
    except Exception as e:
        print(f"  hlo {key}: unavailable ({type(e).__name__})")
    ref = out if ref is None else ref
    print(f"prof {mode} {key}: rel_l2 vs first {np.linalg.norm(out - ref) / np.linalg.norm(ref):.2e}", flush=True)
    fns[key] = run

def us(ns):
    return ns / 1e3

def summarize(key, path, per):
    """per = loop iterations traced (runs * n)."""
    pd = ProfileData.from_file(path)
    for plane in pd.planes:
        lines = list(plane.lines)
        if plane.name.startswith("/device:GPU"):
            evs = []
            for line in lines:
                if not line.name.startswith("Stream"):
                    continue
                for e in line.events:
                    evs.append((e.start_ns, e.duration_ns, e.name, line.name))
            if not evs:
                print(f"prof {mode} {key} device: no stream events (lines: {[l.name for l in lines][:8]})")
                continue
            evs.sort()
            t0, t1 = evs[0][0], max(e[0] + e[1] for e in evs)
            busy = sum(e[1] for e in evs)
            by = collections.defaultdict(list)
            for e in evs:
                by[e[2]].append(e[1])
            streams = sorted({e[3] for e in evs})
            print(f"prof {mode} {key} device: {len(evs)} events on {len(streams)} streams, span per iteration "
                  f"{us(t1 - t0) / per:.2f} us, busy {us(busy) / per:.2f} us "
                  f"({100 * busy / max(1, t1 - t0):.0f}%)")
            for name, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[: a.top]:
                print(f"  dev {len(ds) / per:6.2f}/it  mean {us(np.mean(ds)):7.2f} us  median {us(np.median(ds)):7.2f}"
                      f"  per it {us(sum(ds)) / per:7.2f} us  {name[:110]}")
            # Gaps between consecutive events on the busiest stream: what the device waits for.
            main = collections.Counter(e[3] for e in evs).most_common(1)[0][0]
            ms = [e for e in evs if e[3] == main]
            gaps = [ms[i + 1][0] - (ms[i][0] + ms[i][1]) for i in range(len(ms) - 1)]
            if gaps:
                gg = np.array(gaps, dtype=np.float64)
                print(f"  gaps on {main[:40]}: median {us(np.median(gg)):.2f} us, p90 {us(np.percentile(gg, 90)):.2f}, "
                      f"sum per it {us(gg[gg > 0].sum()) / per:.2f} us")
                # The gap after each kind of event (what follows it waits that long).
                after = collections.defaultdict(list)
                for i in range(len(ms) - 1):
                    after[ms[i][2]].append(gaps[i])
                for name, gs in sorted(after.items(), key=lambda kv: -sum(kv[1]))[:6]:
                    print(f"  gap after {name[:60]}: median {us(np.median(gs)):.2f} us x {len(gs) / per:.2f}/it")
        elif plane.name.startswith("/host:CPU"):
            tot = collections.defaultdict(list)
            for line in lines:
                if line.name == "python3" or line.name.startswith("python"):
                    continue
                for e in line.events:
                    tot[(line.name[:24], e.name)].append(e.duration_ns)
            rows = [(sum(ds), ln, nm, ds) for (ln, nm), ds in tot.items() if len(ds) >= per // 2]
            rows.sort(key=lambda r: -r[0])
            print(f"prof {mode} {key} host: spans seen >= once per 2 iterations:")
            for sm, ln, nm, ds in rows[: a.top]:
                print(f"  host {len(ds) / per:6.2f}/it  mean {us(np.mean(ds)):7.2f} us  per it {us(sm) / per:7.2f} us"
                      f"  [{ln}] {nm[:90]}")

os.makedirs(a.out, exist_ok=True)
for key, f in fns.items():
    for _ in range(3):
        f(q).block_until_ready()
    t = []
    for _ in range(5):
        t0 = time.perf_counter(); f(q).block_until_ready(); t.append(time.perf_counter() - t0)
    print(f"prof {mode} {key}: untraced {np.median(t) * 1e6 / n:.2f} us per call", flush=True)
    d_ = os.path.join(a.out, f"{mode}_{key.replace(' ', '_')}")
    try:
        with jax.profiler.trace(d_):
            for _ in range(a.runs):
                f(q).block_until_ready()
        paths = glob.glob(os.path.join(d_, "**", "*.xplane.pb"), recursive=True)
        summarize(key, sorted(paths)[-1], a.runs * n)
    except Exception as e:
        print(f"prof {mode} {key}: profile FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    sys.stdout.flush()

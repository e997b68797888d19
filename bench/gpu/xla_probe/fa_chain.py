#!/usr/bin/env python3
"""Attention B1 H4 S60 D64 causal f32 in one jitted chain of --n calls (one command buffer when
XLA_FLAGS turn them on), the same call made several ways in one process: our FFI handler from
each given library (registered under its own target name, with the stages that library asks
for), with --alias also with out aliasing q, the same fa_short body as XLA's own kernel node
(`__gpu$xla.gpu.ptx`, its FaArgs from an operand; probe_fa.cu), and JAX's attention. Outputs
checked against the first; per-call times interleaved over rounds. --loop: a lax.fori_loop of
--n calls instead. --once: run each chain twice and stop (for ncu)."""
import argparse, ctypes, os, sys, time, struct
import numpy as np
ap = argparse.ArgumentParser()
ap.add_argument("--ffi", action="append", default=[], help="label=path of a fused_kernels_xla .so")
ap.add_argument("--ptx", default=None)
ap.add_argument("--kernel", action="append", default=[],
                help="NAME:ROWS:THREADS:SMEM: a kernel of --ptx taking (q, k, v, FaArgs*, o, lse) with ROWS "
                     "query rows per block (default: fa_xla_param:2:128:35360, the product's fa_short_f32_2_2)")
ap.add_argument("--n", type=int, default=200)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--once", action="store_true")
ap.add_argument("--no-jax", action="store_true")
ap.add_argument("--alias", action="store_true")
ap.add_argument("--loop", action="store_true", help="a lax.fori_loop of n calls instead of a written-out chain")
a = ap.parse_args()
import jax, jax.numpy as jnp
b, s, h, d = 1, 60, 4, 64
rng = np.random.default_rng(11)
q, k, v = (jnp.asarray(rng.uniform(-2, 2, (b, s, h, d)), jnp.float32) for _ in range(3))
outs = [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, s), jnp.float32)]
steps = {}
libs = []
for spec in a.ffi:
    label, path = spec.split("=", 1)
    lib = ctypes.CDLL(os.path.abspath(path)); libs.append(lib)
    cap = jax.ffi.pycapsule(lib.fused_kernels_flash_attention)
    tname = f"fk_{label}_attention"
    # As each library's own harness registers it: main's with the initialize stage, a library
    # that says which targets take it (fused_kernels_xla_initializes) accordingly.
    init = True
    if hasattr(lib, "fused_kernels_xla_initializes"):
        init = lib.fused_kernels_xla_initializes(b"fused_kernels_flash_attention") == 1
    jax.ffi.register_ffi_target(tname, {"initialize": cap, "execute": cap} if init else cap, platform="CUDA")
    print(f"fa_chain {label}: registered {'initialize+execute' if init else 'execute only'}", flush=True)
    f = jax.ffi.ffi_call(tname, outs)
    steps[f"ffi {label}"] = (lambda f: lambda q: f(q, k, v, causal=True)[0])(f)
    if a.alias:
        # The same call with out declared to alias q (input_output_aliases {0: 0}): in a loop XLA
        # can then write the result into the loop-carried buffer instead of copying it there.
        fa_alias = jax.ffi.ffi_call(tname, outs, input_output_aliases={0: 0})
        steps[f"ffi {label} out aliasing q"] = (lambda f: lambda q: f(q, k, v, causal=True)[0])(fa_alias)
if a.ptx:
    ptx = open(a.ptx).read()
    px = jax.ffi.ffi_call("__gpu$xla.gpu.ptx", outs)
    for kspec in a.kernel or ["fa_xla_param:2:128:35360"]:
        kname, rows, threads, smem = kspec.split(":")
        tiles = -(-s // int(rows))
        args = struct.pack("<9if9qi4x", 4, 1, 60, 60, 64, -1, 0, tiles, 4, 0.125 * 1.4426950408889634,
                           15360, 256, 64, 15360, 256, 64, 15360, 256, 64, 0)
        params = np.frombuffer(args, dtype=np.int32).copy()
        launch = dict(kernel_type="ptx", kernel_data=ptx, grid_x=tiles * b * h, grid_y=1, grid_z=1,
                      block_x=int(threads), block_y=1, block_z=1, shared_mem_bytes=int(smem))
        label = "ptx node (FaArgs operand)" if kname == "fa_xla_param" else f"ptx node {kname}"
        steps[label] = (lambda params, kname, launch: lambda q: px(q, k, v, jnp.asarray(params), name=kname,
                                                                   **launch)[0])(params, kname, launch)
if not a.no_jax:
    steps["jax"] = lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True)
n = 10 if a.once else a.n
fns, ref = {}, None
for key, st in steps.items():
    try:
        if a.loop:
            run = jax.jit(lambda q, st=st: jax.lax.fori_loop(0, n, lambda _, x: st(x), q))
        else:
            @jax.jit
            def run(q, st=st):
                for _ in range(n):
                    q = st(q)
                return q
        out = np.asarray(run(q)).astype(np.float64)
        if ref is None:
            ref = out
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        print(f"fa_chain {key}: chain of {n} rel_l2 vs first {err:.2e}", flush=True)
        fns[key] = run
    except Exception as e:
        print(f"fa_chain {key}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
if a.once:
    for key, f in fns.items():
        f(q).block_until_ready()
    sys.exit(0)
rounds = {k_: [] for k_ in fns}
for r in range(a.rounds):
    keys = list(fns) if r % 2 == 0 else list(fns)[::-1]
    for key in keys:
        f = fns[key]
        f(q).block_until_ready()
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter(); f(q).block_until_ready(); ts.append(time.perf_counter() - t0)
        rounds[key].append(float(np.median(ts)) * 1e6 / n)
for key, v_ in rounds.items():
    print(f"fa_chain{' fori_loop' if a.loop else ''} {key}: {np.median(v_):.2f} us per call (rounds {min(v_):.2f}..{max(v_):.2f})", flush=True)

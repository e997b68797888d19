#!/usr/bin/env python3
"""What a custom call costs inside XLA's command buffers, independent of fused_kernels:
chains of 200 dependent calls in one jitted function (one CUDA graph with command buffers on),
per call: an XLA fusion kernel (x*0.999+1 between optimization barriers), the same kernel from
an FFI handler (ProbeTiny, traced by XLA into a child graph), an FFI handler that launches
nothing (ProbeNop), and the same kernel as `__gpu$xla.gpu.ptx` (XLA's own kernel thunk)."""
import ctypes, os, sys, time, json
import numpy as np
import jax, jax.numpy as jnp

lib = ctypes.CDLL(os.path.abspath(sys.argv[1]))
ptx = open(sys.argv[2]).read()
label = sys.argv[3] if len(sys.argv) > 3 else ""
for name in ["ProbeTiny", "ProbeNop"]:
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")

N, n = 200, 120 * 128
x0 = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, n), jnp.float32)
sds = jax.ShapeDtypeStruct((n,), jnp.float32)
tiny = jax.ffi.ffi_call("ProbeTiny", sds)
nop = jax.ffi.ffi_call("ProbeNop", sds)
ptxc = jax.ffi.ffi_call("__gpu$xla.gpu.ptx", sds)

def fusion(x):
    return jax.lax.optimization_barrier(x * 0.999 + 1.0)

steps = {
    "xla_fusion": fusion,
    "ffi_tiny": lambda x: tiny(x),
    "ffi_nop": lambda x: nop(x),
    "ptx_kernel": lambda x: ptxc(x, name="probe_tiny_ptx", kernel_type="ptx", kernel_data=ptx,
                                 grid_x=120, grid_y=1, grid_z=1, block_x=128, block_y=1, block_z=1,
                                 shared_mem_bytes=0),
}

def chain(step):
    @jax.jit
    def run(x):
        for _ in range(N):
            x = step(x)
        return x
    return run

fns = {}
ref = None
for k, step in steps.items():
    try:
        f = chain(step)
        out = np.asarray(f(x0))
        if k in ("xla_fusion", "ffi_tiny", "ptx_kernel"):
            if ref is None:
                ref = out
            err = float(np.max(np.abs(out - ref)))
            print(f"probe{label} {k}: compiled, max |diff| vs first {err:.2e}", flush=True)
        fns[k] = f
    except Exception as e:
        print(f"probe{label} {k}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)

# Interleaved rounds: each round times every chain 20 times; median per round, then median
# and spread (min..max) of the round medians.
rounds = {k: [] for k in fns}
for r in range(5):
    for k, f in fns.items():
        f(x0).block_until_ready()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter(); f(x0).block_until_ready(); ts.append(time.perf_counter() - t0)
        rounds[k].append(float(np.median(ts)) * 1e6 / N)
for k, v in rounds.items():
    print(f"probe{label} {k}: {np.median(v):.2f} us per call (rounds {min(v):.2f}..{max(v):.2f})", flush=True)

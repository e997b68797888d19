#!/usr/bin/env python3
"""fused_kernels' XLA FFI handlers under JAX, on the GPU machine.

Loads native/fused_kernels_xla's cdylib (built here in release, carried), registers every
handler with `jax.ffi.register_ffi_target` (initialize + execute stages) and calls each through
`jax.ffi.ffi_call` inside `jax.jit`:

  check   outputs against float64 numpy references at the users' shapes and the odd sizes of
          our test matrix (rel. L2: f32 <= 1e-5, bf16/f16 <= 1e-2); XLA's allocator is filled
          with NaN before each call so that unwritten output shows. LSTM, GRU and the Mamba
          block declare a workspace result sized by the library
          (`fused_kernels_xla_workspace_words`);
  errors  a bad call comes back as a Python exception carrying our message;
  loop    every target in a jitted lax.fori_loop of 1,000 dependent calls (result fed back),
          checked against the reference iterated 1,000 times; time per call in the loop and
          the handler's host time per execute;
  graphs  a child process with XLA command buffers (CUDA graphs) forced on for fusions, custom
          calls and cuBLAS: `cb`: every target in a jitted chain, its output checked and the
          handlers' counters read (execute calls made while XLA captured the stream, and none
          outside a capture on the later runs); `chain`: 200 attention calls in one executable
          (one CUDA graph), and 20 GRU/LSTM calls, time per call, ours vs JAX;
  loopgraph  the 1,000-call loops in a child whose command buffers also take loops (WHILE,
          CONDITIONAL): each loop captured once, then replayed with no handler call, i.e. on
          the device alone; and attention's fori_loop of 200 there, ours vs JAX;
  time    ours vs the same computation in JAX (jax.nn.dot_product_attention, lax.scan GRU and
          LSTM with the same weights, lax.scan selective scan) at GRU 2x256 window 60 batch 1,
          attention B1 H4 S60 D64 causal, scan B32 D512 L60 N16: per-call wall time (dispatch
          included), in-graph time per call (fori_loop of 200; for attention also 200 calls
          written out in one executable), and the handlers' host time per call. Ours and
          JAX's are timed call by call in alternation over 5 rounds: the median of the round
          medians, their min..max, and the ratio's (`--cases` picks the cases).

Build here:  bash bench/gpu/xla_ffi_build.sh       (-> .gpu/xla/libfused_kernels_xla.so)
Run there:   python3 bench/gpu/xla_ffi.py --out $OUT        (carry [".gpu/xla"])
"""

import argparse
import ctypes
import functools
import glob
import json
import math
import os
import subprocess
import sys
import time

# The command-buffer check runs in a child process beside this one: with JAX's default
# preallocation (75% of the GPU) the second process cannot get memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

LIB = None  # the handler library (ctypes), set by main
CASES = {"attention", "gru", "lstm", "scan"}  # the timed cases (--cases), set by main

TARGETS = [
    "fused_kernels_flash_attention",
    "fused_kernels_selective_scan",
    "fused_kernels_layer_norm",
    "fused_kernels_rms_norm",
    "fused_kernels_dense",
    "fused_kernels_mamba_block",
    "fused_kernels_lstm",
    "fused_kernels_gru",
]
# The targets whose handlers declare themselves command-buffer compatible: all of them (the
# RNNs and the Mamba block keep their temporaries in a workspace result, see `workspace`).
GRAPHABLE = list(TARGETS)
COUNTERS = ["executes", "captured_executes", "initializes", "execute_ns", "initialize_ns", "op_ns"]
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT --xla_gpu_graph_min_graph_size=1"
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def preload_cuda_libraries():
    """libnvrtc.so.13 (kernels are compiled at run time) and libcublas.so.13, loaded globally
    so that the library's dlopen by soname finds them: the toolkit's, else JAX's wheels'."""
    found = {}
    for soname in ["libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13"]:
        candidates = [soname]
        for pattern in [
            "/usr/local/cuda*/lib64/",
            "/usr/local/cuda*/targets/*/lib/",
            os.path.join(sys.prefix, "lib/python3*/site-packages/nvidia/*/lib/"),
            os.path.join(sys.prefix, "lib/python3*/site-packages/nvidia/cu13/lib/"),
        ]:
            candidates += sorted(glob.glob(pattern + soname))
        try:
            import site

            for sp in site.getsitepackages() + [site.getusersitepackages()]:
                candidates += sorted(glob.glob(os.path.join(sp, "nvidia/*/lib/", soname)))
                candidates += sorted(glob.glob(os.path.join(sp, "nvidia/cu13/lib/", soname)))
        except Exception:
            pass
        for c in candidates:
            try:
                ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
                found[soname] = c
                break
            except OSError:
                continue
    return found


def rel_l2(out, ref):
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        print(f"  shape mismatch: got {out.shape}, reference {ref.shape}", flush=True)
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)


# --------------------------------------------------------------------------------------
# float64 references (written from the equations in /work/shared/exphil.md and mamba_ssm)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.where(x <= 20.0, np.log1p(np.exp(np.minimum(x, 20.0))), x)


def ref_attention(q, k, v, causal, scale=None, window=(-1, -1)):
    """bshd; causal aligned bottom-right; a row that sees no key outputs 0 and lse +inf."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    group = h // kvh
    scale = scale if scale else 1.0 / math.sqrt(d)
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), np.inf)
    left, right = window
    if causal:
        right = 0
    for bi in range(b):
        for hi in range(h):
            s = scale * q[bi, :, hi, :] @ k[bi, :, hi // group, :].T
            i = np.arange(sq)[:, None] + sk - sq
            j = np.arange(sk)[None, :]
            mask = np.ones((sq, sk), bool)
            if left >= 0:
                mask &= j >= i - left
            if right >= 0:
                mask &= j <= i + right
            s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            ok = np.isfinite(m[:, 0])
            p = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
            den = p.sum(axis=1, keepdims=True)
            o = np.where(ok[:, None], p @ v[bi, :, hi // group, :] / np.where(den > 0, den, 1), 0)
            out[bi, :, hi, :] = o
            lse[bi, hi, ok] = (m[:, 0] + np.log(den[:, 0]))[ok]
    return out, lse


def ref_rnn(cell, x, layers, init=None):
    """Axon's LSTM/GRU; layers: list of dicts of float64 weights; returns (seq, states)."""
    seq = x
    states = []
    for li, w in enumerate(layers):
        b, t, _ = seq.shape
        hdim = w["hidden"][0].shape[0]
        outs = np.zeros((b, t, hdim))
        if cell == "gru":
            h = init[li][0] if init else np.zeros((b, hdim))
            wir, wiz, win = w["input"]
            whr, whz, whn = w["hidden"]
            br, bz, bin_, bhn = w["bias"]
            for s in range(t):
                xt = seq[:, s, :]
                r = sigmoid(xt @ wir + br + h @ whr)
                z = sigmoid(xt @ wiz + bz + h @ whz)
                n = np.tanh(xt @ win + bin_ + r * (h @ whn + bhn))
                h = (1 - z) * n + z * h
                outs[:, s, :] = h
            states.append([h])
        else:
            c, h = (init[li][0], init[li][1]) if init else (np.zeros((b, hdim)), np.zeros((b, hdim)))
            wii, wif, wig, wio = w["input"]
            whi, whf, whg, who = w["hidden"]
            bi, bf, bg, bo = w["bias"]
            for s in range(t):
                xt = seq[:, s, :]
                i = sigmoid(xt @ wii + bi + h @ whi)
                f = sigmoid(xt @ wif + bf + h @ whf)
                g = np.tanh(xt @ wig + bg + h @ whg)
                o = sigmoid(xt @ wio + bo + h @ who)
                c = f * c + i * g
                h = o * np.tanh(c)
                outs[:, s, :] = h
            states.append([c, h])
        seq = outs
    return seq, states


def ref_scan(u, delta, a, bm, cm, d=None, z=None, delta_bias=None, softplus_dt=False, clip=None):
    """mamba_ssm's selective scan, u/delta/z {batch, seq, dim}, B/C {batch, seq, state}."""
    bsz, length, dim = u.shape
    state = a.shape[1]
    dt = delta + (delta_bias if delta_bias is not None else 0)
    if softplus_dt:
        dt = softplus(dt)
    if clip is not None:
        dt = np.clip(dt, clip[0], clip[1])
    x = np.zeros((bsz, dim, state))
    y = np.zeros((bsz, length, dim))
    for t in range(length):
        dtt = dt[:, t, :][:, :, None]
        x = np.exp(dtt * a[None]) * x + dtt * bm[:, t, None, :] * u[:, t, :, None]
        y[:, t, :] = np.einsum("bdn,bn->bd", x, cm[:, t, :])
    out = y + (d * u if d is not None else 0)
    if z is not None:
        out = out * silu(z)
    return out, x


def ref_layer_norm(x, gamma, beta, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * gamma + beta


def ref_rms_norm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def act(name, v):
    if name == "none":
        return v
    if name == "relu":
        return np.maximum(v, 0)
    if name == "gelu":
        return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    if name == "silu":
        return silu(v)
    if name == "sigmoid":
        return sigmoid(v)
    if name == "tanh":
        return np.tanh(v)
    raise ValueError(name)


def ref_mamba_block(x, w, eps=1e-5, dt_min=0.001, dt_max=0.1, residual=False):
    bsz, length, hid = x.shape
    xn = ref_layer_norm(x, w["norm_gamma"], w["norm_beta"], eps)
    xz = xn @ w["in_kernel"] + w["in_bias"]
    inner = xz.shape[-1] // 2
    xs, z = xz[..., :inner], xz[..., inner:]
    taps = w["conv_kernel"][:, 0, :]  # {k, inner}
    kk = taps.shape[0]
    xc = np.zeros_like(xs) + w["conv_bias"]
    for j in range(kk):
        shift = kk - 1 - j  # tap j reads x[t + j + 1 - k]
        if shift < length:
            xc[:, shift:, :] += taps[j] * xs[:, : length - shift, :]
    xc = silu(xc)
    bc = xc @ w["bc_kernel"] + w["bc_bias"]
    n = bc.shape[-1] // 2
    r = xc @ w["dt_rank_kernel"] + w["dt_rank_bias"]
    dt = r @ w["dt_proj_kernel"]
    y, _ = ref_scan(
        xc, dt, w["a"], bc[..., :n], bc[..., n:], d=None, z=z,
        delta_bias=w["dt_proj_bias"], softplus_dt=True, clip=(dt_min, dt_max),
    )
    out = y @ w["out_kernel"] + w["out_bias"]
    return out + x if residual else out


# --------------------------------------------------------------------------------------
# JAX side


def setup(lib_path, platform):
    libs = preload_cuda_libraries()
    import jax

    lib = ctypes.CDLL(os.path.abspath(lib_path))
    lib.fused_kernels_xla_registered_on_load.restype = ctypes.c_int
    lib.fused_kernels_xla_counters.restype = ctypes.c_size_t
    lib.fused_kernels_xla_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.fused_kernels_xla_workspace_words.restype = ctypes.c_int64
    lib.fused_kernels_xla_workspace_words.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]
    # Older libraries (before fused_kernels_xla_initializes) served both stages for every target.
    initializes = getattr(lib, "fused_kernels_xla_initializes", None)
    if initializes is not None:
        initializes.restype = ctypes.c_int
        initializes.argtypes = [ctypes.c_char_p]
    on_load = lib.fused_kernels_xla_registered_on_load()
    how = {}
    for name in TARGETS:
        cap = jax.ffi.pycapsule(getattr(lib, name))
        # XLA reads the traits from the handler's metadata answer; jaxlib's own traits
        # argument is given too where it exists (older XLAs read that one).
        extra = {}
        if name in GRAPHABLE:
            try:
                from jax._src.lib import xla_client

                extra["traits"] = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
            except Exception:
                extra = {}
        # The initialize stage only where the library serves it: XLA calls that stage before
        # every run of an executable (command-buffer replays included), once per custom call.
        init = initializes is None or initializes(name.encode()) == 1
        stages = {"initialize": cap, "execute": cap} if init else cap
        try:
            try:
                jax.ffi.register_ffi_target(name, stages, platform=platform, **extra)
            except TypeError:
                jax.ffi.register_ffi_target(name, stages, platform=platform)
            how[name] = ("initialize+execute" if init else "execute") + (
                " (traits: command buffer compatible)" if extra else "")
        except Exception as e:  # a JAX that takes one capsule only
            try:
                jax.ffi.register_ffi_target(name, cap, platform=platform)
                how[name] = f"execute only ({type(e).__name__}: {str(e)[:80]})"
            except Exception as e2:
                how[name] = f"not registered by JAX: {str(e2)[:160]}"
    return jax, lib, {"preloaded": libs, "registered_on_load": on_load, "registration": how}


def workspace(target, *dims):
    """The workspace result `target` needs (lib.rs `fused_kernels_xla_workspace_words`), as an
    out spec: ((words,), "float32"). dims: LSTM/GRU (element bytes, batch, seq, features,
    units per layer...), the Mamba block (batch, seq, hidden, inner, state, dt_rank)."""
    arr = (ctypes.c_int64 * len(dims))(*dims)
    words = LIB.fused_kernels_xla_workspace_words(target.encode(), arr, len(dims))
    if words < 0:
        raise ValueError(f"no workspace size for {target} {dims}")
    return ((int(words),), "float32")


def workspace_sds(jax, target, *dims):
    shape, dt = workspace(target, *dims)
    return jax.ShapeDtypeStruct(shape, dt)


def counters(lib):
    """The handlers' counters (lib.rs `fused_kernels_xla_counters`) as a dict."""
    buf = (ctypes.c_uint64 * len(COUNTERS))()
    n = lib.fused_kernels_xla_counters(buf, len(COUNTERS))
    return {k: int(buf[i]) for i, k in enumerate(COUNTERS[:n])}


def counters_delta(before, after):
    return {k: after[k] - before[k] for k in after}


class Runner:
    """Jitted ffi_calls. With strict=False a call that raises prints the error and returns
    NaN outputs (so the check records a failure and the run goes on)."""

    def __init__(self, jax, strict=True):
        self.jax = jax
        import jax.numpy as jnp

        self.jnp = jnp
        self.cache = {}
        self.strict = strict

    def poison(self):
        # Fill XLA's allocator with NaN so that an output we fail to write shows as NaN.
        x = self.jnp.full((64 << 20,), np.nan, dtype=self.jnp.float32)
        x.block_until_ready()
        del x

    def call(self, target, args, out_specs, attrs):
        """jit(ffi_call(target)) over device arrays `args`; out_specs: [(shape, dtype)]."""
        jax, jnp = self.jax, self.jnp
        key = (target, tuple((a.shape, str(a.dtype)) for a in args), tuple(out_specs), tuple(sorted(attrs.items())))
        f = self.cache.get(key)
        if f is None:
            outs = [jax.ShapeDtypeStruct(s, d) for s, d in out_specs]
            # ffi_call returns the structure it is given: a one-element list for a list of
            # one, which must be unwrapped (compared whole it has the wrong shape).
            call = jax.ffi.ffi_call(target, outs if len(outs) > 1 else outs[0])
            f = jax.jit(lambda *a: call(*a, **attrs))
            self.cache[key] = f
        if self.strict:
            return f(*args)
        try:
            out = f(*args)
            jax.block_until_ready(out)
            return out
        except Exception as e:
            print(f"ERROR {target}: {str(e).splitlines()[0][:300]}", flush=True)
            nans = [np.full(s_, np.nan) for s_, _ in out_specs]
            return nans if len(nans) > 1 else nans[0]


def f64(rng, *shape, scale=1.0):
    return rng.uniform(-2, 2, size=shape) * scale


def as_dev(jnp, a, dtype="float32"):
    return jnp.asarray(np.asarray(a, dtype=np.float64).astype(np.float32)).astype(dtype)


def rounded(a, dtype):
    """The values the device sees after converting a float64 array to `dtype`."""
    import ml_dtypes  # noqa: F401  (jax depends on it)

    return np.asarray(np.asarray(a).astype(np.float32).astype(dtype), dtype=np.float64)


def check_all(jax, results):
    jnp = jax.numpy
    r = Runner(jax, strict=False)
    rng = np.random.default_rng(20261123)
    fails = 0

    def record(name, err, tol, extra=""):
        nonlocal fails
        ok = err <= tol
        fails += 0 if ok else 1
        results.append({"check": name, "rel_l2": err, "tol": tol, "ok": ok})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rel_l2 {err:.2e} (tol {tol:.0e}) {extra}", flush=True)

    f64s = lambda *s, scale=1.0: f64(rng, *s, scale=scale)  # noqa: E731

    # Attention: the users' shape, odd seqs and head dims, GQA, windows, 16-bit types.
    cases = [
        (1, 60, 4, 4, 60, 64, True, "float32", (-1, -1)),
        (1, 1, 4, 4, 1, 64, True, "float32", (-1, -1)),
        (2, 61, 4, 2, 61, 40, True, "float32", (-1, -1)),
        (1, 100, 2, 2, 100, 80, False, "float32", (-1, -1)),
        (1, 61, 4, 1, 100, 96, True, "float32", (-1, -1)),
        (1, 100, 4, 4, 100, 64, False, "float32", (16, 0)),
        (2, 100, 8, 8, 100, 128, True, "bfloat16", (-1, -1)),
        (1, 61, 4, 4, 61, 64, True, "float16", (-1, -1)),
        (1, 60, 4, 4, 60, 256, True, "bfloat16", (-1, -1)),
    ]
    for b, sq, h, kvh, sk, d, causal, dt, window in cases:
        q = rounded(f64s(b, sq, h, d), dt)
        k = rounded(f64s(b, sk, kvh, d), dt)
        v = rounded(f64s(b, sk, kvh, d), dt)
        ro, rl = ref_attention(q, k, v, causal, window=window)
        r.poison()
        out, lse = r.call(
            "fused_kernels_flash_attention",
            [as_dev(jnp, q, dt), as_dev(jnp, k, dt), as_dev(jnp, v, dt)],
            [((b, sq, h, d), dt), ((b, h, sq), "float32")],
            {"causal": causal, "layout": "bshd", "window_left": window[0], "window_right": window[1]},
        )
        name = f"attention b{b} sq{sq} h{h}/{kvh} sk{sk} d{d} causal={causal} window={window} {dt}"
        record(name + " out", rel_l2(np.asarray(out, np.float64), ro), TOL[dt])
        fin = np.isfinite(rl)
        record(name + " lse", rel_l2(np.asarray(lse, np.float64)[fin], rl[fin]), 1e-5 if dt == "float32" else 1e-3)

    # Out aliasing q (`input_output_aliases={0: 0}`): the kernel reads q from the buffer it
    # writes (each block reads its own query rows before it writes them). The short kernel, the
    # FFMA kernel (plain, GQA with sk != sq, a window) and the tensor-core kernel.
    for i in (0, 3, 4, 5, 6):
        b, sq, h, kvh, sk, d, causal, dt, window = cases[i]
        q = rounded(f64s(b, sq, h, d), dt)
        k = rounded(f64s(b, sk, kvh, d), dt)
        v = rounded(f64s(b, sk, kvh, d), dt)
        ro, _ = ref_attention(q, k, v, causal, window=window)
        name = f"attention b{b} sq{sq} h{h}/{kvh} sk{sk} d{d} causal={causal} window={window} {dt} out aliasing q"
        call = jax.ffi.ffi_call("fused_kernels_flash_attention",
                                [jax.ShapeDtypeStruct((b, sq, h, d), dt), jax.ShapeDtypeStruct((b, h, sq), "float32")],
                                input_output_aliases={0: 0})
        attrs = {"causal": causal, "layout": "bshd", "window_left": window[0], "window_right": window[1]}
        try:
            out = jax.jit(lambda q, k, v: call(q, k, v, **attrs)[0])(
                as_dev(jnp, q, dt), as_dev(jnp, k, dt), as_dev(jnp, v, dt))
            err = rel_l2(np.asarray(out, np.float64), ro)
        except Exception as e:
            print(f"ERROR {name}: {str(e).splitlines()[0][:300]}", flush=True)
            err = float("inf")
        record(name, err, TOL[dt])

    # GRU / LSTM: the production GRU (2x256, window 60, batch 1, input 288), hidden 200/512,
    # seq 1 and 61, batch 3, given initial state.
    # The last result is the workspace (its size from the library), never read here.
    for cell, b, t, feat, hidden, init, dt in [
        ("gru", 1, 60, 288, [256, 256], False, "float32"),
        ("lstm", 1, 60, 288, [256, 256], False, "float32"),
        ("gru", 1, 61, 200, [200], True, "float32"),
        ("lstm", 3, 61, 64, [512], True, "float32"),
        ("gru", 3, 1, 32, [512, 200], True, "float32"),
        ("lstm", 1, 1, 16, [200], False, "float32"),
        ("gru", 8, 100, 128, [256], False, "float32"),
        ("lstm", 2, 100, 200, [512], False, "float32"),
        ("gru", 1, 60, 288, [256, 256], False, "bfloat16"),
        ("lstm", 3, 61, 64, [200], True, "float16"),
    ]:
        gates = 3 if cell == "gru" else 4
        x = rounded(f64s(b, t, feat), dt)
        layers, operands, init_states = [], [as_dev(jnp, x, dt)], []
        inp = feat
        for hd in hidden:
            w = {
                "input": [rounded(f64s(inp, hd, scale=1 / math.sqrt(inp)), dt) for _ in range(gates)],
                "hidden": [rounded(f64s(hd, hd, scale=1 / math.sqrt(hd)), dt) for _ in range(gates)],
                "bias": [rounded(f64s(hd, scale=0.1), dt) for _ in range(4)],
            }
            layers.append(w)
            operands += [as_dev(jnp, a, dt) for a in w["input"] + w["hidden"] + w["bias"]]
            if init:
                st = [rounded(f64s(b, hd, scale=0.5), dt) for _ in range(1 if cell == "gru" else 2)]
                init_states.append(st)
                operands += [as_dev(jnp, s, dt) for s in st]
            inp = hd
        rseq, rstates = ref_rnn(cell, x, layers, init_states if init else None)
        outs = [((b, t, hidden[-1]), dt)]
        for hd in hidden:
            outs += [((b, hd), dt)] * (1 if cell == "gru" else 2)
        target = f"fused_kernels_{cell}"
        outs.append(workspace(target, 4 if dt == "float32" else 2, b, t, feat, *hidden))
        r.poison()
        got = r.call(target, operands, outs,
                     {"layers": len(hidden), "initial_state": init, "reverse": False})
        got = [np.asarray(g, np.float64) for g in got[:-1]]
        name = f"{cell} b{b} t{t} in{feat} hidden{hidden} init={init} {dt}"
        record(name + " sequence", rel_l2(got[0], rseq), TOL[dt])
        flat = [s for st in rstates for s in st]
        record(name + " states", max(rel_l2(g, s) for g, s in zip(got[1:], flat)), TOL[dt])

    # Selective scan: the users' shape, state 64, seq 1/61/100, every option, 16-bit I/O.
    for bsz, length, dim, state, opts, dt in [
        (32, 60, 512, 16, "plain", "float32"),
        (2, 61, 96, 64, "all", "float32"),
        (1, 1, 64, 16, "all", "float32"),
        (3, 100, 128, 64, "dz", "float32"),
        (2, 61, 256, 16, "all", "bfloat16"),
        (2, 100, 128, 16, "all", "float16"),
    ]:
        u = rounded(f64s(bsz, length, dim), dt)
        delta = rounded(f64s(bsz, length, dim, scale=0.5), dt)
        a = -np.exp(f64s(dim, state, scale=0.5))
        bm = rounded(f64s(bsz, length, state), dt)
        cm = rounded(f64s(bsz, length, state), dt)
        d = f64s(dim) if opts in ("all", "dz") else None
        z = rounded(f64s(bsz, length, dim), dt) if opts in ("all", "dz") else None
        db = f64s(dim, scale=0.5) if opts == "all" else None
        sp = opts == "all"
        ro, rlast = ref_scan(u, delta if sp else np.abs(delta), a, bm, cm, d, z, db, sp)
        names = ["u", "delta", "a", "b", "c"]
        args = [as_dev(jnp, u, dt), as_dev(jnp, delta if sp else np.abs(delta), dt), as_dev(jnp, a),
                as_dev(jnp, bm, dt), as_dev(jnp, cm, dt)]
        for nm, arr, ty in [("d", d, "float32"), ("z", z, dt), ("delta_bias", db, "float32")]:
            if arr is not None:
                names.append(nm)
                args.append(as_dev(jnp, arr, ty))
        r.poison()
        out, last = r.call(
            "fused_kernels_selective_scan", args,
            [((bsz, length, dim), dt), ((bsz, dim, state), "float32")],
            {"operands": ",".join(names), "delta_softplus": sp},
        )
        name = f"scan b{bsz} l{length} d{dim} n{state} {opts} {dt}"
        record(name + " out", rel_l2(out, ro), TOL[dt])
        record(name + " last_state", rel_l2(last, rlast), TOL[dt])

    # Norms, with and without the fused residual, hidden 200 and 512.
    for kind, rows, hid, res in [("layer", 60, 256, False), ("layer", 61, 200, True),
                                 ("rms", 60, 512, False), ("rms", 7, 200, True)]:
        x = f64s(rows, hid)
        w = f64s(hid)
        bb = f64s(hid)
        resid = f64s(rows, hid) if res else None
        s = x + resid if res else x
        eps = 1e-6
        ref = ref_layer_norm(s, w, bb, eps) if kind == "layer" else ref_rms_norm(s, w, eps)
        names = ["x", "gamma", "beta"] if kind == "layer" else ["x", "weight"]
        args = [as_dev(jnp, x), as_dev(jnp, w)] + ([as_dev(jnp, bb)] if kind == "layer" else [])
        if res:
            names.append("residual")
            args.append(as_dev(jnp, resid))
        outs = [((rows, hid), "float32")] * (2 if res else 1)
        r.poison()
        got = r.call(f"fused_kernels_{kind}_norm", args, outs,
                     {"operands": ",".join(names), "eps": np.float64(eps)})
        got = got if isinstance(got, (list, tuple)) else [got]
        record(f"{kind}_norm rows{rows} hidden{hid} residual={res}", rel_l2(got[0], ref), 1e-5)
        if res:
            record(f"{kind}_norm rows{rows} hidden{hid} sum", rel_l2(got[1], s), 1e-6)

    # Dense epilogues: the FFN's 60x256x1024 + bias + gelu, swiglu, fused norms (which return
    # their row statistics as a second result), residual.
    for kind, m, k, n, actn, extra in [
        ("dense", 60, 256, 1024, "gelu", ["bias"]),
        ("dense", 61, 200, 512, "silu", ["bias", "residual"]),
        ("swiglu", 60, 256, 512, "none", ["bias"]),
        ("rms_norm_dense", 60, 256, 256, "none", ["stats"]),
        ("layer_norm_dense", 3, 512, 200, "relu", ["bias", "stats"]),
        ("layer_norm_dense", 61, 200, 512, "gelu", ["bias", "residual", "stats"]),
    ]:
        x = f64s(m, k)
        kern = f64s(k, n, scale=1 / math.sqrt(k))
        ops = {"x": x, "kernel": kern}
        if kind == "swiglu":
            ops["kernel_up"] = f64s(k, n, scale=1 / math.sqrt(k))
        if "bias" in extra:
            ops["bias"] = f64s(n, scale=0.1)
            if kind == "swiglu":
                ops["bias_up"] = f64s(n, scale=0.1)
        if kind in ("rms_norm_dense", "layer_norm_dense"):
            ops["gamma"] = f64s(k)
        if kind == "layer_norm_dense":
            ops["beta"] = f64s(k)
        if "residual" in extra:
            ops["residual"] = f64s(m, n)
        eps = 1e-6
        xin = x
        if kind == "rms_norm_dense":
            xin = ref_rms_norm(x, ops["gamma"], eps)
        if kind == "layer_norm_dense":
            xin = ref_layer_norm(x, ops["gamma"], ops["beta"], eps)
        acc = xin @ kern + ops.get("bias", 0)
        if kind == "swiglu":
            ref = silu(acc) * (xin @ ops["kernel_up"] + ops.get("bias_up", 0))
        else:
            ref = act(actn, acc)
        ref = ref + ops.get("residual", 0)
        order = [nm for nm in ["x", "kernel", "kernel_up", "bias", "bias_up", "gamma", "beta", "residual"] if nm in ops]
        r.poison()
        outs = [((m, n), "float32")] + ([((m, 2), "float32")] if "stats" in extra else [])
        out = r.call("fused_kernels_dense", [as_dev(jnp, ops[nm]) for nm in order], outs,
                     {"operands": ",".join(order), "kind": kind, "activation": actn, "eps": np.float64(eps)})
        out = out[0] if "stats" in extra else out
        record(f"dense {kind} {m}x{k}x{n} {actn} {'+'.join(extra)}", rel_l2(out, ref), 1e-5)

    # Mamba block (Edifice's): hidden 256, state 16, inner 512, conv 4, dt_rank 16; odd sizes.
    for bsz, length, hid, state, inner, rank, residual in [
        (1, 60, 256, 16, 512, 16, True),
        (2, 61, 200, 64, 400, 13, False),
        (1, 1, 256, 16, 512, 16, True),
        (3, 100, 512, 64, 1024, 32, True),
    ]:
        x = f64s(bsz, length, hid)
        w = {
            "norm_gamma": f64s(hid), "norm_beta": f64s(hid, scale=0.1),
            "in_kernel": f64s(hid, 2 * inner, scale=1 / math.sqrt(hid)), "in_bias": f64s(2 * inner, scale=0.1),
            "conv_kernel": f64s(4, 1, inner, scale=0.5), "conv_bias": f64s(inner, scale=0.1),
            "bc_kernel": f64s(inner, 2 * state, scale=1 / math.sqrt(inner)), "bc_bias": f64s(2 * state, scale=0.1),
            "dt_rank_kernel": f64s(inner, rank, scale=1 / math.sqrt(inner)), "dt_rank_bias": f64s(rank, scale=0.1),
            "dt_proj_kernel": f64s(rank, inner, scale=1 / math.sqrt(rank)), "dt_proj_bias": f64s(inner, scale=0.5),
            "a": -np.tile(np.arange(1, state + 1, dtype=np.float64), (inner, 1)),
            "out_kernel": f64s(inner, hid, scale=1 / math.sqrt(inner)), "out_bias": f64s(hid, scale=0.1),
        }
        ref = ref_mamba_block(x, w, residual=residual)
        order = ["x"] + list(w.keys())
        vals = {"x": x, **w}
        r.poison()
        out = r.call("fused_kernels_mamba_block", [as_dev(jnp, vals[nm]) for nm in order],
                     [((bsz, length, hid), "float32"),
                      workspace("fused_kernels_mamba_block", bsz, length, hid, inner, state, rank)],
                     {"operands": ",".join(order), "residual": residual})[0]
        record(f"mamba_block b{bsz} l{length} h{hid} n{state} inner{inner} rank{rank} residual={residual}",
               rel_l2(out, ref), 1e-5)
    return fails


def check_errors(jax, results):
    """A bad call raises in Python with our message (not a crash)."""
    jnp = jax.numpy
    r = Runner(jax)
    q = jnp.ones((1, 60, 4, 64), jnp.float32)
    k = jnp.ones((1, 60, 4, 32), jnp.float32)
    fails = 0
    for name, fn, needle in [
        ("head_dim mismatch", lambda: r.call("fused_kernels_flash_attention", [q, k, k],
         [((1, 60, 4, 64), "float32"), ((1, 4, 60), "float32")], {"causal": True}), "head_dim 32 differs"),
        ("unknown attribute", lambda: r.call("fused_kernels_flash_attention", [q, q, q],
         [((1, 60, 4, 64), "float32"), ((1, 4, 60), "float32")], {"causl": True}), "attribute causl: unknown"),
        ("negative eps", lambda: r.call("fused_kernels_rms_norm", [jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)],
         [((4, 8), "float32")], {"eps": np.float64(-1.0)}), "eps must be non-negative"),
        ("workspace too small", lambda: r.call(
            "fused_kernels_gru", [jnp.ones((1, 5, 8), jnp.float32)] + [jnp.ones((8, 16), jnp.float32)] * 3
            + [jnp.ones((16, 16), jnp.float32)] * 3 + [jnp.ones((16,), jnp.float32)] * 4,
            [((1, 5, 16), "float32"), ((1, 16), "float32"),
             ((workspace("fused_kernels_gru", 4, 1, 5, 8, 16)[0][0] - 1,), "float32")], {}),
         "workspace: must be f32"),
    ]:
        try:
            np.asarray(fn())
            ok, msg = False, "no error raised"
        except Exception as e:  # XlaRuntimeError or a JaxRuntimeError
            msg = str(e)
            ok = needle in msg
        fails += 0 if ok else 1
        results.append({"check": "error: " + name, "ok": ok, "message": msg[:300]})
        print(f"{'ok  ' if ok else 'FAIL'} error: {name}: {msg.splitlines()[0][:200] if msg else ''}", flush=True)
    return fails


def timed(fn, args, reps=100):
    out = fn(*args)
    jax_block(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax_block(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def timed_pair(ours, ours_args, theirs, theirs_args, reps=100, rounds=5, per=1):
    """Ours and JAX's timed call by call in alternation (which goes first flips every round),
    `rounds` rounds of `reps` calls each; each call's wall time divided by `per` (calls inside
    one executable). Per round the median of each side and their ratio; returned: the median
    over rounds of each, its min..max, and the ratios' median and min..max (the spread is what
    a single run could have read)."""
    jax_block(ours(*ours_args))
    jax_block(theirs(*theirs_args))
    o_r, j_r = [], []
    for r in range(rounds):
        to, tj = [], []
        pair = [(ours, ours_args, to), (theirs, theirs_args, tj)]
        if r % 2:
            pair.reverse()
        for _ in range(reps):
            for fn, args, acc in pair:
                t0 = time.perf_counter()
                jax_block(fn(*args))
                acc.append((time.perf_counter() - t0) * 1e6 / per)
        o_r.append(float(np.median(to)))
        j_r.append(float(np.median(tj)))
    ratios = [j / o for o, j in zip(o_r, j_r)]
    return {"ours_us": float(np.median(o_r)), "ours_us_range": [min(o_r), max(o_r)],
            "jax_us": float(np.median(j_r)), "jax_us_range": [min(j_r), max(j_r)],
            "speedup": float(np.median(ratios)), "speedup_range": [min(ratios), max(ratios)],
            "rounds": rounds, "reps_per_round": reps}


def pair_text(t):
    return (f"ours {t['ours_us']:.2f} us ({t['ours_us_range'][0]:.2f}..{t['ours_us_range'][1]:.2f}), "
            f"JAX {t['jax_us']:.2f} us ({t['jax_us_range'][0]:.2f}..{t['jax_us_range'][1]:.2f}), "
            f"JAX/ours {t['speedup']:.2f}x ({t['speedup_range'][0]:.2f}..{t['speedup_range'][1]:.2f}; "
            f"medians of {t['rounds']} alternating rounds of {t['reps_per_round']})")


def jax_block(x):
    import jax

    jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)


def small_cases(jax, rng):
    """One small call of every target whose first operand and first result have the same
    shape (so that a loop can feed the result back): (label, target fn(first, *rest) ->
    first result, first operand, the rest, float64 reference fn(first) -> first result).
    The RNNs and the Mamba block declare their workspace result."""
    jnp = jax.numpy
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    u = lambda *shape, lo=-2.0, hi=2.0: rng.uniform(lo, hi, shape)  # noqa: E731
    cases = []

    b, s, h, d = 1, 60, 4, 64
    k, v = u(b, s, h, d), u(b, s, h, d)
    fa = jax.ffi.ffi_call("fused_kernels_flash_attention", [sds((b, s, h, d)), sds((b, h, s))])
    cases.append(("fused_kernels_flash_attention", lambda q, k, v: fa(q, k, v, causal=True)[0], u(b, s, h, d), [k, v],
                  lambda q: ref_attention(q, k, v, True)[0]))

    bsz, length, dim, state = 2, 17, 64, 16
    delta = u(bsz, length, dim, lo=0.0, hi=0.5)
    a = -np.exp(u(dim, state, lo=-1.0, hi=1.0))
    bm, cm = u(bsz, length, state), u(bsz, length, state)
    sc = jax.ffi.ffi_call("fused_kernels_selective_scan", sds((bsz, length, dim)))
    cases.append(("fused_kernels_selective_scan", lambda x, *r: sc(x, *r), u(bsz, length, dim), [delta, a, bm, cm],
                  lambda x: ref_scan(x, delta, a, bm, cm)[0]))

    rows, hid = 61, 200
    w, bb = u(hid, lo=0.5, hi=1.5), u(hid, lo=-0.5, hi=0.5)
    rn = jax.ffi.ffi_call("fused_kernels_rms_norm", sds((rows, hid)))
    ln = jax.ffi.ffi_call("fused_kernels_layer_norm", sds((rows, hid)))
    cases.append(("fused_kernels_rms_norm", lambda x, w: rn(x, w, eps=np.float64(1e-6)), u(rows, hid), [w],
                  lambda x: ref_rms_norm(x, w, 1e-6)))
    cases.append(("fused_kernels_layer_norm", lambda x, g, bt: ln(x, g, bt, eps=np.float64(1e-6)), u(rows, hid),
                  [w, bb], lambda x: ref_layer_norm(x, w, bb, 1e-6)))

    rows, feat = 60, 96
    kern = u(feat, feat, lo=-1.0, hi=1.0) / math.sqrt(feat)
    bias, gamma = u(feat, lo=-0.1, hi=0.1), u(feat, lo=0.5, hi=1.5)
    dn = jax.ffi.ffi_call("fused_kernels_dense", sds((rows, feat)))
    dns = jax.ffi.ffi_call("fused_kernels_dense", [sds((rows, feat)), sds((rows, 2))])
    cases.append(("fused_kernels_dense", lambda x, k, b: dn(x, k, b, operands="x,kernel,bias", activation="tanh"),
                  u(rows, feat), [kern, bias], lambda x: np.tanh(x @ kern + bias)))
    cases.append(("fused_kernels_dense (rms_norm_dense)",
                  lambda x, k, g: dns(x, k, g, operands="x,kernel,gamma", kind="rms_norm_dense", eps=np.float64(1e-6))[0],
                  u(rows, feat), [kern, gamma], lambda x: ref_rms_norm(x, gamma, 1e-6) @ kern))

    # GRU at batch 1 (the cluster path on sm_90), LSTM at batch 2 (the per-layer paths).
    for cell, bsz in [("gru", 1), ("lstm", 2)]:
        gates = 3 if cell == "gru" else 4
        t, hd = 16, 64
        wts = {"input": [u(hd, hd, lo=-1.0, hi=1.0) / math.sqrt(hd) for _ in range(gates)],
               "hidden": [u(hd, hd, lo=-1.0, hi=1.0) / math.sqrt(hd) for _ in range(gates)],
               "bias": [u(hd, lo=-0.1, hi=0.1) for _ in range(4)]}
        target = f"fused_kernels_{cell}"
        outs = [sds((bsz, t, hd))] + [sds((bsz, hd))] * (1 if cell == "gru" else 2)
        outs.append(workspace_sds(jax, target, 4, bsz, t, hd, hd))
        rc = jax.ffi.ffi_call(target, outs)
        cases.append((target, lambda x, *w, rc=rc: rc(x, *w)[0], u(bsz, t, hd),
                      wts["input"] + wts["hidden"] + wts["bias"],
                      lambda x, cell=cell, wts=wts: ref_rnn(cell, x, [wts])[0]))

    bsz, length, hid, state, inner, rank = 1, 16, 64, 16, 128, 8
    mw = {
        "norm_gamma": u(hid), "norm_beta": u(hid, lo=-0.2, hi=0.2),
        "in_kernel": u(hid, 2 * inner) / math.sqrt(hid), "in_bias": u(2 * inner, lo=-0.2, hi=0.2),
        "conv_kernel": u(4, 1, inner, lo=-1.0, hi=1.0), "conv_bias": u(inner, lo=-0.2, hi=0.2),
        "bc_kernel": u(inner, 2 * state) / math.sqrt(inner), "bc_bias": u(2 * state, lo=-0.2, hi=0.2),
        "dt_rank_kernel": u(inner, rank) / math.sqrt(inner), "dt_rank_bias": u(rank, lo=-0.2, hi=0.2),
        "dt_proj_kernel": u(rank, inner) / math.sqrt(rank), "dt_proj_bias": u(inner, lo=-1.0, hi=1.0),
        "a": -np.tile(np.arange(1, state + 1, dtype=np.float64), (inner, 1)),
        "out_kernel": u(inner, hid) / math.sqrt(inner), "out_bias": u(hid, lo=-0.2, hi=0.2),
    }
    mb = jax.ffi.ffi_call("fused_kernels_mamba_block",
                          [sds((bsz, length, hid)),
                           workspace_sds(jax, "fused_kernels_mamba_block", bsz, length, hid, inner, state, rank)])
    order = ",".join(["x"] + list(mw.keys()))
    cases.append(("fused_kernels_mamba_block", lambda x, *w: mb(x, *w, operands=order, residual=True)[0],
                  u(bsz, length, hid), list(mw.values()), lambda x: ref_mamba_block(x, mw, residual=True)))
    return cases


def loop_check(jax, results, iters=1000, reps=3):
    """Every target in a jitted lax.fori_loop of `iters` dependent calls (each call's first
    operand is x0 + 0.01 * the previous result, so errors do not compound), checked against the
    float64 reference iterated as many times, run `reps` times, with the handlers' counters:
    host time per execute against the loop's time per call. Under command buffers with WHILE
    (the `loopgraph` child) XLA records the loop as one CUDA graph with a conditional node: a
    handler that synchronised with the host could not be captured, and the later runs replay
    all `iters` calls without calling the handler (executes 0)."""
    jnp, lax = jax.numpy, jax.lax
    rng = np.random.default_rng(7)
    fails = 0
    graphed = "WHILE" in os.environ.get("XLA_FLAGS", "")
    for label, fn, x0, rest, ref_fn in small_cases(jax, rng):

        @jax.jit
        def loop(x0, *rest, fn=fn):
            return lax.fori_loop(0, iters, lambda _, out: fn(x0 + 0.01 * out, *rest), jnp.zeros_like(x0))

        args = [as_dev(jnp, x0)] + [as_dev(jnp, a) for a in rest]
        try:
            c0 = counters(LIB)
            t0 = time.perf_counter()
            got = np.asarray(loop(*args), np.float64)
            first_s = time.perf_counter() - t0
            c1 = counters(LIB)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                last = loop(*args)
                jax_block(last)
                ts.append(time.perf_counter() - t0)
            c2 = counters(LIB)
            last = np.asarray(last, np.float64)
        except Exception as e:  # one target failing must not hide the others
            fails += 1
            results.append({"check": f"fori_loop {iters}: {label}", "ok": False, "exception": str(e)[:2000]})
            print(f"FAIL fori_loop of {iters}, {label}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        first, later = counters_delta(c0, c1), counters_delta(c1, c2)
        ref = np.zeros_like(x0)
        for _ in range(iters):
            ref = ref_fn(x0 + 0.01 * ref)
        # The first run and the last (a replay where XLA recorded the loop) against the reference.
        err = max(rel_l2(got, ref), rel_l2(last, ref))
        per_call = float(np.median(ts)) / iters * 1e6
        host = (first["execute_ns"] + later["execute_ns"]) / max(1, first["executes"] + later["executes"]) / 1e3
        ok = err <= 1e-5
        note = ""
        if graphed:
            # Recorded (the handler called under stream capture) and never called directly
            # after the first run: the later runs' `reps * iters` calls ran from the graph.
            captured = first["captured_executes"] + later["captured_executes"]
            ok = ok and captured > 0 and later["executes"] == later["captured_executes"]
            note = (f"; command buffers: {first['executes']} executes on the first run "
                    f"({first['captured_executes']} under capture), {later['executes']} in the next {reps} runs "
                    f"({later['captured_executes']} under capture) for their {reps * iters} calls")
        else:
            # (XLA's default command buffers may record the body here too: counts reported.)
            note = (f"; {first['executes']} + {later['executes']} handler executes "
                    f"({first['captured_executes'] + later['captured_executes']} under capture)")
        fails += 0 if ok else 1
        results.append({"check": f"fori_loop {iters}: {label}", "rel_l2": err, "tol": 1e-5, "ok": ok,
                        "us_per_call_in_loop": per_call, "handler_host_us_per_execute": host,
                        "first_run_s": first_s, "first_run": first, "later_runs": later, "command_buffers": graphed})
        print(f"{'ok  ' if ok else 'FAIL'} fori_loop of {iters} dependent calls, {label}: rel_l2 {err:.2e} (tol 1e-5), "
              f"{per_call:.2f} us per call in the loop, handler host {host:.2f} us per execute{note}", flush=True)
    return fails


def command_buffer_check(jax, results):
    """Meant for the child run with command buffers forced on (GRAPH_FLAGS). Each graphable
    target in a jitted chain of 3 dependent calls, run 5 times: the output against the
    reference chain, and the handlers' counters: execute calls made while XLA was capturing
    the stream into a CUDA graph (the target is inside a command buffer), and how many
    execute calls the later runs made (a replayed graph does not call the handler)."""
    jnp = jax.numpy
    rng = np.random.default_rng(5)
    n, runs = 3, 5
    cases = []
    for target, fn, x0, rest, ref_fn in small_cases(jax, rng):

        def chain(x, *rest, fn=fn):
            for _ in range(n):
                x = fn(x, *rest)
            return x

        ref = x0
        for _ in range(n):
            ref = ref_fn(ref)
        cases.append((target, chain, [x0] + list(rest), ref))

    fails = 0
    for target, fn, args, ref in cases:
        f = jax.jit(fn)
        dev = [as_dev(jnp, x) for x in args]
        try:
            c0 = counters(LIB)
            got = np.asarray(f(*dev), np.float64)
            c1 = counters(LIB)
            for _ in range(runs - 1):
                last = f(*dev)
                jax_block(last)
            c2 = counters(LIB)
            last = np.asarray(last, np.float64)
        except Exception as e:  # one target failing must not hide the others
            fails += 1
            results.append({"check": f"command buffer: {target}", "ok": False, "exception": str(e)[:2000]})
            print(f"FAIL command buffer: {target}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        first, later = counters_delta(c0, c1), counters_delta(c1, c2)
        # The first (direct) run and the last (replayed) against the reference.
        err = max(rel_l2(got, ref), rel_l2(last, ref))
        inside = first["captured_executes"] + later["captured_executes"]
        # Recorded at least once, and after the first run never called outside a capture (a
        # later run replays the graph, or re-records it when XLA's buffer addresses moved).
        ok = err <= 1e-5 and inside > 0 and later["executes"] == later["captured_executes"]
        fails += 0 if ok else 1
        row = {"check": f"command buffer: {target}", "rel_l2": err, "ok": ok, "calls_per_run": n, "runs": runs,
               "first_run": first, "later_runs": later}
        results.append(row)
        print(f"{'ok  ' if ok else 'FAIL'} command buffer: {target} x{n} per run: rel_l2 {err:.2e}; "
              f"first run: {first['executes']} executes, {first['captured_executes']} under stream capture; "
              f"next {runs - 1} runs: {later['executes']} executes, {later['captured_executes']} under capture",
              flush=True)
    return fails


# --------------------------------------------------------------------------------------
# Timing against the same computation in JAX


def jax_rnn(jax, cell, layers, x, *w):
    """Axon's GRU/LSTM stack in JAX: the input projection of every step at once, then a
    lax.scan over time (x {1, t, features}; w per layer: input kernels, hidden kernels,
    biases, as the handler takes them)."""
    jnp, lax = jax.numpy, jax.lax
    gates = 3 if cell == "gru" else 4
    seq = x[0]
    per = 2 * gates + 4
    for li in range(layers):
        ws = w[li * per:(li + 1) * per]
        wi, wh, bs = ws[:gates], ws[gates:2 * gates], ws[2 * gates:]
        xp = seq @ jnp.concatenate(wi, axis=1)
        hdim = wh[0].shape[0]
        if cell == "gru":
            def step(h, xt, wh=wh, bs=bs, hdim=hdim):
                r = jax.nn.sigmoid(xt[:hdim] + bs[0] + h @ wh[0])
                z = jax.nn.sigmoid(xt[hdim:2 * hdim] + bs[1] + h @ wh[1])
                n = jnp.tanh(xt[2 * hdim:] + bs[2] + r * (h @ wh[2] + bs[3]))
                h = (1 - z) * n + z * h
                return h, h
            _, seq = lax.scan(step, jnp.zeros((hdim,), x.dtype), xp)
        else:
            def step(hc, xt, wh=wh, bs=bs, hdim=hdim):
                c, h = hc
                i = jax.nn.sigmoid(xt[:hdim] + bs[0] + h @ wh[0])
                f = jax.nn.sigmoid(xt[hdim:2 * hdim] + bs[1] + h @ wh[1])
                g = jnp.tanh(xt[2 * hdim:3 * hdim] + bs[2] + h @ wh[2])
                o = jax.nn.sigmoid(xt[3 * hdim:] + bs[3] + h @ wh[3])
                c = f * c + i * g
                h = o * jnp.tanh(c)
                return (c, h), h
            z0 = jnp.zeros((hdim,), x.dtype)
            _, seq = lax.scan(step, (z0, z0), xp)
    return seq[None]


def jax_scan(jax, u, delta, a, bm, cm):
    """The plain selective scan (no D, z, bias or softplus) as a lax.scan over time."""
    jnp, lax = jax.numpy, jax.lax

    def step(x, inp):
        ut, dt, bt, ct = inp
        x = jnp.exp(dt[:, :, None] * a[None]) * x + dt[:, :, None] * bt[:, None, :] * ut[:, :, None]
        return x, jnp.einsum("bdn,bn->bd", x, ct)

    xs = (jnp.swapaxes(u, 0, 1), jnp.swapaxes(delta, 0, 1), jnp.swapaxes(bm, 0, 1), jnp.swapaxes(cm, 0, 1))
    _, y = lax.scan(step, jnp.zeros((u.shape[0], u.shape[2], a.shape[1]), u.dtype), xs)
    return jnp.swapaxes(y, 0, 1)


def rnn_pair(jax, cell, t, feat, hid):
    """(ours, JAX's) 2-layer GRU/LSTM of `hid` units on x {1, t, feat}: fn(x, *weights) ->
    the last layer's sequence."""
    jnp = jax.numpy
    nstate = 1 if cell == "gru" else 2
    target = f"fused_kernels_{cell}"
    outs = [jax.ShapeDtypeStruct((1, t, hid), jnp.float32)] + [jax.ShapeDtypeStruct((1, hid), jnp.float32)] * (2 * nstate)
    outs.append(workspace_sds(jax, target, 4, 1, t, feat, hid, hid))
    rc = jax.ffi.ffi_call(target, outs)
    return (lambda x, *w: rc(x, *w, layers=2)[0]), functools.partial(jax_rnn, jax, cell, 2)


def bench(jax, results):
    jnp, lax = jax.numpy, jax.lax
    rng = np.random.default_rng(11)
    rows = []

    def add(name, ours_fn, ours_args, jax_fn, jax_args, check=None, reps=100, rounds=5):
        per = 200 if "(x200)" in name else 1
        row = {"case": name, **timed_pair(ours_fn, ours_args, jax_fn, jax_args, reps, rounds, per)}
        if per > 1:
            row["per_call"] = True
        if check is not None:
            row["agree_rel_l2"] = check
        rows.append(row)
        print(f"time {name}{' per call' if per > 1 else ''}: {pair_text(row)}"
              + (f" (outputs agree to {check:.1e})" if check is not None else ""), flush=True)

    def chain_of(fn, n=200):
        """n dependent calls written out in one executable (no loop: with command buffers
        on, one CUDA graph), time per call."""
        @jax.jit
        def run(*args):
            a0 = args[0]
            for _ in range(n):
                a0 = fn(a0, *args[1:])
            return a0
        return lambda *args: run(*args)

    def loop_of(fn, n=200):
        """fn(*args) -> same-shaped first arg, fed back n times in one executable."""
        @jax.jit
        def run(*args):
            return lax.fori_loop(0, n, lambda _, a0: fn(a0, *args[1:]), args[0])
        return run

    if "attention" in CASES:
        # Attention B1 H4 S60 D64 causal, f32.
        b, s, h, d = 1, 60, 4, 64
        q, k, v = (jnp.asarray(rng.uniform(-2, 2, (b, s, h, d)), jnp.float32) for _ in range(3))
        fa = jax.ffi.ffi_call("fused_kernels_flash_attention",
                              [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, s), jnp.float32)])
        ours = lambda q, k, v: fa(q, k, v, causal=True)[0]  # noqa: E731
        theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        agree = rel_l2(np.asarray(jax.jit(ours)(q, k, v)), np.asarray(jax.jit(theirs)(q, k, v)))
        add("attention B1 H4 S60 D64 causal f32, per call", jax.jit(ours), [q, k, v], jax.jit(theirs), [q, k, v], agree,
            reps=60)
        # The handler's own host time, call by call (medians: a first call may load things).
        fo = jax.jit(ours)
        per = []
        for _ in range(100):
            c0 = counters(LIB)
            jax_block(fo(q, k, v))
            per.append(counters_delta(c0, counters(LIB)))
        med = lambda key: float(np.median([p[key] for p in per])) / 1e3  # noqa: E731
        host = {"execute_us": med("execute_ns"), "op_us": med("op_ns"), "initialize_us": med("initialize_ns"),
                "executes_per_call": med("executes") * 1e3, "initializes_per_call": med("initializes") * 1e3,
                "execute_us_max": max(p["execute_ns"] for p in per) / 1e3}
        rows[-1]["handler_host"] = host
        print(f"  handler host time per call (median of 100): execute {host['execute_us']:.2f} us (of which the "
              f"op {host['op_us']:.2f} us), initialize {host['initialize_us']:.2f} us; max execute "
              f"{host['execute_us_max']:.1f} us", flush=True)
        add("attention B1 H4 S60 D64 causal f32, in-graph fori_loop (x200)", loop_of(ours), [q, k, v], loop_of(theirs),
            [q, k, v], reps=20)
        # The same loop with out declared to alias q: XLA then writes each result into the
        # loop-carried buffer instead of copying it there.
        fa_alias = jax.ffi.ffi_call("fused_kernels_flash_attention",
                                    [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32),
                                     jax.ShapeDtypeStruct((b, h, s), jnp.float32)], input_output_aliases={0: 0})
        ours_alias = lambda q, k, v: fa_alias(q, k, v, causal=True)[0]  # noqa: E731
        add("attention B1 H4 S60 D64 causal f32, in-graph fori_loop, out aliasing q (x200)", loop_of(ours_alias),
            [q, k, v], loop_of(theirs), [q, k, v], reps=20)
        add("attention B1 H4 S60 D64 causal f32, in-graph unrolled chain (x200)", chain_of(ours), [q, k, v],
            chain_of(theirs), [q, k, v], reps=20)

    # GRU / LSTM 2x256, window 60, batch 1, input 288, f32: the same weights in a lax.scan.
    for cell in [c for c in ["gru", "lstm"] if c in CASES]:
        gates = 3 if cell == "gru" else 4
        feat, hid, t = 288, 256, 60
        x = jnp.asarray(rng.uniform(-2, 2, (1, t, feat)), jnp.float32)
        layers = []
        inp = feat
        for _ in range(2):
            layers.append({
                "input": [jnp.asarray(rng.uniform(-1, 1, (inp, hid)) / math.sqrt(inp), jnp.float32) for _ in range(gates)],
                "hidden": [jnp.asarray(rng.uniform(-1, 1, (hid, hid)) / math.sqrt(hid), jnp.float32) for _ in range(gates)],
                "bias": [jnp.asarray(rng.uniform(-0.1, 0.1, (hid,)), jnp.float32) for _ in range(4)],
            })
            inp = hid
        flat = [a for w in layers for a in w["input"] + w["hidden"] + w["bias"]]
        ours, theirs = rnn_pair(jax, cell, t, feat, hid)
        # In a loop the sequence is fed back into x through a cheap elementwise step (the same
        # on both sides): x + 1e-3 * mean over units.
        fed = lambda f: (lambda x, *w: x + 1e-3 * f(x, *w).mean(axis=-1, keepdims=True))  # noqa: E731
        with jax.default_matmul_precision("highest"):
            agree = rel_l2(np.asarray(jax.jit(ours)(x, *flat)), np.asarray(jax.jit(theirs)(x, *flat)))
            add(f"{cell} 2x256 window 60 batch 1 f32, per call", jax.jit(ours), [x, *flat], jax.jit(theirs), [x, *flat], agree,
                reps=30)
            add(f"{cell} 2x256 window 60 batch 1 f32, in-graph fori_loop (x200)", loop_of(fed(ours)), [x, *flat],
                loop_of(fed(theirs)), [x, *flat], reps=1)

    if "scan" in CASES:
        # Selective scan B32 D512 L60 N16 f32 (plain: delta given, no D/z), lax.scan over time.
        bsz, length, dim, state = 32, 60, 512, 16
        u = jnp.asarray(rng.uniform(-2, 2, (bsz, length, dim)), jnp.float32)
        delta = jnp.asarray(rng.uniform(0, 0.5, (bsz, length, dim)), jnp.float32)
        a = jnp.asarray(-np.exp(rng.uniform(-1, 1, (dim, state))), jnp.float32)
        bm = jnp.asarray(rng.uniform(-2, 2, (bsz, length, state)), jnp.float32)
        cm = jnp.asarray(rng.uniform(-2, 2, (bsz, length, state)), jnp.float32)
        sc = jax.ffi.ffi_call("fused_kernels_selective_scan", jax.ShapeDtypeStruct((bsz, length, dim), jnp.float32))
        ours = lambda u, delta, a, bm, cm: sc(u, delta, a, bm, cm)  # noqa: E731

        theirs = functools.partial(jax_scan, jax)

        args = [u, delta, a, bm, cm]
        with jax.default_matmul_precision("highest"):
            agree = rel_l2(np.asarray(jax.jit(ours)(*args)), np.asarray(jax.jit(theirs)(*args)))
            add("selective scan B32 D512 L60 N16 f32, per call", jax.jit(ours), args, jax.jit(theirs), args, agree, reps=30)
            add("selective scan B32 D512 L60 N16 f32, in-graph (x200)", loop_of(ours), args, loop_of(theirs), args, reps=1)
    results.extend({"time": r} for r in rows)
    return 0


def bench_chain(jax, results):
    """Device time per attention call (run in the command-buffer child, where the chain of
    200 calls is one CUDA graph): ours vs jax.nn.dot_product_attention."""
    jnp = jax.numpy
    rng = np.random.default_rng(11)
    b, s, h, d = 1, 60, 4, 64
    q, k, v = (jnp.asarray(rng.uniform(-2, 2, (b, s, h, d)), jnp.float32) for _ in range(3))
    fa = jax.ffi.ffi_call("fused_kernels_flash_attention",
                          [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, s), jnp.float32)])
    n = 200

    def chain(fn):
        @jax.jit
        def run(q, k, v):
            for _ in range(n):
                q = fn(q, k, v)
            return q
        return run

    ours = chain(lambda q, k, v: fa(q, k, v, causal=True)[0])
    theirs = chain(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    agree = rel_l2(np.asarray(ours(q, k, v)), np.asarray(theirs(q, k, v)))
    c0 = counters(LIB)
    t = timed_pair(ours, [q, k, v], theirs, [q, k, v], reps=10, rounds=5, per=n)
    c1 = counters_delta(c0, counters(LIB))
    row = {"case": "attention B1 H4 S60 D64 causal f32, chain of 200 in one executable, per call",
           "xla_flags": os.environ.get("XLA_FLAGS", ""), **t, "agree_rel_l2": agree, "handler_calls": c1}
    print(f"  chain: {5 * 10 + 1} runs of 200 calls made {c1['executes']} handler executes "
          f"({c1['captured_executes']} under capture)", flush=True)
    results.append({"time": row})
    print(f"time {row['case']} (XLA_FLAGS {row['xla_flags']!r}): {pair_text(t)} (outputs agree to {agree:.1e})",
          flush=True)

    # GRU / LSTM 2x256 window 60 batch 1: a chain of 20 dependent calls in one executable
    # (the sequence fed back into x as in `bench`), per call.
    m = 20
    for cell in [c for c in ["gru", "lstm"] if c in CASES]:
        gates = 3 if cell == "gru" else 4
        feat, hid, t = 288, 256, 60
        x = jnp.asarray(rng.uniform(-2, 2, (1, t, feat)), jnp.float32)
        flat, inp = [], feat
        for _ in range(2):
            flat += [jnp.asarray(rng.uniform(-1, 1, (inp, hid)) / math.sqrt(inp), jnp.float32) for _ in range(gates)]
            flat += [jnp.asarray(rng.uniform(-1, 1, (hid, hid)) / math.sqrt(hid), jnp.float32) for _ in range(gates)]
            flat += [jnp.asarray(rng.uniform(-0.1, 0.1, (hid,)), jnp.float32) for _ in range(4)]
            inp = hid
        ours1, theirs1 = rnn_pair(jax, cell, t, feat, hid)

        def rchain(f):
            @jax.jit
            def run(x, *w):
                for _ in range(m):
                    x = x + 1e-3 * f(x, *w).mean(axis=-1, keepdims=True)
                return x
            return run

        ours, theirs = rchain(ours1), rchain(theirs1)
        with jax.default_matmul_precision("highest"):
            agree = rel_l2(np.asarray(ours(x, *flat)), np.asarray(theirs(x, *flat)))
            c0 = counters(LIB)
            t = timed_pair(ours, [x, *flat], theirs, [x, *flat], reps=2, rounds=5, per=m)
            c1 = counters_delta(c0, counters(LIB))
        row = {"case": f"{cell} 2x256 window 60 batch 1 f32, chain of {m} in one executable, per call",
               "xla_flags": os.environ.get("XLA_FLAGS", ""), **t, "agree_rel_l2": agree, "handler_calls": c1}
        results.append({"time": row})
        print(f"time {row['case']}: {pair_text(t)} (outputs agree to {agree:.1e}); {c1['executes']} handler "
              f"executes ({c1['captured_executes']} under capture)", flush=True)
    return 0


def bench_loop_graph(jax, results):
    """Attention B1 H4 S60 D64 causal f32 in a jitted fori_loop of 200 (run in the loopgraph
    child, whose command buffers take the whole loop: one CUDA graph with a conditional node),
    per call: ours vs jax.nn.dot_product_attention."""
    if "attention" not in CASES:
        return 0
    jnp, lax = jax.numpy, jax.lax
    rng = np.random.default_rng(11)
    b, s, h, d = 1, 60, 4, 64
    q, k, v = (jnp.asarray(rng.uniform(-2, 2, (b, s, h, d)), jnp.float32) for _ in range(3))
    fa = jax.ffi.ffi_call("fused_kernels_flash_attention",
                          [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32), jax.ShapeDtypeStruct((b, h, s), jnp.float32)])
    n = 200

    def loop(fn):
        return jax.jit(lambda q, k, v: lax.fori_loop(0, n, lambda _, x: fn(x, k, v), q))

    fa_alias = jax.ffi.ffi_call("fused_kernels_flash_attention",
                                [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32),
                                 jax.ShapeDtypeStruct((b, h, s), jnp.float32)], input_output_aliases={0: 0})
    theirs = loop(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    for label, ours in [("", loop(lambda q, k, v: fa(q, k, v, causal=True)[0])),
                        (", out aliasing q", loop(lambda q, k, v: fa_alias(q, k, v, causal=True)[0]))]:
        agree = rel_l2(np.asarray(ours(q, k, v)), np.asarray(theirs(q, k, v)))
        t = timed_pair(ours, [q, k, v], theirs, [q, k, v], reps=10, rounds=5, per=n)
        row = {"case": f"attention B1 H4 S60 D64 causal f32, fori_loop of 200 as one command buffer{label}, per call",
               "xla_flags": os.environ.get("XLA_FLAGS", ""), **t, "agree_rel_l2": agree}
        results.append({"time": row})
        print(f"time {row['case']}: {pair_text(t)} (outputs agree to {agree:.1e})", flush=True)
    return 0


LOOP_GRAPH_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1")


def loop_graph_child(args):
    """The 1,000-call loops again in a child whose command buffers take whole loops (WHILE,
    CONDITIONAL): each loop must be captured and then replayed with no handler call."""
    cmd = [sys.executable, __file__, "--lib", args.lib, "--out", args.out, "--platform", args.platform, "--cases", args.cases,
           "--part", "loop,looptime", "--json", os.path.join(args.out, "xla_ffi_loopgraph.json")]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" {LOOP_GRAPH_FLAGS}").strip()
    print(f"== loops under command buffers: XLA_FLAGS='{env['XLA_FLAGS']}'", flush=True)
    child = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(child.stdout[-30000:], flush=True)
    return child.returncode


def graphs_child(args):
    """Runs in a child with command buffers forced on: the checks again, the command-buffer
    proof (the handlers' capture counters) and the attention chain's device time."""
    cmd = [sys.executable, __file__, "--lib", args.lib, "--out", args.out, "--platform", args.platform, "--cases", args.cases,
           "--part", "errors,cb,chain", "--json", os.path.join(args.out, "xla_ffi_graphs.json")]
    # A flag this XLA does not know aborts it: then try the one that matters alone.
    for flags in [GRAPH_FLAGS, "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"]:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" {flags}").strip()
        print(f"== command buffers: XLA_FLAGS='{env['XLA_FLAGS']}'", flush=True)
        child = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(child.stdout[-30000:], flush=True)
        rc = child.returncode
        if "nknown flag" not in child.stdout:
            break
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=".gpu/xla/libfused_kernels_xla.so")
    ap.add_argument("--out", default=os.environ.get("OUT", ".gpu/out"))
    ap.add_argument("--part", default="check,errors,loop,graphs,loopgraph,time")
    ap.add_argument("--json", default=None)
    # "cpu" registers the handlers for JAX's CPU backend: a dry run of this script without a
    # GPU (the handlers then fail with "XLA did not provide a CUDA stream").
    ap.add_argument("--platform", default="CUDA")
    ap.add_argument("--cases", default="attention,gru,lstm,scan",
                    help="the cases the time and chain parts time (comma list)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.part.split(","))
    global LIB, CASES
    CASES = set(args.cases.split(","))
    jax, lib, info = setup(args.lib, args.platform)
    LIB = lib
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    print(json.dumps(info, indent=1), flush=True)
    results = []
    fails = 0
    for part, fn in [("check", check_all), ("errors", check_errors), ("loop", loop_check),
                     ("cb", command_buffer_check), ("time", bench), ("chain", bench_chain),
                     ("looptime", bench_loop_graph)]:
        if part not in parts:
            continue
        try:
            fails += fn(jax, results)
        except Exception as e:  # one part failing must not hide the others
            fails += 1
            results.append({"part": part, "ok": False, "exception": str(e)[:2000]})
            print(f"FAIL part {part}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    summary = {"info": info, "jax": jax.__version__, "device": str(jax.devices()[0]), "results": results}
    if "graphs" in parts:
        rc = graphs_child(args)
        summary["graphs"] = {"child_exit": rc}
        fails += 0 if rc == 0 else 1
    if "loopgraph" in parts:
        rc = loop_graph_child(args)
        summary["loopgraph"] = {"child_exit": rc}
        fails += 0 if rc == 0 else 1
    path = args.json or os.path.join(args.out, "xla_ffi.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"{'ALL OK' if fails == 0 else f'{fails} FAILED'}; results in {path}", flush=True)
    return 0 if fails == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

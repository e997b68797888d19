#!/usr/bin/env python3
"""Our CPU rows side by side with ONNX Runtime and PyTorch (CPU), same weights and inputs.

    python3 -m venv /work/venv-cpu && /work/venv-cpu/bin/pip install numpy onnx onnxruntime torch
    /work/venv-cpu/bin/python bench/cpu/side.py            # from the repository root

Ours runs through the public native API (`mix run bench/cpu/side.exs`, one BEAM per thread
count with FUSED_KERNELS_CPU_THREADS set; the LSTM/GRU and dense rows use weights prepared
once with `FusedKernels.Rnn.prepare/3` / `FusedKernels.Dense.prepare/3`, as ONNX Runtime's
session and PyTorch's modules hold theirs), ONNX Runtime through its own LSTM/GRU ops (LSTM gates
i,o,f,c; GRU z,r,h with linear_before_reset=1, which is Axon's `r * (h Whn + bhn)`), PyTorch
through nn.LSTM/nn.GRU, scaled_dot_product_attention, matmul+gelu and a selective-scan loop
(mamba_ssm's selective_scan_ref). Outputs are checked against ONNX Runtime (PyTorch for the
scan, which has no ONNX Runtime row), then the three are timed in interleaved rounds (the order
rotating each round); the table prints median ms per call and ours / best. Before every batch
the script sleeps --settle milliseconds (default 100), the same for every library, so that no
thread pool of the batch before still spins beside the next one: with 2 threads ONNX Runtime's
intra-op worker spins ~60 ms after its last run, PyTorch's OpenMP worker ~10 ms, ours < 1 ms
(process CPU time sampled every 10 ms after a batch, 2-core EPYC, 2026-11-24); without the pause
a batch that followed ONNX Runtime's ran its whole length beside that spinning worker. Options:
--rounds, --threads 1,2, --rows, --settle, --trace (each batch's median and the batch that ran
before it).

--backbones gru,lstm,attention,mamba,jamba (or `all`) adds the backbone rows: our CPU engine
(`Backbone.load(..., backend: :cpu)`, predict per window, step per frame with the state
carried) against the same backbone with the same weights in PyTorch (the modules of
bench/gpu/side_backbone.py on the CPU) and, for windows, in ONNX Runtime (that module through
torch.onnx.export, where it exports). Outputs are checked against PyTorch (window, and a frame
from a fresh state); PyTorch's frame is timed from a state a window's worth of frames in.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

ROWS = ["lstm_window", "lstm_step", "gru_window", "gru_step", "attention", "dense", "scan"]
# Calls per row per round (about 0.1-0.5 s of work each).
CALLS = {"lstm_window": 20, "gru_window": 20, "lstm_step": 300, "gru_step": 300,
         "attention": 200, "dense": 100, "scan": 3}
B, T, I, H, LAYERS = 1, 60, 288, 256, 2
NAMES = {
    "lstm": (["wii", "wif", "wig", "wio"], ["whi", "whf", "whg", "who"], ["bi", "bf", "bg", "bo"]),
    "gru": (["wir", "wiz", "win"], ["whr", "whz", "whn"], ["br", "bz", "bin", "bhn"]),
}


def write(dir_, row, tensors):
    path = os.path.join(dir_, row)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "manifest.txt"), "w") as m:
        for name, a in tensors.items():
            a = np.ascontiguousarray(a, dtype="<f4")
            a.tofile(os.path.join(path, name + ".f32"))
            m.write(f"{name} {','.join(str(d) for d in a.shape)}\n")


def rnn_tensors(rng, cell, seq):
    ins, hids, biases = NAMES[cell]
    t = {"x": rng.uniform(-1, 1, (B, seq, I)).astype(np.float32)}
    inp = I
    for l in range(LAYERS):
        for n in ins:
            t[f"l{l}_{n}"] = rng.uniform(-1, 1, (inp, H)).astype(np.float32) / np.sqrt(inp)
        for n in hids:
            t[f"l{l}_{n}"] = rng.uniform(-1, 1, (H, H)).astype(np.float32) / np.sqrt(H)
        for n in biases:
            t[f"l{l}_{n}"] = rng.uniform(-0.2, 0.2, (H,)).astype(np.float32)
        t[f"l{l}_h0"] = rng.uniform(-0.5, 0.5, (B, H)).astype(np.float32)
        if cell == "lstm":
            t[f"l{l}_c0"] = rng.uniform(-0.5, 0.5, (B, H)).astype(np.float32)
        inp = H
    return t


def make_inputs(rng):
    rows = {}
    for cell in ["lstm", "gru"]:
        rows[f"{cell}_window"] = rnn_tensors(rng, cell, T)
        rows[f"{cell}_step"] = rnn_tensors(rng, cell, 1)
    rows["attention"] = {n: rng.standard_normal((1, 60, 4, 64)).astype(np.float32) for n in "qkv"}
    rows["dense"] = {
        "x": rng.standard_normal((60, 256)).astype(np.float32),
        "kernel": (rng.standard_normal((256, 1024)) / 16).astype(np.float32),
        "bias": (rng.standard_normal(1024) * 0.1).astype(np.float32),
    }
    bb, d, l, n = 32, 512, 60, 16
    rows["scan"] = {
        "u": rng.standard_normal((bb, l, d)).astype(np.float32),
        "delta": (rng.standard_normal((bb, l, d)) * 0.5 - 1).astype(np.float32),
        "a": -np.exp(rng.uniform(0, 2, (d, n))).astype(np.float32),
        "b": rng.standard_normal((bb, l, n)).astype(np.float32),
        "c": rng.standard_normal((bb, l, n)).astype(np.float32),
        "d": rng.standard_normal(d).astype(np.float32),
    }
    return rows


# ---------------------------------------------------------------- ONNX Runtime

def onnx_rnn(cell, t, step):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    ins, hids, biases = NAMES[cell]
    nodes, inits, g_in, g_out = [], [], [], []
    seq = 1 if step else T
    g_in.append(helper.make_tensor_value_info("X", TensorProto.FLOAT, [seq, B, I]))
    inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "ax1"))
    x = "X"
    for l in range(LAYERS):
        w = {n: t[f"l{l}_{n}"] for n in ins + hids + biases}
        zero = np.zeros(H, np.float32)
        if cell == "lstm":  # ONNX gate order i, o, f, c
            W = np.concatenate([w["wii"].T, w["wio"].T, w["wif"].T, w["wig"].T])
            R = np.concatenate([w["whi"].T, w["who"].T, w["whf"].T, w["whg"].T])
            Bv = np.concatenate([w["bi"], w["bo"], w["bf"], w["bg"], zero, zero, zero, zero])
        else:  # z, r, h; Wb then Rb; Axon's bhn is Rbh under linear_before_reset
            W = np.concatenate([w["wiz"].T, w["wir"].T, w["win"].T])
            R = np.concatenate([w["whz"].T, w["whr"].T, w["whn"].T])
            Bv = np.concatenate([w["bz"], w["br"], w["bin"], zero, zero, w["bhn"]])
        for nm, a in [(f"W{l}", W[None]), (f"R{l}", R[None]), (f"B{l}", Bv[None])]:
            inits.append(numpy_helper.from_array(a.astype(np.float32), nm))
        inputs = [x, f"W{l}", f"R{l}", f"B{l}"]
        outs = [f"Y{l}", f"Yh{l}"] + ([f"Yc{l}"] if cell == "lstm" else [])
        if step:
            g_in.append(helper.make_tensor_value_info(f"h0_{l}", TensorProto.FLOAT, [1, B, H]))
            inputs += ["", f"h0_{l}"]
            if cell == "lstm":
                g_in.append(helper.make_tensor_value_info(f"c0_{l}", TensorProto.FLOAT, [1, B, H]))
                inputs.append(f"c0_{l}")
            g_out.append(helper.make_tensor_value_info(f"Yh{l}", TensorProto.FLOAT, [1, B, H]))
            if cell == "lstm":
                g_out.append(helper.make_tensor_value_info(f"Yc{l}", TensorProto.FLOAT, [1, B, H]))
        attrs = {"hidden_size": H}
        if cell == "gru":
            attrs["linear_before_reset"] = 1
        nodes.append(helper.make_node(cell.upper(), inputs, outs, **attrs))
        nodes.append(helper.make_node("Squeeze", [f"Y{l}", "ax1"], [f"S{l}"]))
        x = f"S{l}"
    g_out.insert(0, helper.make_tensor_value_info(x, TensorProto.FLOAT, [seq, B, H]))
    graph = helper.make_graph(nodes, cell, g_in, g_out, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnx_attention():
    from onnx import TensorProto, helper, numpy_helper

    s, d = 60, 64
    mask = np.triu(np.full((s, s), -np.inf, np.float32), 1)
    inits = [numpy_helper.from_array(mask, "mask"),
             numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "scale")]
    nodes = [
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v"], ["vt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qt", "kt"], ["s0"]),
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Add", ["s1", "mask"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vt"], ["o"]),
        helper.make_node("Transpose", ["o"], ["out"], perm=[0, 2, 1, 3]),
    ]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, s, 4, d])
    graph = helper.make_graph(nodes, "attn", [vi("q"), vi("k"), vi("v")], [vi("out")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnx_dense(t):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(t["kernel"], "W"), numpy_helper.from_array(t["bias"], "b")]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y0"]),
        helper.make_node("Add", ["y0", "b"], ["y1"]),
        helper.make_node("Gelu", ["y1"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [60, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [60, 1024])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


class Ort:
    def __init__(self, rows, threads):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.rows = rows
        self.sess = {}
        mk = lambda m: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for cell in ["lstm", "gru"]:
            self.sess[f"{cell}_window"] = mk(onnx_rnn(cell, rows[f"{cell}_window"], False))
            self.sess[f"{cell}_step"] = mk(onnx_rnn(cell, rows[f"{cell}_step"], True))
        self.sess["attention"] = mk(onnx_attention())
        self.sess["dense"] = mk(onnx_dense(rows["dense"]))

    def has(self, row):
        return row in self.sess

    def runner(self, row):
        t, s = self.rows[row], self.sess[row]
        if row.endswith("_window"):
            feeds = {"X": np.ascontiguousarray(t["x"].transpose(1, 0, 2))}
            return lambda state: (s.run(None, feeds)[0].transpose(1, 0, 2), None)
        if row.endswith("_step"):
            lstm = row.startswith("lstm")
            x = np.ascontiguousarray(t["x"].transpose(1, 0, 2))

            def run(state):
                if state is None:
                    state = {}
                    for l in range(LAYERS):
                        state[f"h0_{l}"] = t[f"l{l}_h0"][None]
                        if lstm:
                            state[f"c0_{l}"] = t[f"l{l}_c0"][None]
                outs = s.run(None, {"X": x, **state})
                nxt, k = {}, 1
                for l in range(LAYERS):
                    nxt[f"h0_{l}"] = outs[k]; k += 1
                    if lstm:
                        nxt[f"c0_{l}"] = outs[k]; k += 1
                return outs[0].transpose(1, 0, 2), nxt
            return run
        if row == "attention":
            feeds = {n: t[n] for n in "qkv"}
            return lambda state: (s.run(None, feeds)[0], None)
        if row == "dense":
            feeds = {"x": t["x"]}
            return lambda state: (s.run(None, feeds)[0], None)
        raise KeyError(row)


# ---------------------------------------------------------------- PyTorch

class Torch:
    def __init__(self, rows, threads):
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.rows = rows
        self.mods = {}
        for cell in ["lstm", "gru"]:
            for kind in ["window", "step"]:
                self.mods[f"{cell}_{kind}"] = self.rnn(cell, rows[f"{cell}_{kind}"])

    def rnn(self, cell, t):
        torch = self.torch
        ins, hids, biases = NAMES[cell]
        m = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(I, H, num_layers=LAYERS, batch_first=True)
        with torch.no_grad():
            for l in range(LAYERS):
                w = lambda n: torch.from_numpy(t[f"l{l}_{n}"])
                zero = torch.zeros(H)
                # torch gate orders: LSTM i,f,g,o (Axon's); GRU r,z,n (Axon's), b_hn in bias_hh.
                getattr(m, f"weight_ih_l{l}").copy_(torch.cat([w(n).T for n in ins]))
                getattr(m, f"weight_hh_l{l}").copy_(torch.cat([w(n).T for n in hids]))
                if cell == "lstm":
                    getattr(m, f"bias_ih_l{l}").copy_(torch.cat([w(n) for n in biases]))
                    getattr(m, f"bias_hh_l{l}").zero_()
                else:
                    getattr(m, f"bias_ih_l{l}").copy_(torch.cat([w("br"), w("bz"), w("bin")]))
                    getattr(m, f"bias_hh_l{l}").copy_(torch.cat([zero, zero, w("bhn")]))
        return m.eval()

    def runner(self, row):
        torch, t = self.torch, self.rows[row]
        if row.endswith("_window"):
            m, x = self.mods[row], torch.from_numpy(t["x"])
            def run(state):
                with torch.inference_mode():
                    return m(x)[0].numpy(), None
            return run
        if row.endswith("_step"):
            m, x = self.mods[row], torch.from_numpy(t["x"])
            lstm = row.startswith("lstm")
            def run(state):
                with torch.inference_mode():
                    if state is None:
                        h = torch.from_numpy(np.stack([t[f"l{l}_h0"] for l in range(LAYERS)]))
                        if lstm:
                            c = torch.from_numpy(np.stack([t[f"l{l}_c0"] for l in range(LAYERS)]))
                            state = (h, c)
                        else:
                            state = h
                    y, nxt = m(x, state)
                    return y.numpy(), nxt
            return run
        if row == "attention":
            q, k, v = (torch.from_numpy(t[n]).transpose(1, 2) for n in "qkv")
            f = torch.nn.functional.scaled_dot_product_attention
            def run(state):
                with torch.inference_mode():
                    return f(q, k, v, is_causal=True).transpose(1, 2).numpy(), None
            return run
        if row == "dense":
            x, w, b = (torch.from_numpy(t[n]) for n in ["x", "kernel", "bias"])
            def run(state):
                with torch.inference_mode():
                    return torch.nn.functional.gelu(torch.addmm(b, x, w)).numpy(), None
            return run
        if row == "scan":
            u, dl, a, bm, cm, d = (torch.from_numpy(t[n]) for n in ["u", "delta", "a", "b", "c", "d"])
            def run(state):
                # mamba_ssm's selective_scan_ref, in our {batch, seq, dim} layout.
                with torch.inference_mode():
                    delta = torch.nn.functional.softplus(dl)
                    x = torch.zeros(u.shape[0], u.shape[2], a.shape[1])
                    ys = []
                    for i in range(u.shape[1]):
                        dA = torch.exp(delta[:, i, :, None] * a)
                        dBu = delta[:, i, :, None] * bm[:, i, None, :] * u[:, i, :, None]
                        x = dA * x + dBu
                        ys.append(torch.einsum("bdn,bn->bd", x, cm[:, i]))
                    y = torch.stack(ys, dim=1) + u * d
                    return y.numpy(), None
            return run
        raise KeyError(row)


# ---------------------------------------------------------------- ours (the BEAM)

class Ours:
    def __init__(self, dir_, threads, root):
        env = dict(os.environ, FUSED_KERNELS_CPU_THREADS=str(threads), FUSED_KERNELS_DEVICE="cpu")
        self.p = subprocess.Popen(["mix", "run", "bench/cpu/side.exs", dir_], cwd=root, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.dir = dir_
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("side.exs exited before it was ready")
            if line.startswith("ready"):
                self.ready = line.strip()
                break

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        if line.startswith("error") or not line:
            raise RuntimeError(f"side.exs: {cmd}: {line}")
        return line

    def time(self, row, n):
        return [float(v) for v in self.ask(f"time {row} {n}").split()[1:]]

    def output(self, row, shape):
        self.ask(f"check {row}")
        return np.fromfile(os.path.join(self.dir, row, "ours.f32"), dtype="<f4").reshape(shape)

    def close(self):
        self.p.stdin.close()
        self.p.wait()


# ---------------------------------------------------------------- backbones

BACKBONES = ["gru", "lstm", "attention", "mamba", "jamba"]
BACKBONE_CALLS = {"window": {"gru": 20, "lstm": 20, "attention": 20, "mamba": 5, "jamba": 3},
                  "frame": {"gru": 200, "lstm": 200, "attention": 100, "mamba": 50, "jamba": 30}}


class Backbones:
    """PyTorch (and ONNX Runtime for windows) runners of the backbones side.exs exported."""

    def __init__(self, dir_, kinds, threads):
        import torch
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
        import side_backbone as sb

        torch.set_num_threads(threads)
        self.torch, self.dir, self.threads = torch, os.path.join(dir_, "backbone"), threads
        self.mods, self.wins, self.onnx = {}, {}, {}
        for kind in kinds:
            p = sb.load(kind, self.dir)
            if kind in sb.GATES:
                # Plain tensors, not trainable parameters: the ONNX export takes them as constants.
                self.mods[kind] = sb.Backbone(kind, p).eval().requires_grad_(False)
            else:
                self.mods[kind] = sb.Seq(kind, p, device="cpu")
            self.wins[kind] = torch.from_numpy(self.read(kind, "window").reshape(1, 60, 288))

    def read(self, kind, what):
        return np.fromfile(os.path.join(self.dir, f"{kind}_{what}.bin"), dtype="<f4")

    def fresh(self, kind):
        m = self.mods[kind]
        return m.init_state() if hasattr(m, "init_state") else None

    def checks(self, kind):
        """rel L2 of ours vs PyTorch: (window, frame from a fresh state)."""
        m, torch = self.mods[kind], self.torch
        with torch.inference_mode():
            win = m(self.wins[kind])[0].numpy()
            frame = m(self.wins[kind][:, -1:], self.fresh(kind))[0].numpy()
        return rel_l2(self.read(kind, "out"), win), rel_l2(self.read(kind, "frame_out"), frame)

    def torch_runner(self, kind, mode):
        m, torch, x = self.mods[kind], self.torch, self.wins[kind]
        if mode == "window":
            def run(state):
                with torch.inference_mode():
                    return m(x)[0].numpy(), None
            return run
        frame = x[:, -1:]
        with torch.inference_mode():
            state = self.fresh(kind)
            for _ in range(60):
                _, state = m(frame, state)

        def run(_):
            with torch.inference_mode():
                return m(frame, state)[0].numpy(), None
        return run

    def onnx_runner(self, kind):
        """The window through ONNX Runtime, or (None, why not)."""
        import onnxruntime as ort
        torch, m = self.torch, self.mods[kind]

        class Window(torch.nn.Module):
            def forward(self, x):
                return m(x)[0]

        path = os.path.join(self.dir, f"{kind}.onnx")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            with torch.inference_mode():
                torch.onnx.export(Window(), (self.wins[kind],), path, input_names=["x"],
                                  output_names=["y"], opset_version=17, dynamo=False)
            so = ort.SessionOptions()
            so.intra_op_num_threads = self.threads
            so.inter_op_num_threads = 1
            s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        except Exception as e:  # an exporter that cannot take the module: report, keep torch
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        feeds = {"x": self.wins[kind].numpy()}
        out = s.run(None, feeds)[0]
        return (lambda state: (s.run(None, feeds)[0], None)), rel_l2(self.read(kind, "out"), out)


def settle(ms):
    """Sleeps `ms` milliseconds between two batches (see the module doc)."""
    if ms > 0:
        time.sleep(ms / 1e3)


def time_py(run, n):
    state, out = None, []
    for _ in range(n):
        t0 = time.perf_counter()
        _, state = run(state)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--backbones", default="", help="gru,lstm,attention,mamba,jamba or all")
    ap.add_argument("--settle", type=float, default=100.0,
                    help="ms slept before every batch, the same for every library (0: none)")
    ap.add_argument("--trace", action="store_true",
                    help="print each batch's median with the batch that ran before it")
    args = ap.parse_args()
    rows_sel = [r for r in args.rows.split(",") if r]
    kinds = BACKBONES if args.backbones == "all" else [k for k in args.backbones.split(",") if k]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rng = np.random.default_rng(20261123)
    rows = make_inputs(rng)
    import onnxruntime
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    print(f"onnxruntime {onnxruntime.__version__}, torch {torch_version or 'not installed (skipped)'}, "
          f"numpy {np.__version__}; {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(prefix="fk_side_") as dir_:
        for row, t in rows.items():
            write(dir_, row, t)
        results = {}
        for threads in [int(v) for v in args.threads.split(",")]:
            ours = Ours(dir_, threads, root)
            ort = Ort(rows, threads)
            tch = Torch(rows, threads) if torch_version else None
            print(f"\n== {threads} thread(s); ours: {ours.ready}")
            runners = {}
            if kinds:
                ours.ask(f"backbones {','.join(kinds)}")
                bb = Backbones(dir_, kinds, threads)
                for kind in kinds:
                    ew, ef = bb.checks(kind)
                    onnx_run, onnx_note = bb.onnx_runner(kind)
                    note = (f", onnxruntime window {onnx_note:.1e}" if onnx_run
                            else f"; no onnxruntime row ({onnx_note})")
                    bad = "" if max(ew, ef) <= 1e-4 else "  <-- MISMATCH"
                    print(f"check backbone {kind}: rel L2 ours vs pytorch: window {ew:.1e}, "
                          f"frame {ef:.1e}{note}{bad}")
                    for mode in ["window", "frame"]:
                        row = f"backbone_{kind}_{mode}"
                        CALLS[row] = BACKBONE_CALLS[mode][kind]
                        impls = {"ours": None, "pytorch": bb.torch_runner(kind, mode)}
                        if mode == "window" and onnx_run:
                            impls["onnxruntime"] = onnx_run
                        runners[row] = impls
            row_order = rows_sel + [r for r in runners if r.startswith("backbone_")]
            for row in rows_sel:
                impls = {"ours": None}
                if ort.has(row):
                    impls["onnxruntime"] = ort.runner(row)
                if tch:
                    impls["pytorch"] = tch.runner(row)
                runners[row] = impls
                # One call of each from the same inputs; compared with ORT (PyTorch for the scan).
                outs = {k: r(None)[0] for k, r in impls.items() if r}
                ref_name = "onnxruntime" if "onnxruntime" in outs else "pytorch"
                if ref_name in outs:
                    ref = outs[ref_name]
                    mine = ours.output(row, ref.shape)
                    errs = {k: rel_l2(v, ref) for k, v in outs.items() if k != ref_name}
                    errs["ours"] = rel_l2(mine, ref)
                    ok = all(e <= 1e-4 for e in errs.values())
                    print(f"check {row}: rel L2 vs {ref_name}: "
                          + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
                          + ("" if ok else "  <-- MISMATCH"))
            samples = {}
            prev = "the checks"
            for r in range(args.rounds):
                for row in row_order:
                    n = CALLS[row]
                    # The order rotates each round: a batch right after another library's
                    # (whose pool threads may still spin for a while) is each one's turn alike.
                    order = list(runners[row].items())
                    order = order[r % len(order):] + order[:r % len(order)]
                    for name, run in order:
                        settle(args.settle)
                        ms = ours.time(row, n) if name == "ours" else time_py(run, n)
                        if args.trace:
                            print(f"trace round {r} {row} {name} after {prev}: "
                                  f"{float(np.median(ms)):.3f} ms", flush=True)
                        prev = f"{name} ({row})"
                        samples.setdefault((row, name), []).extend(ms[1:] if r == 0 else ms)
            ours.close()
            print(f"{'row':<24} {'ours':>9} {'onnxrt':>9} {'pytorch':>9} {'ours/best':>9}   (median ms per call)")
            for row in row_order:
                med = {name: float(np.median(samples[(row, name)])) for name in runners[row]}
                best = min(v for k, v in med.items() if k != "ours") if len(med) > 1 else float("nan")
                cell = lambda k: f"{med[k]:9.3f}" if k in med else f"{'-':>9}"
                print(f"{row:<24} {cell('ours')} {cell('onnxruntime')} {cell('pytorch')} {med['ours'] / best:9.2f}")
                results[(threads, row)] = med
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PyTorch eager and CUDA-graph side by side with `mix bench`'s backbone rows: the same backbones (LSTM/GRU:
LayerNorm → cuDNN LSTM/GRU → LayerNorm per layer; attention with SDPA; Mamba / Jamba with the
scan as an eager loop; last position) with the same weights
(exported by `mix bench --export DIR --json BENCH_JSON`, which records DIR in the JSON), checked against our output on an
exported window, then timed like ours: wall clock around the call until the device is idle,
input from and output to the host, median of many after warm-up. The CUDA-graph anchor
captures the window and the frame once (static device input, host copies around the replay)
and checks the replayed window against our output too.

Usage: python3 bench/gpu/side_backbone.py BENCH_JSON [DIR]   (DIR: the JSON's export directory)
(bench/cpu/side.py imports the modules for its CPU backbone rows.)"""
import json
import os
import sys

import numpy as np
import torch

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
GATES = {"lstm": (["wii", "wif", "wig", "wio"], ["whi", "whf", "whg", "who"], ["bi", "bf", "bg", "bo"]),
         "gru": (["wir", "wiz", "win"], ["whr", "whz", "whn"], ["br", "bz", "bin", "bhn"])}


def load(kind, dir_):
    index = json.load(open(f"{dir_}/{kind}_params.json"))
    data = open(f"{dir_}/{kind}_params.bin", "rb").read()
    t = {}
    for name, (off, shape) in index.items():
        n = int(np.prod(shape))
        t[name] = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=n, offset=off).reshape(shape).copy())
    return t


class Backbone(torch.nn.Module):
    def __init__(self, kind, p, layers=2, embed=288, hidden=256, eps=1e-6):
        super().__init__()
        self.kind, self.layers = kind, layers
        self.norms = torch.nn.ModuleList()
        self.rnns = torch.nn.ModuleList()
        ln = lambda name, n: self._ln(p, name, n, eps)
        self.norms.append(ln("input_norm", embed))
        ins, hids, bs = GATES[kind]
        for l in range(1, layers + 1):
            inp = embed if l == 1 else hidden
            cell = getattr(torch.nn, kind.upper())(inp, hidden, batch_first=True)
            with torch.no_grad():
                cell.weight_ih_l0.copy_(torch.cat([p[f"rnn_{l}/input_kernel/{g}"].T for g in ins]))
                cell.weight_hh_l0.copy_(torch.cat([p[f"rnn_{l}/hidden_kernel/{g}"].T for g in hids]))
                if kind == "lstm":
                    cell.bias_ih_l0.copy_(torch.cat([p[f"rnn_{l}/bias/{b}"] for b in bs]))
                    cell.bias_hh_l0.zero_()
                else:  # Axon/torch GRU: b_hn sits inside the reset product, as torch's b_hn
                    cell.bias_ih_l0.copy_(torch.cat([p[f"rnn_{l}/bias/{b}"] for b in bs[:3]]))
                    cell.bias_hh_l0.copy_(torch.cat([torch.zeros(2 * hidden), p[f"rnn_{l}/bias/bhn"]]))
            self.rnns.append(cell)
            self.norms.append(ln(f"rnn_{l}_norm", hidden))

    @staticmethod
    def _ln(p, name, n, eps):
        m = torch.nn.LayerNorm(n, eps=eps)
        with torch.no_grad():
            m.weight.copy_(p[f"{name}/gamma"])
            m.bias.copy_(p[f"{name}/beta"])
        return m

    def forward(self, x, state=None):
        x = self.norms[0](x)
        new = []
        for l, rnn in enumerate(self.rnns):
            x, s = rnn(x, None if state is None else state[l])
            new.append(s)
            x = self.norms[l + 1](x)
        return x[:, -1], new


F = torch.nn.functional


class Seq:
    """Attention / Mamba / Jamba backbones in eager PyTorch (SDPA for attention, the selective
    scan as a plain loop over time), a window forward and a one-frame step with KV caches of the
    last 60 frames and Mamba (conv, SSM) state, the same maths as FusedKernels.Backbone."""

    def __init__(self, kind, p, window=60, heads=4, hidden=256, device="cuda"):
        self.kind, self.p, self.window, self.heads, self.hidden = kind, {k: v.to(device) for k, v in p.items()}, window, heads, hidden
        self.device = device
        if kind == "attention":
            self.plan = [("attn", str(l)) for l in (1, 2)]
        elif kind == "mamba":
            self.plan = [("mamba", f"mamba_{l}") for l in (1, 2)]
        else:
            self.plan = [("pre" if l % 3 == 0 else "mamba", f"jamba_{l}") for l in range(1, 7)]

    def d(self, x, n, act=None):
        y = x @ self.p[f"{n}/kernel"] + self.p[f"{n}/bias"]
        return F.gelu(y) if act else y

    def ln(self, x, n, eps=1e-6):
        return F.layer_norm(x, (x.shape[-1],), self.p[f"{n}/gamma"], self.p[f"{n}/beta"], eps)

    def attn(self, x, pre, qk, cache, count):
        b, t, _ = x.shape
        sp = lambda y: y.view(b, t, self.heads, -1)
        q, k, v = sp(self.d(x, f"{pre}_q")), sp(self.d(x, f"{pre}_k")), sp(self.d(x, f"{pre}_v"))
        if qk:
            q, k = F.layer_norm(q, (q.shape[-1],), eps=1e-6), F.layer_norm(k, (k.shape[-1],), eps=1e-6)
        if cache is None:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            new = None
        else:
            kc, vc = torch.cat([cache[0][:, 1:], k], 1), torch.cat([cache[1][:, 1:], v], 1)
            n = min(count, self.window)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, -n:].transpose(1, 2), vc[:, -n:].transpose(1, 2))
            new = (kc, vc)
        return a.transpose(1, 2).reshape(b, t, self.hidden), new

    def mamba(self, x, n, state):
        p = self.p
        xz = self.d(self.ln(x, f"{n}_norm", 1e-5), f"{n}_in_proj")
        inner = xz.shape[-1] // 2
        xs, z = xz[..., :inner], xz[..., inner:]
        w = p[f"{n}_conv_dw_conv/kernel"]  # {k, 1, inner}
        k = w.shape[0]
        prev = torch.zeros(x.shape[0], k - 1, inner, device=x.device) if state is None else state[0]
        allx = torch.cat([prev, xs], 1)
        xc = F.conv1d(allx.transpose(1, 2), w.permute(2, 1, 0), p[f"{n}_conv_dw_conv/bias"], groups=inner).transpose(1, 2)
        xc = F.silu(xc)
        bc = self.d(xc, f"{n}_ssm_bc_proj")
        ns = bc.shape[-1] // 2
        dt = self.d(self.d(xc, f"{n}_ssm_dt_rank"), f"{n}_ssm_dt_proj")
        dt = F.softplus(dt).clamp(0.001, 0.1)
        A = -torch.arange(1, ns + 1, device=x.device, dtype=torch.float32).expand(inner, ns)
        h = torch.zeros(x.shape[0], inner, ns, device=x.device) if state is None else state[1]
        ys = []
        for t in range(x.shape[1]):
            h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * xc[:, t])[:, :, None] * bc[:, t, None, :ns]
            ys.append((h * bc[:, t, None, ns:]).sum(-1))
        y = torch.stack(ys, 1) * F.silu(z)
        return x + self.d(y, f"{n}_out_proj"), (allx[:, -(k - 1):], h)

    def __call__(self, x, state=None):
        count = None if state is None else state[0] + 1
        x = self.d(x, "input_proj")
        new = []
        for i, (kind, n) in enumerate(self.plan):
            st = None if state is None else state[1][i]
            if kind == "attn":
                a, s = self.attn(x, f"attn_{n}", False, st, count)
                x1 = self.ln(x + self.d(a, f"attn_{n}_out"), f"attn_{n}_norm")
                x = self.ln(x1 + self.d(self.d(x1, f"ffn_{n}_up", True), f"ffn_{n}_down"), f"ffn_{n}_norm")
            elif kind == "pre":
                a, s = self.attn(self.ln(x, f"{n}_attn_norm"), n, True, st, count)
                x = x + self.d(a, f"{n}_out")
            else:
                x, s = self.mamba(x, n, st)
            new.append(s)
        return x[:, -1], (count, new)

    def init_state(self, b=1):
        z = lambda *s: torch.zeros(*s, device=self.device)
        return (0, [(z(b, self.window, self.heads, 64), z(b, self.window, self.heads, 64)) if k != "mamba"
                    else (z(b, 3, 512), z(b, 512, 16)) for k, _ in self.plan])


def graphed(fn, static_in):
    """`fn(static_in)` captured as one CUDA graph (warmed on a side stream, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(static_in)
    return g, static_out


def replay(g, static_in, static_out, host_in):
    static_in.copy_(host_in, non_blocking=True)
    g.replay()
    return static_out.cpu()


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import wall_ms

    bench = json.load(open(sys.argv[1]))
    DIR = sys.argv[2] if len(sys.argv) > 2 else bench.get("export")
    if DIR is None:
        sys.exit(f"{sys.argv[1]} names no export directory: run mix bench with --export DIR, or pass DIR")
    rows = bench["rows"]
    ours = {(r["case"], r["backend"]): r for r in rows}
    print(f"\n{'backbone':24} {'ours cuda':>12} {'torch eager':>12} {'torch graph':>12} {'eager/ours':>10} {'graph/ours':>10}   max|ours-torch| eager, graph")
    for kind in ["attention", "lstm", "gru", "mamba", "jamba"]:
        if not os.path.exists(f"{DIR}/{kind}_params.json"):
            continue
        m = Backbone(kind, load(kind, DIR)).cuda().eval() if kind in GATES else Seq(kind, load(kind, DIR))
        win = np.fromfile(f"{DIR}/{kind}_window.bin", dtype="<f4").reshape(1, 60, 288)
        ref = np.fromfile(f"{DIR}/{kind}_out.bin", dtype="<f4")
        host_win = torch.from_numpy(win).pin_memory()
        host_frame = host_win[:, -1:].clone().pin_memory()
        with torch.no_grad():
            got = m(host_win.cuda())[0].cpu().numpy().ravel()
            diff = float(np.abs(got - ref).max())
            _, state = m(host_frame.cuda()) if kind in GATES else m(host_frame.cuda(), m.init_state())
            graphs = {}
            try:
                static_win, static_frame = host_win.cuda(), host_frame.cuda()
                gw, out_w = graphed(lambda x: m(x)[0], static_win)
                gf, out_f = graphed(lambda x: m(x, state)[0], static_frame)
                gdiff = float(np.abs(replay(gw, static_win, out_w, host_win).numpy().ravel() - ref).max())
                graphs = {"window": lambda: replay(gw, static_win, out_w, host_win),
                          "frame": lambda: replay(gf, static_frame, out_f, host_frame)}
            except Exception as e:  # report, keep the eager rows
                print(f"{kind}: CUDA graph capture failed: {e}")
                gdiff = float("nan")
            for mode, fn in [("window", lambda: m(host_win.cuda())[0].cpu()),
                             ("frame", lambda: m(host_frame.cuda(), state)[0].cpu())]:
                t = wall_ms(fn, warm=20, rep=300) * 1e3
                tg = wall_ms(graphs[mode], warm=20, rep=300) * 1e3 if mode in graphs else float("nan")
                r = ours.get((f"backbone {kind} {mode}", "cuda"))
                mine = r["median_ms"] * 1e3 if r else float("nan")
                print(json.dumps(dict(case=f"backbone {kind} {mode}", ours_us=mine, torch_us=t, torch_graph_us=tg,
                                      ratio=t / mine, graph_ratio=tg / mine, max_abs_diff=diff, graph_max_abs_diff=gdiff)))
                print(f"{kind + ' ' + mode:24} {mine:9.1f} us {t:9.1f} us {tg:9.1f} us {t / mine:9.2f}x {tg / mine:9.2f}x   {diff:.2e}, {gdiff:.2e}")


if __name__ == "__main__":
    main()

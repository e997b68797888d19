"""PyTorch eager side by side with `mix bench`'s backbone rows: the same LSTM/GRU backbones
(LayerNorm → cuDNN LSTM/GRU → LayerNorm per layer, last position) with the same weights
(exported by `mix bench` under FUSED_KERNELS_EXPORT_DIR), checked against our output on an
exported window, then timed like ours: wall clock around the call until the device is idle,
input from and output to the host, median of many after warm-up.

Usage: FUSED_KERNELS_EXPORT_DIR=DIR python3 bench/gpu/side_backbone.py BENCH_JSON"""
import json
import os
import sys
import time

import numpy as np
import torch

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
DIR = os.environ["FUSED_KERNELS_EXPORT_DIR"]
GATES = {"lstm": (["wii", "wif", "wig", "wio"], ["whi", "whf", "whg", "who"], ["bi", "bf", "bg", "bo"]),
         "gru": (["wir", "wiz", "win"], ["whr", "whz", "whn"], ["br", "bz", "bin", "bhn"])}


def load(kind):
    index = json.load(open(f"{DIR}/{kind}_params.json"))
    data = open(f"{DIR}/{kind}_params.bin", "rb").read()
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


def wall_us(fn, warm=20, rep=300):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e6)
    ts.sort()
    return ts[len(ts) // 2]


rows = json.load(open(sys.argv[1]))["rows"]
ours = {(r["case"], r["backend"]): r for r in rows}
print(f"\n{'backbone':24} {'ours cuda':>12} {'torch eager':>12} {'ratio':>7}   max|ours-torch|")
for kind in ["lstm", "gru"]:
    if not os.path.exists(f"{DIR}/{kind}_params.json"):
        continue
    m = Backbone(kind, load(kind)).cuda().eval()
    win = np.fromfile(f"{DIR}/{kind}_window.bin", dtype="<f4").reshape(1, 60, 288)
    ref = np.fromfile(f"{DIR}/{kind}_out.bin", dtype="<f4")
    host_win = torch.from_numpy(win)
    host_frame = host_win[:, -1:].clone()
    with torch.no_grad():
        got = m(host_win.cuda())[0].cpu().numpy().ravel()
        diff = float(np.abs(got - ref).max())
        _, state = m(host_frame.cuda())
        for mode, fn in [("window", lambda: m(host_win.cuda())[0].cpu()),
                         ("frame", lambda: m(host_frame.cuda(), state)[0].cpu())]:
            t = wall_us(fn)
            r = ours.get((f"backbone {kind} {mode}", "cuda"))
            mine = r["median_ms"] * 1e3 if r else float("nan")
            print(json.dumps(dict(case=f"backbone {kind} {mode}", ours_us=mine, torch_us=t, ratio=t / mine, max_abs_diff=diff)))
            print(f"{kind + ' ' + mode:24} {mine:9.1f} us {t:9.1f} us {t / mine:6.2f}x   {diff:.2e}")

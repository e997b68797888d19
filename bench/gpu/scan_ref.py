"""The PyTorch selective scan a user writes without a fused kernel: a sequential loop over the
steps (the anchor in ../shared/exphil.md). Shared by side_scan.py and side_mamba.py."""
import torch


def scan_loop(u, delta, A, B, C):
    b, l, d = u.shape
    x = torch.zeros(b, d, A.shape[1], device=u.device)
    ys = []
    for t in range(l):
        dA = torch.exp(delta[:, t, :, None] * A)
        x = dA * x + (delta[:, t, :, None] * u[:, t, :, None]) * B[:, t, None, :]
        ys.append((x * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1)

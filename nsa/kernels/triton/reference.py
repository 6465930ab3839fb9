"""A naive torch reference with the Triton launcher's signature (whole-T layout), for tests and benches.

Runs nsa.ops.branches.selected_branch (the torch backend's own code) over all T at once, in the input
dtype's compute dtype (fp32 for fp16/bf16, fp64 for fp64). Memory: B*T*Hkv*n*l'*(Dk+Dv) gathered.
"""

from __future__ import annotations

import math

import torch

from ...ops import branches


class _Cfg:
    def __init__(self, block_sel: int):
        self.block_sel = block_sel


def selected_attention_torch(q, k, v, indices, seq_start, cfg, scale=None, chunk=None):
    """Same contract as nsa.kernels.triton.selection.selected_attention_triton; output in q's dtype."""
    block_sel = int(cfg) if isinstance(cfg, int) else int(cfg.block_sel)
    cfg_ = cfg if not isinstance(cfg, int) else _Cfg(block_sel)
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    if seq_start is None:
        seq_start = torch.zeros(B, T, dtype=torch.long, device=q.device)
    elif seq_start.dim() == 1:
        seq_start = seq_start[None].expand(B, T)
    seq_start = seq_start.long()
    idx = indices.long()
    kc, vc = k.to(ct), v.to(ct)
    outs = []
    chunk = chunk or max(1, T)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        t = torch.arange(c0, c1, device=q.device)
        ss = seq_start[:, c0:c1]
        qc = q[:, c0:c1].to(ct).unflatten(2, (Hkv, G))
        o = branches.selected_branch(qc, kc, vc, idx[:, c0:c1], t[None] - ss, ss, cfg_, scale)
        outs.append(o.flatten(2, 3))
    out = torch.cat(outs, 1) if outs else q.new_zeros(B, 0, Hq, v.shape[-1], dtype=ct)
    return out.to(q.dtype)

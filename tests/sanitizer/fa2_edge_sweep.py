"""Edge-shape sweep of the FA-2 providers for compute-sanitizer (memcheck): forward and backward of the
cmp and win branches on tiny and odd shapes, dense and varlen (empty sequences). Exit 0 when every call
returned finite values; the sanitizer reports memory errors. Run by tests/sanitizer/test_memcheck.py
(`nox -s sanitizer`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: nsa
os.environ.setdefault("NSA_FA2_MIN_LEN_WIN", "1")
os.environ.setdefault("NSA_FA2_MIN_LEN_CMP", "1")

from nsa import (  # noqa: E402
    NSAConfig,
    nsa_attention,
    plan,  # noqa: E402
    telemetry,
)


def main() -> int:
    dev = torch.device("cuda")
    provs = [n for n in ("flash_attn", "torch_flash") if plan.PROVIDERS[n].availability(dev, True)[0]]
    cfg = NSAConfig(block_cmp=32, stride_cmp=16, block_sel=64, n_sel=4, window=48)
    cases = [  # (lengths or None, B, T, Hq, Hkv, Dk, Dv)
        (None, 1, 1, 4, 1, 64, 64), (None, 2, 31, 4, 2, 64, 64), (None, 1, 33, 8, 1, 128, 128),
        (None, 1, 97, 16, 1, 192, 128), (None, 1, 50, 4, 4, 256, 256),
        ([0, 1, 0, 31, 32, 47], 1, None, 8, 2, 128, 128), ([0, 0], 1, None, 4, 1, 64, 64),
        ([5, 0, 200], 1, None, 4, 1, 64, 64),
    ]
    bad = 0
    for prov in provs:
        for lengths, B, T, Hq, Hkv, Dk, Dv in cases:
            for dtype in (torch.float16, torch.bfloat16):
                cu = None
                if lengths is not None:
                    T = sum(lengths)
                    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
                q = torch.randn(B, T, Hq, Dk, device=dev, dtype=dtype, requires_grad=True)
                k = torch.randn(B, T, Hkv, Dk, device=dev, dtype=dtype, requires_grad=True)
                v = torch.randn(B, T, Hkv, Dv, device=dev, dtype=dtype, requires_grad=True)
                g = torch.rand(B, T, Hq, 3, device=dev, dtype=dtype)
                out = nsa_attention(q, k, v, g, cfg, backend=prov, cu_seqlens=cu)
                out.float().sum().backward() if T else None
                torch.cuda.synchronize()
                ok = bool(torch.isfinite(out).all()) and all(
                    x.grad is None or bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
                bad += not ok
                print(f"{prov:12} lengths={lengths} B={B} T={T} Hq={Hq} Hkv={Hkv} D={Dk}/{Dv} {dtype}: "
                      f"{'ok' if ok else 'NON-FINITE'}", flush=True)
    print("telemetry", telemetry.snapshot()["counts"])
    print(f"edge sweep: {bad} non-finite case(s), providers {provs}")
    return 1 if bad or not provs else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the fused and chunked executors share."""

from __future__ import annotations


def branch_kv(k, v, kv_cmp, kv_win):
    kc, vc = kv_cmp if kv_cmp is not None else (k, v)
    kw, vw = kv_win if kv_win is not None else (k, v)
    return kc, vc, kw, vw

"""Launch 1 of a decode step (grid B x Hkv): the token into the raw K/V, the window ring and the raw
compression ring; the mean of a compressed block that completes at t (compress="mlp": the launcher runs phi
in torch right after); t saved in the workspace (`pos`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .parts import _cmp_row, _let_next_start, _token_row


@triton.jit
def _append_kernel(
    SEQ, POS, KN, VN, KCN, VCN, KWN, VWN, KSEL, VSEL, KWIN, VWIN, KRAW, VRAW, KCMP, VCMP,
    skn_b, skn_h, svn_b, svn_h, skc_b, skc_h, svc_b, svc_h, skw_b, skw_h, svw_b, svw_h,
    Hkv, Dk, Dv, max_len, W, NB, BT, sbt,
    BLOCK_CMP: tl.constexpr, STRIDE_CMP: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, AVG: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    PDL: tl.constexpr,
):
    _let_next_start(PDL)  # at once: the compressed launch loads its queries, then waits for this launch to end
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.load(SEQ + b).to(tl.int64)
    if h == 0:
        tl.store(POS + b, t.to(tl.int32))
    rdk = tl.arange(0, BLOCK_DK)
    rdv = tl.arange(0, BLOCK_DV)
    mk = rdk < Dk
    mv = rdv < Dv
    k = tl.load(KN + b * skn_b + h * skn_h + rdk, mask=mk)
    v = tl.load(VN + b * svn_b + h * svn_h + rdv, mask=mv)
    kc = tl.load(KCN + b * skc_b + h * skc_h + rdk, mask=mk)
    vc = tl.load(VCN + b * svc_b + h * svc_h + rdv, mask=mv)
    kw = tl.load(KWN + b * skw_b + h * skw_h + rdk, mask=mk)
    vw = tl.load(VWN + b * svw_b + h * svw_h + rdv, mask=mv)
    srow = _token_row(BT, sbt, b, t, h, Hkv, max_len, True, PAGE, PAGED)
    tl.store(KSEL + srow * Dk + rdk, k, mask=mk)
    tl.store(VSEL + srow * Dv + rdv, v, mask=mv)
    sw = t % W
    tl.store(KWIN + ((b * W + sw) * Hkv + h) * Dk + rdk, kw, mask=mk)
    tl.store(VWIN + ((b * W + sw) * Hkv + h) * Dv + rdv, vw, mask=mv)
    sc = t % BLOCK_CMP
    tl.store(KRAW + ((b * BLOCK_CMP + sc) * Hkv + h) * Dk + rdk, kc, mask=mk)
    tl.store(VRAW + ((b * BLOCK_CMP + sc) * Hkv + h) * Dv + rdv, vc, mask=mv)
    if AVG:
        rel = t + 1 - BLOCK_CMP
        if rel >= 0:
            if rel % STRIDE_CMP == 0:
                i = rel // STRIDE_CMP
                rl = tl.arange(0, BLOCK_L)
                # the ring as it is after this token: the new one from registers (not re-read), the rest loaded
                old = (rl < BLOCK_CMP) & (rl != sc)
                kr = tl.load(KRAW + ((b * BLOCK_CMP + rl[:, None]) * Hkv + h) * Dk + rdk[None, :],
                             mask=old[:, None] & mk[None, :], other=0.0).to(tl.float32)
                kr = tl.where((rl == sc)[:, None], kc.to(tl.float32)[None, :], kr)
                vr = tl.load(VRAW + ((b * BLOCK_CMP + rl[:, None]) * Hkv + h) * Dv + rdv[None, :],
                             mask=old[:, None] & mv[None, :], other=0.0).to(tl.float32)
                vr = tl.where((rl == sc)[:, None], vc.to(tl.float32)[None, :], vr)
                km = tl.sum(kr, 0) / BLOCK_CMP
                vm = tl.sum(vr, 0) / BLOCK_CMP
                crow = _cmp_row(BT, sbt, b, i, h, Hkv, NB, True, STRIDE_CMP, PAGE, PAGED)
                tl.store(KCMP + crow * Dk + rdk, km.to(KCMP.dtype.element_ty), mask=mk)
                tl.store(VCMP + crow * Dv + rdv, vm.to(VCMP.dtype.element_ty), mask=mv)

"""Triton kernels of one NSA decode step (one new token per sequence, ragged positions): five launches, one
module each (append, cmp_win, score_topk, sel, combine), their shared helpers (parts) and the split plan
(workspace); the launcher is here.

Contract (same function as the torch step, nsa.branches.decode.naive): the cache (nsa.NSACache) holds sequence b's
cache_seqlens[b] tokens; the step appends its new token at position t_b = cache_seqlens[b] and returns
o [B, 1, Hq, Dv] = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win for that token, then cache_seqlens += 1.

Every program handles all G query heads of one KV head (the G rows of tl.dot, padded to 16), so each K/V
row is loaded once per group. Softmax state is fp32 in the exp2 domain (logits * scale * log2(e)).

1. append (grid B x Hkv): writes the token into the raw K/V, the window ring and the raw compression ring;
   if a compressed block completes at t (t - l + 1 >= 0 and (t - l + 1) % d == 0), writes its mean
   (compress="mlp": the launcher runs phi in torch right after). Saves t in the workspace (`pos`).
2. compressed attention (grid n_split_cmp x B*Hkv), flash-decoding style: a program takes a contiguous
   share of the visible compressed blocks and writes its partial (max, sum, unnormalised acc); it also
   keeps the raw logits of its blocks in a scratch row [G, max_blocks] (fp32) for the selection scores.
3. scores + top-n candidates (grid n_chunks x B*Hkv): the log-sum-exp of each head from the partials, then
   for a chunk of selection blocks j: score[j] = sum over the compressed blocks overlapping j (fixed
   order) of sum over the G heads (one reduction, the same for every block) of exp2(logit - lse). Every
   block's score goes through the same operations in the same order, so mathematically equal inputs give
   bitwise-equal scores. The chunk's best n - n_init - n_local non-forced candidates (no step selects more),
   as int64 keys (score bits << 32 | (2^31 - 1 - j)): larger key = higher score, then lower index, exactly the
   tie rule of top_n_blocks.
4. selected + window attention (grid (n_split_sel + n_split_win) x B*Hkv): each selection program merges
   the chunks' candidates (the global top-n of the candidates is the top-n of the chunks' top-n), adds the
   forced blocks (first n_init, the n_local ending at t // l'), sorts the set ascending, then attends its
   share of the selected blocks (tokens u <= t). Program 0 writes the indices [B, 1, Hkv, n_sel] (ascending,
   -1 padded). The window programs attend their share of the window ring's slots, partials like step 2.
   (Tuning.window_with_sel=False moves them into step 2's launch.)
5. combine (grid B*Hkv x Dv tiles): merges each branch's partials, applies the gates, writes o, and
   publishes cache_seqlens[b] = t + 1 (the only write to the lengths). Where it has at most 2 programs per
   SM (Tuning.early_combine), it starts with the selection programs and merges the compressed and window
   partials (the window's programs then in launch 2) before it waits for the selection's.

On sm 9.0 and later, launches 2-5 are programmatic dependent launches (Tuning.pdl): each starts as the
programs of the one before it finish their main loop, loads what the step was given (the queries, the gates)
and waits on the device for the rest; the window programs of launch 4 need no scores and run beside the end
of launch 3. H100, paper heads, bf16, CUDA graphs: 8k x 8 35.3 -> 32.1 us, 64k x 1 26.7 -> 24.1, 64k x 8
68.1 -> 65.9; 64k x 32 and 128k x 16 unchanged.

Nor did one launch of work items in place of launches 2-5 pay (the code: commit 807c070, `Tuning(fused=True)`; the
figures: bench/results/h200-cu130-torch2.11/decode-fused/). Each program took one item (a compressed, window,
scoring, selection or combine program's work, the same splits) from a queue by an atomic ticket, and waited on
per-(b, KV head) counters (release increments; relaxed polls, then one acquire) for the items it read, so that a
(b, KV head)'s scoring started as soon as its own compressed items ended; the results were bitwise those of the
five launches. H200, paper heads, bf16, CUDA graphs, both in one process: 64k x 8 49.1 -> 60.8 us, 64k x 1 20.7 ->
33.9, 8k x 8 28.0 -> 34.4, 64k x 32 144.3 -> 179.5 (150.6 with 128 blocks per scoring item). Its per-item trace at
64k x 1, every item resident from the start: the compressed items end at 10.0 us, the scoring at 16.1, the
selection at 25.1, the combine at 31.7, each dependent hop about 3.5 us longer than between launches under PDL;
neither counters on lines of their own, sleeping between polls, relaxed polls (acquire polls before), nor the waits
after the prologue's loads moved it. At 64k x 8 the 1056 scoring items held the program slots from 16.6 to 41.5 us.
Programs looping over items instead (persistent) took 255 registers, two programs per SM: 70.3 us.

Nor did splitting the batch into parts pay, so that a part's scoring, selection and combine overlap the next part's
compressed launch (the code: commit d16216a, `Tuning(batch_parts=P)`; the figures: bench/results/h200-cu130-
torch2.11/decode-parts/). The parts' compressed launches ran in the step's stream, each part's later launches in a
side stream of higher priority once its own compressed launch had ended. H200, paper heads, bf16, CUDA graphs:
64k x 8 50.2 -> 65.6 us (2 parts), 94.2 (4), 138.3 (8); 64k x 32 144.2 -> 148.5 (2), 170.4 (4); 8k x 8 29.0 ->
39.3 (2). In the graph each part's compressed launch started 2.5-3 us after the one before it had ended (the
event each part records ends the programmatic overlap of consecutive launches), and a part's launch, a quarter of
the batch in 176-396 programs of 1-3 key tiles, streamed its 16 MiB in 11-19 us: too few bytes per program.

Grids, splits and buffers depend on the cache's capacity only (DecodeWorkspace, made once per cache and
head count): the step allocates nothing but its output (and not even that with out=), never reads the
device back, and can be captured in a CUDA graph and replayed at every later position.
"""

from __future__ import annotations

import torch

from ...device import on_gpu
from ..common import LOG2E
from .append import _append_kernel
from .cmp_win import _cmp_win_kernel
from .combine import _combine_kernel
from .parts import _attend_tile, _fold_parts, _load_parts, _merge_parts, _store_partial, _window_partial
from .score_topk import _score_topk_kernel
from .sel import _merge_candidates, _sel_kernel
from .workspace import DecodeWorkspace, Tuning, _cdiv, max_free_blocks, pdl_supported, plan_combine

TUNING = Tuning()  # the launcher's default (tests and bench/tune_decode.py replace it)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_opts(device, warps: int, ws=None, stages: str | None = None, pdl: bool = False) -> dict:
    """Launch options on CUDA (the interpreter takes none); `stages` names the workspace's pipeline depth;
    `pdl`: a programmatic dependent launch (the workspace's plan; the kernels wait with _wait_previous)."""
    if not on_gpu(device):
        return {}
    opts = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": getattr(ws, stages)}
    return {**opts, "launch_pdl": True} if pdl else opts


def _storage(cache):
    """(raw k, raw v, compressed k, compressed v, page arguments) of a contiguous or paged cache: the kernels
    take the block table and its row stride, and PAGE / PAGED as constexprs (nsa.paged_cache for the layout)."""
    if getattr(cache, "page_size", None) is None:
        pages = {"args": (cache.cache_seqlens, 0), "meta": {"PAGE": 1, "PAGED": False}}  # table unused
        return cache.k_sel, cache.v_sel, cache.k_cmp, cache.v_cmp, pages
    bt = cache.block_table
    pages = {"args": (bt, bt.stride(0)), "meta": {"PAGE": cache.page_size, "PAGED": True}}
    return cache.k_pages, cache.v_pages, cache.k_cmp_pages, cache.v_cmp_pages, pages


def workspace_for(cache, Hq: int, tuning: Tuning | None = None) -> DecodeWorkspace:
    tuning = tuning or TUNING
    return cache.workspace(("triton_decode", Hq, tuning), lambda: DecodeWorkspace(cache, Hq, tuning))


def decode_step_triton(q, gates, cache, tokens, compress_fn=None, *, out=None, want_indices=False):
    """Run the five kernels (module doc). tokens: the validated (k, v, kc, vc, kw, vw) [B, 1, Hkv, D].

    Returns (o [B, 1, Hq, Dv] in q's dtype, indices int32 [B, 1, Hkv, n_sel]). The indices tensor is a
    fresh one when want_indices, else the workspace's (overwritten by the next step). Publishes the new
    lengths on the device (cache_seqlens += 1); the caller updates the host copy.
    """
    cfg = cache.config
    B, _, Hq, Dk = q.shape
    Hkv, Dv = cache.n_kv_heads, cache.d_v
    ws = workspace_for(cache, Hq)
    device = q.device
    q = _last_dim_contiguous(q)
    gates = _last_dim_contiguous(gates)
    k, v, kc, vc, kw, vw = (_last_dim_contiguous(x) for x in tokens)
    if out is None:
        out = torch.empty(B, 1, Hq, Dv, device=device, dtype=q.dtype)
    idx = torch.empty(B, 1, Hkv, cfg.n_sel, dtype=torch.int32, device=device) if want_indices else ws.indices
    qk_scale = cfg.softmax_scale(Dk) * LOG2E
    ieee = q.dtype == torch.float32
    NB, W = cache.cmp_capacity, cache.window_slots
    BH = B * Hkv
    ksel, vsel, kcmp, vcmp, pages = _storage(cache)
    _append_kernel[(B, Hkv)](
        cache.cache_seqlens, ws.pos, k, v, kc, vc, kw, vw,
        ksel, vsel, cache.k_win, cache.v_win, cache.k_raw_cmp, cache.v_raw_cmp, kcmp, vcmp,
        k.stride(0), k.stride(2), v.stride(0), v.stride(2), kc.stride(0), kc.stride(2), vc.stride(0), vc.stride(2),
        kw.stride(0), kw.stride(2), vw.stride(0), vw.stride(2),
        Hkv, Dk, Dv, cache.max_len, W, NB, *pages["args"],
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_L=ws.BLOCK_L, BLOCK_DK=ws.BLOCK_DK,
        BLOCK_DV=ws.BLOCK_DV, AVG=compress_fn is None, **pages["meta"], PDL=ws.pdl, **_launch_opts(device, 2),
    )
    if compress_fn is not None:  # phi is a torch module: the block completed at t (if any), from the raw ring
        cache.compress_step(compress_fn)
    _cmp_win_kernel[(ws.grid_cmp, BH)](
        q, ws.pos, kcmp, vcmp, cache.k_win, cache.v_win, ws.scratch, ws.pm, ws.pl, ws.pacc,
        q.stride(0), q.stride(2), Hkv, ws.G, Dk, Dv, NB, W, ws.n_split_cmp, ws.blocks_per_split, ws.slots_per_split,
        ws.n_parts, qk_scale, *pages["args"],
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_G=ws.BLOCK_G, BLOCK_N=ws.BLOCK_N,
        BLOCK_DK=ws.BLOCK_DK, BLOCK_DV=ws.BLOCK_DV, IEEE=ieee, **pages["meta"], PDL=ws.pdl,
        **_launch_opts(device, ws.tuning.warps_cmp, ws, "stages_cmp", ws.pdl),
    )
    _score_topk_kernel[(ws.n_chunks, BH)](
        ws.pos, ws.scratch, ws.pm, ws.pl, ws.cand, ws.scores,
        Hkv, ws.G, NB, ws.NJ, ws.n_split_cmp, ws.n_parts, ws.n_chunks,
        BLOCK_CMP=cfg.block_cmp, STRIDE_CMP=cfg.stride_cmp, BLOCK_SEL=cfg.block_sel, N_INIT=cfg.n_init,
        N_LOCAL=cfg.n_local, K_FREE=ws.K_FREE, N_PAD=ws.N_PAD, BLOCK_G=ws.BLOCK_G, CHUNK_J=ws.CHUNK_J,
        SPLIT_PAD=ws.SPLIT_PAD, PDL=ws.pdl, **_launch_opts(device, ws.tuning.warps_score, pdl=ws.pdl),
    )
    _sel_kernel[(ws.grid_sel, BH)](
        q, ws.pos, ws.cand, ksel, vsel, cache.k_win, cache.v_win, idx, ws.pm, ws.pl, ws.pacc,
        q.stride(0), q.stride(2), idx.stride(0), idx.stride(2), Hkv, ws.G, Dk, Dv, cache.max_len, W, ws.n_cand,
        ws.n_parts, ws.n_split_cmp + ws.n_split_win, ws.n_split_sel, ws.n_split_cmp, ws.slots_per_prog,
        ws.slots_per_split, qk_scale, *pages["args"],
        BLOCK_SEL=cfg.block_sel, N_INIT=cfg.n_init, N_LOCAL=cfg.n_local, N_SEL=cfg.n_sel, N_PAD=ws.N_PAD,
        NC_PAD=ws.NC_PAD, BLOCK_G=ws.BLOCK_G, BLOCK_N=ws.BLOCK_N_SEL, BLOCK_DK=ws.BLOCK_DK, BLOCK_DV=ws.BLOCK_DV,
        IEEE=ieee, **pages["meta"], PDL=ws.pdl, EARLY_NEXT=ws.early_combine,
        **_launch_opts(device, ws.tuning.warps_sel, ws, "stages_sel", ws.pdl),
    )
    _combine_kernel[(BH, _cdiv(Dv, ws.DV_TILE))](
        ws.pos, cache.cache_seqlens, ws.pm, ws.pl, ws.pacc, gates, out,
        gates.stride(0), gates.stride(2), gates.stride(3), out.stride(0), out.stride(2), Hkv, ws.G, Dv, ws.n_parts,
        ws.n_split_cmp, ws.n_split_win,
        BLOCK_G=ws.BLOCK_G, BLOCK_DV=ws.BLOCK_DV, DV_TILE=ws.DV_TILE, CHUNK_CMP=ws.CHUNK_CMP, CHUNK_WIN=ws.CHUNK_WIN,
        CHUNK_SEL=ws.CHUNK_SEL, PDL=ws.pdl, EARLY=ws.early_combine,
        **_launch_opts(device, ws.tuning.warps_combine, pdl=ws.pdl),
    )
    return out, idx


__all__ = ["DecodeWorkspace", "TUNING", "Tuning", "decode_step_triton", "max_free_blocks", "pdl_supported",
           "plan_combine", "workspace_for",
           "_append_kernel", "_attend_tile", "_cmp_win_kernel", "_combine_kernel", "_fold_parts", "_load_parts",
           "_merge_candidates", "_merge_parts", "_score_topk_kernel", "_sel_kernel", "_store_partial",
           "_window_partial"]

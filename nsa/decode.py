"""The decode entry points: `nsa_decode` (one step: each sequence's new token, its NSA output from the cache,
equal to prefill at that position) and `nsa_prefill` (outputs for the prompts, and the cache filled; into a
cache that holds tokens, the new ones appended). The cache: nsa.NSACache (contiguous, one buffer per
sequence) or nsa.PagedNSACache (a page pool and block tables, docs/serving.md); both paths read either.

Several tokens appended to every row (nsa_prefill into a non-empty cache) run as that many decode steps
on the Triton kernels when every row gets the same number and a step would run there (nsa.plan.plan_append),
else on the torch append (nsa.branches.decode.extend).

Two implementations of a step, chosen by `backend=` ("auto" | "torch" | "triton"): torch (the prefill
branches' per-chunk functions on the cache, nsa.branches.decode.naive) and triton (five launches per step,
no host sync, no allocation, static shapes, capturable in a CUDA graph: nsa.branches.decode.triton).
Planning decides (nsa.plan.plan_decode: a forced backend that cannot run raises NSAInputError with the
reason; "auto" takes the kernels on CUDA when their guards pass), and every decision is counted in
nsa.telemetry as (branch, backend, reason) for cmp, sel and win; nsa.run.decode_step runs it.
"""

from __future__ import annotations

import torch

from .cache import NSACache, n_cmp_blocks_dev
from .config import NSAConfig
from .plan import DECODE_BACKENDS, DECODE_BRANCHES, plan_append, plan_decode
from .run.decode_step import run_decode, run_decode_steps
from .validation import NSAInputError, check_qkv

plan_decode_backend = plan_decode  # the name this decision had before planning moved into nsa.plan


def _check_step(q, k, v, gates, cache: NSACache, cfg, kv_cmp, kv_win, compress_fn, out):
    """Every check of a decode step, before anything is written. Returns (k, v, kc, vc, kw, vw)."""
    if not isinstance(cache, NSACache):
        raise NSAInputError(f"cache must be an nsa.NSACache or nsa.PagedNSACache, got {type(cache).__name__}")
    if cfg != cache.config:
        raise NSAInputError("config differs from the cache's config")
    shapes = check_qkv(q, k, v, gates)
    if shapes.T != 1:
        raise NSAInputError(f"nsa_decode takes one new token per sequence (T=1), got T={shapes.T}: "
                            "nsa_prefill fills the cache and appends several tokens to a non-empty one")
    if shapes.B != cache.batch:
        raise NSAInputError(f"q has batch {shapes.B}, the cache holds {cache.batch} sequences")
    if q.device != cache.device:
        raise NSAInputError(f"q is on {q.device}, the cache on {cache.device}")
    if q.dtype != cache.dtype:
        raise NSAInputError(f"q has dtype {q.dtype}, the cache holds {cache.dtype}: create the cache with the "
                            "model's dtype")
    if q.shape[3] != cache.d_k:
        raise NSAInputError(f"q head dim {q.shape[3]} differs from the cache's d_k={cache.d_k}")
    if cfg.compress == "mlp" and compress_fn is None:
        raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v)")
    tokens = cache.branch_tokens(k, v, kv_cmp, kv_win)
    if out is not None:
        want = (cache.batch, 1, q.shape[2], cache.d_v)
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype
                or out.device != q.device):
            raise NSAInputError(f"out must be a {q.dtype} tensor of shape {list(want)} on {q.device}")
    cache.check_room(1)
    return tokens


def nsa_decode(q, k, v, gates, cache: NSACache, config: NSAConfig | None = None, *, kv_cmp=None, kv_win=None,
               compress_fn=None, return_indices=False, return_stats=False, backend="auto", out=None):
    """Append each sequence's new token ([B, 1, Hkv, D]) to `cache` and return its output [B, 1, Hq, Dv].

    q [B, 1, Hq, Dk], gates [B, 1, Hq, 3]; sequence b's token goes to position cache.cache_seqlens[b]
    (a PagedNSACache: into page block_table[b, t // page_size], taken from the free list when new).
    kv_cmp / kv_win / compress_fn as in nsa_attention. backend: "auto" | "torch" | "triton" (module doc).
    out: optional [B, 1, Hq, Dv] buffer for the output (static address, e.g. for CUDA graphs).
    return_indices adds the selected blocks [B, 1, Hkv, n_sel] int32 (ascending, -1 padded); return_stats
    a dict with the K/V bytes this step read from the cache (compressed blocks + selected tokens + window),
    counted from the cache (this reads the lengths back to the host: for benchmarks, not for serving).
    """
    cfg = config or cache.config
    tokens = _check_step(q, k, v, gates, cache, cfg, kv_cmp, kv_win, compress_fn, out)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, gates, *tokens))
    plan = plan_decode(backend, q, cache, needs_grad=needs_grad, record=True)
    res, indices = run_decode(plan, q, gates, cache, tokens, compress_fn, out=out,
                              want_indices=return_indices or return_stats)
    result = [res]
    if return_indices:
        result.append(indices)
    if return_stats:
        result.append(step_stats(cache, indices))
    return result[0] if len(result) == 1 else tuple(result)


def step_stats(cache: NSACache, indices) -> dict:
    """K/V bytes the step that just ran read from the cache, per branch, counted from the cache's state."""
    cfg = cache.config
    t = cache.cache_seqlens.long() - 1  # the step's positions
    Hkv = cache.n_kv_heads
    per_tok = (cache.d_k + cache.d_v) * cache.dtype.itemsize
    n_cmp = n_cmp_blocks_dev(t + 1, cfg)
    idx = indices[:, 0].long()  # [B, Hkv, n]
    lo = idx.clamp(min=0) * cfg.block_sel
    n_sel_tok = ((t[:, None, None] + 1 - lo).clamp(0, cfg.block_sel) * (idx >= 0)).sum()
    n_win = (t + 1).clamp(max=cache.window_slots)
    host_t = t.tolist()
    stats = {
        "position": host_t[0] if len(set(host_t)) == 1 else host_t,
        "cmp_blocks": int(n_cmp[0]) if len(set(host_t)) == 1 else n_cmp.tolist(),
        "kv_bytes_cmp": int(n_cmp.sum()) * Hkv * per_tok,
        "kv_bytes_sel": int(n_sel_tok) * per_tok,
        "kv_bytes_win": int(n_win.sum()) * Hkv * per_tok,
    }
    stats["kv_bytes"] = stats["kv_bytes_cmp"] + stats["kv_bytes_sel"] + stats["kv_bytes_win"]
    return stats


def nsa_prefill(q, k, v, gates, cache: NSACache, config: NSAConfig | None = None, *, cu_seqlens=None, kv_cmp=None,
                kv_win=None, compress_fn=None, backend="auto"):
    """Prefill: outputs for the prompts and the cache filled with their K/V (NSACache or PagedNSACache).

    Dense prompts q [B, T, Hq, Dk] (every sequence T tokens), or prompts of different lengths packed along
    T with cu_seqlens (int32 [batch + 1], B == 1: sequence b = tokens cu_seqlens[b]:cu_seqlens[b+1] goes to
    cache row b), the varlen convention of FlashAttention and serving engines. Returns [B, T, Hq, Dv].

    Into an empty cache: nsa_attention on the prompts (its fast paths, `backend`), then the cache written.
    Into a cache that already holds tokens (a prompt in chunks, a new sequence in a freed row beside
    running ones, the k draft tokens of speculative decoding's verify step): each new token attends the
    cached tokens and the new ones up to itself, equal to one prefill of the whole sequences; rows with
    no new tokens stay as they are. When every row gets the same number k >= 1 of tokens (dense, or
    cu_seqlens with k per row) and a decode step would run on the Triton decode kernels (plan_decode),
    this runs as k decode steps on them (cost: k decode steps; telemetry event ("pipeline", "append",
    "decode_steps")); otherwise on the torch path (nsa.branches.decode.extend; event "torch_ragged",
    "torch_backend" or "torch_planned"). backend there: "auto", "torch" or a prefill provider (the torch
    path), or "triton" (the decode steps forced). No gradient flows through an append.
    `cache.truncate(lengths)` then drops the rejected drafts (docs/serving.md).
    """
    from .functional import nsa_attention

    cfg = config or cache.config
    if not isinstance(cache, NSACache):
        raise NSAInputError(f"cache must be an nsa.NSACache or nsa.PagedNSACache, got {type(cache).__name__}")
    if cfg != cache.config:
        raise NSAInputError("config differs from the cache's config")
    if not cache.is_empty:
        return _extend(q, k, v, gates, cache, cfg, cu_seqlens, kv_cmp, kv_win, compress_fn, backend)
    if cu_seqlens is not None:
        cache.branch_tokens(k, v, kv_cmp, kv_win, batch=1)
        cache.check_cu_seqlens(cu_seqlens, k.shape[1])
    else:
        cache.branch_tokens(k, v, kv_cmp, kv_win)
    out = nsa_attention(q, k, v, gates, cfg, cu_seqlens=cu_seqlens, kv_cmp=kv_cmp, kv_win=kv_win,
                        compress_fn=compress_fn, backend=backend)
    cache.write(k, v, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn, cu_seqlens=cu_seqlens)
    return out

def _extend(q, k, v, gates, cache, cfg, cu_seqlens, kv_cmp, kv_win, compress_fn, backend):
    """nsa_prefill into a non-empty cache (its doc): every check first, then the append nsa.plan.plan_append
    chooses: k decode steps on the Triton decode kernels (nsa.run.decode_step.run_decode_steps) or the torch
    append (nsa.branches.decode.extend). Telemetry: (cmp|sel|win, backend, reason) as for a decode step, and
    the event ("pipeline", "append", route)."""
    from . import telemetry
    from .branches.decode.extend import extend

    packed = cu_seqlens is not None
    shapes = check_qkv(q, k, v, gates)
    if shapes.B != (1 if packed else cache.batch):
        raise NSAInputError(f"q has batch {shapes.B}, the cache holds {cache.batch} sequences"
                            + (" (packed input with cu_seqlens: batch 1)" if packed else ""))
    if q.device != cache.device or q.dtype != cache.dtype:
        raise NSAInputError(f"q is {q.dtype} on {q.device}, the cache holds {cache.dtype} on {cache.device}")
    if cfg.compress == "mlp" and compress_fn is None:
        raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v)")
    # cache.write's checks, in its order, before anything is written (the decode steps write token by token)
    tokens = cache.branch_tokens(k, v, kv_cmp, kv_win, batch=1 if packed else None)
    if packed:
        cu = cache.check_cu_seqlens(cu_seqlens, k.shape[1])
        news = [e - a for a, e in zip(cu, cu[1:])]
    else:
        news = [shapes.T] * cache.batch
    cache.check_room(news)
    plan = plan_append(backend, q, cache, news)
    for branch in DECODE_BRANCHES:
        telemetry.record(branch, plan.step.served, plan.step.reason, detail=plan.step.detail)
    telemetry.event("pipeline", "append", plan.route)
    with torch.no_grad():
        if not plan.steps:
            return extend(q, gates, cache, k, v, kv_cmp, kv_win, compress_fn, cu_seqlens)
        T = news[0]
        if not packed:
            return run_decode_steps(plan.step, q, gates, cache, tokens, compress_fn)
        # equal lengths covering every row: row b's tokens are b*T .. (b+1)*T - 1 of the packed input
        rows = [x[0].unflatten(0, (cache.batch, T)) for x in (q, gates, *tokens)]
        out = run_decode_steps(plan.step, rows[0], rows[1], cache, tuple(rows[2:]), compress_fn)
        return out.flatten(0, 1)[None]


__all__ = ["DECODE_BACKENDS", "nsa_decode", "nsa_prefill", "plan_decode_backend", "step_stats"]

"""One decode step: each sequence's new token, its NSA output from the cache, equal to prefill at that position.

Two implementations of the same step, chosen by `backend=` ("auto" | "torch" | "triton"):

- torch: the per-chunk branch functions of prefill (nsa.branches.*.naive) on a chunk of one query per sequence, keys
  from the cache (completed compressed blocks, the selected blocks of the raw K/V, the window ring).
  Each sequence sits at its own position (`cache_seqlens`), expressed in per-sequence shifted
  coordinates so that the prefill masks apply unchanged. Sizes come from the cache's host-side length
  bound (no device sync); under CUDA-graph capture, from its capacity (static).
- triton (nsa.kernels.triton.decode): five launches per step, no host sync, no allocation, static shapes
  (capturable in a CUDA graph): append the token, compressed + window attention split over many
  programs, selection scores + top-n candidates, selected attention, combine + gates.

`plan_decode_backend` decides (and is the one place that does): a forced backend that cannot run raises
NSAInputError with the reason; "auto" takes the kernels on CUDA when their guards pass, else torch, and
every decision is counted in nsa.telemetry as (branch, backend, reason) for cmp, sel and win: reason
"ok" / "forced" when the chosen path ran as asked, "decode" when torch ran because the kernels are not
available here (CPU, no triton: the environment, not a fallback), or the failed guard's reason (a
fallback). Guards: disabled (NSA_USE_TRITON_DECODE=0), sm_unsupported (< 8.0), dtype (fp16/bf16/fp32),
head_dim (> 256), group_size (Hq/Hkv > 64), grad (inputs that need gradients: the kernels have no
backward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import telemetry
from .branches.attend import compute_dtype
from .branches.compressed.naive import compressed_chunk
from .branches.selected.naive import selected_chunk, topn_chunk
from .branches.sliding.naive import sliding_chunk
from .cache import NSACache, n_cmp_blocks_dev
from .config import NSAConfig
from .validation import NSAInputError, check_qkv

DECODE_BACKENDS = ("auto", "torch", "triton")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256
TRITON_MAX_GROUP = 64
BRANCHES = ("cmp", "sel", "win")


@dataclass
class DecodeHooks:
    """Test hooks of the routing: pretend a CUDA capability, or let the kernels take CPU tensors (interpreter)."""

    capability: tuple[int, int] | None = None
    allow_cpu: bool = False


HOOKS = DecodeHooks()


@dataclass(frozen=True)
class DecodePlan:
    backend: str  # "torch" or "triton"
    reason: str  # telemetry reason
    detail: str = ""


def _triton_available(device: torch.device, forced: bool) -> tuple[bool, str]:
    try:
        from .kernels.triton import decode as _  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available", with the reason
        return False, f"nsa.kernels.triton.decode does not import: {type(e).__name__}: {e}"
    if device.type == "cuda" or HOOKS.allow_cpu:
        return True, "ok"
    if forced and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "Triton interpreter on CPU (TRITON_INTERPRET=1)"
    return False, f"the Triton decode kernels run on CUDA tensors, got {device}" + (
        " (forcing them on CPU needs TRITON_INTERPRET=1)" if forced else "")


def _triton_guard(q, cache: NSACache, needs_grad: bool) -> tuple[str, str] | None:
    """(reason, message) of the first failed guard of the Triton decode kernels, or None."""
    from .kernels.device import device_capability
    from .toggles import env_bool

    if not env_bool("NSA_USE_TRITON_DECODE", True):
        return "disabled", "NSA_USE_TRITON_DECODE=0"
    cap = HOOKS.capability or (device_capability(q.device) if q.device.type == "cuda" else None)
    if cap is not None and tuple(cap) < (8, 0):
        return "sm_unsupported", f"sm {cap[0]}.{cap[1]}: the Triton decode kernels need sm >= 8.0"
    if q.dtype not in TRITON_DTYPES:
        return "dtype", f"the Triton decode kernels take fp16/bf16/fp32, got {q.dtype}"
    if max(cache.d_k, cache.d_v) > TRITON_MAX_HEAD_DIM:
        return "head_dim", f"head dim {max(cache.d_k, cache.d_v)} > {TRITON_MAX_HEAD_DIM}"
    G = q.shape[2] // cache.n_kv_heads
    if G > TRITON_MAX_GROUP:
        return "group_size", f"{G} query heads per KV head > {TRITON_MAX_GROUP}"
    if needs_grad:
        return "grad", "inputs need gradients and the Triton decode kernels have no backward"
    return None


def plan_decode_backend(backend: str, q, cache: NSACache, *, needs_grad: bool = False) -> DecodePlan:
    """Which implementation runs this decode step, and the telemetry reason. Raises when forced and impossible."""
    if backend not in DECODE_BACKENDS:
        raise NSAInputError(f"backend must be one of {DECODE_BACKENDS} for a decode step, got {backend!r}"
                            + (" (that backend has no decode step of its own: NSAAttention takes decode_backend=)"
                               if isinstance(backend, str) else ""))
    if backend == "torch":
        return DecodePlan("torch", "forced")
    forced = backend == "triton"
    ok, why = _triton_available(q.device, forced)
    if not ok:
        if forced:
            raise NSAInputError(f"backend='triton' is not available here: {why}")
        return DecodePlan("torch", "decode", why)  # the environment, not a fallback
    fail = _triton_guard(q, cache, needs_grad)
    if fail:
        if forced:
            raise NSAInputError(f"backend='triton' cannot run this decode step: {fail[0]}: {fail[1]}")
        return DecodePlan("torch", fail[0], fail[1])
    return DecodePlan("triton", "forced" if forced else "ok")


def _check_step(q, k, v, gates, cache: NSACache, cfg, kv_cmp, kv_win, compress_fn, out):
    """Every check of a decode step, before anything is written. Returns (k, v, kc, vc, kw, vw)."""
    if not isinstance(cache, NSACache):
        raise NSAInputError(f"cache must be an nsa.NSACache, got {type(cache).__name__}")
    if cfg != cache.config:
        raise NSAInputError("config differs from the cache's config")
    shapes = check_qkv(q, k, v, gates)
    if shapes.T != 1:
        raise NSAInputError(f"nsa_decode takes one new token per sequence (T=1), got T={shapes.T}: "
                            "use nsa_prefill to fill the cache")
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
    tokens = cache._branch_inputs(k, v, kv_cmp, kv_win)
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

    q [B, 1, Hq, Dk], gates [B, 1, Hq, 3]; sequence b's token goes to position cache.cache_seqlens[b].
    kv_cmp / kv_win / compress_fn as in nsa_attention. backend: "auto" | "torch" | "triton" (module doc).
    out: optional [B, 1, Hq, Dv] buffer for the output (static address, e.g. for CUDA graphs).
    return_indices adds the selected blocks [B, 1, Hkv, n_sel] int32 (ascending, -1 padded); return_stats
    a dict with the K/V bytes this step read from the cache (compressed blocks + selected tokens + window),
    counted from the cache (this reads the lengths back to the host: for benchmarks, not for serving).
    """
    cfg = config or cache.config
    tokens = _check_step(q, k, v, gates, cache, cfg, kv_cmp, kv_win, compress_fn, out)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, gates, *tokens))
    plan = plan_decode_backend(backend, q, cache, needs_grad=needs_grad)
    served = "triton_decode" if plan.backend == "triton" else "torch"
    for branch in BRANCHES:
        telemetry.record(branch, served, plan.reason, **({"detail": plan.detail} if plan.detail else {}))
    if plan.backend == "triton":
        from .kernels.triton.decode import decode_step_triton

        res, indices = decode_step_triton(q, gates, cache, tokens, compress_fn, out=out,
                                          want_indices=return_indices or return_stats)
        cache.commit_step(on_device=False)  # the last kernel published the new lengths
    else:
        res, indices = _decode_torch(q, gates, cache, tokens, compress_fn)
        if out is not None:
            out.copy_(res)
            res = out
        cache.commit_step()
    result = [res]
    if return_indices:
        result.append(indices)
    if return_stats:
        result.append(step_stats(cache, indices))
    return result[0] if len(result) == 1 else tuple(result)


@dataclass
class TorchStepView:
    """What the torch step's branch calls see of the cache after the append (module doc: shifted coordinates)."""

    qc: torch.Tensor  # [B, 1, Hkv, G, Dk] in the compute dtype
    pos: torch.Tensor  # [B, 1] each sequence's new position t
    seq_start: torch.Tensor  # [B, 1] ref - t: sequence b starts there in shifted coordinates
    t_glob: torch.Tensor  # [1] = ref, the new tokens' shared shifted position
    cmp_local: torch.Tensor  # [B, n] start of each compressed block within its sequence
    n_cmp: int  # compressed blocks any sequence can see (static)
    n_sel_blocks: int  # selection blocks any sequence can see (static)
    win_key_pos: torch.Tensor  # [B, W] shifted position held by each window slot (-1: empty)
    scale: float


def torch_step_view(q, cache: NSACache) -> TorchStepView:
    cfg = cache.config
    B, _, Hq, Dk = q.shape
    device = q.device
    # Static sizes: everything a sequence of at most `n_tok` tokens can see (the capacity while a CUDA graph
    # is captured, so that the replay serves every later step).
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    n_tok = cache.max_len if capturing else min(cache.max_seqlen_bound + 1, cache.max_len)
    n = min(cfg.n_cmp_blocks(n_tok), cache.cmp_capacity)
    t = cache.cache_seqlens.long()  # position of each sequence's new token
    ref = cache.max_len - 1  # sequence b starts at ref - t_b, so its new token sits at ref
    seq_start = (ref - t)[:, None]
    win = cache.window_positions(t)
    return TorchStepView(
        qc=q.to(compute_dtype(q.dtype)).unflatten(2, (cache.n_kv_heads, Hq // cache.n_kv_heads)),
        pos=t[:, None], seq_start=seq_start, t_glob=torch.full((1,), ref, device=device, dtype=torch.long),
        cmp_local=(torch.arange(n, device=device) * cfg.stride_cmp)[None].expand(B, n), n_cmp=n,
        n_sel_blocks=cfg.n_sel_blocks(n_tok),
        win_key_pos=torch.where(win >= 0, seq_start + win, torch.full_like(win, -1)),
        scale=cfg.softmax_scale(Dk))


def _decode_torch(q, gates, cache: NSACache, tokens, compress_fn):
    """The step with the prefill branch functions. Returns (out [B, 1, Hq, Dv], indices int32 [B, 1, Hkv, n])."""
    cfg = cache.config
    cache.append_step(*tokens, compress_fn=compress_fn)
    B = q.shape[0]
    sv = torch_step_view(q, cache)
    ct, n = sv.qc.dtype, sv.n_cmp
    valid = torch.ones(B, n, dtype=torch.bool, device=q.device)
    k_cmp = cache.k_cmp[:, :n].to(ct)
    cmp_start = sv.seq_start + sv.cmp_local
    o_cmp, lse = compressed_chunk(sv.qc, k_cmp, cache.v_cmp[:, :n].to(ct), cmp_start, valid, sv.t_glob, sv.seq_start,
                                  cfg, sv.scale)
    indices = topn_chunk(sv.qc, k_cmp, lse, cmp_start, sv.cmp_local, valid, sv.t_glob, sv.seq_start,
                         sv.n_sel_blocks, cfg, sv.scale)
    o_sel = selected_chunk(sv.qc, cache.k_sel, cache.v_sel, indices, sv.pos, torch.zeros_like(sv.pos), cfg, sv.scale)
    o_win = sliding_chunk(sv.qc, cache.k_win.to(ct), cache.v_win.to(ct), sv.win_key_pos, sv.t_glob, sv.seq_start, cfg,
                          sv.scale)
    g = gates.to(ct)
    out = (g[..., 0:1] * o_cmp.flatten(2, 3) + g[..., 1:2] * o_sel.flatten(2, 3)
           + g[..., 2:3] * o_win.flatten(2, 3)).to(q.dtype)
    return out, indices.to(torch.int32)


def step_stats(cache: NSACache, indices) -> dict:
    """K/V bytes the step that just ran read from the cache, per branch, counted from the cache's state."""
    cfg = cache.config
    t = cache.cache_seqlens.long() - 1  # the step's positions
    Hkv = cache.n_kv_heads
    per_tok = (cache.d_k + cache.d_v) * cache.k_sel.element_size()
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
    """Prefill: outputs for the prompts (nsa_attention) and the empty cache filled with their K/V.

    Dense prompts q [B, T, Hq, Dk] (every sequence T tokens), or prompts of different lengths packed along
    T with cu_seqlens (int32 [batch + 1], B == 1: sequence b = tokens cu_seqlens[b]:cu_seqlens[b+1] goes to
    cache row b), the varlen convention of FlashAttention and serving engines. Returns [B, T, Hq, Dv].
    """
    from .functional import nsa_attention

    cfg = config or cache.config
    if not isinstance(cache, NSACache):
        raise NSAInputError(f"cache must be an nsa.NSACache, got {type(cache).__name__}")
    if cfg != cache.config:
        raise NSAInputError("config differs from the cache's config")
    if not cache.is_empty:
        raise NSAInputError(f"nsa_prefill needs an empty cache, this one holds up to {cache.max_seqlen_bound} tokens "
                            "per sequence (cache.reset() empties it)")
    if cu_seqlens is not None:
        cache._branch_inputs(k, v, kv_cmp, kv_win, batch=1)
        cache.check_cu_seqlens(cu_seqlens, k.shape[1])
    else:
        cache._branch_inputs(k, v, kv_cmp, kv_win)
    out = nsa_attention(q, k, v, gates, cfg, cu_seqlens=cu_seqlens, kv_cmp=kv_cmp, kv_win=kv_win,
                        compress_fn=compress_fn, backend=backend)
    cache.write(k, v, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn, cu_seqlens=cu_seqlens)
    return out

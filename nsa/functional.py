"""nsa_attention: the functional API. Validate the inputs, plan once (nsa.plan), run the plan (nsa.run).

`backend="auto"`: every step goes to the fastest implementation that can serve it here: on a GPU the
fused pipeline (compressed and sliding branches on FlashAttention-2, top-n and selected attention on
NSA's Triton kernels); elsewhere the chunked PyTorch path. `backend="torch"` forces the PyTorch path,
`backend="reference"` the float64 oracle, "flash_attn" / "torch_flash" / "sdpa" that provider for the
compressed and sliding branches. Forcing something that cannot run is an NSAInputError naming the
reason, never a silent fallback. Every decision is counted in nsa.telemetry (docs/backends.md).
"""

from __future__ import annotations

from . import telemetry
from .config import NSAConfig
from .layout import dense_layout, packed_layout
from .plan import BACKENDS, make_plan
from .run import run
from .validation import NSAInputError, check_block_indices, check_branch_kv, check_cu_seqlens, check_qkv


def nsa_attention(q, k, v, gates, config: NSAConfig, *, cu_seqlens=None, block_indices=None,
                  return_indices=False, backend="auto", kv_cmp=None, kv_win=None, compress_fn=None,
                  chunk_size=None, cp_group=None):
    """Native Sparse Attention.

    q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv], gates [B, T, Hq, 3] (cmp, sel, win; in
    [0, 1]). Hq must be a multiple of Hkv (GQA: query head h reads KV head h // (Hq / Hkv)).
    cu_seqlens: int32 [n_seq + 1] offsets of sequences packed along T (then B == 1). Sequences of one length
    (empty ones aside; one sequence spanning T among them) run as the dense batch they are, on the faster
    dense path.
    block_indices: [B, T, Hkv, n_sel] selection blocks to use instead of the top-n step (-1 = none).
    return_indices: also return the selected blocks [B, T, Hkv, n_sel] int32 (ascending, -1 padded).
    kv_cmp / kv_win: (k, v) for the compressed / sliding branches when they have their own projections
    (k, v then serve the selected branch). compress_fn: (phi_k, phi_v) for config.compress == "mlp".
    chunk_size: queries per chunk of the chunked PyTorch path (default: sized from a memory budget).
    cp_group: context parallelism: a ProcessGroup, DeviceMesh (dimension) or nsa.distributed.ContextParallel
    over whose ranks the sequence is split; every tensor is then this rank's slice, cu_seqlens the whole
    stream's offsets (docs/context-parallel.md).
    Returns out [B, T, Hq, Dv] in q's dtype (and the indices when asked).
    """
    if cp_group is not None:
        from .distributed import cp_nsa_attention, single_rank

        if not single_rank(cp_group):  # one rank: the plain call below, no collective, no copy
            return cp_nsa_attention(q, k, v, gates, config, cp_group=cp_group, cu_seqlens=cu_seqlens,
                                    block_indices=block_indices, return_indices=return_indices, backend=backend,
                                    kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn, chunk_size=chunk_size)
    if not isinstance(config, NSAConfig):
        raise NSAInputError(f"config must be an nsa.NSAConfig, got {type(config).__name__}")
    if backend not in BACKENDS:
        raise NSAInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    shapes = check_qkv(q, k, v, gates)
    if kv_cmp is not None:
        check_branch_kv("kv_cmp", kv_cmp, k, v)
    if kv_win is not None:
        check_branch_kv("kv_win", kv_win, k, v)
    if config.compress == "mlp" and compress_fn is None:
        raise NSAInputError("config.compress='mlp' needs compress_fn=(phi_k, phi_v); 'avg' needs none")
    if block_indices is not None:
        check_block_indices(block_indices, shapes, config.n_sel, q.device)
    host_cu = None
    if cu_seqlens is not None:
        host_cu = check_cu_seqlens(cu_seqlens, shapes, q.device)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise NSAInputError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    n_rows = batch_rows(host_cu) if backend != "reference" else 0
    if n_rows:
        return _as_batch(n_rows, q, k, v, gates, config, block_indices=block_indices, return_indices=return_indices,
                         backend=backend, kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn,
                         chunk_size=chunk_size)

    plan = make_plan(backend, q, k, v, config, kv_cmp=kv_cmp, kv_win=kv_win, cu_seqlens=cu_seqlens,
                     host_cu=host_cu, given_indices=block_indices is not None)
    if plan.executor == "reference":
        from .reference import nsa_reference

        res = nsa_reference(q, k, v, gates, config, cu_seqlens=cu_seqlens, block_indices=block_indices,
                            kv_cmp=kv_cmp, kv_win=kv_win, compress_fn=compress_fn)
        out = res.out.to(q.device, q.dtype)
        return (out, res.indices.to(q.device)) if return_indices else out

    layout = (packed_layout(cu_seqlens, shapes.T, config) if cu_seqlens is not None
              else dense_layout(shapes.B, shapes.T, config, q.device))
    out, indices = run(plan, q, k, v, gates, config, layout, kv_cmp=kv_cmp, kv_win=kv_win,
                       compress_fn=compress_fn, block_indices=block_indices, need_indices=return_indices,
                       chunk=chunk_size)
    return (out, indices) if return_indices else out


def batch_rows(host_cu: list[int] | None) -> int:
    """Packed sequences that are a dense batch: the number of non-empty sequences when they all have one
    length (1 when there is none), else 0 (and 0 for dense input)."""
    if host_cu is None:
        return 0
    lengths = {b - a for a, b in zip(host_cu, host_cu[1:]) if b > a}
    if len(lengths) > 1:
        return 0
    return host_cu[-1] // lengths.pop() if lengths else 1


def _as_batch(n_rows, q, k, v, gates, config, *, block_indices, return_indices, kv_cmp, kv_win, **kwargs):
    """Packed sequences of one length (empty ones aside) as the dense batch [n_rows, L] they are: the same
    function, on the dense call (q folded by view, the sliding branch's Triton kernels, cached plans, no
    varlen copies). Every tensor is reshaped (a view where it is contiguous) and the result back to
    [1, T, ...]."""
    telemetry.event("pipeline", "packed", "as_batch")

    def rows(x):
        return None if x is None else x.reshape(n_rows, -1, *x.shape[2:])

    pair = {name: None if kv is None else (rows(kv[0]), rows(kv[1])) for name, kv in (("kv_cmp", kv_cmp),
                                                                                        ("kv_win", kv_win))}
    res = nsa_attention(rows(q), rows(k), rows(v), rows(gates), config, block_indices=rows(block_indices),
                        return_indices=return_indices, **pair, **kwargs)
    if not return_indices:
        return res.reshape(1, -1, *res.shape[2:])
    out, idx = res
    return out.reshape(1, -1, *out.shape[2:]), idx.reshape(1, -1, *idx.shape[2:])


__all__ = ["nsa_attention", "BACKENDS", "telemetry"]

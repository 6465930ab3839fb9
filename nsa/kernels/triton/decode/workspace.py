"""How a decode step is split and launched (Tuning) and the split plan with its preallocated buffers
(DecodeWorkspace), made once per cache and query-head count."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...device import device_capability, on_gpu
from ..common import next_pow2 as _np2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_free_blocks(n_sel: int, n_init: int, n_local: int) -> int:
    """The most free (non-forced) blocks one step selects, at least 1 (a buffer's row length): free blocks
    exist only once all n_init + n_local forced blocks do, and then n - n_init - n_local of them are taken."""
    return max(1, n_sel - n_init - n_local)


def pdl_supported(device) -> bool:
    """Whether the decode launches can use programmatic dependent launch on `device`: a CUDA GPU of compute
    capability 9.0 or later and a Triton with grid dependency control."""
    if not on_gpu(device):
        return False
    from .parts import HAS_GDC

    cap = device_capability(torch.device(device))
    return HAS_GDC and _launch_pdl_option() and cap is not None and cap >= (9, 0)


def _launch_pdl_option() -> bool:
    """Whether Triton's CUDA launch options have `launch_pdl` (the launch attribute the kernels' waits pair with)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _max_shared_mem(device) -> int:
    """Opt-in shared memory per program of the device (bytes), as Triton's own resource checks see it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except (AttributeError, KeyError, TypeError):  # a Triton without the query: size for sm86-class GPUs
        return 99 * 1024


def _stages(tile_bytes: int, smem: int, low_precision: bool, q_bytes: int = 0) -> int:
    """Pipeline depth of a K/V tile loop: 3 for 16-bit tiles (2 for fp32), fewer where shared memory is short
    (kept beside the tiles: 32 KiB, or the q tile of `q_bytes` where that is larger, which the dots stage too).
    A larger q tile occurs for fp32 with 64 heads and D=256 only: 2 stages needed 196608 bytes, past the
    A100's 166912 (bench/triton_compile_check.py --arch 80); sm 9.0's 232448 still hold 2 stages there."""
    fit = max(1, (smem - max(32 * 1024, q_bytes)) // tile_bytes)
    return int(min(3 if low_precision else 2, fit))


@dataclass(frozen=True)
class Tuning:
    """How the step is split and launched (None: the default).
    target_programs: programs per launch to aim for (default: 4 per SM).
    block_n: keys per tile (default 64, 32 for head dims > 128; 128 measured slower: H100, paper heads, 64k x 8
        60.6 -> 69.2 us per step, 8 warps or 2 programs per SM with it no better).
    tiles_per_program: key tiles of every compressed and window program (default: from target_programs,
        at least min_tiles).
    min_tiles: the least key tiles per compressed / window program (default 3: one-tile programs left many
        partials to merge; H100, paper heads: 8k x 8 38.9 -> 35.4 us, 64k x 1 29.0 -> 26.6 us per step).
    chunk_j: selection blocks per scoring program (default: 32, more where the selection programs would
        merge more than 1024 candidates).
    sel_splits: selection programs per (b, KV head) (default: about 2 per SM in all, at most n_sel).
    dv_tile: output columns per combine program (default 8).
    part_chunk: partials per combine load and branch (default 256 / padded G).
    warps_*: warps of each kernel; stages_cmp: pipeline depth of the compressed/window loop (default 2,
        fewer where shared memory is short); stages_sel: the selection launch's (default: stages_cmp's with
        the window programs in that launch, else 3 for 16-bit tiles, fewer where shared memory is short).
    target_cmp: compressed programs per launch, at most (default on CUDA: 3 per SM, one wave of the programs
        an SM holds at once; with target_programs set: that, rounded up per (b, KV head)).
    cmp_align: compressed blocks per program are a multiple of this (default block_n: whole tiles; 16 gave
        64k x 8 12 programs of 5.5 tiles per (b, KV head) instead of 11 of 6, and measured no faster).
    window_with_sel: the window's programs run in the selection launch (default, unless the combine starts
        early), else in the compressed one. The window needs no scores; beside the selection programs, which
        wait on the candidate merge, its memory traffic overlaps theirs instead of lengthening the compressed
        launch, the longest of the step.
    early_combine: the combine launch starts as the selection programs start, merges the compressed and
        window partials meanwhile and waits only for the selection's (needs window_with_sel=False; default:
        where PDL runs and the combine has at most 2 programs per SM: plan_combine).
    pdl: programmatic dependent launch of launches 2-5 (default: where the GPU (sm 9.0 and later) and Triton
        (3.4 and later) have it). Each launch then starts while the one before it ends and waits on the
        device for its results, so launch latency and the previous launch's tail overlap; the window
        programs of the selection launch need no scores and run beside the scoring launch.
    Tests shrink the sizes to exercise many splits on tiny shapes; bench/tune_decode.py sweeps the rest."""

    target_programs: int | None = None
    block_n: int | None = None
    chunk_j: int | None = None
    dv_tile: int | None = None
    warps_cmp: int = 4
    warps_score: int = 4
    warps_sel: int = 4
    warps_combine: int = 4
    stages_cmp: int | None = None
    stages_sel: int | None = None
    part_chunk: int | None = None
    sel_splits: int | None = None
    tiles_per_program: int | None = None
    min_tiles: int = 3
    target_cmp: int | None = None
    cmp_align: int | None = None
    window_with_sel: bool | None = None
    early_combine: bool | None = None
    pdl: bool | None = None


def plan_combine(tuning: Tuning, pdl: bool, combine_programs: int, sms: int) -> tuple[bool, bool]:
    """(early_combine, window_with_sel) of a launch plan: Tuning's choice, else an early combine where PDL
    runs and the combine has at most 2 programs per SM, its window programs then in the compressed launch
    (the early combine reads their partials before it waits). Measured on an H100, paper heads, bf16, CUDA
    graphs (us per step, before -> after): 64k x 1 23.6 -> 21.4, 128k x 1 31.9 -> 26.8, 64k x 2 28.2 -> 25.0,
    16k x 2 22.3 -> 20.3, 8k x 4 24.1 -> 23.1, 64k x 4 44.1 -> 43.6; but 8k x 8 30.6 -> 31.8 and 64k x 8
    61.0 -> 64.0-67.0: there the 512 combine programs, resident while they wait, crowd the selection's."""
    early = tuning.early_combine
    if early is None:
        early = pdl and tuning.window_with_sel is not True and 0 < combine_programs <= 2 * sms
    if early and tuning.window_with_sel:
        raise ValueError("Tuning: early_combine needs window_with_sel=False: the combine reads the window's "
                         "partials before it waits, so the window's programs must run in the compressed launch")
    window_with_sel = tuning.window_with_sel if tuning.window_with_sel is not None else not early
    return bool(early), bool(window_with_sel)


class DecodeWorkspace:
    """Split plan and preallocated buffers of the decode step for one cache and query-head count."""

    def __init__(self, cache, Hq: int, tuning: Tuning):
        cfg = cache.config
        B, Hkv, Dk, Dv = cache.batch, cache.n_kv_heads, cache.d_k, cache.d_v
        device = cache.device
        self.G = Hq // Hkv
        self.BLOCK_G = max(16, _np2(self.G))
        self.BLOCK_DK = max(16, _np2(Dk))
        self.BLOCK_DV = max(16, _np2(Dv))
        self.BLOCK_N = tuning.block_n or (64 if max(self.BLOCK_DK, self.BLOCK_DV) <= 128 else 32)
        self.BLOCK_N_SEL = min(max(16, _np2(cfg.block_sel)), self.BLOCK_N)
        BH = B * Hkv
        sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu(device) else 0
        target = tuning.target_programs or (4 * sms if sms else 64)
        self.target_programs = target
        per_bh = max(1, _cdiv(target, BH))
        # Compressed launch: one wave of the three programs an SM holds (2 pipeline stages, 146 registers on
        # sm_90), not a second, partial wave (H100, paper heads, 64k x 8: 32.6 -> 30.2 us; 4 per SM: 36.0).
        target_cmp = tuning.target_cmp or (3 * sms if sms and not tuning.target_programs else None)
        per_bh_cmp = max(1, target_cmp // BH) if target_cmp else per_bh
        bn = self.BLOCK_N
        NB = cache.cmp_capacity
        W = cache.window_slots
        if tuning.tiles_per_program:  # every compressed and window program the same work: no long stragglers
            self.blocks_per_split = self.slots_per_split = tuning.tiles_per_program * bn
        else:  # about target_programs in all, at least min_tiles tiles each
            n_split = min(per_bh_cmp, _cdiv(NB, bn))
            align = tuning.cmp_align or bn  # shares of cmp_align blocks: even shares (the last tile masked)
            self.blocks_per_split = max(_cdiv(_cdiv(NB, n_split), align) * align, tuning.min_tiles * bn)
            n_split = min(per_bh, _cdiv(W, bn))
            self.slots_per_split = max(_cdiv(_cdiv(W, n_split), bn), tuning.min_tiles) * bn
        self.n_split_cmp = _cdiv(NB, self.blocks_per_split)
        self.n_split_win = _cdiv(W, self.slots_per_split)
        # Selection: about 2 programs per SM (each merges the candidates itself, so fewer, longer programs
        # measured faster than the 4 per SM of the other branches).
        sel_splits = tuning.sel_splits or max(1, _cdiv(target // 2, BH))
        self.slots_per_prog = _cdiv(cfg.n_sel, min(sel_splits, cfg.n_sel))
        self.n_split_sel = _cdiv(cfg.n_sel, self.slots_per_prog)
        self.n_parts = self.n_split_cmp + self.n_split_win + self.n_split_sel
        self.NJ = cfg.n_sel_blocks(cache.max_len)
        # 32 selection blocks per scoring program: many short programs (the scoring launch is latency-bound;
        # H100, paper heads, 64k x 32: 23.2 -> 19.8 us against 64) and a cheap rank-based top-n per chunk,
        # as long as the selection programs merge at most 1024 candidates (longer chunks past about 64k
        # tokens: a longer merge would cost more than the shorter chunks save).
        cj = tuning.chunk_j or min(32, max(16, _np2(self.NJ)))
        # Candidates per chunk: the most free blocks a step selects (13 of the paper's 16), not n: at 64k + a
        # few tokens (1026 selection blocks, 33 chunks) 429 candidates pad to 512, not 528 to 1024.
        self.K_FREE = max_free_blocks(cfg.n_sel, cfg.n_init, cfg.n_local)
        cj = max(cj, _np2(cfg.n_sel))
        if not tuning.chunk_j:
            cj = max(cj, _np2(_cdiv(self.NJ * self.K_FREE, 1024)))
        cj = max(cj, _np2(_cdiv(self.NJ * self.K_FREE, 4096)))  # at most 4096 candidates to merge
        self.CHUNK_J = cj
        self.n_chunks = _cdiv(self.NJ, cj)
        self.N_PAD = _np2(cfg.n_sel)
        self.n_cand = self.n_chunks * self.K_FREE
        self.NC_PAD = _np2(self.n_cand)
        self.SPLIT_PAD = _np2(self.n_split_cmp)
        self.BLOCK_L = _np2(cfg.block_cmp)
        # Combine: many programs (the merge is latency-bound), each loading [chunk, G, DV_TILE] fp32 tiles of
        # partials, one per branch, at most part_chunk partials (default 16 x 16 / padded G) per load. Wider
        # tiles (32 x 16 x 16) spilled registers and ran twice as long.
        self.DV_TILE = min(tuning.dv_tile or 8, self.BLOCK_DV)
        cap = tuning.part_chunk or max(1, 256 // self.BLOCK_G)
        self.CHUNK_CMP, self.CHUNK_WIN, self.CHUNK_SEL = (
            max(2, min(_np2(n), cap)) for n in (self.n_split_cmp, self.n_split_win, self.n_split_sel))
        self.tuning = tuning
        self.pdl = bool(tuning.pdl is not False and pdl_supported(device))
        self.early_combine, self.window_with_sel = plan_combine(tuning, self.pdl, BH * _cdiv(Dv, self.DV_TILE), sms)
        win = self.n_split_win
        self.grid_cmp = self.n_split_cmp + (0 if self.window_with_sel else win)
        self.grid_sel = self.n_split_sel + (win if self.window_with_sel else 0)
        if on_gpu(device):
            smem, elem, low = _max_shared_mem(device), cache.dtype.itemsize, cache.dtype != torch.float32
            kv_row, q_bytes = (self.BLOCK_DK + self.BLOCK_DV) * elem, self.BLOCK_G * self.BLOCK_DK * elem
            # 2 stages: three programs fit an SM (3 stages left room for one, and measured 15% slower)
            self.stages_cmp = tuning.stages_cmp or min(2, _stages(self.BLOCK_N * kv_row, smem, low, q_bytes))
            self.stages_sel = _stages(self.BLOCK_N_SEL * kv_row, smem, low, q_bytes)
            if self.window_with_sel:  # its window loop is pipelined like the compressed one
                self.stages_sel = min(self.stages_sel, self.stages_cmp)
            self.stages_sel = tuning.stages_sel or self.stages_sel
        f32 = dict(device=device, dtype=torch.float32)
        self.pos = torch.zeros(B, dtype=torch.int32, device=device)
        self.pm = torch.empty(BH, self.n_parts, self.BLOCK_G, **f32)
        self.pl = torch.empty(BH, self.n_parts, self.BLOCK_G, **f32)
        self.pacc = torch.empty(BH, self.n_parts, self.BLOCK_G, self.BLOCK_DV, **f32)
        self.scratch = torch.empty(BH, self.BLOCK_G, NB, **f32)
        self.cand = torch.empty(BH, self.n_cand, dtype=torch.int64, device=device)
        self.scores = torch.zeros(BH, self.NJ, **f32)
        self.indices = torch.empty(B, 1, Hkv, cfg.n_sel, dtype=torch.int32, device=device)

    def describe(self) -> str:
        """The split plan, e.g. "cmp17x256/win8x64/sel16x1/chunks5x256" (programs x items per program)."""
        win = "+win" if self.window_with_sel else ""
        return (f"cmp{self.n_split_cmp}x{self.blocks_per_split}/win{self.n_split_win}x{self.slots_per_split}/"
                f"sel{self.n_split_sel}x{self.slots_per_prog}{win}/chunks{self.n_chunks}x{self.CHUNK_J}"
                + ("/early" if self.early_combine else "") + ("/pdl" if self.pdl else ""))

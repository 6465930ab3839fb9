"""Fused selection score + top-n (Triton): the blocks each query's KV group attends in the selected branch.

Contract (same function as nsa.branches.selected.naive.top_n, see docs/semantics.md):
    q [B, T, Hq, Dk], k_cmp [B, Nc, Hkv, Dk] (compressed keys, one slot per block, nsa.layout),
    lse [B, T, Hq] fp32 (the compressed branch's natural-log LSE, -inf for a query that sees no block),
    seq_start [B, T] (global index of each token's sequence start), cmp_slot0 [B, T] (slot of block 0 of
    each token's sequence). Returns int32 [B, T, Hkv, n_sel]: ascending block ids local to the sequence,
    -1 padded. No gradient, nothing of size [T, Nc] or [T, N_sel] in global memory.

One program per (tile of BLOCK_T tokens, batch x KV head). The rows of tl.dot are the tile's tokens and its
columns a chunk of compressed blocks: the program walks the selection blocks of its tokens in chunks of
BLOCK_J and, per chunk, loops over the G query heads of the KV head: recomputes head g's logits against the
R compressed blocks that start in each selection block (R = l'/d), turns them into probabilities with head
g's LSE (exp2 domain) and adds them to one fp32 tile, so the sum over heads is an elementwise add in
registers (no reduction across threads) and the chunk's keys are loaded once for all G heads. Selection
block j overlaps compressed blocks j*R - C ... j*R + R - 1 (C = l/d - 1): its group (the R blocks starting
inside j) and its tail (the C blocks before them, which reach into j). When C <= R (the paper's blocks:
R = 4, C = 1) the tail of j is the end of j - 1's group, already in the tile: after the head loop the
tails' sums move one column right through a dot with a 0/1 shift matrix, and the chunk's first column
takes the previous chunk's last (SHIFT_TAIL). The dot runs on tensor cores in three bf16 parts of the fp32
sums (_shift_right: exact), where one fp32 dot on CUDA cores cost about a seventh of the kernel. Otherwise
the tails have their own, smaller dot: a second key tile holds, per selection block of the chunk, its C
tail blocks, so each head pays C/R more logits and exponentials. H200, G=16, D=128, 64k: 6.9 ms with the
bf16 shift, 8.1 with an fp32 one, 9.06 with the tail dot, 12.1 with the shift done by tl.gather.
Only the chunks that reach past some token's last visible block pay for the causal mask (applied once to the
head sums); tokens outside the current pass get an LSE of +inf, so their probabilities are 0 without one.
On Hopper the q tiles and (when R_PAD == R) the chunk's compressed keys come by TMA copies (tma.py).
Every score is thus formed by the same operations in the same order, whatever the block's position:
mathematically equal scores are bitwise equal, and ties go to the lower index as the semantics say.

Ranking: each candidate becomes one int64 key, (score bits << 32) | (2^31 - 1 - j): for scores >= 0 the
float bits order like the values, and among equal scores the lower j has the larger key. Forced blocks
(the first n_init, the n_local ending at the token's own block) get +inf's bits, non-candidates distinct
negative keys. Each token keeps its n_sel best keys unsorted; a chunk's key that beats the smallest kept
key replaces it (largest first; after the first chunks only a few keys per chunk get in), and at the
end the kept blocks are put in ascending order by rank (a one-hot sum, no sort network).

Packed input: a tile may hold tokens of several sequences, whose compressed blocks start at different
slots; the program processes one sequence of its tile at a time (at most BLOCK_T passes, one for dense
input). Offsets are int64 wherever a stride times an index can pass 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import device_capability
from . import tma
from .common import bh_program, qk_dot, split_dim
from .common import next_pow2 as _np2

LOG2E = 1.4426950408889634
MAX_KEEP = 64
MAX_TAIL = 63  # tail blocks per selection block (block_cmp / stride_cmp - 1)


@triton.jit
def _load_blocks(base, slot0, i_loc, i_hi, skn, u_ok, d_ok, EVEN_D: tl.constexpr):
    """Compressed keys of blocks i_loc of the sequence whose block 0 sits in slot slot0 (0 past i_hi)."""
    ok = u_ok & (i_loc <= i_hi)
    ptr = base + (slot0 + i_loc).to(tl.int64)[:, None] * skn
    if EVEN_D:
        return tl.load(ptr, mask=ok[:, None], other=0.0)
    return tl.load(ptr, mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _bf16_parts(x):
    """fp32 x as three bf16 parts, x == x1 + (x2 + x3) exactly for |x| >= 2**-110 (8 significant bits each,
    and each residual is exact in fp32); smaller x lose low bits."""
    x1 = x.to(tl.bfloat16)
    r1 = x - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
    return x1, x2, x3


@triton.jit
def _shift_right(x, shift_m, SPLIT: tl.constexpr):
    """x @ shift_m for fp32 x and a 0/1 fp32 shift_m, exactly: each output is one product by 1 plus products
    by 0. SPLIT: on tensor cores, one bf16 dot per part of _bf16_parts added back as m1 + (m2 + m3) (m2 + m3
    is the first residual, exact); otherwise one fp32 dot on CUDA cores (Triton's interpreter, whose bf16
    dots are not faithful)."""
    if SPLIT:
        x1, x2, x3 = _bf16_parts(x)
        sm = shift_m.to(tl.bfloat16)
        return tl.dot(x1, sm) + (tl.dot(x2, sm) + tl.dot(x3, sm))
    return tl.dot(x, shift_m, input_precision="ieee")


@triton.jit
def _topn_kernel(
    Q, KC, QD, KCD, QD2, KCD2, LSE, SS, SC0, IDX,
    sqb, sqt, sqh, sqd,
    skb, skn, skh, skd,
    slb, slt, slh,
    ssb, sst,
    scb, sct,
    sib, sit, sih, sin,
    T, Hkv, G, D, n_sel, n_init, n_local, qk_scale,
    n_tiles, q_off,
    R: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr,
    STRIDE: tl.constexpr, BLOCK_CMP: tl.constexpr, BLOCK_SEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, R_PAD: tl.constexpr, BLOCK_J: tl.constexpr,
    KEEP: tl.constexpr, HEAD_STAGES: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    SHIFT_TAIL: tl.constexpr, TMA_Q: tl.constexpr = False, TMA_KC: tl.constexpr = False,
    SHIFT_BF16: tl.constexpr = True, BLOCK_D2: tl.constexpr = 0, EVEN_D2: tl.constexpr = True,
):
    # KEEP: slots of the kept list (n_sel of them live). BLOCK_D2 > 0: q and the compressed keys have a second
    # column tile [BLOCK_D, BLOCK_D + BLOCK_D2) (common.split_dim), its dot added to the logits; QD2 / KCD2
    # are its TMA descriptors.
    SPLIT: tl.constexpr = BLOCK_D2 > 0
    DEAD: tl.constexpr = 9223372036854775807  # above every key (the largest is +inf bits << 32)
    BLOCK_C: tl.constexpr = BLOCK_J * R_PAD
    BLOCK_TAIL: tl.constexpr = BLOCK_J * C_PAD
    tile = n_tiles - 1 - tl.program_id(0)  # the longest tiles (most blocks) first
    b, h = bh_program(1, Hkv)

    # Tokens of the tile. Positions fit int32 (T < 2^31).
    t_tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t_tok < T
    t_tok64 = t_tok.to(tl.int64)
    start_tok = tl.load(SS + b * ssb + t_tok64 * sst, mask=tok_ok, other=0).to(tl.int32)
    slot0_tok = tl.load(SC0 + b * scb + t_tok64 * sct, mask=tok_ok, other=0).to(tl.int32)
    pos_tok = t_tok + q_off - start_tok  # q_off: the stream position of row 0
    jt_tok = pos_tok // BLOCK_SEL
    # Last compressed block the token sees (i*d + l - 1 <= pos), -1 for none; an offset keeps // a floor.
    last_tok = (pos_tok + 1 - BLOCK_CMP + STRIDE) // STRIDE - 1
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    kc_base = KC + b * skb + h * skh + rd[None, :] * skd
    q_base = Q + b * sqb + t_tok64[:, None] * sqt + (h * G) * sqh + rd[None, :] * sqd
    lse_base = LSE + b * slb + t_tok64 * slt + (h * G) * slh
    if SPLIT:
        rd2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = rd2 < D
        kc2_base = KC + b * skb + h * skh + rd2[None, :] * skd
        q2_base = Q + b * sqb + t_tok64[:, None] * sqt + (h * G) * sqh + rd2[None, :] * sqd

    # Compressed blocks of a chunk: kk = jj * R_PAD + u is block (j0 + jj) * R + u of the sequence.
    kk = tl.arange(0, BLOCK_C)
    jj_c = kk // R_PAD
    u_c = kk % R_PAD
    # Tail blocks of a chunk: ee = jj * C_PAD + c is block (j0 + jj) * R - C + c (c < C).
    ee = tl.arange(0, BLOCK_TAIL)
    jj_e = ee // C_PAD
    c_e = ee % C_PAD
    u3 = tl.arange(0, R_PAD)[None, None, :]
    jj2 = tl.arange(0, BLOCK_J)[None, :]
    # SHIFT_TAIL: x @ shift_m moves column j - 1 of x to column j (_shift_right).
    shift_m = (tl.arange(0, BLOCK_J)[None, :] == tl.arange(0, BLOCK_J)[:, None] + 1).to(tl.float32)

    # The kept keys of each token, unsorted: n_sel live slots (filled with distinct negative sentinels) and
    # KEEP - n_sel dead ones (a huge value: never the minimum, never replaced, ignored at the end).
    slot = tl.arange(0, KEEP)[None, :]
    top = tl.where(slot < n_sel, -(1 << 40) - slot.to(tl.int64), DEAD) + tl.zeros([BLOCK_T, KEEP], tl.int64)
    done = ~tok_ok
    low = tl.full((), -(1 << 42), tl.int64)  # non-candidate keys of this pass start here (a scalar)
    for _ in range(BLOCK_T):  # one pass per sequence present in the tile (one for dense input)
        if tl.min(done.to(tl.int32), axis=0) == 0:
            cur = tl.min(tl.where(done, 2147483647, slot0_tok), axis=0)
            act_tok = (~done) & (slot0_tok == cur)
            in_pass = tok_ok & (slot0_tok == cur)
            last = tl.where(in_pass, last_tok, -1)  # tokens outside this pass see nothing
            # Chunks up to the smallest last block of the pass need no mask (tokens seeing nothing have LSE +inf).
            i_full = tl.min(tl.where(in_pass & (last_tok >= 0), last_tok, 2147483647), axis=0)
            if R_PAD != R:
                i_full = -1
            j_hi = tl.max(tl.where(act_tok, jt_tok, -1), axis=0)
            i_hi = tl.max(last, axis=0)
            carry = tl.zeros([BLOCK_T], tl.float32)  # SHIFT_TAIL: the previous chunk's last tail sum
            for j0 in range(0, j_hi + 1, BLOCK_J):
                i_loc = (j0 + jj_c) * R + u_c
                if TMA_KC:  # R_PAD == R: the chunk's blocks are consecutive slots. Slots past i_hi hold later
                    # blocks (or zeros past the end), whose probabilities the causal mask below zeroes.
                    kc = tl.reshape(KCD.load([b.to(tl.int32), cur + j0 * R, h.to(tl.int32), 0]), [BLOCK_C, BLOCK_D])
                    if SPLIT:
                        kc2 = tl.reshape(KCD2.load([b.to(tl.int32), cur + j0 * R, h.to(tl.int32), BLOCK_D]),
                                         [BLOCK_C, BLOCK_D2])
                else:
                    kc = _load_blocks(kc_base, cur, i_loc, i_hi, skn, u_c < R, d_ok, EVEN_D)
                    if SPLIT:
                        kc2 = _load_blocks(kc2_base, cur, i_loc, i_hi, skn, u_c < R, d2_ok, EVEN_D2)
                i_tail = (j0 + jj_e) * R - C + c_e
                tail_ok = (c_e < C) & (i_tail >= 0)
                if C > 0 and not SHIFT_TAIL:
                    kt = _load_blocks(kc_base, cur, i_tail, i_hi, skn, tail_ok, d_ok, EVEN_D)
                    if SPLIT:
                        kt2 = _load_blocks(kc2_base, cur, i_tail, i_hi, skn, tail_ok, d2_ok, EVEN_D2)
                # The sums over heads, in head order: the same adds for every block (bitwise-equal ties).
                p = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
                pt = tl.zeros([BLOCK_T, BLOCK_TAIL], tl.float32)
                # Pointers step one head at a time: a head stride times g may pass 2**31 (a transposed q).
                q_ptr, lse_ptr = q_base, lse_base
                if SPLIT:
                    q2_ptr = q2_base
                for g in tl.range(0, G, num_stages=HEAD_STAGES):
                    if TMA_Q:  # one copy into shared memory: no [BLOCK_T, BLOCK_D] pointer tile in registers
                        qg = tl.reshape(QD.load([b.to(tl.int32), tile * BLOCK_T, (h * G + g).to(tl.int32), 0]),
                                        [BLOCK_T, BLOCK_D])
                        if SPLIT:
                            qg2 = tl.reshape(QD2.load([b.to(tl.int32), tile * BLOCK_T, (h * G + g).to(tl.int32),
                                                       BLOCK_D]), [BLOCK_T, BLOCK_D2])
                    else:
                        if EVEN_D:  # no column mask: vectorized loads
                            qg = tl.load(q_ptr, mask=tok_ok[:, None], other=0.0)
                        else:
                            qg = tl.load(q_ptr, mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
                        q_ptr += sqh
                        if SPLIT:
                            qg2 = tl.load(q2_ptr, mask=tok_ok[:, None] & d2_ok[None, :], other=0.0)
                            q2_ptr += sqh
                    lse_g = tl.load(lse_ptr, mask=tok_ok, other=float("-inf"))
                    lse_ptr += slh
                    # Tokens outside the pass, or seeing nothing, get +inf: probabilities 0 without a mask.
                    lse2p = tl.where(in_pass & (lse_g > float("-inf")), lse_g * 1.4426950408889634, float("inf"))
                    s = qk_dot(qg, kc, IEEE)
                    if SPLIT:
                        s += qk_dot(qg2, kc2, IEEE)
                    p += tl.exp2(s * qk_scale - lse2p[:, None])
                    if C > 0 and not SHIFT_TAIL:
                        st = qk_dot(qg, kt, IEEE)
                        if SPLIT:
                            st += qk_dot(qg2, kt2, IEEE)
                        pt += tl.exp2(st * qk_scale - lse2p[:, None])
                if (j0 + BLOCK_J) * R - 1 > i_full:  # the chunk reaches past some token's last block
                    p = tl.where((i_loc[None, :] <= last[:, None]) & (u_c < R)[None, :], p, 0.0)
                # The group of j (blocks starting inside j), then its tail.
                p3 = tl.reshape(p, [BLOCK_T, BLOCK_J, R_PAD])
                score = tl.sum(p3, axis=2)
                if SHIFT_TAIL:
                    # The tail of j is the last C blocks of j - 1's group: their sum moves one column right,
                    # the chunk's first column takes the previous chunk's last.
                    tails = tl.sum(tl.where(u3 >= R - C, p3, 0.0), axis=2)
                    moved = _shift_right(tails, shift_m, SHIFT_BF16)
                    score += tl.where(jj2 == 0, carry[:, None], moved)
                    carry = tl.sum(tl.where(jj2 == BLOCK_J - 1, tails, 0.0), axis=1)
                elif C > 0:
                    # Tail blocks are below the group's: masked by the same causal rule (and padding).
                    pt = tl.where((i_tail[None, :] <= last[:, None]) & tail_ok[None, :], pt, 0.0)
                    score += tl.sum(tl.reshape(pt, [BLOCK_T, BLOCK_J, C_PAD]), axis=2)
                jg = j0 + tl.arange(0, BLOCK_J)[None, :]
                cand = act_tok[:, None] & (jg <= jt_tok[:, None])
                forced = cand & ((jg < n_init) | (jg > jt_tok[:, None] - n_local))
                bits = tl.where(forced, 2139095040, score.to(tl.int32, bitcast=True))  # +inf's bits first
                # Non-candidates get negative keys below every other key, distinct across chunks and passes:
                # ranking needs distinct keys, and a token outside this pass must keep its list as it is.
                jg64 = jg.to(tl.int64)
                key = tl.where(cand, bits.to(tl.int64) * 4294967296 + (2147483647 - jg64), low - jg64)
                # Insert the keys that beat a token's smallest kept key, largest first, each replacing that
                # smallest one (keys are distinct, so exactly one slot matches). Usually a few per chunk.
                thr = tl.min(top, axis=1)
                best = tl.max(key, axis=1)
                while tl.max((best > thr).to(tl.int32), axis=0) > 0:
                    ins = best > thr
                    top = tl.where(ins[:, None] & (top == thr[:, None]), best[:, None], top)
                    key = tl.where(key == best[:, None], low - BLOCK_J, key)  # out of this chunk's race
                    thr = tl.min(top, axis=1)
                    best = tl.max(key, axis=1)
            done = done | act_tok
            low = low - 4294967296

    # The kept keys -> block ids, ascending (by rank: how many are smaller), -1 padded.
    col = tl.arange(0, KEEP)[None, :]
    big = 1 << 40
    j_sel = tl.where((top >= 0) & (top < DEAD), 2147483647 - (top & 4294967295), big + col)  # distinct
    rank = tl.sum((j_sel[:, None, :] < j_sel[:, :, None]).to(tl.int32), axis=2)
    j_sel = tl.sum(tl.where(rank[:, :, None] == col[:, None, :], j_sel[:, :, None], 0), axis=1)
    j_sel = tl.where(j_sel >= big, -1, j_sel).to(tl.int32)
    tl.store(IDX + b * sib + t_tok64[:, None] * sit + h * sih + col * sin, j_sel,
             mask=tok_ok[:, None] & (col < n_sel))


def _interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module loaded)."""
    return "Interpreted" in type(_topn_kernel).__name__


def unsupported(cfg) -> str | None:
    """Why the kernel cannot run this configuration (None when it can)."""
    if cfg.n_sel > MAX_KEEP:
        return f"n_sel={cfg.n_sel} > {MAX_KEEP}: the top-n kernel keeps at most {MAX_KEEP} keys per query"
    c = cfg.sel_overlap()[1]
    if c > MAX_TAIL:
        return (f"block_cmp={cfg.block_cmp} is {c + 1} strides of {cfg.stride_cmp}: the top-n kernel handles at most "
                f"{MAX_TAIL + 1} (block_cmp <= {MAX_TAIL + 1} * stride_cmp)")
    return None


def shifts_tail(cfg) -> bool:
    """Whether the tails come from the group tile (0 < C <= R), not from a dot of their own."""
    r, c = cfg.sel_overlap()
    return 0 < c <= r


def chunk_shape(cfg, cmp_per_chunk: int) -> tuple[int, int, int]:
    """(selection blocks per chunk, padded group width R_PAD, padded tail width C_PAD): about `cmp_per_chunk`
    columns in the wider of the two tiles, and at least 16 in each (tl.dot's smallest N)."""
    r, c = cfg.sel_overlap()
    r_pad, c_pad = _np2(r), _np2(max(c, 1))
    block_j = max(cmp_per_chunk // max(r_pad, c_pad), 2)
    return block_j, max(r_pad, 16 // block_j), max(c_pad, 16 // block_j)


def tile_config(D: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tokens per program (the dot's rows), compressed blocks per chunk (the group tile's columns), the head
    loop's pipeline depth and warps, and whether the tails are shifted from the group tile where the blocks
    allow it. H100, G=16, D=128, bf16, 64k, tails by their own dot: 64 tokens x 128 blocks with 3 stages
    took 8.9 ms; 64 x 128 with 2 stages 9.9 ms, 64 x 256 9.7-25 ms, 64 x 64 12.7-20 ms, 128-token tiles
    11.2-62 ms (bench/results/h100-cu130-torch2.11/tune_topn.csv; bench/tune_kernels.py runs the same grid).
    The shift's dot grows with the chunk: on an H200 at 64k, 64 x 128 with 3 stages took 8.28 ms shifted (an
    fp32 dot) against 9.06, but 64 x 256 with 8 warps 15.5 against 9.9. With the shift on tensor cores and
    TMA copies, 64 x 128 with 3 stages takes 6.84 ms; 4 stages 6.96, pointer loads 7.25, 64 x 64 9.3,
    128 x 64 9.0, 64 x 256 9.5 (bench/results/h200-cu130-torch2.11/tune_topn_seldq.csv). Wide heads keep
    the shared memory of the pipelined q tiles in bounds; fp32 (IEEE dots on CUDA cores) takes smaller
    tiles."""
    if dtype == torch.float32:
        return {"BLOCK_T": 32, "CMP_PER_CHUNK": 32, "HEAD_STAGES": 2, "num_warps": 4, "SHIFT_TAIL": False}
    if D > 128 and not split_dim(D)[1]:  # D=192 as one 256-column tile, 64k: 15.5 ms; 64 x 128 x 3 stages 16.3
        return {"BLOCK_T": 64, "CMP_PER_CHUNK": 256, "HEAD_STAGES": 2, "num_warps": 8, "SHIFT_TAIL": False}
    # D=192 as 128 + 64 columns with TMA copies (H200, 64k): 9.8 ms with this entry; 10.1 with 2 stages, 13.2
    # with 64 blocks per chunk, 21.0 with 8 warps, 23.4-29.0 with 256 blocks per chunk and 8 warps
    return {"BLOCK_T": 64, "CMP_PER_CHUNK": 128, "HEAD_STAGES": 3, "num_warps": 4, "SHIFT_TAIL": True}


def tile_config_sm8x(D: int, dtype: torch.dtype) -> dict | None:
    """sm 8.x's own entries where tile_config's (tuned on sm 9.0) do not fit it, else None. Without TMA the q
    tiles and compressed keys come by pointer loads, through registers: for heads wider than 128 the sm 9.0
    entry (256 blocks per chunk, tails by their own dot) needs 196864 bytes of shared memory per block on
    sm 8.0, past the A100's 166912, and with one head per group ptxas keeps 32 registers and spills 28 KB.
    64 blocks per chunk with the tails shifted from the group tile need 33-49 KB and spill at most 36 bytes
    for G = 1-64 (bench/triton_compile_check.py --arch 80; chosen by compile resources, not yet timed on an
    A100)."""
    if dtype != torch.float32 and D > 128:
        return {"BLOCK_T": 64, "CMP_PER_CHUNK": 64, "HEAD_STAGES": 2, "num_warps": 8, "SHIFT_TAIL": True}
    return None


def launch_table(D: int, dtype: torch.dtype, capability) -> dict:
    """The tile configuration for a GPU of this compute capability (None: sm 9.0's table)."""
    own = tile_config_sm8x(D, dtype) if capability is not None and capability[0] < 9 else None
    return own if own is not None else tile_config(D, dtype)


def topn_triton(q, k_cmp, lse, seq_start, cmp_slot0, cfg, scale, config: dict | None = None, q_offset: int = 0):
    """Selection blocks int32 [B, T, Hkv, n_sel] for every query (see the module doc for the contract).
    q_offset: q's rows (and lse's, seq_start's, cmp_slot0's) are the stream's positions [q_offset,
    q_offset + T); k_cmp holds the compressed blocks of the stream from position 0 on."""
    B, T, Hq, Dk = q.shape
    Hkv = k_cmp.shape[2]
    G = Hq // Hkv
    idx = torch.empty(B, T, Hkv, cfg.n_sel, dtype=torch.int32, device=q.device)
    if B * T * Hkv == 0:
        return idx
    if k_cmp.shape[1] == 0:  # T < l: no block anywhere; keep one zero slot so the kernel has a pointer
        k_cmp = k_cmp.new_zeros(B, 1, Hkv, Dk)
    r, c = cfg.sel_overlap()
    fail = unsupported(cfg)
    if fail:
        raise ValueError(fail)
    meta = {**launch_table(Dk, q.dtype, device_capability(q.device)), **(config or {})}
    block_j, r_pad, c_pad = chunk_shape(cfg, meta.pop("CMP_PER_CHUNK", 64))
    warps = meta.pop("num_warps")
    # The shift's dot needs 16 rows and columns.
    shift = meta.pop("SHIFT_TAIL", False) and shifts_tail(cfg) and block_j >= 16 and meta["BLOCK_T"] >= 16
    n_tiles = triton.cdiv(T, meta["BLOCK_T"])
    block_d, block_d2 = split_dim(Dk)  # the paper's 192 as 128 + 64 columns
    # TMA copies of the q tiles (and of the chunk's compressed keys when its blocks are consecutive slots):
    # no pointer tiles in registers (ncu, H200, 64k: the pointer form used 255 registers and spilled).
    even = block_d + block_d2 == Dk and q.dtype != torch.float32
    use_q = meta.pop("TMA_Q", None)
    use_q = even and tma.supported(q) if use_q is None else use_q
    use_kc = meta.pop("TMA_KC", None)
    use_kc = use_q and r_pad == r and tma.supported(k_cmp) if use_kc is None else use_kc
    qd = tma.tile_descriptor(q, meta["BLOCK_T"], block_d, "topn") if use_q else q
    kcd = tma.tile_descriptor(k_cmp, block_j * r_pad, block_d, "topn") if use_kc else k_cmp
    qd2 = tma.tail_descriptor(use_q, q, meta["BLOCK_T"], block_d2, "topn_tail")
    kcd2 = tma.tail_descriptor(use_kc, k_cmp, block_j * r_pad, block_d2, "topn_tail")
    _topn_kernel[(n_tiles, B * Hkv)](
        q, k_cmp, qd, kcd, qd2, kcd2, lse, seq_start, cmp_slot0, idx,
        *q.stride(), *k_cmp.stride(), *lse.stride(), *seq_start.stride(), *cmp_slot0.stride(), *idx.stride(),
        T, Hkv, G, Dk, cfg.n_sel, cfg.n_init, cfg.n_local, float(scale) * LOG2E, n_tiles, q_offset,
        R=r, C=c, C_PAD=c_pad, STRIDE=cfg.stride_cmp, BLOCK_CMP=cfg.block_cmp, BLOCK_SEL=cfg.block_sel,
        BLOCK_D=block_d, R_PAD=r_pad, BLOCK_J=block_j, KEEP=max(2, _np2(cfg.n_sel)),
        EVEN_D=block_d <= Dk, BLOCK_D2=block_d2, EVEN_D2=block_d + block_d2 == Dk,
        IEEE=q.dtype == torch.float32, SHIFT_TAIL=shift,
        TMA_Q=use_q, TMA_KC=use_kc, SHIFT_BF16=not _interpreted(), num_warps=warps, **meta,
    )
    return idx


__all__ = ["launch_table", "topn_triton", "tile_config", "tile_config_sm8x", "unsupported"]

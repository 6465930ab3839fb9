"""Seeded bugs that the fast CPU suite must catch: apply each one to a copy of the tree, run the tests named
for it, and check that they fail.

    python tests/mutations.py              # every seeded change (about a minute of CPU)
    python tests/mutations.py 5 8          # only changes 5 and 8
    python tests/mutations.py --list       # the table: change -> test that catches it
    python tests/mutations.py --clean 5    # the named tests pass on the unchanged tree

Run it with the test environment's Python (torch, triton, pytest); the tests run in Triton's interpreter.

The repository itself is never edited: the tracked and untracked (not ignored) files are copied to a
temporary directory, the change is made there by an exact text replacement (which must match once, so a
moved or reworded line is reported instead of silently testing nothing), and pytest runs in that copy.
A change "survives" when its tests pass; the script exits 1 if any change survives or no longer applies.
Not part of the default suite (it runs pytest itself, once per change).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    what: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids (relative to the root) of which at least one must fail


MUTATIONS = [
    Mutation("top-n kernel: forced local blocks bound `>` -> `>=` (one forced block too many)",
             "nsa/kernels/triton/topn.py",
             "(jg > jt_tok[:, None] - n_local)", "(jg >= jt_tok[:, None] - n_local)",
             ("tests/cpu/test_pipeline_interp.py::test_topn_kernel_matches_naive",)),
    Mutation("reverse index: block start without the sequence start (packed input)",
             "nsa/kernels/triton/reverse_index.py",
             "s0 = seq_start.long()[:, None, :, None] + j * block_sel", "s0 = j * block_sel",
             ("tests/cpu/test_triton_sel_bwd_interp.py::test_reverse_index_matches_python",)),
    Mutation("reverse index: a query's own first block left out (`j*l' <= p` -> `<`)",
             "nsa/kernels/triton/reverse_index.py",
             "(j * block_sel <= p)", "(j * block_sel < p)",
             ("tests/cpu/test_triton_sel_bwd_interp.py::test_reverse_index_matches_python",)),
    Mutation("decode scoring: last free candidate block treated as forced (`free` bound `<=` -> `<`)",
             "nsa/kernels/triton/decode/score_topk.py",
             "(j <= jt - N_LOCAL)", "(j < jt - N_LOCAL)",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_ragged_decode_equals_prefill",)),
    Mutation("decode combine: `_fold_parts` does not rescale the running sum",
             "nsa/kernels/triton/decode/parts.py",
             "lsum = lsum * alpha + tl.sum(l_p * beta, 0)", "lsum = lsum + tl.sum(l_p * beta, 0)",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_ragged_decode_equals_prefill",)),
    Mutation("decode window: `_window_partial` reads slots < min(t, W), missing the newest token",
             "nsa/kernels/triton/decode/parts.py",
             "tl.minimum(lo + slots_per_split, tl.minimum(t + 1, W))",
             "tl.minimum(lo + slots_per_split, tl.minimum(t, W))",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_ragged_decode_equals_prefill",)),
    Mutation("gate combine backward: row t=0 of d g_sel left unwritten",
             "nsa/kernels/triton/combine.py",
             "tl.store(DG + r * 3 + 1, tl.sum(do * s, axis=1).to(DG.dtype.element_ty), mask=ok)",
             "tl.store(DG + r * 3 + 1, tl.sum(do * s, axis=1).to(DG.dtype.element_ty), mask=ok & (t > 0))",
             ("tests/cpu/test_pipeline_interp.py::test_combine_kernel_forward_backward",)),
    Mutation("selection forward: query heads of a KV head interleaved (`heads = h + rg*Hkv`)",
             "nsa/kernels/triton/selection_fwd.py",
             "heads = (h * G + rg).to(tl.int64)", "heads = (h + rg * Hkv).to(tl.int64)",
             ("tests/cpu/test_triton_sel_interp.py::test_kernel_matches_torch_dense",)),
    Mutation("packed layout: last compressed block dropped (`n_slots = (T-1)//d`)",
             "nsa/layout.py",
             "n_slots = T // d", "n_slots = (T - 1) // d",
             ("tests/cpu/test_varlen.py::test_packed_layout_keeps_the_last_compressed_block",)),
    Mutation("decode scoring: the current block never a free candidate (`j <= jt` -> `<`, n_local = 0)",
             "nsa/kernels/triton/decode/score_topk.py",
             "free = (j <= jt) & (j < NJ)", "free = (j < jt) & (j < NJ)",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_odd_group_and_head_dims",)),
    Mutation("paged decode: a token's page looked up in row 0's block table (row offset dropped)",
             "nsa/kernels/triton/decode/parts.py",
             "page = tl.load(BT + b * sbt + u // PAGE, mask=mask, other=0)",
             "page = tl.load(BT + u // PAGE, mask=mask, other=0)",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_on_the_paged_cache",)),
    Mutation("paged decode: a compressed block's page taken by its index, not its first token (`i // PAGE`)",
             "nsa/kernels/triton/decode/parts.py",
             "page = tl.load(BT + b * sbt + start // PAGE, mask=mask, other=0)",
             "page = tl.load(BT + b * sbt + i // PAGE, mask=mask, other=0)",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_on_the_paged_cache",)),
    Mutation("selection dK/dV kernel: causal mask at the query row, not its stream position (context parallelism)",
             "nsa/kernels/triton/selection_bwd.py",
             "(ktok[:, None] <= tq[None, :] + q_off)", "(ktok[:, None] <= tq[None, :])",
             ("tests/cpu/test_cp_fused_interp.py::test_offset_core_matches_one_process[mid_row_mid_window]",)),
    Mutation("top-n kernel: query offset ignored (context parallelism)",
             "nsa/kernels/triton/topn.py",
             "pos_tok = t_tok + q_off - start_tok", "pos_tok = t_tok - start_tok",
             ("tests/cpu/test_cp_fused_interp.py::test_offset_core_matches_one_process[mid_row_mid_window]",)),
    Mutation("truncate: the compression ring not refilled (blocks made again from dropped draft tokens)",
             "nsa/cache.py",
             'for ring in ("win", "cmp"):', 'for ring in ("win",):',
             ("tests/cpu/test_truncate.py::test_mlp_compression_at_other_boundaries",
              "tests/cpu/test_decode_triton_interp.py::test_kernels_after_a_truncate")),
    Mutation("paged truncate: pages past the new length kept instead of given back",
             "nsa/paged_cache.py",
             "keep = -(-n // self.page_size)", "keep = len(self._pages[b])",
             ("tests/cpu/test_truncate.py::test_paged_pages_past_the_new_length_return_to_the_pool",)),
    Mutation("append as decode steps: step j writes the new tokens in reverse order",
             "nsa/run/decode_step.py",
             "tuple(x[:, one] for x in tokens)", "tuple(x[:, T - 1 - j:T - j] for x in tokens)",
             ("tests/cpu/test_append_steps_interp.py::test_equal_k_appends_as_kernel_steps[paged-3]",)),
    Mutation("append routing: rows with different numbers of new tokens taken as decode steps",
             "nsa/plan/__init__.py",
             "    if min(news) != max(news):", "    if False:",
             ("tests/cpu/test_append_steps_interp.py::test_ragged_k_stays_on_the_torch_append",)),
    Mutation("selection walk: the own block's last sub-tile holding the query left out",
             "nsa/kernels/triton/common.py",
             "(pos - own * block_sel) // BLOCK_N + 1, N_SUB)", "(pos - own * block_sel) // BLOCK_N, N_SUB)",
             ("tests/cpu/test_triton_sel_interp.py::test_shortened_walk_gives_the_whole_walks_bits[pointers]",)),
    Mutation("selection walk: a row with an invisible block before a visible one taken as leading",
             "nsa/kernels/triton/common.py",
             "    return tl.where(leading, n_it, n_sel * N_SUB)", "    return n_it",
             ("tests/cpu/test_triton_sel_interp.py::test_walk_ends_after_the_last_visible_tile",)),
    Mutation("decode combine: the window branch left out of the output",
             "nsa/kernels/triton/decode/combine.py",
             "o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel + g_win[:, None] * o_win",
             "o = g_cmp[:, None] * o_cmp + g_sel[:, None] * o_sel",
             ("tests/cpu/test_decode_triton_interp.py::test_kernels_ragged_decode_equals_prefill",)),
    Mutation("decode scoring: each chunk keeps one free candidate too few (`n - n_init - n_local - 1`)",
             "nsa/kernels/triton/decode/workspace.py",
             "return max(1, n_sel - n_init - n_local)", "return max(1, n_sel - n_init - n_local - 1)",
             ("tests/cpu/test_decode_triton_interp.py::"
              "test_candidate_merge_takes_the_forced_blocks_and_the_best_keys",)),
]


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():  # deleted but still in the index: skip
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _pytest(tree: Path, tests, quiet: bool) -> tuple[int, float, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    return res.returncode, time.monotonic() - t0, res.stdout[-3000:] + res.stderr[-2000:]


def check(index: int, m: Mutation, clean: bool, verbose: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix="nsa-mutation-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        target = tree / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            print(f"[{index}] DOES NOT APPLY: {m.old!r} occurs {text.count(m.old)} times in {m.path}")
            return False
        if not clean:
            target.write_text(text.replace(m.old, m.new))
        rc, secs, out = _pytest(tree, m.tests, quiet=not verbose)
    # pytest: 0 all passed, 1 some failed; anything else (no tests collected, usage or collection error)
    # means the named tests did not run, which proves nothing.
    if clean:
        ok = rc == 0
        verdict = "clean tree passes" if ok else f"clean tree FAILS (pytest exit {rc})"
    else:
        ok = rc == 1
        verdict = "caught" if ok else ("SURVIVES" if rc == 0 else f"tests did not run (pytest exit {rc})")
    print(f"[{index}] {verdict} in {secs:.0f} s: {m.what}")
    if verbose or not ok:
        print(out)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="*", type=int, help="numbers of the changes to check (default: all)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--clean", action="store_true", help="run the named tests on the unchanged tree instead")
    ap.add_argument("-v", "--verbose", action="store_true", help="show pytest's output for every change")
    args = ap.parse_args(argv)
    chosen = args.which or list(range(1, len(MUTATIONS) + 1))
    if args.list:
        for i in chosen:
            m = MUTATIONS[i - 1]
            print(f"{i}. {m.what} ({m.path}) -> {', '.join(m.tests)}")
        return 0
    results = [check(i, MUTATIONS[i - 1], args.clean, args.verbose) for i in chosen]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

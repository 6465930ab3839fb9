"""The smoke (main job) and the bench scripts on tiny settings: they run, write what they promise, and the
smoke's gate can fail."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from nsa import NSAConfig, benchutil, nsa_decode

ROOT = Path(__file__).resolve().parents[2]
TINY_SMOKE = ["--seq", "40", "--batch", "1", "--layers", "1", "--new-tokens", "3", "--steps", "4", "--lr", "1e-2",
              "--vocab", "64", "--dim", "32", "--heads", "4", "--kv-groups", "2", "--dk", "8", "--dv", "8"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_main_writes_valid_json(tmp_path, capsys):
    from nsa import smoke

    assert smoke.main(TINY_SMOKE + ["--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "smoke.json").read_text())
    assert rep["passed"] is True
    names = {c["name"]: c["passed"] for c in rep["checks"]}
    assert names == {"forward_finite": True, "backward_finite": True, "loss_decreases": True,
                     "generate_matches_uncached": True, "routing_visible": True}
    for key in ("python", "torch", "cuda", "device_name", "git_commit", "date_utc"):
        assert key in rep["meta"]
    assert rep["config"]["nsa"]["block_cmp"] == 16 and rep["shapes"]["generated"] == [1, 43]
    for phase in ("forward", "train", "generate"):
        assert all(rep["served"][phase][b] for b in ("cmp", "sel", "win"))
    assert "PASSED" in capsys.readouterr().out


def test_smoke_fails_when_a_check_fails(tmp_path, monkeypatch):
    from nsa import smoke

    monkeypatch.setitem(smoke.TOLERANCE, torch.float32, -1.0)  # no logit difference can pass
    assert smoke.main(TINY_SMOKE + ["--steps", "1", "--out", str(tmp_path)]) == 1
    rep = json.loads((tmp_path / "smoke.json").read_text())
    failed = {c["name"] for c in rep["checks"] if not c["passed"]}
    assert "generate_matches_uncached" in failed and rep["passed"] is False


def test_bench_decode_and_summary(tmp_path, capsys):
    dec = _load("bench_decode")
    out = tmp_path / "decode.csv"
    argv = ["--B", "1", "--dim", "32", "--heads", "4", "--groups", "2", "--dk", "8", "--dv", "8", "--l", "8",
            "--d", "4", "--l_sel", "8", "--n_sel", "3", "--w", "16", "--S_list", "20,41", "--iters", "1",
            "--warmup", "0", "--csv", str(out), "--branch_force_mode", "env", "--device", "cpu"]
    assert dec.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert [int(r["S"]) for r in rows] == [20, 41]
    assert list(rows[0]) == dec.COLUMNS
    for r in rows:
        for c in ("step_ms", "tok_per_s", "cmp_ms", "topk_ms", "sel_ms", "win_ms", "dense_ms", "kv_bytes"):
            assert float(r[c]) > 0, c
        parts = sum(int(r[c]) for c in ("kv_bytes_cmp", "kv_bytes_sel", "kv_bytes_win"))
        assert int(r["kv_bytes"]) == parts
    # S=41, step at t=41: 9 compressed blocks of the 42 tokens, window 16, selected blocks 0 (init), 5 (local:
    # tokens 40..41 only) and one more full block -> 8 + 8 + 2 tokens; per KV head, 2 KV heads
    per_tok = (8 + 8) * 4
    assert int(rows[1]["cmp_blocks"]) == 9
    assert int(rows[1]["kv_bytes"]) == 2 * per_tok * (9 + 18 + 16)
    assert int(rows[1]["dense_kv_bytes"]) == 2 * per_tok * 42
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["meta"]["torch"] == torch.__version__ and len(side["rows"]) == 2

    assert dec.main(argv[:-4] + ["--branch_force_mode", "sel", "--device", "cpu"]) == 0
    row = next(csv.DictReader(out.open()))
    assert row["cmp_ms"] == "" and row["win_ms"] == "" and float(row["sel_ms"]) > 0

    summ = _load("summarize_decode_csv")
    capsys.readouterr()
    assert summ.main([str(out), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "| 41 |" in text and "tok/s" in text
    assert summ.main([str(out)]) == 0


def test_dense_decode_baseline_matches_nsa_window_branch():
    """With w >= S + 1 and only the window gate on, NSA decode is dense attention over the cache: the
    bench's SDPA baseline (no is_causal with one query) must agree."""
    dec = _load("bench_decode")
    torch.manual_seed(0)
    cfg = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=2, n_init=1, n_local=1, window=64)
    B, S, Hq, Hkv, D = 2, 30, 4, 2, 8
    k, v = torch.randn(B, S + 1, Hkv, D, dtype=torch.float64), torch.randn(B, S + 1, Hkv, D, dtype=torch.float64)
    q = torch.randn(B, 1, Hq, D, dtype=torch.float64)
    from nsa import NSACache

    cache = NSACache(cfg, B, S + 1, Hkv, D, D, dtype=torch.float64)
    cache.write(k[:, :S], v[:, :S])
    gates = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand(B, 1, Hq, 3)
    out = nsa_decode(q, k[:, S:], v[:, S:], gates, cache)
    ref = dec.sdpa_decode(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), D ** -0.5).transpose(1, 2)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_bench_decode_smoke_fill_mode(tmp_path):
    """--smoke: the cache filled through its API (no prefill), dense and ragged rows, bytes counted from it."""
    dec = _load("bench_decode")
    out = tmp_path / "fill.csv"
    assert dec.main(["--smoke", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == dec.COLUMNS
    assert [(int(r["S"]), int(r["B"]), r["ragged"]) for r in rows] == [
        (40, 1, ""), (70, 1, ""), (40, 3, ""), (70, 3, ""), (70, 3, "23-70")]
    for r in rows:
        for c in ("step_ms", "step_eager_ms", "dense_ms", "speedup_vs_dense", "kv_bytes", "dense_kv_bytes", "tbps"):
            assert float(r[c]) > 0, c
        for key in ("step", "dense"):  # the spread of the batches the median was taken over
            assert 0 < float(r[f"{key}_min_ms"]) <= float(r[f"{key}_ms"]) <= float(r[f"{key}_max_ms"]), key
        assert r["step_graph_ms"] == "" and r["hbm_tbps"] == ""  # CPU: no graph, no HBM limit
        assert float(r["check_rel_err"]) == 0 and float(r["check_idx_agree"]) == 1
    # S=70, B=1 (tiny preset: l=8, d=4, l'=8, n=4, w=16, Hkv=2, D=16, fp32): step at t=70 sees 16 compressed
    # blocks, blocks 0 (init), 7 and 8 (local; 8 holds tokens 64..70) and one more full block -> 8+7+8+8 = 31
    # selected tokens, and the window of 16
    per_tok = (16 + 16) * 4
    assert int(rows[1]["kv_bytes"]) == 2 * per_tok * (16 + 31 + 16)
    assert int(rows[1]["dense_kv_bytes"]) == 2 * per_tok * 71
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["meta"]["torch"] == torch.__version__ and len(side["rows"]) == 5
    assert {r["cache"] for r in rows} == {"contiguous"}


def test_bench_decode_paged_rows(tmp_path):
    """--paged: each cell on the contiguous cache, then on a paged one (pages of --page-size): the same bytes
    read, the paged step checked against the torch step; no dense baseline on the paged rows."""
    dec = _load("bench_decode")
    out = tmp_path / "paged.csv"
    assert dec.main(["--smoke", "--S_list", "70", "--B_list", "3", "--ragged_S", "70", "--paged", "--page-size", "8",
                     "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["cache"], r["page_size"], r["ragged"]) for r in rows] == [
        ("contiguous", "", ""), ("paged", "8", ""), ("contiguous", "", "23-70"), ("paged", "8", "23-70")]
    for contiguous, paged in (rows[0:2], rows[2:4]):
        assert paged["kv_bytes"] == contiguous["kv_bytes"] and float(paged["tbps"]) > 0
        assert float(paged["check_rel_err"]) == 0 and float(paged["check_idx_agree"]) == 1
        assert paged["dense_ms"] == "" and float(contiguous["dense_ms"]) > 0
        # the read floor is a CUDA measurement: empty on this CPU run, never a made-up figure
        assert contiguous["read_floor_ms"] == contiguous["speedup_ceiling"] == paged["read_floor_ms"] == ""
    with pytest.raises(SystemExit):
        dec.main(["--smoke", "--paged", "--page-size", "6"])


def test_bench_prefill_tiny(tmp_path):
    pre = _load("bench_prefill")
    out = tmp_path / "prefill.csv"
    argv = ["--T_list", "24,70", "--heads", "4", "--kv_heads", "2", "--dk", "16", "--dv", "8", "--l", "8", "--d",
            "4", "--l_sel", "8", "--n_sel", "3", "--w", "16", "--iters", "1", "--warmup", "0", "--device", "cpu",
            "--csv", str(out)]
    assert pre.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == pre.COLUMNS and [int(r["T"]) for r in rows] == [24, 70]
    for r in rows:
        for c in ("fwd_ms", "fwd_bwd_ms", "dense_fwd_ms", "dense_fwd_bwd_ms", "ratio_fwd", "fwd_ns_per_work"):
            assert float(r[c]) > 0, c
        assert int(r["fwd_peak_bytes"]) >= 0
        assert r["served"] == "cmp:torch;sel:torch;win:torch"
        assert float(r["work"]) == int(r["T"]) * (int(r["T"]) / 4 + 3 * 8 + 16)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["args"]["backward"] is True and len(meta["rows"]) == 2

    assert pre.main(argv + ["--no-backward", "--no-dense", "--csv", str(out)]) == 0
    r = next(csv.DictReader(out.open()))
    assert r["fwd_bwd_ms"] == "" and r["dense_fwd_ms"] == ""


def test_dense_prefill_baseline_is_causal_gqa():
    pre = _load("bench_prefill")
    torch.manual_seed(0)
    q = torch.randn(1, 10, 4, 8, dtype=torch.float64)
    k, v = torch.randn(1, 10, 2, 8, dtype=torch.float64), torch.randn(1, 10, 2, 6, dtype=torch.float64)
    out, _ = pre.dense_attention(q, k, v, 8 ** -0.5)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    logits = torch.einsum("bthd,bshd->bhts", q, kk) * 8 ** -0.5
    logits = logits.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhts,bshd->bthd", logits.softmax(-1), vv)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_benchutil(tmp_path, monkeypatch):
    calls = []
    t = benchutil.time_fn(lambda: calls.append(1), iters=3, warmup=2)
    assert len(calls) == 5 and t["iters"] == 3 and t["median_ms"] >= 0 and len(t["times_ms"]) == 3
    with pytest.raises(ValueError):
        benchutil.time_fn(lambda: None, iters=0)
    mem = benchutil.peak_memory(lambda: torch.ones(8 << 20).add_(1))  # 32 MiB
    assert mem["peak_bytes"] >= 0 and mem["method"]
    monkeypatch.setattr(sys, "argv", ["/opt/x/bench.py", "--csv", "/data/run/out.csv", "--out=/data/run", "rel/a.csv"])
    meta = benchutil.env_metadata("cpu")
    json.dumps(meta)
    assert meta["argv"] == ["bench.py", "--csv", "out.csv", "--out=run", "rel/a.csv"]  # no machine directories
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__
    monkeypatch.setattr(benchutil, "REPO_ROOT", tmp_path)  # not a git checkout: None, not an error
    assert benchutil.git_commit() is None
    p = benchutil.write_csv(tmp_path / "x.csv", [{"a": 1, "b": float("nan")}, {"a": 2.5, "c": "z"}])
    assert p.read_text().splitlines() == ["a,b,c", "1,,", "2.5,,z"]
    j = benchutil.write_json(tmp_path / "x.json", {"v": float("inf"), "t": torch.tensor([1, 2]), "d": torch.float32})
    assert json.loads(j.read_text()) == {"v": None, "t": [1, 2], "d": "torch.float32"}
    assert benchutil.parse_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError):
        benchutil.parse_dtype("int3")
    assert benchutil.fmt_bytes(2048) == "2.00 KiB" and benchutil.fmt_bytes(float("nan")) == "-"
    with benchutil.Stopwatch() as sw:
        pass
    assert math.isfinite(sw.ms) and sw.ms >= 0


def test_bench_nsa_smoke_with_config(tmp_path, capsys):
    """bench_nsa's --smoke runs every row on CPU; --config changes the NSAConfig it times (recorded in the
    JSON) and refuses unknown fields, non-integers and combinations NSAConfig rejects, naming the option."""
    bench = _load("bench_nsa")
    assert bench.main(["--smoke", "--config", "n_sel=3,window=8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_nsa.json").read_text())
    assert (data["config"]["n_sel"], data["config"]["window"], data["config"]["block_sel"]) == (3, 8, 8)
    rows = list(csv.DictReader((tmp_path / "bench_nsa.csv").open()))
    assert rows and all(r["status"] == "ok" and float(r["fwdbwd_ms"]) > 0 for r in rows)
    assert "n_sel=3" in capsys.readouterr().out
    for bad, says in (("n_sell=3", "FIELD one of"), ("n_sel=three", "takes an integer"), ("window", "FIELD=INT"),
                      ("n_sel=2", "n_sel"), ("compress=1", "FIELD one of")):
        with pytest.raises(SystemExit, match=says) as e:
            bench.main(["--smoke", "--config", bad, "--out", str(tmp_path)])
        assert "--config" in str(e.value)


def test_bench_sel_triton_smoke(tmp_path):
    """The selection bench's --smoke (the kernels in Triton's interpreter on CPU) writes every column; its
    byte counts agree with a count by loops."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the CPU lock pins it)")
    sel = _load("bench_sel_triton")
    try:
        sel.prepare_device(sel.argparse.Namespace(smoke=True))
    except SystemExit as e:
        pytest.skip(str(e))
    assert sel.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "bench_sel_triton.csv").open()))
    assert list(rows[0]) == sel.COLUMNS and {r["indices"] for r in rows} == {"topn", "random"}
    for r in rows:
        assert r["status"] == "ok" and r["dense_impl"] == "sdpa_math"
        for c in sel.COLUMNS[10:]:
            if c not in ("dense_impl", "status"):
                assert float(r[c]) > 0, c

    cfg = NSAConfig(block_cmp=4, stride_cmp=4, block_sel=8, n_sel=3, n_init=1, n_local=1, window=8)
    idx = sel.make_indices("topn", 45, 2, cfg, torch.device("cpu"))
    idx[0, 30, 1, 0] = 5  # a block after the query: nothing visible
    tokens = pairs = 0
    last = {}
    for t, h, j in itertools.product(range(45), range(2), range(3)):
        blk = int(idx[0, t, h, j])
        seen = min(max(t - blk * 8 + 1, 0), 8) if blk >= 0 else 0
        tokens, pairs = tokens + seen, pairs + (seen > 0)
        if seen:
            last[(h, blk)] = max(last.get((h, blk), 0), seen)
    assert sel.traffic(idx, 8) == (tokens, pairs, sum(last.values()))


def test_tune_decode_variants_parse():
    """Every default variant of bench/tune_decode.py names real Tuning fields (a typo would end a GPU run at its
    first cell); per-SM counts scale with the GPU; unknown fields are refused with the known ones listed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the CPU lock pins it)")
    tune = _load("tune_decode")
    parsed = dict(tune.parse_variant(v, 132) for v in tune.DEFAULT_VARIANTS)
    assert len(parsed) == len(tune.DEFAULT_VARIANTS) and parsed["base"] == tune.kd.Tuning()
    assert parsed["c4"].target_cmp == 4 * 132 and parsed["p2"].target_programs == 2 * 132
    assert parsed["win_in_cmp"].window_with_sel is False
    with pytest.raises(SystemExit, match="unknown Tuning field 'nope'.*window_with_sel"):
        tune.parse_variant("x:nope=1", 132)


def test_tune_decode_timeline_of_steps():
    """The decode timeline: each launch's start and end relative to its step's first kernel (a step begins at
    each append, events in any order), medians over the steps, the step's span; a kernel missing from a step
    counts only where it ran. Planted figures, so a wrong grouping or reference point changes them."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the CPU lock pins it)")
    tune = _load("tune_decode")
    one = [(100, 102, "append"), (101, 130, "cmp_win"), (129, 136, "score"), (135, 152, "sel"), (151, 160, "combine")]
    two = [(200, 202, "append"), (201, 232, "cmp_win"), (231, 238, "score"), (237, 254, "sel"),
           (253, 262, "combine"), (258, 259, "other")]
    tl = tune.step_timeline(list(reversed(one + two)))
    assert (tl["append_start_us"], tl["append_end_us"]) == (0, 2)
    assert (tl["cmp_win_start_us"], tl["cmp_win_end_us"]) == (1, 31)  # medians of 30 and 32
    assert (tl["sel_start_us"], tl["sel_end_us"]) == (36, 53)
    assert (tl["other_start_us"], tl["other_end_us"]) == (58, 59)
    assert tl["step_span_us"] == 61
    assert set(tune.TIMELINE_COLUMNS) <= set(tl)
    text = tune.format_timeline(tl)
    assert "cmp_win 1.0-31.0" in text and "combine 52.0-61.0" in text and text.endswith("step 61.0")
    assert tune.step_timeline([]) == {"step_span_us": 0.0}


def test_bench_decode_config_and_steps(tmp_path):
    """The seeds' `--config configs/base.yaml --steps N`: shapes, S and B from the file (flags override), then
    a prefill + N decode steps through the layer (run_* columns)."""
    pytest.importorskip("yaml")
    dec = _load("bench_decode")
    args = dec.parse_args(["--config", str(ROOT / "configs" / "base.yaml")])
    assert (args.dim, args.heads, args.groups, args.dk, args.dv) == (256, 8, 2, 32, 32)
    assert (args.l, args.d, args.l_sel, args.n_sel, args.w, args.S, args.B, args.steps) == (
        32, 16, 64, 16, 512, [2048], 1, 200)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: {dim: 32, n_heads: 4, n_kv_groups: 2, d_k: 8, d_v: 8}\n"
                   "nsa: {block_cmp: 8, stride_cmp: 4, block_sel: 8, n_sel: 3, window: 16}\n"
                   "bench: {seq_len: 30, batch_size: 2, steps: 50}\n")
    out = tmp_path / "decode.csv"
    argv = ["--config", str(cfg), "--steps", "5", "--iters", "1", "--warmup", "0", "--csv", str(out), "--device",
            "cpu", "--no-check"]
    assert dec.main(argv) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert (int(row["S"]), int(row["B"]), int(row["heads"]), int(row["run_steps"])) == (30, 2, 4, 5)
    assert row["run_finite"] == "True" and float(row["run_tok_per_s"]) > 0 and float(row["decode_tok_per_s"]) > 0
    assert dec.parse_args(["--config", str(cfg), "--B", "3"]).B == 3  # a flag overrides the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {dim: -4}\n")
    with pytest.raises(SystemExit, match="model.dim must be a positive integer"):
        dec.parse_args(["--config", str(bad)])
    with pytest.raises(SystemExit, match="No such file"):
        dec.parse_args(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("start, fits_up_to, expect", [
    # doubling 64, 128, 256 (out of memory), then bisection: 192 fits, 224 does not, 208 is below a quantum
    (64, 200, {64: "ok", 128: "ok", 256: "oom", 192: "ok", 224: "oom"}),
    # a first try that does not fit halves until one does, then bisects (112 is within a quantum of 96)
    (512, 100, {512: "oom", 256: "oom", 128: "oom", 64: "ok", 96: "ok"}),
])
def test_bench_cp_longest_search(tmp_path, monkeypatch, start, fits_up_to, expect):
    """bench_cp --longest: the tries and their verdicts when a call past `fits_up_to` tokens runs out of memory,
    every try on disk, and the summary's longest stream and first failure."""
    import time

    import torch.distributed as dist

    from nsa.distributed import ContextParallel

    bench_cp = _load("bench_cp")
    real = bench_cp.nsa_attention

    def fake(q, *a, **kw):
        if q.shape[1] > fits_up_to:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(q, *a, **kw)

    monkeypatch.setattr(bench_cp, "nsa_attention", fake)
    args = bench_cp.parse_args(["--smoke", "--out", str(tmp_path), "--longest", "--longest-from", str(start),
                                "--longest-refine", "3"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        spec = ContextParallel(dist.group.WORLD, layout="zigzag")
        rows = bench_cp.longest(args, torch.device("cpu"), bench_cp.SMOKE_CFG, spec, "small",
                                bench_cp.SMOKE_SHAPES["small"], torch.float32, tmp_path, time.perf_counter())
    finally:
        dist.destroy_process_group()
    assert {r["T_total"]: r["status"] for r in rows} == expect
    assert len(rows) == len(expect)  # no length tried twice
    on_disk = list(csv.DictReader(open(tmp_path / "bench_cp_longest_w1.csv")))
    assert [(int(r["T_total"]), r["status"]) for r in on_disk] == list(expect.items())
    fit = max(T for T, s in expect.items() if s == "ok")
    # a second world size's search next to it: the summary gives its ratio to one GPU's longest
    bench_cp.write_csv(tmp_path / "bench_cp_longest_w4.csv",
                       [dict(on_disk[0], world="4", T_total=str(4 * fit), status="ok")])
    table = {b["world"]: b for b in bench_cp.summarize_longest(tmp_path)}
    assert table[1]["longest_T"] == fit and table[1]["first_oom_T"] == min(T for T, s in expect.items()
                                                                          if s == "oom" and T > fit)
    assert table[4]["x_one_gpu"] == 4.0

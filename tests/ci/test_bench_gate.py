"""ci/evidence/bench_gate.py and bench/bench_headline.py: the gate passes within its allowance, fails beyond
it, and a deliberately slowed path (NSA_TEST_SLOWDOWN) makes it fail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ci.evidence import bench_gate as G

_spec = importlib.util.spec_from_file_location("bench_headline", Path(__file__).parents[2] / "bench/bench_headline.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

BASE = {"schema": G.SCHEMA, "policy": {"allowance": 0.10},
        "classes": {"h200": {"figures": {
            "prefill_fwd_ms": {"value": 10.0, "better": "lower", "source": {"commit": "abc"}},
            "tok_per_s": {"value": 1000.0, "better": "higher"},
            "decode_step_ms": {"value": 1.0, "allowance": 0.5}}}}}


def fig(v):
    return {"value": v, "better": "lower"}


def test_gpu_class():
    assert G.gpu_class("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert G.gpu_class("NVIDIA H200") == "h200"
    assert G.gpu_class(None) == "cpu"


def test_within_allowance_passes_beyond_fails():
    assert G.compare({"prefill_fwd_ms": fig(10.9)}, BASE, "h200")["status"] == G.PASS
    assert G.compare({"prefill_fwd_ms": fig(11.0)}, BASE, "h200")["status"] == G.PASS  # at the limit
    res = G.compare({"prefill_fwd_ms": fig(11.2)}, BASE, "h200")
    assert res["status"] == G.FAIL and res["rows"][0]["source"] == {"commit": "abc"}
    assert G.compare({"prefill_fwd_ms": fig(5.0)}, BASE, "h200")["status"] == G.PASS  # faster is fine
    # higher-is-better figures and a figure's own allowance
    assert G.compare({"tok_per_s": {"value": 899.0, "better": "higher"}}, BASE, "h200")["status"] == G.FAIL
    assert G.compare({"tok_per_s": {"value": 950.0, "better": "higher"}}, BASE, "h200")["status"] == G.PASS
    assert G.compare({"decode_step_ms": fig(1.45)}, BASE, "h200")["status"] == G.PASS
    # one regression among passing figures fails the gate
    both = G.compare({"prefill_fwd_ms": fig(10.0), "decode_step_ms": fig(2.0)}, BASE, "h200")
    assert both["status"] == G.FAIL
    assert any("FAIL" in line for line in G.describe(both))


def test_no_baseline_for_class():
    res = G.compare({"prefill_fwd_ms": fig(10.0)}, BASE, "h100-80gb-hbm3")
    assert res["status"] == G.NO_BASELINE and "no baseline" in G.describe(res)[0]


def test_shipped_baselines_file_loads():
    data = G.load_baselines()
    assert data["schema"] == G.SCHEMA and 0 < data["policy"]["allowance"] < 1
    for cls in data["classes"].values():  # every stored number says where it came from
        for f in cls["figures"].values():
            assert f["source"]["commit"] and f["source"]["date"]


def test_slowdown_switch(monkeypatch):
    monkeypatch.delenv(H.ENV, raising=False)
    f = lambda: 1  # noqa: E731
    assert H.slowed(f) is f
    assert H.factor({H.ENV: "2.5"}) == 2.5
    for bad in ("x", "0.5", "-1"):
        with pytest.raises(ValueError, match=H.ENV):
            H.factor({H.ENV: bad})
    w = H.slowed(f, environ={H.ENV: "3"})
    assert w() == 1 and w.slowdown == 3.0


@pytest.fixture
def one_thread():
    """One intra-op thread: the CPU headline clock is this process's CPU time, which pool threads spinning on a
    loaded machine inflate at random."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_seeded_regression_fails_the_gate(tmp_path, monkeypatch, one_thread):
    """The real headline bench (tiny shapes, CPU): baseline, an unchanged rerun passes, a slowed one fails."""
    monkeypatch.delenv(H.ENV, raising=False)
    run = lambda: H.run("cpu", "tiny", repeats=5, iters=2, only=["prefill_fwd_ms"])  # noqa: E731
    run()  # one-time costs (lazy imports, allocator warm-up) stay out of the baseline
    first = run()
    assert first["slowdown"] == 1.0 and first["figures"]["prefill_fwd_ms"]["value"] > 0
    baselines = G.promote(first, {"schema": G.SCHEMA, "policy": {"allowance": 1.0}, "classes": {}}, "cpu",
                          commit="test", artifact="tmp")
    src = baselines["classes"]["cpu"]["figures"]["prefill_fwd_ms"]["source"]
    assert src["commit"] == "test" and src["date"] and src["statistic"].startswith("median")
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(baselines))

    assert G.compare(run()["figures"], baselines, "cpu")["status"] == G.PASS

    monkeypatch.setenv(H.ENV, "5")
    slowed = run()
    assert slowed["slowdown"] == 5.0
    res = G.compare(slowed["figures"], baselines, "cpu")
    assert res["status"] == G.FAIL and res["rows"][0]["ratio"] > 3, (first["figures"], slowed["figures"])
    head = tmp_path / "headline.json"
    head.write_text(json.dumps(slowed))
    assert G.main(["check", str(head), "--baselines", str(path), "--gpu-class", "cpu"]) == 1
    with pytest.raises(ValueError, match="SLOWDOWN"):
        G.promote(slowed, baselines, "cpu", commit="x")


def test_cli_promote_then_check(tmp_path, capsys):
    head = tmp_path / "h.json"
    head.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-11-22T00:00:00+00:00", "slowdown": 1.0,
                                "figures": {"prefill_fwd_ms": fig(2.0)}}))
    path = tmp_path / "b.json"
    assert G.main(["promote", str(head), "--baselines", str(path), "--commit", "c0ffee"]) == 0
    assert json.loads(path.read_text())["classes"]["h200"]["figures"]["prefill_fwd_ms"]["value"] == 2.0
    out_json = tmp_path / "gate.json"
    assert G.main(["check", str(head), "--baselines", str(path), "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["status"] == G.PASS
    assert G.main(["check", str(head), "--baselines", str(path), "--gpu-class", "a100", "--strict"]) == 1
    assert "NO-BASELINE" in capsys.readouterr().out


def test_speedup_figure_drop_fails_the_gate():
    """The whole-op speedup over dense FA-2 is a higher-is-better figure: a drop beyond the allowance fails."""
    base = {"policy": {"allowance": 0.15}, "classes": {"h100-80gb-hbm3": {"figures": {
        "speedup_fwd_bwd_vs_fa2_64k": {"value": 3.0, "better": "higher", "unit": "x", "source": {"commit": "abc"}}}}}}
    ok = G.compare({"speedup_fwd_bwd_vs_fa2_64k": {"value": 2.6, "better": "higher", "unit": "x"}}, base,
                   "h100-80gb-hbm3")
    bad = G.compare({"speedup_fwd_bwd_vs_fa2_64k": {"value": 2.5, "better": "higher", "unit": "x"}}, base,
                    "h100-80gb-hbm3")
    assert ok["status"] == G.PASS and bad["status"] == G.FAIL
    line = G.describe(bad)[0]
    assert "2.5000 x vs baseline 3.0000" in line and "higher is better" in line and "FAIL" in line


@pytest.mark.parametrize(("figure", "good", "bad"), [
    ("seed_block_fwd_s128_ms", 12.0, 1500.0), ("seed_prefill_decode_tok_per_s_2k", 900.0, 120.0),
    ("seed_fa2_over_sdpa_cmp", 5.0, 1.1), ("seed_fa2_over_sdpa_win", 1.3, 0.9)])
def test_seed_acceptance_figures_have_fixed_limits_on_every_gpu_class(figure, good, bad):
    """The seeds' absolute criteria (< 1 s block forward at S=128, > 300 tok/s at S ~ 2048, FA-2 > 1.2x SDPA on
    cmp and win) gate any GPU class, even one with no stored baselines."""
    base = G.load_baselines()
    for cls in ("h100-80gb-hbm3", "some-new-gpu"):
        ok = G.check({"figures": {figure: {"value": good}}}, base, cls)
        assert ok["status"] == G.PASS and "allowance 0%" in ok["lines"][0], ok["lines"]
        assert G.check({"figures": {figure: {"value": bad}}}, base, cls)["status"] == G.FAIL


def test_second_opinion_counts_a_regression_only_when_it_holds_twice():
    """A failed figure measured again in a second process: passing there, the gate passes (both values kept);
    failing there, or missing from the second run, the gate fails; passing figures are not remeasured."""
    first = G.compare({"prefill_fwd_ms": fig(10.0), "decode_step_ms": fig(2.0)}, BASE, "h200")
    assert first["status"] == G.FAIL
    noise = G.second_opinion(first, {"decode_step_ms": fig(1.2)}, BASE, "h200")
    row = next(r for r in noise["rows"] if r["figure"] == "decode_step_ms")
    assert noise["status"] == G.PASS and row["value"] == 1.2 and row["first_value"] == 2.0
    assert any("the first measured 2.0000" in line for line in noise["lines"])
    assert G.second_opinion(first, {"decode_step_ms": fig(1.9)}, BASE, "h200")["status"] == G.FAIL
    assert G.second_opinion(first, {}, BASE, "h200")["status"] == G.FAIL
    kept = G.second_opinion(first, {"decode_step_ms": fig(1.2), "prefill_fwd_ms": fig(99.0)}, BASE, "h200")
    assert kept["status"] == G.PASS  # prefill passed the first time: its second value is not used


class _Res:
    def __init__(self, rc):
        self.returncode = rc


def _session_gate(tmp_path, monkeypatch, first, second, rc=0):
    """ci.sessions.gpu.bench_gate with the headline bench replaced: `first` written by the first run,
    `second` by the retry (None: it writes nothing)."""
    from types import SimpleNamespace

    from ci.sessions import gpu

    calls = []

    def sh(cmd, log):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        data = first if len(calls) == 1 else second
        if data is not None:
            out.write_text(json.dumps({"gpu": "H200", "figures": data}))
        return _Res(0 if len(calls) == 1 else rc)

    monkeypatch.setattr(G, "load_baselines", lambda *a: BASE)
    run = SimpleNamespace(path=tmp_path, state={})
    ctx = SimpleNamespace(run=run, python="python", opts=SimpleNamespace(full=False), sh=sh, log=lambda m: None)
    return gpu.bench_gate(ctx), calls, run.state["gate"]


def test_session_gate_retries_failed_figures_in_a_second_process(tmp_path, monkeypatch):
    ok, calls, gate = _session_gate(tmp_path, monkeypatch, {"decode_step_ms": fig(2.0)}, {"decode_step_ms": fig(1.1)})
    assert ok and gate["status"] == G.PASS and calls[1][-2:] == ["--only", "decode_step_ms"]
    ok, _, gate = _session_gate(tmp_path, monkeypatch, {"decode_step_ms": fig(2.0)}, {"decode_step_ms": fig(1.9)})
    assert not ok and gate["status"] == G.FAIL
    ok, _, _ = _session_gate(tmp_path, monkeypatch, {"decode_step_ms": fig(2.0)}, {"decode_step_ms": fig(1.1)}, rc=1)
    assert not ok  # the retry crashed: the first measurement stands
    (tmp_path / "bench-headline-retry.json").unlink(missing_ok=True)
    ok, _, _ = _session_gate(tmp_path, monkeypatch, {"decode_step_ms": fig(2.0)}, None)
    assert not ok  # the retry wrote nothing
    ok, calls, _ = _session_gate(tmp_path, monkeypatch, {"decode_step_ms": fig(1.0)}, None)
    assert ok and len(calls) == 1  # nothing failed: no second run


def test_headline_only_flag(tmp_path, one_thread):
    out = tmp_path / "h.json"
    assert H.main(["--out", str(out), "--device", "cpu", "--tiny", "--repeats", "1", "--iters", "1",
                   "--only", "decode_step_ms"]) == 0
    assert set(json.loads(out.read_text())["figures"]) == {"decode_step_ms"}


def test_informational_figures_are_recorded_never_gated():
    base = {**BASE, "policy": {**BASE["policy"], "informational": {"decode_step_ms": "host-bound"}}}
    res = G.compare({"prefill_fwd_ms": fig(10.0), "decode_step_ms": fig(5.0)}, base, "h200")
    row = next(r for r in res["rows"] if r["figure"] == "decode_step_ms")
    assert res["status"] == G.PASS and row["status"] == G.RECORDED and row["ratio"] == 5.0
    assert any("RECORDED, not gated: host-bound" in line for line in G.describe(res))
    # another figure still fails; an informational figure with no baseline leaves the status alone
    assert G.compare({"prefill_fwd_ms": fig(12.0), "decode_step_ms": fig(0.1)}, base, "h200")["status"] == G.FAIL
    alone = G.compare({"prefill_fwd_ms": fig(10.0), "decode_step_ms": fig(9.0)},
                      {**base, "classes": {"h200": {"figures": {"prefill_fwd_ms": BASE["classes"]["h200"]["figures"]
                                                                ["prefill_fwd_ms"]}}}}, "h200")
    assert alone["status"] == G.PASS and "RECORDED" in G.describe(alone)[0]


def test_the_shipped_policy_gates_the_graph_step_not_the_eager_one():
    data = G.load_baselines()
    assert set(data["policy"]["informational"]) == {"decode_step_ms", "prefill_fwd_ms"}
    for cls in ("h100-80gb-hbm3", "h200"):  # every class with an eager baseline has the graph one
        assert "decode_step_ms" in data["classes"][cls]["figures"]
        graph = data["classes"][cls]["figures"]["decode_graph_step_ms"]
        assert graph["better"] == "lower" and 0 < graph["value"] < 1.0, (cls, graph)
        artifact = json.loads((G.ROOT / graph["source"]["artifact"]).read_text())
        assert G.gpu_class(artifact["gpu"]) == cls
        assert artifact["figures"]["decode_graph_step_ms"]["value"] == pytest.approx(graph["value"], abs=1e-6)
        assert G.compare(artifact["figures"], data, cls)["status"] == G.PASS

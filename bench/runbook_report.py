"""The GPU test plan's reporting template, line by line, for one run directory of `nox -s oneshot`.

    python bench/runbook_report.py RUN_DIR [--no-bench]

After the suites have run (junit-*.xml, bench-decode.csv and bench-fa2/ in RUN_DIR), this runs what the
plan's one-shot runner collected beyond them: the Triton selection bench (bench-sel-triton/), the decode
CSV summary (decode-summary.md, Markdown) and a selected-block ranges sample, and writes RUN_DIR/template.json:
{"lines": [...]}, the template's lines, each kept on its own line:

    Tests:
    - Triton FWD parity: PASS/FAIL (<runtime>)     tests/gpu/test_triton_sel_parity_gpu.py
    - Triton BWD parity: PASS/FAIL (<runtime>)     tests/gpu/test_triton_sel_backward_gpu.py, _bwd_gpu.py
    - FA-2 varlen: PASS/FAIL (<runtime>)           tests/gpu/test_fa2_gpu_varlen.py
    - Grad/Train smokes: PASS/FAIL (<runtime>)     the backward suite (gradient parity, gradcheck, training)
    Benches:
    - Decode bench / Triton selection bench / FA-2 bench: summary numbers
    - Ranges sample, Training showcase (bench/train_showcase.py, short: NSA and dense tok/s at S=2048)

A file whose tests all skipped reads SKIPPED with the first reason. Exit 1 when a step it runs fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_LINES = (
    ("Triton FWD parity", ("test_triton_sel_parity_gpu",)),
    ("Triton BWD parity", ("test_triton_sel_backward_gpu", "test_triton_sel_bwd_gpu")),
    ("FA-2 varlen", ("test_fa2_gpu_varlen",)),
)
# A short run of the training showcase: enough steps for a tok/s figure, not a loss curve (that is the full
# `python bench/train_showcase.py`). On CPU the tiny model at S=128.
SHOWCASE_ARGS = {"cuda": ["--steps", "20", "--seq-lens", "2048", "--warmup", "5"],
                 "cpu": ["--tiny", "--steps", "3", "--seq-lens", "128", "--warmup", "1"]}


def junit_cases(run_dir: Path) -> list[dict]:
    """Every testcase of the run's junit files: {file, status, seconds, message}."""
    cases = []
    for path in sorted(run_dir.glob("junit-*.xml")):
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for case in root.iter("testcase"):
            kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), None)
            cases.append({"file": case.get("classname", "").rsplit(".", 1)[-1], "suite": path.stem[len("junit-"):],
                          "status": {"failure": "FAIL", "error": "FAIL", "skipped": "SKIPPED"}.get(kind, "PASS"),
                          "seconds": float(case.get("time") or 0.0),
                          "message": case.find(kind).get("message", "") if kind else ""})
    return cases


def verdict(cases: list[dict]) -> str:
    """PASS/FAIL (runtime, counts) of some test cases; SKIPPED (reason) when all skipped; NOT RUN when none."""
    if not cases:
        return "NOT RUN (no such tests in this run's junit files)"
    n = {s: sum(c["status"] == s for c in cases) for s in ("PASS", "FAIL", "SKIPPED")}
    if n["PASS"] == 0 and n["FAIL"] == 0:
        return f"SKIPPED ({cases[0]['message'] or 'no reason given'})"
    return (f"{'FAIL' if n['FAIL'] else 'PASS'} ({sum(c['seconds'] for c in cases):.1f} s; {n['PASS']} passed, "
            f"{n['FAIL']} failed, {n['SKIPPED']} skipped)")


def fa2_summary(run_dir: Path) -> list[str]:
    rows = []
    for path in run_dir.glob("bench-fa2/bench_fa2.csv"):
        rows = [r for r in csv.DictReader(path.open()) if r.get("status") == "ok"]
    best = {}
    for r in rows:
        key = (r["provider"], r["branch"])
        if key not in best or int(r["T"]) > int(best[key]["T"]):
            best[key] = r
    return [f"{p} {b}: x{float(r['speedup_vs_sdpa']):.2f} over SDPA at T={r['T']}, D={r['D']} "
            f"({r['fa2_ms']} ms vs {r['sdpa_ms']} ms)" for (p, b), r in sorted(best.items())]


def sel_summary(out: Path) -> list[str]:
    path = out / "bench_sel_triton.csv"
    if not path.exists():
        return []
    rows = list(csv.DictReader(path.open()))
    keys = ("T", "G", "Dk", "fwd_ms", "bwd_ms", "dense_fa2_fwd_ms", "dense_fa2_bwd_ms", "speedup_fwd_bwd")
    return [", ".join(f"{k} {r[k]}" for k in keys if r.get(k) not in (None, "")) for r in rows[:4]]


def run(cmd: list[str], log: Path) -> tuple[int, list[str]]:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write_text(res.stdout + res.stderr)
    return res.returncode, [ln for ln in res.stdout.splitlines() if ln.strip()]


def ranges_sample(device: str) -> str:
    """The selected blocks of the last query of a small sequence, per KV head: what the runner's ranges sample
    showed (block j covers tokens [j*l', (j+1)*l'))."""
    import torch

    sys.path.insert(0, str(ROOT))
    from nsa import NSAConfig, nsa_attention

    cfg = NSAConfig()
    g = torch.Generator().manual_seed(0)
    T, dtype = 1024, torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, T, h, 64, generator=g).to(device, dtype) for h in (8, 2, 2))
    gates = torch.rand(1, T, 8, 3, generator=g).to(device, dtype)
    with torch.no_grad():
        _, idx = nsa_attention(q, k, v, gates, cfg, return_indices=True)
    blocks = [sorted(x for x in idx[0, -1, h].tolist() if x >= 0) for h in range(idx.shape[2])]
    return f"t={T - 1}, l'={cfg.block_sel}: " + "; ".join(f"KV head {h}: blocks {b}" for h, b in enumerate(blocks))


def report(run_dir: Path, bench: bool = True, device: str = "cuda") -> tuple[list[str], bool]:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cases, ok = junit_cases(run_dir), True
    lines = ["Tests:"]
    for title, files in TEST_LINES:
        lines.append(f"- {title}: {verdict([c for c in cases if c['file'] in files])}")
    lines.append(f"- Grad/Train smokes: {verdict([c for c in cases if c['suite'] == 'backward'])}")
    lines += ["", "Benches:"]
    decode_csv = run_dir / "bench-decode.csv"
    if decode_csv.exists():
        rc, out = run([sys.executable, "bench/summarize_decode_csv.py", str(decode_csv), "--markdown"],
                      logs / "decode-summary.log")
        (run_dir / "decode-summary.md").write_text("\n".join(out) + "\n")
        ok &= rc == 0
        rows = [f"S={r['S']}: step {float(r['step_ms']):.3f} ms, {float(r['tok_per_s']):.0f} tok/s, "
                f"x{float(r['speedup_vs_dense']):.2f} vs dense" for r in csv.DictReader(decode_csv.open())]
        lines.append("- Decode bench: " + ("; ".join(rows) if rc == 0 else f"summary failed (exit {rc})"))
    else:
        lines.append("- Decode bench: NOT RUN (no bench-decode.csv)")
    if bench:
        out_dir = run_dir / "bench-sel-triton"
        cmd = [sys.executable, "bench/bench_sel_triton.py", "--out", str(out_dir), "--T", "4096,16384", "--G", "16",
               "--D", "128", "--indices", "topn", "--max-seconds", "60"]
        rc, _ = run(cmd, logs / "bench-sel-triton.log")
        ok &= rc == 0
        summ = sel_summary(out_dir)
        lines.append("- Triton selection bench: " + ("; ".join(summ) if rc == 0 and summ else f"FAIL (exit {rc})"))
    else:
        lines.append("- Triton selection bench: NOT RUN (--no-bench)")
    fa2 = fa2_summary(run_dir)
    lines.append("- FA-2 bench: " + ("; ".join(fa2) if fa2 else "NOT RUN (no bench-fa2/bench_fa2.csv)"))
    try:
        lines.append(f"- Ranges sample: {ranges_sample(device)}")
    except Exception as e:  # noqa: BLE001 - reported in the template line and the exit status, not hidden
        ok = False
        lines.append(f"- Ranges sample: FAIL ({type(e).__name__}: {e})")
    if bench:
        out_dir = run_dir / "train-showcase"
        cmd = [sys.executable, "bench/train_showcase.py", "--out", str(out_dir), "--device", device,
               "--log-every", "10", *SHOWCASE_ARGS.get(device, SHOWCASE_ARGS["cuda"])]
        rc, _ = run(cmd, logs / "train-showcase.log")
        ok &= rc == 0
        lines.append(f"- Training showcase: {showcase_summary(out_dir) if rc == 0 else f'FAIL (exit {rc})'}")
    else:
        lines.append("- Training showcase: NOT RUN (--no-bench)")
    return lines, ok


def showcase_summary(out_dir: Path) -> str:
    """NSA's and each dense backend's tok/s per length from train_showcase.json, and the corpus that served."""
    rep = json.loads((out_dir / "train_showcase.json").read_text())
    parts = []
    for r in sorted(rep["runs"], key=lambda r: (r["seq_len"], r["attention"] != "nsa")):
        parts.append(f"{r['label']} S={r['seq_len']}: {r['tok_s']:.0f} tok/s, "
                     f"loss {r['loss_first']:.2f} -> {r['loss_last']:.2f}")
    ratios = ", ".join(f"S={k} vs {backend}: x{v:.2f}"
                       for backend, per_len in rep.get("nsa_over_dense_tok_s", {}).items()
                       for k, v in per_len.items())
    return "; ".join(parts) + (f"; NSA over dense {ratios}" if ratios else "") + f" ({rep['corpus']['corpus']})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--no-bench", action="store_true", help="skip the Triton selection bench")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    lines, ok = report(args.run_dir, bench=not args.no_bench, device=args.device)
    (args.run_dir / "template.json").write_text(json.dumps({"lines": lines, "ok": ok}, indent=2) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

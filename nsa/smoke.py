"""The main job: a tiny NSA language model's forward, backward, training steps and cached generation.

    python -m nsa.smoke [--device cpu] [--dtype float32] [--seq 256] [--batch 2] [--layers 2]
                        [--new-tokens 16] [--out artifacts/smoke]

Checks (each recorded in the report with pass/fail and its numbers; any failure -> exit status 1):
- forward_finite: logits have the expected shape and are finite;
- backward_finite: every parameter gets a gradient and all gradients are finite;
- loss_decreases: a few AdamW steps on a fixed random token batch lower the loss by >= 5 %;
- generate_matches_uncached: greedy generation through the decode caches equals greedy decoding by
  recomputing the full forward over the growing sequence: the last-position logits agree within the
  dtype's tolerance (float64 1e-9, float32 1e-4, bf16/fp16 5e-2, absolute, on logits of size ~1) and
  every generated token is the uncached argmax (a different token is only allowed where the uncached
  top-2 logits are within that tolerance, i.e. a genuine tie);
- routing_visible: every branch was served by a recorded backend in every phase; fallbacks (telemetry
  reasons other than ok / forced* / decode, on any step but core: nsa.telemetry.is_fallback) are listed,
  and fail the check only with --no-fallbacks (use it where a fast path must serve, e.g. on a GPU with
  FlashAttention-2).
Which backend served each branch (nsa.telemetry) is printed per phase and written to the report.
Writes OUT/smoke.json: environment metadata, configuration, shapes, timings, telemetry, checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from . import telemetry
from .benchutil import Stopwatch, console, env_metadata, parse_dtype, print_table, resolve_device, write_json
from .config import NSAConfig

BRANCHES = ("cmp", "sel", "win")
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}

CONFIGS = {
    # Blocks small enough that a 256-token sequence is genuinely sparse: 31 compressed blocks, 16
    # selection blocks of which 4 are kept, a 64-token window.
    "small": dict(block_cmp=16, stride_cmp=8, block_sel=16, n_sel=4, n_init=1, n_local=2, window=64),
    "paper": dict(),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nsa.smoke", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, bfloat16, float16")
    p.add_argument("--seq", type=int, default=256, help="training / prompt length (default 256)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated through the cache")
    p.add_argument("--out", default="artifacts/smoke", help="report directory (writes smoke.json)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps of the training check")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-groups", type=int, default=2)
    p.add_argument("--dk", type=int, default=32)
    p.add_argument("--dv", type=int, default=32)
    p.add_argument("--config", choices=sorted(CONFIGS), default="small",
                   help="NSA block sizes: small (sparse at the smoke's length, default) or paper (NSAConfig())")
    p.add_argument("--compress", choices=("avg", "mlp"), default="mlp")
    p.add_argument("--shared-kv", action="store_true", help="one K/V projection for all branches")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "reference"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fallbacks", action="store_true", help="fail the routing check on any fallback")
    return p.parse_args(argv)


def _check(checks, name, passed, **detail):
    checks.append({"name": name, "passed": bool(passed), **detail})
    return bool(passed)


def _phase_telemetry(store, served, phase):
    snap = telemetry.snapshot()
    store[phase] = snap
    served[phase] = {b: telemetry.served(b) for b in BRANCHES}
    telemetry.reset()


def run(args) -> dict:
    from .model import TinyNSALM

    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype)
    tol = TOLERANCE[dtype]
    torch.manual_seed(args.seed)
    cfg = NSAConfig(**CONFIGS[args.config], compress=args.compress)
    timings, shapes, checks, tel, served = {}, {}, [], {}, {}
    telemetry.reset()

    with Stopwatch(device) as sw:
        model = TinyNSALM(args.vocab, args.dim, args.layers, args.heads, args.kv_groups, args.dk, args.dv, cfg,
                          shared_kv=args.shared_kv, backend=args.backend,
                          # the oracle has no decode step: generation then decodes with the torch branches
                          decode_backend="torch" if args.backend == "reference" else None,
                          ).to(device=device, dtype=dtype)
    timings["build_ms"] = sw.ms
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)

    # 1. forward (training path, no cache)
    with Stopwatch(device) as sw:
        logits = model(tokens[:, :-1])
    timings["forward_ms"] = sw.ms
    shapes["tokens"] = list(tokens[:, :-1].shape)
    shapes["logits"] = list(logits.shape)
    want = [args.batch, args.seq, args.vocab]
    _check(checks, "forward_finite", list(logits.shape) == want and bool(torch.isfinite(logits).all()),
           shape=list(logits.shape), expected_shape=want)
    _phase_telemetry(tel, served, "forward")

    # 2. backward
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens)
    with Stopwatch(device) as sw:
        loss.backward()
    timings["backward_ms"] = sw.ms
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    zero = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.any()]
    gnorm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
    _check(checks, "backward_finite", not missing and not bad, missing_grads=missing, nonfinite_grads=bad,
           all_zero_grads=zero, grad_norm=gnorm, loss=loss.item())
    _phase_telemetry(tel, served, "backward")

    # 3. a few optimizer steps on the same fixed batch
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, step_ms = [], []
    for _ in range(args.steps):
        with Stopwatch(device) as sw:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(tokens)
            loss.backward()
            opt.step()
        losses.append(loss.item())
        step_ms.append(sw.ms)
    with torch.no_grad():
        final = model.loss(tokens).item()
    losses.append(final)
    timings["train_step_ms_median"] = sorted(step_ms)[len(step_ms) // 2] if step_ms else None
    ok = args.steps > 0 and all(map(torch.isfinite, map(torch.tensor, losses))) and final < 0.95 * losses[0]
    _check(checks, "loss_decreases", ok, losses=losses, rule="final < 0.95 * initial")
    _phase_telemetry(tel, served, "train")

    # 4. generation through the caches vs recomputing the full forward
    model.eval()
    prompt = tokens[:, : args.seq]
    with Stopwatch(device) as sw:
        out, cached_logits = model.generate(prompt, args.new_tokens, return_logits=True)
    timings["generate_ms"] = sw.ms
    timings["generate_tok_per_s"] = args.batch * args.new_tokens / (sw.ms / 1e3) if args.new_tokens else None
    _phase_telemetry(tel, served, "generate")
    shapes["generated"] = list(out.shape)
    max_diff, mismatches, ties = 0.0, 0, 0
    with Stopwatch(device) as sw, torch.no_grad():
        for i in range(args.new_tokens):
            ref = model(out[:, : args.seq + i])[:, -1]
            got = cached_logits[:, i]
            max_diff = max(max_diff, (ref.double() - got.double()).abs().max().item())
            arg = ref.argmax(dim=-1)
            wrong = arg != out[:, args.seq + i]
            if wrong.any():
                top2 = ref.double().topk(2, dim=-1).values
                tie = (top2[:, 0] - top2[:, 1]) <= tol
                ties += int((wrong & tie).sum())
                mismatches += int((wrong & ~tie).sum())
    timings["uncached_check_ms"] = sw.ms
    telemetry.reset()  # the oracle's full forwards are not part of the generate phase
    _check(checks, "generate_matches_uncached", max_diff <= tol and mismatches == 0,
           max_abs_logit_diff=max_diff, tolerance=tol, token_mismatches=mismatches, near_tie_mismatches=ties,
           new_tokens=args.new_tokens)

    # 5. routing: every branch served in every phase; fallbacks listed (fatal with --no-fallbacks)
    unexpected = [dict(phase=ph, **row) for ph, snap in tel.items() for row in snap["counts"]
                  if telemetry.is_fallback(row["branch"], row["reason"])]
    unserved = [f"{ph}:{b}" for ph in ("forward", "train", "generate") for b in BRANCHES if not served[ph].get(b)]
    if args.new_tokens == 0:
        unserved = [u for u in unserved if not u.startswith("generate")]
    _check(checks, "routing_visible", not unserved and not (args.no_fallbacks and unexpected),
           fallbacks=unexpected, unserved=unserved, fallbacks_fatal=args.no_fallbacks)

    return {
        "meta": env_metadata(device),
        "config": {
            "model": dict(vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                          n_kv_groups=args.kv_groups, d_k=args.dk, d_v=args.dv, shared_kv=args.shared_kv,
                          backend=args.backend, n_params=n_params),
            "nsa": dataclasses.asdict(cfg),
            "nsa_preset": args.config,
            "run": dict(device=str(device), dtype=str(dtype).replace("torch.", ""), seq=args.seq, batch=args.batch,
                        new_tokens=args.new_tokens, steps=args.steps, lr=args.lr, seed=args.seed),
        },
        "shapes": shapes,
        "timings_ms": timings,
        "telemetry": tel,
        "served": served,
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
    }


def report(result, path, con) -> None:
    t = result["timings_ms"]
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    cfg = result["config"]
    print_table(
        f"NSA smoke: {cfg['run']['device']} {cfg['run']['dtype']}, {cfg['model']['n_layers']} layers, "
        f"{cfg['model']['n_params']:,} params, NSA {cfg['nsa_preset']} compress={cfg['nsa']['compress']}",
        ["step", "shape", "time (ms)"],
        [["forward", f"{result['shapes']['tokens']} -> {result['shapes']['logits']}", fmt(t["forward_ms"])],
         ["backward", "", fmt(t["backward_ms"])],
         [f"train step (median of {cfg['run']['steps']})", "", fmt(t["train_step_ms_median"])],
         [f"generate {cfg['run']['new_tokens']} tokens (prefill + decode)", str(result["shapes"]["generated"]),
          fmt(t["generate_ms"])],
         ["uncached oracle", "", fmt(t["uncached_check_ms"])]], con)
    rows = []
    for phase, by_branch in result["served"].items():
        rows.append([phase] + [", ".join(f"{be} x{n}" for be, n in sorted(by_branch[b].items())) or "-"
                               for b in BRANCHES])
    print_table("backend that served each branch (nsa.telemetry)", ["phase", *BRANCHES], rows, con)
    rows = [[c["name"], "PASS" if c["passed"] else "FAIL",
             ", ".join(f"{k}={_short(v)}" for k, v in c.items() if k not in ("name", "passed"))]
            for c in result["checks"]]
    print_table("checks", ["check", "result", "detail"], rows, con)
    verdict = "PASSED" if result["passed"] else "FAILED"
    print(f"smoke {verdict}; report: {path}")


def _short(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list) and v and isinstance(v[0], float):
        return "[" + ", ".join(f"{x:.3f}" for x in v) + "]"
    return str(v)


def main(argv=None) -> int:
    args = parse_args(argv)
    con = console()
    t0 = time.perf_counter()
    if con is not None:
        with con.status("running the NSA smoke..."):
            result = run(args)
    else:
        result = run(args)
    result["timings_ms"]["total_ms"] = (time.perf_counter() - t0) * 1e3
    from pathlib import Path

    path = write_json(Path(args.out) / "smoke.json", result)
    report(result, path, con)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

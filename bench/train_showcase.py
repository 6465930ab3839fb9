"""Training showcase: a LLaMA-style language model with NSA attention, trained on real text beside the same
model with dense causal attention, in one process.

    PYTHONPATH=. python bench/train_showcase.py --dataset fineweb_edu --steps 200          # GPU, S = 2k, 8k, 32k
    NSA_BATCH_SIZE=1 NSA_ACCUM=4 PYTHONPATH=. python bench/train_showcase.py --seq-lens 2048 --steps 200
    PYTHONPATH=. python bench/train_showcase.py --tiny --steps 3 --seq-lens 128 --out /tmp/show   # CPU smoke

Model: embedding -> --layers x LlamaBlockNSA (RMSNorm, NSA attention with RoPE and gates, SwiGLU) -> LM
head, byte-level tokens (vocabulary 256 + a document separator), AdamW with a linear warm-up, bf16 autocast
on a GPU (fp32 master weights). The dense model is the same model with each block's attention replaced by
causal SDPA over one K/V projection (GQA through enable_gqa), trained once per --dense-backends entry:
  fa2    FlashAttention-2 (SDPA's flash backend), the baseline NSA's speedups are stated against;
  cudnn  cuDNN's fused attention (SDPA's cuDNN backend), the fastest dense attention on Hopper;
  auto   whatever SDPA picks (the only choice on CPU).
Default on a GPU: fa2,cudnn. A forced backend that cannot serve is an error from SDPA, never a silent
fallback. Packed documents (--packed) go through FA-2's varlen kernel on a GPU (SDPA has no packed cuDNN
path, so cudnn trains no packed run). Every model starts from the same seed and sees the same batches.

Data (--dataset):
  fineweb_edu  HuggingFaceFW/fineweb-edu (sample-10BT) streamed through `datasets`. When `datasets` is missing
               or the hub does not answer within --hub-timeout seconds (HF_ENDPOINT, HF_HUB_OFFLINE), the
               run says so and uses `pydoc` instead; the JSON records which corpus served and why.
  pydoc        the text of Python's own documentation topics (module pydoc_data, shipped with CPython:
               about 0.5 MB of English prose), available everywhere, no network.
  file:PATH    a UTF-8 text file; documents are separated by blank lines.
Batch: NSA_BATCH_SIZE sequences of S tokens per micro-step (default 1; with --packed one stream of
NSA_BATCH_SIZE * S tokens cut into documents), NSA_ACCUM micro-steps per optimizer step (default 1).

Outputs in --out (default artifacts/train_showcase/<time>): train_showcase.csv (one row per step: loss, step
time, tok/s), train_showcase.json (environment, arguments, corpus, per run: median step time with min/max,
tok/s, peak memory, first and last loss, the NSA paths that served from nsa.telemetry, and NSA's tok/s over
each dense backend's at each length) and train_showcase.png (loss against step, every model, every length)
when matplotlib is installed. Timing excludes the first --warmup steps (kernel compilation).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from nsa import NSAConfig, telemetry  # noqa: E402
from nsa.attention import rope  # noqa: E402
from nsa.benchutil import env_metadata, write_csv, write_json  # noqa: E402
from nsa.model import TinyNSALM  # noqa: E402

SEP = 256  # document separator token; bytes are 0..255
VOCAB = 264  # 257 rounded up to a multiple of 8
FINEWEB = ("HuggingFaceFW/fineweb-edu", "sample-10BT")


# -- data -------------------------------------------------------------------------------------------------
def hub_unreachable(timeout: float) -> str | None:
    """Why the Hugging Face hub cannot serve now (None when it answers a TCP connect within `timeout`)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
        "",
        "0",
    ):
        return "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}:{port} did not answer in {timeout:g} s ({e.__class__.__name__}: {e})"
    return None


def fineweb_docs(max_bytes: int):
    """Documents of fineweb-edu, streamed (nothing is downloaded beyond max_bytes of text)."""
    import datasets  # noqa: PLC0415 - optional: only this corpus needs it

    stream = datasets.load_dataset(FINEWEB[0], name=FINEWEB[1], split="train", streaming=True)
    total = 0
    for row in stream:
        doc = row["text"].encode("utf-8")
        yield doc
        total += len(doc)
        if total >= max_bytes:
            return


def pydoc_docs():
    from pydoc_data.topics import topics  # noqa: PLC0415

    return [topics[name].encode("utf-8") for name in sorted(topics)]


def file_docs(path: str):
    text = Path(path).read_text(encoding="utf-8")
    return [d.strip().encode("utf-8") for d in text.split("\n\n") if d.strip()]


def load_corpus(name: str, *, max_bytes: int, hub_timeout: float) -> tuple[list[bytes], dict]:
    """(documents, what served): the named corpus, or pydoc with the reason when fineweb-edu cannot serve."""
    if name.startswith("file:"):
        return file_docs(name[5:]), {"corpus": name, "fallback": None}
    if name == "pydoc":
        return pydoc_docs(), {"corpus": "pydoc", "fallback": None}
    if name != "fineweb_edu":
        raise SystemExit(f"--dataset must be fineweb_edu, pydoc or file:PATH, got {name!r}")
    try:
        import datasets  # noqa: F401, PLC0415
    except ImportError:
        why = "the `datasets` package is not installed"
    else:
        why = hub_unreachable(hub_timeout)
    if why is None:
        try:
            return list(fineweb_docs(max_bytes)), {"corpus": "fineweb_edu", "fallback": None}
        except Exception as e:  # noqa: BLE001 - any failure of the hub or the loader is reported, then pydoc serves
            why = f"loading {FINEWEB[0]} failed: {e.__class__.__name__}: {e}"
    print(f"train_showcase: fineweb_edu unavailable ({why}); using the pydoc corpus instead", flush=True)
    return pydoc_docs(), {"corpus": "pydoc", "fallback": f"fineweb_edu: {why}"}


class Batches:
    """Same batches for both models: random windows of the corpus (dense) or a stream of whole documents with
    their offsets (packed), drawn from one seeded generator per run."""

    def __init__(self, docs: list[bytes], seed: int):
        self.docs = [d for d in docs if d]
        if not self.docs:
            raise SystemExit("the corpus has no text")
        joined = bytearray()
        for d in self.docs:
            joined += d + b"\0"
        self.stream = torch.frombuffer(joined, dtype=torch.uint8).long()
        self.stream[self.stream == 0] = SEP
        self.seed = seed

    def reset(self):
        self.gen = torch.Generator().manual_seed(self.seed)

    def dense(self, batch: int, seq: int) -> torch.Tensor:
        """[batch, seq + 1] tokens (inputs and next-token targets)."""
        n = self.stream.numel()
        if n < seq + 2:
            reps = (seq + 2) // n + 1
            self.stream = self.stream.repeat(reps)
            n = self.stream.numel()
        starts = torch.randint(0, n - seq - 1, (batch,), generator=self.gen)
        return torch.stack([self.stream[s : s + seq + 1] for s in starts.tolist()])

    def packed(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [1, total + 1], cu_seqlens int32 of the documents among the first `total` tokens)."""
        toks, cu = [], [0]
        while cu[-1] < total + 1:
            d = self.docs[int(torch.randint(0, len(self.docs), (1,), generator=self.gen))]
            take = min(len(d), total + 1 - cu[-1])
            toks.append(torch.frombuffer(bytearray(d[:take]), dtype=torch.uint8).long())
            cu.append(cu[-1] + take)
        cu[-1] = total  # the last token is only a target
        cu = [c for i, c in enumerate(cu) if i == 0 or c > cu[i - 1]]
        return torch.cat(toks)[None], torch.tensor(cu, dtype=torch.int32)


# -- models -----------------------------------------------------------------------------------------------
class DenseCausalAttention(nn.Module):
    """The dense baseline: NSAAttention's interface (x [B, T, dim], cu_seqlens) over one K/V projection."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, d_k: int, d_v: int, rope_theta: float = 10000.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_k, self.d_v, self.rope_theta = n_heads, n_kv_heads, d_k, d_v, rope_theta
        self.q_proj = nn.Linear(dim, n_heads * d_k, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * d_k, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * d_v, bias=False)
        self.o_proj = nn.Linear(n_heads * d_v, dim, bias=False)

    def forward(self, x, cache=None, *, cu_seqlens=None):
        B, T, _ = x.shape
        if cu_seqlens is None:
            pos = torch.arange(T, device=x.device)[None].expand(B, T)
        else:
            cu = cu_seqlens.long()
            tok = torch.arange(T, device=x.device)
            pos = (tok - cu[torch.searchsorted(cu[1:], tok, right=True).clamp(max=cu.numel() - 2)])[None]
        q = rope(self.q_proj(x).view(B, T, self.n_heads, self.d_k), pos, self.rope_theta)
        k = rope(self.k_proj(x).view(B, T, self.n_kv_heads, self.d_k), pos, self.rope_theta)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.d_v)
        if cu_seqlens is None:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        elif x.is_cuda:  # FA-2 varlen: one kernel over the packed documents
            lens = cu_seqlens[1:] - cu_seqlens[:-1]
            mx = int(lens.max())
            o = torch.ops.aten._flash_attention_forward(
                q[0], k[0], v[0], cu_seqlens, cu_seqlens, mx, mx, 0.0, True, False
            )[0][None]
        else:  # CPU: document by document
            bounds = cu_seqlens.tolist()
            o = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, a:b].transpose(1, 2),
                        k[:, a:b].transpose(1, 2),
                        v[:, a:b].transpose(1, 2),
                        is_causal=True,
                        enable_gqa=True,
                    ).transpose(1, 2)
                    for a, b in zip(bounds, bounds[1:])
                ],
                dim=1,
            )
        return self.o_proj(o.flatten(2))


# --dense-backends: name -> SDPBackend member (None: SDPA's own pick)
DENSE_BACKENDS = {"fa2": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "auto": None}


def dense_backend(name: str | None):
    """The SDPA backend context of a dense run. Entered around forward and backward: SDPA (eager, or when
    torch.compile traces it) dispatches to the one backend allowed, or raises when it cannot serve."""
    member = DENSE_BACKENDS.get(name)
    if member is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    return sdpa_kernel([getattr(SDPBackend, member)])


# A dense run's attention kernels must be its backend's: SDPA's flash kernels (FA-2) or cuDNN's
BACKEND_KERNEL = {"fa2": lambda n: "flash" in n and "cudnn" not in n, "cudnn": lambda n: "cudnn" in n}


def attention_kernels(prof) -> list[str]:
    """Names (cut to 100 characters) of the attention kernels a profiled step ran on the GPU."""
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return sorted(n[:100] for n in names if re.search("flash|cudnn|fmha|attention|sdpa", n, re.IGNORECASE))


def backend_served(backend: str | None, kernels: list[str] | None) -> bool | None:
    """Whether a forced backend's kernels ran (None: nothing to check: NSA, `auto`, or not profiled)."""
    if backend not in BACKEND_KERNEL or kernels is None:
        return None
    return any(BACKEND_KERNEL[backend](n.lower()) for n in kernels)


def run_label(attention: str, backend: str | None) -> str:
    return attention if attention == "nsa" else f"dense/{backend}"


@dataclass
class ModelShape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    d_k: int
    d_v: int


def build(attention: str, shape: ModelShape, device, seed: int) -> TinyNSALM:
    torch.manual_seed(seed)
    model = TinyNSALM(
        VOCAB, shape.dim, shape.layers, shape.heads, shape.kv_heads, shape.d_k, shape.d_v, NSAConfig(), shared_kv=True
    )
    if attention == "dense":
        for blk in model.blocks:
            blk.attn = DenseCausalAttention(shape.dim, shape.heads, shape.kv_heads, shape.d_k, shape.d_v)
    return model.to(device)


def lm_loss(model, tokens, cu_seqlens=None):
    """Next-token cross-entropy in fp32; with packed documents no token predicts across a document end."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1
        targets[0, ends] = -100
    logits = model(inputs, cu_seqlens=cu_seqlens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


# -- one run ----------------------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_steps(model, packed, backend, graphs, args, seq, data, device, autocast) -> float:
    """Forward and backward of the args.accum micro-batches of one optimizer step; returns their loss."""
    total = 0.0
    for _ in range(args.accum):
        if graphs:  # CUDA graphs (cudagraph trees): a new iteration, so earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if packed:
            toks, cu = data.packed(args.batch * seq)
            toks, cu = toks.to(device), cu.to(device)
        else:
            toks, cu = data.dense(args.batch, seq).to(device), None
        with dense_backend(backend):
            with autocast:
                loss = lm_loss(model, toks, cu) / args.accum
            loss.backward()
        total += float(loss.detach())
    return total


def train(attention, seq, packed, args, shape, data, device, dtype, log, backend=None):
    """Train one model for args.steps optimizer steps; returns (per-step rows, summary). `backend`: the dense
    model's SDPA backend (DENSE_BACKENDS)."""
    label = run_label(attention, backend)
    model = build(attention, shape, device, args.seed)
    if args.compile:
        # A fresh trace per run: Dynamo's guards do not cover SDPA's backend flags, so without the reset the
        # second dense model would reuse the first one's graph, whichever backend that traced.
        torch._dynamo.reset()
        model = torch.compile(model, mode=args.compile_mode)
    graphs = args.compile and args.compile_mode == "reduce-overhead"
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.lr_warmup)))
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    data.reset()
    telemetry.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows, tokens_per_step = [], args.batch * args.accum * seq
    kernels = None
    for step in range(args.steps):
        # Step 0 (compilation, left out of the timing) of a dense run on a GPU is profiled: which attention
        # kernels SDPA dispatched to, so a run cannot report one backend while another served.
        watch = step == 0 and attention == "dense" and device.type == "cuda"
        prof = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            if watch
            else contextlib.nullcontext()
        )
        sync(device)
        t0 = time.perf_counter()
        with prof:
            total = micro_steps(model, packed, backend, graphs, args, seq, data, device, autocast)
        if watch:
            kernels = attention_kernels(prof)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(
            {
                "attention": attention,
                "dense_backend": backend,
                "seq_len": seq,
                "packed": packed,
                "step": step,
                "loss": total,
                "step_ms": ms,
                "tok_s": tokens_per_step / ms * 1e3,
            }
        )
        if step % args.log_every == 0 or step == args.steps - 1:
            log(
                f"  {label:11s} S={seq:6d}{' packed' if packed else ''} step {step:4d}  loss {total:.4f}  "
                f"{ms:8.1f} ms  {rows[-1]['tok_s']:10.0f} tok/s"
            )
    timed = [r["step_ms"] for r in rows[args.warmup :]] or [r["step_ms"] for r in rows]
    med = statistics.median(timed)
    summary = {
        "attention": attention,
        "dense_backend": backend,
        "label": run_label(attention, backend),
        "seq_len": seq,
        "packed": packed,
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "step_ms_median": med,
        "step_ms_min": min(timed),
        "step_ms_max": max(timed),
        "tok_s": tokens_per_step / med * 1e3,
        "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "params": sum(p.numel() for p in model.parameters()),
        "nsa_paths": telemetry.snapshot() if attention == "nsa" else None,
        "attention_kernels": kernels,
        "backend_served": backend_served(backend, kernels),
    }
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, summary


def plot(rows, path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("train_showcase: matplotlib is not installed; no PNG", flush=True)
        return False
    runs = sorted({(r["seq_len"], r["packed"]) for r in rows})
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    labels = dict.fromkeys(run_label(r["attention"], r["dense_backend"]) for r in rows)
    for ax, (seq, packed) in zip(axes[0], runs):
        for label in labels:
            pts = [
                (r["step"], r["loss"])
                for r in rows
                if (r["seq_len"], r["packed"]) == (seq, packed)
                and run_label(r["attention"], r["dense_backend"]) == label
            ]
            if pts:
                ax.plot(*zip(*pts), label=label)
        ax.set_title(f"S={seq}{' packed' if packed else ''}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise SystemExit(f"{name} must be a positive integer, got {raw!r}")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring (bench/train_showcase.py) for data, batches and outputs.",
    )
    ap.add_argument("--dataset", default="fineweb_edu", help="fineweb_edu (default), pydoc or file:PATH")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    ap.add_argument(
        "--seq-lens",
        default=None,
        help="comma-separated sequence lengths (default 2048,8192,32768 on a GPU, 256 on CPU)",
    )
    ap.add_argument("--attention", default="nsa,dense", help="models to train: nsa, dense or both (default)")
    ap.add_argument(
        "--dense-backends",
        default=None,
        help="SDPA backends of the dense model, a run each: fa2, cudnn, auto (default fa2,cudnn on GPU, auto on CPU)",
    )
    ap.add_argument("--packed", action="store_true", help="also train on packed documents (cu_seqlens) at each length")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, dim-128 model (CPU smoke)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    ap.add_argument("--kv-heads", type=int, default=1, help="KV heads (GQA groups; default 1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--lr-warmup", type=int, default=20, help="linear warm-up steps (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (default 3)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every model")
    ap.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile's mode with --compile (reduce-overhead: CUDA graphs, for host-bound steps)",
    )
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="autocast dtype on a GPU (CPU runs fp32)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-corpus-mb", type=float, default=64.0, help="text to stream from fineweb-edu (default 64)")
    ap.add_argument("--hub-timeout", type=float, default=5.0, help="seconds to wait for the hub (default 5)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default=None, help="output folder (default artifacts/train_showcase/<time>)")
    args = ap.parse_args(argv)
    for name in ("steps", "layers", "dim", "heads", "kv_heads", "head_dim", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    args.batch, args.accum = env_int("NSA_BATCH_SIZE", 1), env_int("NSA_ACCUM", 1)
    args.attention = [a.strip() for a in args.attention.split(",") if a.strip()]
    bad = [a for a in args.attention if a not in ("nsa", "dense")]
    if bad or not args.attention:
        ap.error(f"--attention takes nsa, dense or nsa,dense; got {','.join(args.attention) or '(nothing)'}")
    if args.dense_backends is not None:
        args.dense_backends = [b.strip() for b in args.dense_backends.split(",") if b.strip()]
        bad = [b for b in args.dense_backends if b not in DENSE_BACKENDS]
        if bad or not args.dense_backends:
            ap.error(
                f"--dense-backends takes a comma-separated list of {', '.join(DENSE_BACKENDS)}; "
                f"got {','.join(args.dense_backends) or '(nothing)'}"
            )
    return args


def graph_caches_off() -> contextlib.ExitStack:
    """Inductor's FX graph cache and AOTAutograd's cache off for the runs, restored afterwards: both key on the
    traced graph, which names SDPA, not the backend it dispatches to, so a cached dense graph would serve every
    backend. Each compiled run then compiles afresh."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def nsa_over_dense(runs) -> dict:
    """{dense backend: {"<S>" or "<S>_packed": NSA's tok/s over that dense run's}} for every length both ran."""
    ratios: dict = {}
    for s in runs:
        if s["attention"] != "nsa":
            continue
        for d in runs:
            if d["attention"] == "dense" and (d["seq_len"], d["packed"]) == (s["seq_len"], s["packed"]):
                key = f"{s['seq_len']}{'_packed' if s['packed'] else ''}"
                ratios.setdefault(d["dense_backend"], {})[key] = s["tok_s"] / d["tok_s"]
    return ratios


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device.type == "cpu":
        dtype = torch.float32
    backends = args.dense_backends or (["fa2", "cudnn"] if device.type == "cuda" else ["auto"])
    if device.type != "cuda" and backends != ["auto"]:
        raise SystemExit(f"--dense-backends: fa2 and cudnn need a CUDA device; on {device.type} use auto")
    args.dense_backends = backends
    seqs = (
        [int(s) for s in args.seq_lens.split(",")]
        if args.seq_lens
        else ([2048, 8192, 32768] if device.type == "cuda" else [256])
    )
    shape = (
        ModelShape(2, 128, 4, 1, 32, 32)
        if args.tiny
        else ModelShape(args.layers, args.dim, args.heads, args.kv_heads, args.head_dim, args.head_dim)
    )
    out = Path(args.out or Path("artifacts") / "train_showcase" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    docs, corpus = load_corpus(args.dataset, max_bytes=int(args.max_corpus_mb * 2**20), hub_timeout=args.hub_timeout)
    corpus.update(documents=len(docs), bytes=sum(len(d) for d in docs))
    data = Batches(docs, args.seed)

    def log(msg):
        print(msg, flush=True)

    log(
        f"train_showcase: {corpus['corpus']} ({corpus['documents']} documents, {corpus['bytes'] / 2**20:.1f} MiB), "
        f"{device}, {args.dtype if device.type == 'cuda' else 'fp32'}, model {shape}, batch {args.batch} x accum "
        f"{args.accum}, {args.steps} steps, S={seqs}, out {out}"
    )
    rows, runs, skipped = [], [], []
    with graph_caches_off() if args.compile else contextlib.nullcontext():
        for seq in seqs:
            for packed in (False, True) if args.packed else (False,):
                plan = [(a, None) for a in args.attention if a == "nsa"]
                plan += [(a, b) for a in args.attention if a == "dense" for b in backends]
                for att, backend in plan:
                    if packed and backend == "cudnn":
                        skipped.append(
                            {
                                "attention": att,
                                "dense_backend": backend,
                                "seq_len": seq,
                                "packed": True,
                                "why": "SDPA has no packed (varlen) cuDNN path",
                            }
                        )
                        log(f"dense/cudnn S={seq} packed: not trained ({skipped[-1]['why']})")
                        continue
                    r, s = train(att, seq, packed, args, shape, data, device, dtype, log, backend)
                    rows += r
                    runs.append(s)
                    log(
                        f"{run_label(att, backend)} S={seq} {'packed ' if packed else ''}: {s['tok_s']:.0f} tok/s "
                        f"(median step {s['step_ms_median']:.1f} ms), "
                        f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}"
                        + (f", peak {s['peak_mib']:.0f} MiB" if s["peak_mib"] is not None else "")
                    )
                    if s["attention_kernels"] is not None:
                        log(f"  attention kernels: {'; '.join(s['attention_kernels']) or '(none)'}")
    ratios = nsa_over_dense(runs)
    for backend, per_len in ratios.items():
        for key, r in per_len.items():
            log(f"NSA over dense/{backend} tok/s at S={key}: {r:.2f}x")
    write_csv(out / "train_showcase.csv", rows)
    report = {
        "environment": env_metadata(device),
        "args": {k: v for k, v in vars(args).items()},
        "model": shape.__dict__,
        "corpus": corpus,
        "runs": runs,
        "skipped": skipped,
        "nsa_over_dense_tok_s": ratios,
        "png": plot(rows, out / "train_showcase.png"),
    }
    write_json(out / "train_showcase.json", report)
    log(f"wrote {out}/train_showcase.csv, train_showcase.json{', train_showcase.png' if report['png'] else ''}")
    wrong = [
        f"{run_label(s['attention'], s['dense_backend'])} S={s['seq_len']}"
        for s in runs
        if s["backend_served"] is False
    ]
    if wrong:
        raise SystemExit(
            f"train_showcase: the forced SDPA backend did not serve in {', '.join(wrong)} (see attention_kernels)"
        )
    return report


if __name__ == "__main__":
    main()

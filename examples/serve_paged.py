"""Serve a tiny NSA language model from paged caches: continuous batching over a fixed number of rows.

    python examples/serve_paged.py                              # CPU, a few seconds
    python examples/serve_paged.py --device cuda --dtype bfloat16 --requests 32 --rows 8 --no-check

Requests (prompts of different lengths, each with its own number of new tokens) wait in a queue; the
engine holds --rows sequences at a time, each layer's K/V in an nsa.PagedNSACache of --pages pages of
--page-size tokens. Every iteration:

1. admit: each free row takes the next request. Its row is emptied (cache.free: the pages of the request
   that ran there go back to the pool) and the new prompts go in one packed call (cu_seqlens, 0 tokens
   for the rows that keep running): nsa_prefill's append on a cache that holds the other rows' tokens;
2. decode: one token for every row (greedy), one nsa_decode step per layer, each sequence at its own
   position, reading K/V through its block table; rows without a request decode a padding token;
3. retire: a request that has its tokens leaves its row free for the next one.

--check (default): every request's tokens equal generating it alone (TinyNSALM.generate, contiguous
cache). The model is random (seeded): the point is the cache plumbing, not the text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from nsa import NSAConfig, PagedNSACache  # noqa: E402
from nsa.model.llama_block_nsa import TinyNSALM  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--rows", type=int, default=2, help="sequences decoded together")
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--pages", type=int, default=48, help="pages per layer's pool")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--backend", default="auto", help="decode backend: auto, torch, triton")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def make_requests(n: int, vocab: int, gen) -> list[tuple[torch.Tensor, int]]:
    """(prompt, new tokens) pairs of different lengths."""
    out = []
    for i in range(n):
        length = int(torch.randint(3, 40, (1,), generator=gen))
        out.append((torch.randint(0, vocab, (length,), generator=gen), 3 + i % 4))
    return out


def serve(model, requests, caches, device) -> tuple[list[list[int]], dict]:
    """Run every request through the rows of `caches` (one PagedNSACache per layer). Returns each request's
    new tokens and counters (iterations, pages reused)."""
    rows = caches[0].batch
    queue = list(range(len(requests)))
    running: dict[int, int] = {}  # row -> request
    out: list[list[int]] = [[] for _ in requests]
    nxt = torch.zeros(rows, 1, dtype=torch.long, device=device)  # each row's next input token
    stats = {"iterations": 0, "pages_reused": 0}
    seen_pages: set[int] = set()
    while queue or running:
        stats["iterations"] += 1
        admit = {r: queue.pop(0) for r in range(rows) if r not in running and queue}
        if admit:
            for c in caches:
                c.free(list(admit))  # the row's earlier sequence (or padding) gives its pages back
            prompts = [requests[admit[r]][0] if r in admit else torch.zeros(0, dtype=torch.long) for r in range(rows)]
            cu = torch.tensor([0] + torch.tensor([len(p) for p in prompts]).cumsum(0).tolist(), dtype=torch.int32,
                              device=device)
            logits = model(torch.cat(prompts).to(device)[None], caches, cu_seqlens=cu)[0]
            for r, i in admit.items():
                tok = int(logits[int(cu[r + 1]) - 1].argmax())
                out[i].append(tok)
                nxt[r, 0] = tok
                running[r] = i
                pages = set(caches[0].pages_of(r))
                stats["pages_reused"] += len(pages & seen_pages)
                seen_pages |= pages
        for r, i in list(running.items()):  # a request of one new token is done at its prefill
            if len(out[i]) == requests[i][1]:
                del running[r]
        if not running:
            continue
        logits = model.decode_step(nxt, caches)  # every row, each at its own position
        picked = logits.argmax(-1)
        for r, i in list(running.items()):
            out[i].append(int(picked[r]))
            nxt[r, 0] = picked[r]
            if len(out[i]) == requests[i][1]:
                del running[r]
    return out, stats


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    cfg = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=2, window=16)
    model = TinyNSALM(64, 32, 2, 4, 2, 8, 8, cfg, decode_backend=args.backend).to(args.device, dtype).eval()
    requests = make_requests(args.requests, model.vocab, torch.Generator().manual_seed(args.seed))
    longest = max(len(p) + n for p, n in requests) + 64  # room for a row's padding steps
    caches = [PagedNSACache(cfg, args.rows, args.pages, args.page_size, -(-longest // args.page_size), 2, 8, 8,
                            device=args.device, dtype=dtype) for _ in model.blocks]
    with torch.no_grad():
        out, stats = serve(model, requests, caches, args.device)
        print(f"{len(requests)} requests on {args.rows} rows: {stats['iterations']} iterations, "
              f"{stats['pages_reused']} pages reused from finished requests")
        for i, (prompt, _) in enumerate(requests):
            print(f"request {i}: prompt of {len(prompt)} tokens -> {out[i]}")
        if args.check:
            for i, (prompt, n) in enumerate(requests):
                alone = model.generate(prompt[None].to(args.device), n)[0, len(prompt):].tolist()
                if alone != out[i]:
                    print(f"request {i}: served {out[i]} != generated alone {alone}", file=sys.stderr)
                    return 1
            print("every request equals its generation alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())

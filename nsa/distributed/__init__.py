"""Context parallelism: NSA over a sequence split across the ranks of a torch.distributed group.

`nsa_attention(..., cp_group=...)` and `NSAAttention(..., cp_group=...)` dispatch here
(docs/context-parallel.md).
"""

from .cp import LAYOUTS, ContextParallel, cp_nsa_attention, positions, resolve, shard, single_rank

__all__ = ["LAYOUTS", "ContextParallel", "cp_nsa_attention", "positions", "resolve", "shard", "single_rank"]

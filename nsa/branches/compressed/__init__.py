"""Compressed branch: attention over the compressed blocks a query can see, with its log-sum-exp
(the selection scores are computed from it). naive: torch; fa2: FlashAttention-2 through query folding
(fold.py); sdpa: scaled_dot_product_attention over query chunks."""

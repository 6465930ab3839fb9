"""Sliding branch: each query attends the last `window` tokens of its sequence (itself included).
naive: torch; fa2: FlashAttention-2 with window_size=(w-1, 0); sdpa: masked SDPA over query chunks."""

"""Selected branch: the top-n step that picks each query's selection blocks from the compressed
branch's probabilities, and attention over the tokens of those blocks. naive: torch (the chunked
pipeline, decode, the oracle-tested fallback); triton: the fused score + top-n kernel and the selected
attention kernels (nsa.kernels.triton)."""

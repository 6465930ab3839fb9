"""Gate combine: out = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win. naive: torch (the chunked path and
the fused path where the kernel does not serve); triton: one pass over the branch outputs, forward and
backward (nsa.kernels.triton.combine), and the form the dense core uses (o_cmp in two token segments)."""

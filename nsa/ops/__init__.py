"""Vectorized PyTorch building blocks of NSA (the `torch` backend) shared by prefill, training and decode."""

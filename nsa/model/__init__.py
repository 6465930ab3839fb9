"""Small models built on NSAAttention: the seeds' LlamaBlockNSA and a tiny language model for smoke runs."""

from .llama_block_nsa import LlamaBlockNSA, RMSNorm, SwiGLU, TinyNSALM

__all__ = ["LlamaBlockNSA", "RMSNorm", "SwiGLU", "TinyNSALM"]

"""Shared by the Triton selection GPU tests: markers, configs, the toggle fixture and the error measure."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from nsa import NSAConfig
from nsa.branches.selected.naive import selected_attention, top_n_blocks

MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.usefixtures("sel_env"),  # tests/gpu/conftest.py
]
PAPER = NSAConfig()
SMALL = NSAConfig(block_cmp=32, stride_cmp=16, block_sel=64, n_sel=4, n_init=1, n_local=2, window=64)
SEL_ENV = ("NSA_USE_TRITON_SEL", "NSA_TRITON_SEL_FORCE", "NSA_SEL_TRITON_ALLOW_GRAD", "NSA_SEL_TRITON_MIN_L",
           "NSA_SEL_BACKEND", "TRITON_INTERPRET")


def err(got, want):
    """max |got - want| / max(1, max |want|)."""
    got, want = got.detach().double(), want.detach().double().to(got.device)
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item() if want.numel() else 0.0


def topn_indices(gen, seq_start, Hkv, cfg, device="cuda"):
    """Valid indices as the top-n step makes them (forced blocks included) from random scores."""
    B, T = seq_start.shape
    pos = torch.arange(T, device=device)[None] - seq_start
    scores = torch.rand(B, T, Hkv, cfg.n_sel_blocks(T), generator=gen).to(device)
    return top_n_blocks(scores, pos, cfg).to(torch.int32)


def selected_attention_torch(q, k, v, indices, seq_start, cfg, scale=None, chunk=256):
    """The naive twin (nsa.branches.selected.naive) with the kernel entry point's arguments."""
    B, T = q.shape[:2]
    ss = torch.zeros(B, T, dtype=torch.long, device=q.device) if seq_start is None else seq_start.long().expand(B, T)
    block = cfg if isinstance(cfg, int) else cfg.block_sel
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return selected_attention(q, k, v, indices, SimpleNamespace(seq_start=ss), SimpleNamespace(block_sel=block),
                              scale, chunk=chunk)
